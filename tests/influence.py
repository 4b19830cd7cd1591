"""One private step through the public API, on any path, and one user's influence on it (the privacy test matrix and
the fast-path findings of issue 24 use it).

A step with every user sampled (q = 1) and σ = 0 is deterministic, so a user's influence is the difference between
the clipped sums with and without that user: ``‖Σ(D) − Σ(D \\ u)‖``, each sum read off the update as
``(θ_before − θ_after) · ñ / lr``.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp
from trl_userdp.mechanisms import AdaptiveClipUserDPSGD
from trl_userdp.utils import UserBatchMemoryManager

D, T = 16, 3  # features, positions per row


@dataclass
class Rows:
    """Rows of a linear-in-the-head task: input ``x`` [T, D], loss weight ``w`` (a row's loss is
    ``w · ⟨v, f(x)⟩`` summed over positions, so rows with opposite weights cancel), and their users."""

    x: torch.Tensor
    w: torch.Tensor
    users: List[int]

    def without(self, user: int) -> "Rows":
        keep = [i for i, u in enumerate(self.users) if u != user]
        return Rows(self.x[keep], self.w[keep], [self.users[i] for i in keep])


def make_model(seed: int = 0, width: int = D, kind: str = "mlp") -> nn.Module:
    """"mlp": Linear → Tanh → Linear; "linear": one Linear layer (the Gram route on its own)."""
    torch.manual_seed(seed)
    if kind == "linear":
        return nn.Linear(width, width)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def row_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor, dtype: str = "fp32",
             params: Optional[Iterable[nn.Parameter]] = None) -> torch.Tensor:
    """The mean over rows of ``w · ⟨v, f(x)⟩`` (summed over positions), under bf16 autocast for "bf16-autocast"
    (``params``: the model's parameters, when ``model`` is a call of a module rather than the module)."""
    direction = torch.linspace(-1, 1, x.shape[-1])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16-autocast" else contextlib.nullcontext()
    with autocast:
        out = model(x.to(next(iter(params) if params is not None else model.parameters()).dtype))
    per_row = (out.float() * direction).sum((1, 2))
    return (w * per_row).mean()


def clipped_sum(rows: Rows, *, mode: str = "hooks", dtype: str = "fp32", batching: str = "one",
                mechanism: str = "user_dpsgd", clip: float = 1.0, passes: int = 1, m: Optional[int] = None,
                model: str = "mlp", model_seed: int = 0, drawn: Optional[Iterable[int]] = None,
                engine_out: Optional[list] = None) -> torch.Tensor:
    """``Σ_u c_u g_u`` of one step (σ = 0, every user sampled), as released: the private gradient ``p.grad``
    times ñ (in the parameters' dtype), as a flat fp32 tensor.

    Args:
        mode: ``grad_sample_mode`` ("hooks" or "ghost").
        dtype: "fp32", "bf16" (weights and activations) or "bf16-autocast" (fp32 weights, bf16 autocast).
        batching: "one" (one batch a step), "micro" (``micro_batches=2``), "physical" (``UserBatchMemoryManager``
            with physical batches of at most ``m`` rows).
        mechanism: "user_dpsgd", "user_dpsgd_adaptive_clip" or "group".
        passes: backward passes per batch (the loss split into that many equal terms, each backpropagated).
        drawn: the users the step's Poisson draw takes (default: all of them; none is an empty draw). The dataset,
            and so n, q and ñ, stay the same whatever is drawn.
    """
    net = make_model(model_seed, rows.x.shape[-1], model)
    if dtype == "bf16":
        net = net.to(torch.bfloat16)
    n_users = len(set(rows.users))
    m = m or max(rows.users.count(u) for u in set(rows.users))
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    chosen = AdaptiveClipUserDPSGD(0.5, 0.2, count_noise_multiplier=1.0) if mechanism == "user_dpsgd_adaptive_clip" \
        else mechanism
    engine = trl_userdp.PrivacyEngine()
    net, optimizer, loader = engine.make_private_user_level(
        module=net, optimizer=optimizer, data_loader=DataLoader(TensorDataset(rows.x, rows.w)), user_ids=rows.users,
        max_samples_per_user=m, users_per_batch=float(n_users), steps=1, sampling_seed=0, noise_multiplier=0.0,
        max_grad_norm=clip, mechanism=chosen, grad_sample_mode=mode,
        micro_batches=2 if batching == "micro" else 1, noise_generator=torch.Generator().manual_seed(0))
    if drawn is not None:
        drawn = set(drawn)
        if mechanism == "group":  # its sampling units are records: a user is drawn as all of its records
            drawn = {r for r, u in enumerate(rows.users) if u in drawn}
        users = torch.tensor(sorted(drawn), dtype=torch.long)
        engine.data_loader.user_sampler.sample_users = lambda: users
    if batching == "physical":
        batches = UserBatchMemoryManager(data_loader=loader, max_physical_batch_size=m, optimizer=optimizer).__enter__()
    else:
        batches = loader
    per_step = 2 if batching == "micro" else 1
    released = None
    for i, (x, w) in enumerate(batches):
        if len(x):
            for _ in range(passes):
                (row_loss(net, x, w, dtype) / passes).backward()
        if batching != "micro" or (i + 1) % per_step == 0:
            optimizer.step()
            if not optimizer._is_last_step_skipped:  # the step that ends the draw: its private gradient
                released = torch.cat([p.grad.float().flatten() for p in net.parameters()])
            optimizer.zero_grad()
    if engine_out is not None:
        engine_out.append(engine)
    # across processes each rank's ñ is its share of the global ñ (Opacus's convention)
    return released * optimizer.expected_batch_size * (dist.get_world_size() if dist.is_initialized() else 1)


def influence(rows: Rows, user: int, **kwargs) -> float:
    """``‖Σ(D) − Σ(D \\ user)‖``: the user's influence on the clipped sum of one step."""
    return float(torch.linalg.vector_norm(clipped_sum(rows, **kwargs) - clipped_sum(rows.without(user), **kwargs)))


def user_autograd_sum(rows: Rows, users: Sequence[int], net: Optional[nn.Module] = None, model: str = "mlp",
                     model_seed: int = 0) -> torch.Tensor:
    """``Σ_u ḡ_u`` by a per-user autograd loop in fp32 (each user's mean row loss, no clipping): the reference. ``net``
    is the model to differentiate (default: :func:`make_model` of ``model`` and ``model_seed``)."""
    net = net if net is not None else make_model(model_seed, rows.x.shape[-1], model)
    total = [torch.zeros_like(p) for p in net.parameters()]
    for u in users:
        keep = [i for i, v in enumerate(rows.users) if v == u]
        net.zero_grad()
        row_loss(net, rows.x[keep], rows.w[keep]).backward()
        total = [t + p.grad for t, p in zip(total, net.parameters())]
    return torch.cat([t.flatten() for t in total])


def _serve(rank: int, world: int, rendezvous: str, requests, replies) -> None:
    """A rank of :class:`TwoRanks`: runs :func:`clipped_sum` on each request until it gets ``None``."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for rows, kwargs in iter(requests.get, None):
            engines: list = []
            try:
                released = clipped_sum(rows, engine_out=engines, **kwargs)
                replies.put((rank, released, list(engines[0].accountant.history)))
            except Exception as err:  # noqa: BLE001 - sent back to the test, which raises it
                replies.put((rank, f"{type(err).__name__}: {err}", None))
    finally:
        dist.destroy_process_group()


class TwoRanks:
    """Two data-parallel processes (gloo on CPU) that take one private step with :func:`clipped_sum` on request: the
    engine shards the users by rank and all-reduces the clipped sums. Started once and reused, since a process start
    costs seconds."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp()
        self._requests = [context.Queue() for _ in range(2)]
        self._replies = context.Queue()
        self._ranks = [context.Process(target=_serve, args=(r, 2, self._dir, self._requests[r], self._replies),
                                       daemon=True) for r in range(2)]
        for process in self._ranks:
            process.start()

    def clipped_sum(self, rows: Rows, **kwargs) -> Tuple[torch.Tensor, list]:
        """:func:`clipped_sum` on two processes: the released sum (the same on both ranks, or an AssertionError) and
        the accountant's history. A rank's exception is raised here as a RuntimeError with its message."""
        for requests in self._requests:
            requests.put((rows, kwargs))
        try:
            replies = sorted((self._replies.get(timeout=120) for _ in self._ranks), key=lambda r: r[0])
        except queue.Empty:
            raise RuntimeError("a rank did not answer within two minutes") from None
        errors = [r[1] for r in replies if isinstance(r[1], str)]
        if errors:
            raise RuntimeError(" | ".join(errors))
        (_, first, history), (_, second, _) = replies
        assert torch.equal(first, second), "the ranks released different sums"
        return first, history

    def close(self) -> None:
        for requests in self._requests:
            requests.put(None)
        for process in self._ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
