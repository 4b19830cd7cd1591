"""``AdaptiveUserPrivacyEngine``: AUP-RLHF (Zhang et al., Alg. 1–3) for any PyTorch model, in the
calling style of :meth:`trl_userdp.PrivacyEngine.make_private_user_level` (docs/mechanisms.md, M4).

Privacy: AboveThreshold spends ``ε_svt = svt_fraction·ε`` (pure, for the whole run, once any query
is made); the Gaussian steps are calibrated to ``(ε − ε_svt, δ/2)`` as T truncated-Poisson
subsampled Gaussian steps (dp-accounting PLD) — AUP-RLHF Alg. 2 line 2 with PrivacyAccount; the
total is their sum (basic composition, Thm 3). Users are sampled with ``q = ñ/n`` and each step is
truncated to ``ñ_max`` users, which bounds the concentration score's sensitivity (docs/mechanisms.md, M4).
Alg. 1's ``k`` phases run Alg. 2 on disjoint user sets one after another (parallel composition).
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn, optim
from torch.utils.data import DataLoader

from . import distributed
from .accountants import DPAccountingAccountant
from .data import PhasedUserDataLoader, UserDataLoader, resolve_user_ids
from .data.phases import assign_phases, phase_datasets, phase_shares
from .grad_sample import UserGradSampleHooks
from .mechanisms import aup
from .mechanisms.aup import AUPRLHF, default_max_users_per_batch, pairwise_distances
from .optimizers.aup_optimizer import AUPOptimizer
from .privacy_engine import PrivacyEngine
from .setup_options import SetupOptions
from .seeding import derive_seed
from .validators import check_positive, check_steps


class AdaptiveUserPrivacyEngine(PrivacyEngine):
    """AUP-RLHF: per-user gradients, concentration score, AboveThreshold, randomized outlier
    removal, mean of the kept users plus Gaussian noise scaled to τ, then the wrapped optimizer.

    Accounting is dp-accounting's PLD (the truncated-Poisson event has no RDP form). With ``k``
    phases (Alg. 1) each phase has its own accountant; the phases' users are disjoint, so the run's
    ε is the largest phase's (parallel composition).
    """

    adaptive = True

    def __init__(self, *, secure_mode: bool = False, neighboring_relation: str = "add_or_remove"):
        super().__init__(accountant="pld", secure_mode=secure_mode, neighboring_relation=neighboring_relation)
        self.svt_epsilon: Optional[float] = None
        self.radius_epsilon = 0.0
        self.phase_users: Optional[str] = None
        #: per phase: accountant, σ and planned steps (one entry when phases=1)
        self.phase_accountants: List[DPAccountingAccountant] = []
        self.phase_noise_multipliers: List[float] = []
        self.phase_steps: List[int] = []
        self.phase = 0

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
        radius_epsilon: float = 0.0,
        phases: int = 1,
        phase_users: str = "all",
        average_iterates: bool = False,
        **options: Any,
    ) -> Tuple[nn.Module, AUPOptimizer, Union[UserDataLoader, PhasedUserDataLoader]]:
        """Like :meth:`PrivacyEngine.make_private_user_level` (the same ``options``:
        :class:`~trl_userdp.setup_options.SetupOptions`), plus ``concentration_radius`` (τ),
        ``max_users_per_batch`` (ñ_max; default :func:`default_max_users_per_batch`),
        ``svt_fraction`` (share of ε for AboveThreshold), ``radius_epsilon`` (the part of ``target_epsilon``
        already spent choosing τ on these users with :func:`propose_concentration_radius_private`; the run
        gets the rest, and ε adds up by basic composition), ``phases`` (Alg. 1's k), ``phase_users``
        (``"all"``: the phases' geometric split rescaled to use every user; ``"paper"``: Alg. 1 as
        written, which leaves a share 2^−k unused — half the users at k = 1; see
        :mod:`trl_userdp.data.phases`) and ``average_iterates``. The budget is required (the noise
        scale depends on ε, δ and T). ``epochs`` or ``steps`` give each phase the same number of
        passes over its own users; every phase runs Alg. 2 afresh (new AboveThreshold threshold, its
        own σ and T) from the previous phase's parameters. With ``phases > 1`` the loader is a
        :class:`~trl_userdp.data.PhasedUserDataLoader` (not with ``user_key``: a loop that prefetches
        would cross a phase boundary early). On ⊥ the optimizer halts, the loader stops, and
        :meth:`privacy_report` says at which query.
        """
        mech = self._resolve_mechanism(AUPRLHF())
        opts = SetupOptions(**options)
        if opts.grad_sample_mode == "ghost":
            raise ValueError("AUP-RLHF needs every sampled user's gradient (the pairwise distances of its concentration "
                             "score), which ghost clipping never materialises: use grad_sample_mode='hooks'.")
        check_positive(concentration_radius, "concentration_radius")
        self._check_target(target_epsilon, target_delta, epochs, steps)
        if not 0 <= radius_epsilon < target_epsilon:
            raise ValueError(f"radius_epsilon must lie in [0, target_epsilon={target_epsilon}), got {radius_epsilon}.")
        self.radius_epsilon = float(radius_epsilon)
        run_epsilon = target_epsilon - self.radius_epsilon
        self.svt_epsilon, *gaussian_budget = aup.split_budget(run_epsilon, target_delta, svt_fraction)
        shares = phase_shares(phases, phase_users)
        if phases > 1 and (opts.user_key is not None or opts.micro_batches > 1):
            raise ValueError("phases > 1 needs a loop that steps each batch before fetching the next; "
                             "it cannot be used with user_key (transformers' Trainer prefetches batches) or "
                             "micro_batches > 1.")
        m = self._check_model(module, optimizer, max_samples_per_user)
        if distributed.world_size() > 1:
            raise ValueError("AUP-RLHF compares every sampled user's gradient with every other's (the concentration "
                             "score): it runs in one process; use PrivacyEngine for data-parallel user-wise DP-SGD.")
        n_max = default_max_users_per_batch(users_per_batch) if max_users_per_batch is None else int(max_users_per_batch)
        bounded = self._bound(data_loader, m, opts, target_delta)
        index = resolve_user_ids(bounded, user_column=opts.user_column)
        phase_of_user = assign_phases(index, shares, opts.bounding_seed)
        sizes = np.bincount(phase_of_user[phase_of_user >= 0], minlength=phases)
        if sizes.min() < users_per_batch:
            raise ValueError(
                f"Phase sizes {sizes.tolist()} (users): every phase needs at least users_per_batch="
                f"{users_per_batch} users; use fewer phases, phase_users='all' or a smaller users_per_batch."
            )
        used = int(sizes.sum())
        loader_options = self._loader_options(data_loader, opts)
        loaders = []
        for i, dataset in enumerate(phase_datasets(bounded, index, phase_of_user, phases)):
            q = users_per_batch / int(sizes[i])
            t = check_steps(None, epochs, q) if steps is None else max(1, int(round(check_steps(steps, None, q) * sizes[i] / used)))
            loader_options.update(seed=None if opts.sampling_seed is None else _phase_seed(opts.sampling_seed, i, phases))
            loaders.append(UserDataLoader(
                dataset, users_per_batch=users_per_batch, max_samples_per_user=m, max_users_per_batch=n_max,
                steps=t if phases > 1 else None,  # one phase: epochs of round(1/q) steps, as without phases
                **loader_options,
            ))
            self._install_accountant(q, mech.step_event(max_samples_per_user=m, n_users=int(sizes[i]),
                                                        max_users_per_batch=n_max))
            self.phase_accountants.append(self.accountant)
            self.phase_steps.append(t)
            self.phase_noise_multipliers.append(aup.gaussian_noise_multiplier(
                *gaussian_budget, sample_rate=q, steps=t, n_users=int(sizes[i]), max_users_per_batch=n_max,
                relation=self.accountant.relation))
        self._calibrated = True
        self.accountant = self.phase_accountants[0]
        dp_optimizer = self._make_optimizer(
            mech.optimizer_class(1), optimizer, module, opts, budget_guard=self._check_budget,
            noise_multiplier=self.phase_noise_multipliers[0], concentration_radius=concentration_radius,
            expected_batch_size=loaders[0].users_per_batch, max_users_per_batch=n_max, epsilon=run_epsilon,
            delta=target_delta, steps=self.phase_steps[0], svt_epsilon=self.svt_epsilon,
            average_iterates=average_iterates,
        )
        self.phase_users = phase_users
        if phases == 1:
            loader = loaders[0]
        else:
            per_iteration = sum(self.phase_steps) if epochs is None else math.ceil(sum(self.phase_steps) / epochs)
            loader = PhasedUserDataLoader(loaders, per_iteration)
            loader.add_phase_callback(self._start_phase)
        loader.stop_when = lambda: dp_optimizer.halted
        return self._finish(module, dp_optimizer, loader, mech, self.phase_steps[0], tuple(gaussian_budget))

    #: the ε-targeted entry point is this one (the budget is always required)
    make_private_user_level_with_epsilon = make_private_user_level

    def steps_accounted(self) -> int:
        """Steps accounted over all phases."""
        return sum(acc.steps_taken for acc in self.phase_accountants)

    def _start_phase(self, phase: int) -> None:
        """Switch optimizer, accountant and budget guard to ``phase`` (called by the phased loader)."""
        self.phase = phase
        self.accountant = self.phase_accountants[phase]
        self.planned_steps = self.phase_steps[phase]
        self.optimizer.start_phase(self.phase_noise_multipliers[phase], self.phase_steps[phase])

    def _phase_epsilons(self, delta: float) -> List[float]:
        """Each started phase's ε: its Gaussian steps plus ε_svt once its AboveThreshold was queried, plus
        the ε spent choosing τ (on all users, so it adds to every phase)."""
        queries = self.optimizer.svt_queries_by_phase if self.optimizer is not None else [0]
        return [self.radius_epsilon + acc.get_epsilon(delta) + (self.svt_epsilon if queried else 0.0)
                for acc, queried in zip(self.phase_accountants, queries)]

    def get_epsilon(self, delta: float) -> float:
        """The largest phase's ε (disjoint users: parallel composition); within a phase, the Gaussian
        steps' ε at ``delta`` plus AboveThreshold's pure ε_svt (basic composition, Thm 3), plus
        ``radius_epsilon``."""
        return max(self._phase_epsilons(delta), default=0.0)

    def _report_fields(self, delta: float) -> Dict[str, Any]:
        fields = super()._report_fields(delta)
        opt: AUPOptimizer = self.optimizer
        fields.update(max_grad_norm=None, concentration_radius=opt.concentration_radius, steps=sum(self.phase_steps))
        fields["extra"].update(
            {
                "svt_epsilon": self.svt_epsilon if any(opt.svt_queries_by_phase) else 0.0,
                "radius_epsilon": self.radius_epsilon,
                "gaussian_epsilon": max(acc.get_epsilon(delta) for acc in self.phase_accountants),
                "svt_queries": sum(opt.svt_queries_by_phase),
                "halted": opt.halted,
                "halted_at_query": opt.halted_at_query,
                "max_users_per_batch": opt.max_users_per_batch,
                "noise_std": opt.noise_std,
                "phase_users": self.phase_users,
                "composition": "basic: Gaussian (PLD, truncated Poisson) + AboveThreshold (pure ε)"
                + (" + τ selection (pure ε)" if self.radius_epsilon else "")
                + ("; parallel over disjoint phases" if len(self.phase_steps) > 1 else ""),
            }
        )
        if len(self.phase_steps) > 1:
            fields["extra"]["phases"] = [
                {"n_users": loader.n_users, "sample_rate": loader.sample_rate, "noise_multiplier": sigma,
                 "steps": t, "steps_taken": acc.steps_taken, "epsilon": eps}
                for loader, sigma, t, acc, eps in zip(self.data_loader.loaders, self.phase_noise_multipliers,
                                                      self.phase_steps, self.phase_accountants,
                                                      self._phase_epsilons(delta))
            ]
        return fields


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
    distances = []
    for i, batch in enumerate(public_loader):
        if i >= max_batches:
            break
        grads = _user_gradients(model, loss_fn, batch, public_loader.last_row_users)
        if not grads or len(grads[0]) < 2:
            continue
        d = pairwise_distances(grads)
        distances.append(d[~torch.eye(len(d), dtype=torch.bool)])
    if not distances:
        raise ValueError("The public loader gave no batch with two or more users.")
    return float(torch.quantile(torch.cat(distances), coverage))


def propose_concentration_radius_private(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    private_loader: UserDataLoader,
    *,
    epsilon: float,
    radii: Sequence[float],
    threshold_fraction: float = 0.9,
    generator: Optional[torch.Generator] = None,
) -> float:
    """Propose τ from *private* users for a pure ``epsilon`` (pass it on as ``radius_epsilon``).

    One batch of ``private_loader`` (a truncated user-level Poisson loader over the users AUP-RLHF
    will train on: ``max_users_per_batch`` set) gives per-user averaged gradients at the current
    parameters; AboveThreshold (AUP-RLHF Alg. 3) then walks the increasing ``radii`` and returns the
    first whose concentration score ``(1/ñ)·#{(i, i'): ‖g_i − g_i'‖ ≤ τ}`` clears
    ``threshold_fraction·ñ`` (above AUP's own test at 4ñ/5, so its first queries are likely to pass).
    Adding, removing or replacing a user changes the count by at most ``2ñ_max − 1`` (docs/mechanisms.md, M4), so
    each query has sensitivity ``(2ñ_max − 1)/ñ``; the whole walk is ``epsilon``-DP (pure), whatever
    the number of radii, and is spent even when no radius passes (then it raises).
    """
    if not (private_loader.user_sampler.max_users_per_batch or 0) > 0:
        raise ValueError("The private loader must truncate its steps (max_users_per_batch): the score's "
                         "sensitivity (2ñ_max − 1)/ñ is unbounded otherwise.")
    if not 0 < threshold_fraction:
        raise ValueError(f"threshold_fraction must be > 0, got {threshold_fraction}.")
    check_positive(epsilon, "epsilon")
    radii = sorted(float(r) for r in radii)
    if not radii or radii[0] <= 0:
        raise ValueError("radii must be a non-empty list of positive candidate radii.")
    n_tilde, n_max = private_loader.users_per_batch, private_loader.user_sampler.max_users_per_batch
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(secrets.randbits(63))  # the Laplace noise must not be predictable
    svt = aup.score_test(n_tilde, n_max, epsilon, generator, threshold_fraction=threshold_fraction)
    batch = next(iter(private_loader))
    grads = _user_gradients(model, loss_fn, batch, private_loader.last_row_users)
    dist = pairwise_distances(grads) if grads else torch.zeros(0, 0)
    for tau in radii:
        if svt.query(float((dist <= tau).sum()) / n_tilde):
            return tau
    raise ValueError(f"No radius up to {radii[-1]} passed (ε = {epsilon} is spent): offer larger radii.")


def _user_gradients(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
                    row_users: torch.Tensor) -> List[torch.Tensor]:
    """Each parameter's per-user averaged gradients ``[U, *p.shape]`` for one batch ([] with no rows)."""
    if len(row_users) == 0:
        return []
    hooks = UserGradSampleHooks(model)
    try:
        hooks.set_row_users(row_users)
        model.zero_grad()
        loss_fn(model, batch).backward()
        counts = hooks.unit_counts
        return [p.grad_sample / counts.view(-1, *([1] * p.dim())) for p in hooks.param_names if p.grad_sample is not None]
    finally:
        hooks.cleanup()
        model.zero_grad()


def _phase_seed(seed: int, phase: int, phases: int) -> int:
    """Phase ``phase``'s sampling seed (the seed itself with one phase, as without phases)."""
    return seed if phases == 1 else derive_seed(seed, "phase", phase)
