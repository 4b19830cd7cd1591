"""Full fine-tuning across two processes: user-level DP-SGD on replicas (data parallelism) and on a model sharded by
FSDP2, each against the non-private run of the same layout, per rank (issue 28).

The model is step_cost's tiny Llama (19.5 M parameters, a causal LM, full fine-tuning, AdamW). Four methods, each in
its own pair of processes:

- ``ddp non-private``: ``DistributedDataParallel``, ``loss.backward()``, ``optimizer.step()``;
- ``ddp user ghost``: the plain model on each rank, ``make_private_user_level(grad_sample_mode="ghost")`` (users
  sharded by rank, the clipped sums all-reduced);
- ``fsdp2 non-private``: ``fully_shard`` on the decoder layers and the root, plain training;
- ``fsdp2 user ghost``: the same sharding, ``make_private_user_level(grad_sample_mode="ghost")`` (each layer's clipped
  sums reduce-scattered to the shards, noise on each rank's own elements).

Every step of a private run draws users by Poisson sampling (ñ users of one row each, over all ranks); the
non-private runs take ñ/W rows per rank, the expected size. Per rank:

- **state**: the bytes of parameters, gradients (with the private optimizer's clipped sums) and optimizer state held
  when the step's update is computed, counted over distinct storages (each rank's local shards for FSDP2);
- **peak extra**: the process's peak memory during the steps minus what it held once the model was built, sharded and
  made private (gradients, optimizer state, activations, gathered parameters, buffers of the collectives): on CPU the
  resident set (``VmHWM``, step_cost's measure), on CUDA the allocator's peak. It includes activations, which are the
  same for both layouts, so its ratio is nearer 1 than the state's;
- **time**: the median seconds of a step.

Ratios: FSDP2's to DDP's (the memory sharding saves) and each private run's to the non-private run of its layout (the
cost of privacy on that layout, the control).

    python -m benchmarks.sharding                     # 2 gloo processes on CPU, about 3 min
    python -m benchmarks.sharding --device cuda      # 2 GPUs, NCCL
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ and __name__ == "__main__":
    # as step_cost: freed tensors go back to the OS, so the resident set measures live memory (the workers inherit it)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.sharding", *sys.argv[1:]])

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import RESULTS_DIR, print_table, write_results
from benchmarks.step_cost import Memory, _llama, lm_losses
from trl_userdp.distributed import shard_model

METHODS = ("ddp non-private", "ddp user ghost", "fsdp2 non-private", "fsdp2 user ghost")


def _storage_bytes(tensors: List[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor's local shard)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, extra: List[torch.Tensor]) -> int:
    inner = getattr(optimizer, "original_optimizer", optimizer)
    params = list(model.parameters())
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return _storage_bytes(params + [p.grad for p in params] + [getattr(p, "summed_grad", None) for p in params]
                          + states + extra)


def _inputs(ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _run(method: str, args, device: torch.device) -> Dict[str, float]:
    """One method's steps on this rank: {state bytes, peak extra bytes, median step seconds, steps}."""
    import trl_userdp

    memory = Memory(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _llama(lora=False).to(device)
    layout, private = method.split(" ", 1)
    if layout == "fsdp2":
        model = shard_model(model, device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    n_users = args.users
    ids = torch.randint(5, 32000, (n_users, args.seq), generator=g)
    state, times = [], []
    if private == "non-private":
        if layout == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        rows = max(1, round(args.users_per_step / world))
        memory.start()
        for step in range(args.steps + 1):
            batch = _inputs(ids[(step * world + rank) * rows:(step * world + rank + 1) * rows].to(device))
            start = time.perf_counter()
            lm_losses(model, batch).mean().backward()
            state.append(_state_bytes(model, optimizer, []))
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    else:
        engine = trl_userdp.PrivacyEngine()
        model, optimizer, loader = engine.make_private_user_level(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids)), user_ids=list(range(n_users)),
            noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=1, users_per_batch=args.users_per_step,
            grad_sample_mode="ghost", sampling_seed=0, steps=args.steps + 1)
        hooks = engine.hooks
        optimizer.attach_step_hook(lambda opt: state.append(_state_bytes(model, opt, list(hooks.clipped.values()))))
        placeholder = _inputs(ids[:1].to(device))
        memory.start()
        for step, (batch_ids,) in enumerate(loader):
            if step > args.steps:
                break
            start = time.perf_counter()
            if len(batch_ids):
                lm_losses(model, _inputs(batch_ids.to(device))).mean().backward()
            elif layout == "fsdp2":  # every rank runs the layers' collectives
                with hooks.placeholder_pass():
                    lm_losses(model, placeholder).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return {"state_bytes": max(state), "peak_extra_bytes": memory.peak_extra()[0],
            "median_s": statistics.median(times[1:]), "steps": len(times) - 1}


def _worker(rank: int, world: int, tmp: str, method: str, args) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/rendezvous",
                            rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        torch.save(_run(method, args, device), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--users-per-step", type=float, default=8.0, help="ñ over all processes (one row per user)")
    parser.add_argument("--users", type=int, default=200, help="users in the dataset")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--name", default="sharding")
    args = parser.parse_args(argv)
    results = {}
    for method in args.methods:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(args.processes, tmp, method, args), nprocs=args.processes, join=True)
            ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.processes)]
        results[method] = {"per_rank": ranks, **{k: max(r[k] for r in ranks) for k in ranks[0]}}
        print(f"[sharding] {method}: {results[method]}", flush=True)
    header = ["method", "state MB", "peak extra MB", "median s", "state × DDP", "peak × DDP", "time × non-private"]
    rows = []
    for method, r in results.items():
        layout, private = method.split(" ", 1)
        ddp = results.get(f"ddp {private}")
        control = results.get(f"{layout} non-private")
        rows.append([method, f"{r['state_bytes'] / 2**20:.0f}", f"{r['peak_extra_bytes'] / 2**20:.0f}",
                     f"{r['median_s']:.3f}",
                     f"{r['state_bytes'] / ddp['state_bytes']:.2f}" if ddp else "—",
                     f"{r['peak_extra_bytes'] / ddp['peak_extra_bytes']:.2f}" if ddp else "—",
                     f"{r['median_s'] / control['median_s']:.2f}" if control else "—"])
    print(f"\nTiny Llama (19.5 M parameters, full fine-tuning, AdamW), {args.processes} processes on {args.device}, "
          f"ñ = {args.users_per_step:g} users of 1 row of {args.seq} tokens per step; per rank, the larger of the ranks")
    table = print_table(header, rows)
    path = write_results(args.name, {"settings": vars(args), "results": results, "table": table}, args.out)
    print(f"results: {path}")
    return results


if __name__ == "__main__":
    main()
