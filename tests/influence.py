"""One private step through the public API, on any path, and one user's influence on it (the privacy test matrix and
the fast-path findings of issue 24 use it).

A step with every user sampled (q = 1) and σ = 0 is deterministic, so a user's influence is the difference between
the clipped sums with and without that user: ``‖Σ(D) − Σ(D \\ u)‖``, each sum read off the update as
``(θ_before − θ_after) · ñ / lr``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
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


def row_loss(model: nn.Module, x: torch.Tensor, w: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """The mean over rows of ``w · ⟨v, f(x)⟩`` (summed over positions), under bf16 autocast for "bf16-autocast"."""
    direction = torch.linspace(-1, 1, x.shape[-1])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16-autocast" else contextlib.nullcontext()
    with autocast:
        out = model(x.to(next(model.parameters()).dtype))
    per_row = (out.float() * direction).sum((1, 2))
    return (w * per_row).mean()


def clipped_sum(rows: Rows, *, mode: str = "hooks", dtype: str = "fp32", batching: str = "one",
                mechanism: str = "user_dpsgd", clip: float = 1.0, passes: int = 1, m: Optional[int] = None,
                model: str = "mlp", model_seed: int = 0, engine_out: Optional[list] = None) -> torch.Tensor:
    """``Σ_u c_u g_u`` of one step (σ = 0, every user sampled), as released: the private gradient ``p.grad``
    times ñ (in the parameters' dtype), as a flat fp32 tensor.

    Args:
        mode: ``grad_sample_mode`` ("hooks" or "ghost").
        dtype: "fp32", "bf16" (weights and activations) or "bf16-autocast" (fp32 weights, bf16 autocast).
        batching: "one" (one batch a step), "micro" (``micro_batches=2``), "physical" (``UserBatchMemoryManager``
            with physical batches of at most ``m`` rows).
        mechanism: "user_dpsgd", "user_dpsgd_adaptive" or "group".
        passes: backward passes per batch (the loss split into that many equal terms, each backpropagated).
    """
    net = make_model(model_seed, rows.x.shape[-1], model)
    if dtype == "bf16":
        net = net.to(torch.bfloat16)
    n_users = len(set(rows.users))
    m = m or max(rows.users.count(u) for u in set(rows.users))
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    chosen = AdaptiveClipUserDPSGD(0.5, 0.2, count_noise_multiplier=1.0) if mechanism == "user_dpsgd_adaptive" \
        else mechanism
    engine = trl_userdp.PrivacyEngine()
    net, optimizer, loader = engine.make_private_user_level(
        module=net, optimizer=optimizer, data_loader=DataLoader(TensorDataset(rows.x, rows.w)), user_ids=rows.users,
        max_samples_per_user=m, users_per_batch=float(n_users), steps=1, sampling_seed=0, noise_multiplier=0.0,
        max_grad_norm=clip, mechanism=chosen, grad_sample_mode=mode,
        micro_batches=2 if batching == "micro" else 1, noise_generator=torch.Generator().manual_seed(0))
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
    return released * optimizer.expected_batch_size


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
