"""``AdaptiveUserPrivacyEngine``: AUP-RLHF (Zhang et al., Alg. 1–3) for any PyTorch model, in the
calling style of :meth:`trl_userdp.PrivacyEngine.make_private_user_level` (SPEC §2 M4).

Privacy: AboveThreshold spends ``ε_svt = svt_fraction·ε`` (pure, for the whole run, once any query
is made); the Gaussian steps are calibrated to ``(ε − ε_svt, δ/2)`` as T truncated-Poisson
subsampled Gaussian steps (dp-accounting PLD) — AUP-RLHF Alg. 2 line 2 with PrivacyAccount; the
total is their sum (basic composition, Thm 3). Users are sampled with ``q = ñ/n`` and each step is
truncated to ``ñ_max`` users, which bounds the concentration score's sensitivity (SPEC §2 M4).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn, optim
from torch.utils.data import DataLoader

from .accountants import PrivacyReport
from .data import DEFAULT_USER_COLUMN, UserDataLoader
from .grad_sample import UserGradSampleHooks
from .optimizers.aup_optimizer import AUPOptimizer, pairwise_distances
from .privacy_engine import PrivacyEngine
from .validators import check_positive, check_steps

PHASE_USERS = ("all", "paper")


def default_max_users_per_batch(users_per_batch: float) -> int:
    """ñ + 4√ñ, rounded up: Poisson(ñ) exceeds it with probability below about 1e-4 per step."""
    return int(math.ceil(users_per_batch + 4 * math.sqrt(users_per_batch)))


class AdaptiveUserPrivacyEngine(PrivacyEngine):
    """AUP-RLHF: per-user gradients, concentration score, AboveThreshold, randomized outlier
    removal, mean of the kept users plus Gaussian noise scaled to τ, then the wrapped optimizer.

    Accounting is dp-accounting's PLD (the truncated-Poisson event has no RDP form).
    """

    def __init__(self, *, secure_mode: bool = False, neighboring_relation: str = "add_or_remove"):
        super().__init__(accountant="pld", secure_mode=secure_mode, neighboring_relation=neighboring_relation)
        self.svt_epsilon: Optional[float] = None
        self.phase_users: Optional[str] = None

    def make_private_user_level(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        data_loader: DataLoader,
        concentration_radius: float,
        target_epsilon: float,
        target_delta: float,
        max_samples_per_user: int,
        users_per_batch: float,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        max_users_per_batch: Optional[int] = None,
        svt_fraction: float = 0.5,
        phase_users: str = "all",
        average_iterates: bool = False,
        user_ids: Optional[Sequence[Any]] = None,
        user_column: str = DEFAULT_USER_COLUMN,
        rows_per_example: int = 1,
        bounding_seed: Optional[int] = 0,
        sampling_seed: Optional[int] = None,
        noise_generator: Optional[torch.Generator] = None,
        self_check: bool = True,
        grad_sample_mode: str = "hooks",
        user_key: Optional[str] = None,
    ) -> Tuple[nn.Module, AUPOptimizer, UserDataLoader]:
        """Like :meth:`PrivacyEngine.make_private_user_level`, plus ``concentration_radius`` (τ),
        ``max_users_per_batch`` (ñ_max; default :func:`default_max_users_per_batch`),
        ``svt_fraction`` (share of ε for AboveThreshold), ``phase_users`` (``"all"``: all users in
        one phase; ``"paper"``: Alg. 1 read literally with k = 1, a seeded half of the users) and
        ``average_iterates``. The budget is required (the noise scale depends on ε, δ and T). On ⊥ the
        optimizer halts, the loader stops, and :meth:`privacy_report` says at which query.
        """
        check_positive(concentration_radius, "concentration_radius")
        self._check_target(target_epsilon, target_delta, epochs, steps)
        if not 0 < svt_fraction < 1:
            raise ValueError(f"svt_fraction must lie in (0, 1), got {svt_fraction}.")
        if phase_users not in PHASE_USERS:
            raise ValueError(f"phase_users must be one of {PHASE_USERS}, got {phase_users!r}.")
        m = self._check_model(module, optimizer, grad_sample_mode, max_samples_per_user)
        n_max = default_max_users_per_batch(users_per_batch) if max_users_per_batch is None else int(max_users_per_batch)
        if phase_users == "paper":
            data_loader = _half_of_the_users(data_loader, user_ids, user_column, bounding_seed)
            user_ids = getattr(data_loader.dataset, "user_ids", None) if user_ids is not None else None
        loader, expected = self._make_loader(
            data_loader, "user_dpsgd", m, users_per_batch, user_ids, user_column, rows_per_example, bounding_seed,
            sampling_seed, max_users_per_batch=n_max, user_key=user_key,
        )
        self._install_accountant(loader.sample_rate, truncation=(loader.n_users, n_max))
        total_steps = check_steps(steps, epochs, loader.sample_rate)
        self.svt_epsilon = svt_fraction * target_epsilon
        gaussian_budget = (target_epsilon - self.svt_epsilon, target_delta / 2)
        sigma = self._calibrate(*gaussian_budget, loader.sample_rate, total_steps)
        self._calibrated = True
        hooks = self._attach_hooks(module, grad_sample_mode)
        aup = AUPOptimizer(
            optimizer,
            noise_multiplier=sigma,
            concentration_radius=concentration_radius,
            expected_batch_size=expected,
            max_users_per_batch=n_max,
            epsilon=target_epsilon,
            delta=target_delta,
            steps=total_steps,
            svt_epsilon=self.svt_epsilon,
            hooks=hooks,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            secure_mode=self.secure_mode,
            self_check=self_check,
            budget_guard=self._check_budget,
            average_iterates=average_iterates,
        )
        self.phase_users = phase_users
        loader.stop_when = lambda: aup.halted
        return self._finish(module, aup, loader, "aup", total_steps, gaussian_budget)

    def get_epsilon(self, delta: float) -> float:
        """Gaussian steps' ε at ``delta`` plus AboveThreshold's ε_svt once it has answered a query."""
        svt = self.svt_epsilon if self.optimizer is not None and self.optimizer.svt_queries else 0.0
        return self.accountant.get_epsilon(delta) + svt

    def privacy_report(self, delta: float) -> PrivacyReport:
        report = super().privacy_report(delta)
        opt: AUPOptimizer = self.optimizer
        report.max_grad_norm = None
        report.concentration_radius = opt.concentration_radius
        report.extra.update(
            {
                "svt_epsilon": self.svt_epsilon if opt.svt_queries else 0.0,
                "gaussian_epsilon": self.accountant.get_epsilon(delta),
                "svt_queries": opt.svt_queries,
                "halted": opt.halted,
                "halted_at_query": opt.halted_at_query,
                "max_users_per_batch": opt.max_users_per_batch,
                "noise_std": opt.noise_std,
                "phase_users": self.phase_users,
                "composition": "basic: Gaussian (PLD, truncated Poisson) + AboveThreshold (pure ε)",
            }
        )
        return report


def propose_concentration_radius(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    public_loader: UserDataLoader,
    *,
    coverage: float = 0.9,
    max_batches: int = 10,
) -> float:
    """Propose τ from *public* users (no privacy cost): the ``coverage`` quantile of the pairwise
    distances between per-user averaged gradients at the current parameters, over up to
    ``max_batches`` batches of ``public_loader``. AboveThreshold passes when about 4/5 of the pairs of
    a step lie within τ, so a coverage of 0.9 leaves a margin. Call it before making the model
    private; ``loss_fn(model, batch)`` must return the mean loss over the batch's rows.
    """
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must lie in (0, 1), got {coverage}.")
    hooks = UserGradSampleHooks(model)
    distances = []
    try:
        for i, batch in enumerate(public_loader):
            if i >= max_batches:
                break
            hooks.reset_step()
            hooks.set_row_users(public_loader.last_row_users)
            model.zero_grad()
            loss_fn(model, batch).backward()
            counts = hooks.unit_counts
            if len(counts) < 2:
                continue
            grads = [p.grad_sample / counts.view(-1, *([1] * p.dim())) for p in hooks.param_names if p.grad_sample is not None]
            d = pairwise_distances(grads)
            distances.append(d[~torch.eye(len(d), dtype=torch.bool)])
    finally:
        hooks.cleanup()
        model.zero_grad()
    if not distances:
        raise ValueError("The public loader gave no batch with two or more users.")
    return float(torch.quantile(torch.cat(distances), coverage))


def _half_of_the_users(data_loader: DataLoader, user_ids, user_column: str, seed: Optional[int]) -> DataLoader:
    """Alg. 1 with k = 1: its only phase holds n/2^{k+1−1} = n/2 users (a seeded uniform half)."""
    from .data import UserSubset, resolve_user_ids
    from .data.users import is_hf_dataset

    dataset = data_loader.dataset
    index = resolve_user_ids(dataset, user_column=user_column, user_ids=user_ids)
    chosen = np.random.default_rng(seed).permutation(index.n_users)[: index.n_users // 2]
    rows = np.sort(np.concatenate([index.rows[u] for u in chosen])).tolist()
    if is_hf_dataset(dataset) and user_ids is None:
        subset = dataset.select(rows)
    else:
        subset = UserSubset(dataset, rows, index.keys[index.codes[rows]].tolist())
    return DataLoader(subset, collate_fn=data_loader.collate_fn, num_workers=data_loader.num_workers,
                      pin_memory=data_loader.pin_memory)
