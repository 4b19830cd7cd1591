"""``AdaptiveUserPrivacyEngine``: AUP-RLHF (Zhang et al., Alg. 1–3) for any PyTorch model (docs/mechanisms.md, M4).

The mechanism (:class:`~trl_userdp.mechanisms.AUPRLHF`: AboveThreshold, outlier removal, noise scaled to τ, its
budget split and truncated-Poisson accounting) goes through the set-up every mechanism goes through,
:meth:`PrivacyEngine.make_private_user_level`; this engine adds Alg. 1's ``k`` phases, which run Alg. 2 on disjoint
user sets one after another (parallel composition), and AUP-RLHF's calling style. It also holds the two ways of
choosing τ.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from .accountants import DPAccountingAccountant
from .data import PhasedUserDataLoader, UserDataLoader, resolve_user_ids
from .data.phases import assign_phases, phase_datasets, phase_shares
from .grad_sample import UserGradSampleHooks
from .mechanisms import aup
from .mechanisms.aup import AUPRLHF, pairwise_distances
from .optimizers.aup_optimizer import AUPOptimizer
from .privacy_engine import PrivacyEngine
from .seeding import derive_seed
from .validators import check_positive, check_steps


class AdaptiveUserPrivacyEngine(PrivacyEngine):
    """AUP-RLHF with Alg. 1's phases: :meth:`PrivacyEngine.make_private_user_level` with the
    :class:`~trl_userdp.mechanisms.AUPRLHF` mechanism, in AUP-RLHF's calling style, where ``phases`` runs Alg. 2 on
    disjoint user sets one after another.

    Accounting is dp-accounting's PLD (the truncated-Poisson event has no RDP form). Each phase has its own
    accountant; the phases' users are disjoint, so the run's ε is the largest phase's (parallel composition).

    Args:
        secure_mode: as in Opacus.
        neighboring_relation: ``"add_or_remove"`` (default) or ``"replace"`` one user.
    """

    def __init__(self, *, secure_mode: bool = False, neighboring_relation: str = "add_or_remove"):
        super().__init__(accountant="pld", secure_mode=secure_mode, neighboring_relation=neighboring_relation)
        self.phases, self.phase_users = 1, "all"
        #: per phase: accountant, σ and planned steps (one entry when phases=1)
        self.phase_accountants: List[DPAccountingAccountant] = []
        self.phase_noise_multipliers: List[float] = []
        self.phase_steps: List[int] = []
        self.phase = 0

    def make_private_user_level(
        self,
        *,
        concentration_radius: float,
        target_epsilon: float,
        target_delta: float,
        max_users_per_batch: Optional[int] = None,
        svt_fraction: float = 0.5,
        radius_epsilon: float = 0.0,
        phases: int = 1,
        phase_users: str = "all",
        average_iterates: bool = False,
        **kwargs: Any,
    ) -> Tuple[nn.Module, AUPOptimizer, Union[UserDataLoader, PhasedUserDataLoader]]:
        """AUP-RLHF over ``phases`` disjoint sets of users.

        ``epochs`` or ``steps`` give each phase the same number of passes over its own users; every phase runs Alg. 2
        afresh (new AboveThreshold threshold, its own σ and T) from the previous phase's parameters. On ⊥ the optimizer
        halts, the loader stops, and :meth:`privacy_report` says at which query. The budget is required (the noise
        scale depends on ε, δ and T).

        Args:
            concentration_radius: τ.
            target_epsilon: the run's ε.
            target_delta: the run's δ.
            max_users_per_batch: ñ_max (default :func:`~trl_userdp.mechanisms.aup.default_max_users_per_batch`).
            svt_fraction: the share of ε for AboveThreshold.
            radius_epsilon: the part of ``target_epsilon`` already spent choosing τ on these users
                (:func:`propose_concentration_radius_private`); ε adds up by basic composition.
            phases: Alg. 1's k.
            phase_users: ``"all"`` (the phases' geometric split rescaled to use every user) or ``"paper"`` (Alg. 1 as
                written, which leaves a share 2^−k unused: half the users at k = 1; :mod:`trl_userdp.data.phases`).
            average_iterates: keep the running average of the iterates.
            **kwargs: the rest of :meth:`PrivacyEngine.make_private_user_level`'s arguments (``module``,
                ``optimizer``, ``data_loader``, ``max_samples_per_user``, ``users_per_batch``, ``epochs`` or ``steps``,
                and the set-up options).

        Returns:
            The model, the :class:`~trl_userdp.optimizers.AUPOptimizer` and the loader (a
            :class:`~trl_userdp.data.PhasedUserDataLoader` with ``phases > 1``).

        Raises:
            ValueError: as :meth:`PrivacyEngine.make_private_user_level`, and ``phases > 1`` with ``user_key`` or
                ``micro_batches`` (a loop that prefetches would cross a phase boundary early).
        """
        phase_shares(phases, phase_users)
        if phases > 1 and (kwargs.get("user_key") is not None or kwargs.get("micro_batches", 1) > 1):
            raise ValueError("phases > 1 needs a loop that steps each batch before fetching the next; "
                             "it cannot be used with user_key (transformers' Trainer prefetches batches) or "
                             "micro_batches > 1.")
        self.phases, self.phase_users = phases, phase_users
        mechanism = AUPRLHF(concentration_radius, max_users_per_batch=max_users_per_batch, svt_fraction=svt_fraction,
                            radius_epsilon=radius_epsilon, average_iterates=average_iterates)
        module, optimizer, loader = super().make_private_user_level(
            mechanism=mechanism, target_epsilon=target_epsilon, target_delta=target_delta, **kwargs)
        if phases > 1:
            loader.add_phase_callback(self._start_phase)
        return module, optimizer, loader

    #: the ε-targeted entry point is this one (the budget is always required)
    make_private_user_level_with_epsilon = make_private_user_level

    def _plan(self, mech, bounded, data_loader, opts, *, m, users_per_batch, epochs, steps, noise_multiplier, budget):
        """Alg. 1's phases: each phase's users, loader, accountant, T and σ (calibrated to the Gaussian share of the
        budget); the first phase's are the run's until the phased loader starts the next."""
        index = resolve_user_ids(bounded, user_column=opts.user_column)
        phase_of_user = assign_phases(index, phase_shares(self.phases, self.phase_users), opts.bounding_seed)
        sizes = np.bincount(phase_of_user[phase_of_user >= 0], minlength=self.phases)
        if sizes.min() < users_per_batch:
            raise ValueError(
                f"Phase sizes {sizes.tolist()} (users): every phase needs at least users_per_batch="
                f"{users_per_batch} users; use fewer phases, phase_users='all' or a smaller users_per_batch."
            )
        used = int(sizes.sum())
        loader_options = opts.loader_options(data_loader)
        loaders = []
        for i, dataset in enumerate(phase_datasets(bounded, index, phase_of_user, self.phases)):
            q = users_per_batch / int(sizes[i])
            t = check_steps(None, epochs, q) if steps is None else max(1, int(round(check_steps(steps, None, q) * sizes[i] / used)))
            loader_options.update(seed=None if opts.sampling_seed is None else _phase_seed(opts.sampling_seed, i, self.phases))
            loader, _ = mech.make_loader(dataset, n_users=int(sizes[i]), users_per_batch=users_per_batch,
                                         max_samples_per_user=m, steps=t if self.phases > 1 else None, **loader_options)
            loaders.append(loader)  # one phase: epochs of round(1/q) steps, as without phases
            self._install_accountant(q, mech.step_event(max_samples_per_user=m, n_users=int(sizes[i]),
                                                        users_per_batch=users_per_batch))
            self.phase_accountants.append(self.accountant)
            self.phase_steps.append(t)
            self.phase_noise_multipliers.append(self.accountant.calibrate(*budget, sample_rate=q, steps=t))
        self.accountant = self.phase_accountants[0]
        if self.phases == 1:
            loader = loaders[0]
        else:
            per_iteration = sum(self.phase_steps) if epochs is None else math.ceil(sum(self.phase_steps) / epochs)
            loader = PhasedUserDataLoader(loaders, per_iteration)
        return loader, loaders[0].users_per_batch, self.phase_noise_multipliers[0], self.phase_steps[0]

    def steps_accounted(self) -> int:
        """Steps accounted over all phases."""
        return sum(acc.steps_taken for acc in self.phase_accountants)

    def _start_phase(self, phase: int) -> None:
        """Switch optimizer, accountant and budget guard to ``phase`` (called by the phased loader)."""
        self.phase = phase
        self.accountant = self.phase_accountants[phase]
        self.planned_steps = self.budget.calibrated_steps = self.phase_steps[phase]  # σ calibrated to the phase's T
        self.optimizer.start_phase(self.phase_noise_multipliers[phase], self.phase_steps[phase])

    def _phase_epsilons(self, delta: float) -> List[float]:
        """Each started phase's ε: its Gaussian steps plus ε_svt once its AboveThreshold was queried, plus
        the ε spent choosing τ (on all users, so it adds to every phase)."""
        queries = self.optimizer.svt_queries_by_phase if self.optimizer is not None else [0]
        svt_epsilon = self.optimizer.svt_epsilon if self.optimizer is not None else 0.0
        return [self.mechanism.radius_epsilon + acc.get_epsilon(delta) + (svt_epsilon if queried else 0.0)
                for acc, queried in zip(self.phase_accountants, queries)]

    def get_epsilon(self, delta: float) -> float:
        """The largest phase's ε (disjoint users: parallel composition); within a phase, the Gaussian
        steps' ε at ``delta`` plus AboveThreshold's pure ε_svt (basic composition, Thm 3), plus
        ``radius_epsilon``."""
        return max(self._phase_epsilons(delta), default=0.0)

    def restore_privacy_state(self, accountant_state: Dict[str, Any], optimizer_state: Dict[str, Any], *,
                              source: str = "checkpoint") -> None:
        """As :meth:`PrivacyEngine.restore_privacy_state`, for a run of one phase.

        Raises:
            ValueError: a run of several phases, or a state that does not belong to this run.
        """
        if len(self.phase_accountants) > 1:
            raise ValueError("Checkpoints of a multi-phase AUP-RLHF run cannot be resumed; run the phases in one go.")
        super().restore_privacy_state(accountant_state, optimizer_state, source=source)

    def _report_fields(self, delta: float) -> Dict[str, Any]:
        fields = super()._report_fields(delta)
        fields.update(steps=sum(self.phase_steps))
        fields["extra"].update(
            gaussian_epsilon=max(acc.get_epsilon(delta) for acc in self.phase_accountants), phase_users=self.phase_users)
        if len(self.phase_steps) > 1:
            fields["extra"]["composition"] += "; parallel over disjoint phases"
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
    """Propose τ from *public* users (no privacy cost): a quantile of the pairwise distances between per-user averaged
    gradients at the current parameters. AboveThreshold passes when about 4/5 of the pairs of a step lie within τ
    (AUP-RLHF Alg. 2), so a coverage of 0.9 leaves a margin. Call it before making the model private.

    Args:
        model: the model, before the engine attaches its hooks.
        loss_fn: ``loss_fn(model, batch)``, the mean loss over the batch's rows.
        public_loader: a :class:`~trl_userdp.data.UserDataLoader` over public users.
        coverage: the quantile.
        max_batches: the batches of ``public_loader`` to read at most.

    Returns:
        τ.

    Raises:
        ValueError: ``coverage`` outside (0, 1), or no batch with two or more users.
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

    Args:
        model: the model, before the engine attaches its hooks.
        loss_fn: ``loss_fn(model, batch)``, the mean loss over the batch's rows.
        private_loader: the truncated loader (``max_users_per_batch`` set).
        epsilon: the walk's pure ε (pass it on as ``radius_epsilon``).
        radii: the candidate radii.
        threshold_fraction: the bar, as a share of ñ.
        generator: the Laplace noise's generator (default: seeded from the OS).

    Returns:
        The first radius that passes.

    Raises:
        ValueError: an untruncated loader, bad arguments, or no radius passed (ε is spent).
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
