"""``trl_userdp.PrivacyEngine``: Opacus's ``PrivacyEngine`` with ``make_private_user_level``.

The mechanism (a registered name or a :class:`~trl_userdp.mechanisms.GradientMechanism` object) supplies the loader,
the accounting event, its budget split, the optimizer's kind and its report fields (:mod:`trl_userdp.mechanisms`; math
in docs/mechanisms.md); the engine does the rest in one set-up path for every mechanism, AUP-RLHF included: model
checks, contribution bounding, the accountant, σ, the hooks, the optimizer, and the step hook that accounts each step.
Every privacy number comes from dp-accounting through the accountants of :mod:`trl_userdp.accountants`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import opacus
from torch import nn, optim
from torch.utils.data import DataLoader

from . import checkpoints, distributed
from .accountants import DPAccountingAccountant, PrivacyBudget, PrivacyReport
from .accountants.accountant import accountant_class
from .accountants.events import StepEvent
from .data import UserDataLoader, bound_contributions
from .data.bounding import BoundingReport
from .grad_sample import RowPositions, RowRelativePositions, UserGhostHooks, UserGradSampleHooks, check_module
from .grad_sample.checks import active_dropout
from .grad_sample.ghost import PACKABLE
from .mechanisms import GradientMechanism, gradient_mechanism
from .optimizers import PrivacyBudgetExhausted, UserDPOptimizer, get_optimizer_class
from .setup_options import SetupOptions
from .validators import (
    check_max_samples_per_user,
    check_noise_or_target,
    check_steps,
    check_target,
    warn_if_delta_is_large,
)

logger = logging.getLogger(__name__)


class PrivacyEngine(checkpoints.EngineCheckpoints, opacus.PrivacyEngine):
    """Opacus's engine, plus user-level DP (:meth:`make_private_user_level`), with its checkpoints' privacy state saved
    and restored by :class:`~trl_userdp.checkpoints.EngineCheckpoints`.

    Args:
        accountant: ``"rdp"`` or ``"pld"`` (dp-accounting; ``"prv"`` is taken as ``"pld"``, and the
            registered names ``"dp_rdp"`` / ``"dp_pld"`` are accepted).
        secure_mode: as in Opacus (needs ``torchcsprng``).
        neighboring_relation: ``"add_or_remove"`` (default) or ``"replace"`` one user (PLD only).

    Raises:
        ValueError: an unknown accountant or relation.
    """

    def __init__(self, *, accountant: str = "pld", secure_mode: bool = False, neighboring_relation: str = "add_or_remove"):
        cls = accountant_class(accountant)
        with warnings.catch_warnings():  # Opacus's advice to retrain with secure_mode, which this stack cannot do
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            super().__init__(accountant=cls.mechanism(), secure_mode=secure_mode)
        if not secure_mode:
            logger.info("Noise and user draws come from torch's generator seeded from the OS (or privacy_seed), not a "
                        "cryptographic RNG: docs/privacy_model.md, 'Randomness'.")
        self.accountant: DPAccountingAccountant = cls(relation=neighboring_relation)
        self.mechanism: Optional[GradientMechanism] = None
        self.bounding: Optional[BoundingReport] = None
        self.hooks: Optional[UserGradSampleHooks] = None
        self.optimizer: Optional[UserDPOptimizer] = None
        self.data_loader: Optional[UserDataLoader] = None
        self.planned_steps: Optional[int] = None
        #: the (ε, δ) the accountant may reach, which decides whether a step fits (the optimizer's guard refuses one
        #: that does not)
        self.budget: Optional[PrivacyBudget] = None
        #: what gives each batch row its own positions (absolute, and DeBERTa's relative ones) while hooked
        self._row_positions: List[Union[RowPositions, RowRelativePositions]] = []

    def make_private_user_level(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        data_loader: DataLoader,
        max_samples_per_user: int,
        users_per_batch: float,
        max_grad_norm: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        mechanism: Union[str, GradientMechanism] = "user_dpsgd",
        **options: Any,
    ) -> Tuple[nn.Module, UserDPOptimizer, UserDataLoader]:
        """Make ``(module, optimizer, data_loader)`` user-level private.

        The mechanism supplies the loader, the accounting event, the budget split, the optimizer (by its
        ``clipping``, :func:`~trl_userdp.optimizers.get_optimizer_class`) and its report fields
        (:mod:`trl_userdp.mechanisms`; math in docs/mechanisms.md). The loss must be the mean over the batch's rows;
        each user counts as the average of its rows. Every batch the loader yields must be used by one
        ``optimizer.step()``. One epoch is ``round(1/q)`` steps.

        Under ``torch.distributed`` (one process per device, the plain module on each) every rank draws the same
        users and keeps its shard (``user % world_size == rank``), parameters start from rank 0's, and a
        :class:`~trl_userdp.optimizers.DistributedUserDPOptimizer` all-reduces the clipped sums with one noise draw
        (rank 0's).

        Args:
            module: the model, in training mode (the plain module, not a DDP wrapper).
            optimizer: the optimizer over its parameters, wrapped by the private one.
            data_loader: supplies the dataset and collate function; it is replaced by a
                :class:`~trl_userdp.data.UserDataLoader` over the contribution-bounded dataset.
            max_samples_per_user: m; a user's rows beyond it are dropped by a seeded draw.
            users_per_batch: ñ, the expected users per step (q = ñ/n).
            max_grad_norm: C, the clip of each user's averaged gradient (AUP-RLHF takes τ instead).
            noise_multiplier: a fixed σ; with ``target_epsilon``/``target_delta`` as well, ε is capped (the optimizer
                refuses any step past it). Without it σ is calibrated to the target over ``epochs``/``steps``.
            target_epsilon: the target ε.
            target_delta: the target δ.
            epochs: the planned epochs (σ depends on them).
            steps: the planned steps, instead of ``epochs``.
            mechanism: a registered name (``"user_dpsgd"``, ``"group"``, ``"user_dpsgd_adaptive_clip"``) or a
                :class:`~trl_userdp.mechanisms.GradientMechanism` object (``GroupPrivacy("els")``,
                ``AUPRLHF(concentration_radius=...)``).
            **options: the :class:`~trl_userdp.setup_options.SetupOptions`: who wrote each row (``user_ids`` or a
                ``user_column``), ``rows_per_example``, the seeds, ``self_check``, ``grad_sample_mode``, ``user_key``
                and ``micro_batches``.

        Returns:
            The model itself (hooks attached), the private optimizer and the user-level loader.

        Raises:
            ValueError: a setting that would break the guarantee or the per-user gradients, before anything runs.
        """
        mech = gradient_mechanism(mechanism)
        opts = SetupOptions(**options)
        sharded = distributed.is_sharded(module)
        mech.check_setup(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, sharded=sharded,
                         world_size=distributed.world_size(), grad_sample_mode=opts.grad_sample_mode)
        check_noise_or_target(noise_multiplier, target_epsilon, target_delta, epochs, steps)
        budget = None if target_epsilon is None else mech.budget(target_epsilon, target_delta)
        m = self._check_model(module, optimizer, max_samples_per_user)
        opts = opts.joined(module, sharded=sharded)
        bounded = self._bound(data_loader, m, opts, target_delta)
        calibrated = noise_multiplier is None
        loader, expected_units, noise_multiplier, total_steps = self._plan(
            mech, bounded, data_loader, opts, m=m, users_per_batch=users_per_batch, epochs=epochs, steps=steps,
            noise_multiplier=noise_multiplier, budget=budget)
        dp_optimizer = self._make_optimizer(
            get_optimizer_class(mech.clipping, "sharded" if sharded else distributed.world_size() > 1,
                                opts.grad_sample_mode),
            optimizer, module, opts, budget_guard=self._check_budget if budget is not None else None,
            noise_multiplier=noise_multiplier, expected_batch_size=expected_units,
            **mech.optimizer_options(max_grad_norm=max_grad_norm, expected_units=expected_units, steps=total_steps,
                                     target_epsilon=target_epsilon, target_delta=target_delta),
        )
        if budget is not None:
            budget = PrivacyBudget(*budget, calibrated_steps=total_steps if calibrated else None)
        return self._finish(module, dp_optimizer, loader, mech, total_steps, budget)

    def make_private_user_level_with_epsilon(
        self, *, target_epsilon: float, target_delta: float, epochs: Optional[float] = None,
        steps: Optional[int] = None, **kwargs: Any,
    ) -> Tuple[nn.Module, UserDPOptimizer, UserDataLoader]:
        """As Opacus's ``make_private_with_epsilon``: σ is the smallest noise multiplier for which ``epochs`` or
        ``steps`` steps at this run's user sampling rate meet ``(target_epsilon, target_delta)`` with this engine's
        accountant (it needs the bounded dataset's user count, so it is found during set-up), and the optimizer
        refuses any step past the target.

        Args:
            target_epsilon: the target ε.
            target_delta: the target δ.
            epochs: the planned epochs.
            steps: the planned steps, instead of ``epochs``.
            **kwargs: those of :meth:`make_private_user_level` but ``noise_multiplier``.

        Returns:
            As :meth:`make_private_user_level`.

        Raises:
            ValueError: a ``noise_multiplier`` is given, or the target or its length is missing or invalid.
        """
        if "noise_multiplier" in kwargs:
            raise ValueError("make_private_user_level_with_epsilon calibrates σ; to fix σ use make_private_user_level.")
        check_target(target_epsilon, target_delta, epochs, steps)
        return self.make_private_user_level(target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
                                            steps=steps, **kwargs)

    # -- the set-up steps (AdaptiveUserPrivacyEngine adds AUP-RLHF's phases in _plan) -------------
    def _plan(self, mech: GradientMechanism, bounded: Any, data_loader: DataLoader, opts: SetupOptions, *, m: int,
              users_per_batch: float, epochs: Optional[float], steps: Optional[int],
              noise_multiplier: Optional[float], budget: Optional[Tuple[float, float]],
              ) -> Tuple[UserDataLoader, float, float, Optional[int]]:
        """The mechanism's loader and accountant, and σ (calibrated to ``budget`` over the planned steps when no
        ``noise_multiplier`` is given). Returns ``(loader, expected units per step, σ, planned steps)``."""
        loader, expected_units = mech.make_loader(
            bounded, n_users=self.bounding.n_users, users_per_batch=users_per_batch, max_samples_per_user=m,
            **opts.loader_options(data_loader))
        self._install_accountant(loader.sample_rate, mech.step_event(
            max_samples_per_user=m, n_users=self.bounding.n_users, users_per_batch=users_per_batch))
        total_steps = None if steps is None and epochs is None else check_steps(steps, epochs, loader.sample_rate)
        if noise_multiplier is None:
            noise_multiplier = self.accountant.calibrate(*budget, sample_rate=loader.sample_rate, steps=total_steps)
        return loader, expected_units, noise_multiplier, total_steps

    def _check_model(self, module, optimizer, max_samples_per_user: int) -> int:
        """Refuse what the engine cannot make private (before anything is built); warn of dropout that is on."""
        if self.hooks is not None:
            raise ValueError("This engine already made a model private; create a new PrivacyEngine.")
        m = check_max_samples_per_user(max_samples_per_user)
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "Pass the plain module, not a DistributedDataParallel wrapper: DDP would average the raw gradients "
                "across processes; the engine shards users by rank and all-reduces the clipped, noised sums itself."
            )
        if distributed.is_sharded(module):
            distributed.check_sharding(module, PACKABLE)
        model_params = set(module.parameters())
        if any(p not in model_params for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("Module parameters are different than optimizer parameters.")
        check_module(module)
        dropout = active_dropout(module)
        if dropout:
            logger.warning("The model has dropout on (%s): its masks come from torch's global stream, one per batch, "
                           "so one user's rows move the others' masks. Turn it off before training "
                           "(trl_userdp.grad_sample.checks.disable_dropout(model)); the trainers refuse it.", dropout[0])
        return m

    def _bound(self, data_loader, m, opts: SetupOptions, target_delta):
        """The dataset with at most ``m`` rows per user (a seeded draw); the counts go to :attr:`bounding`."""
        bounded, self.bounding = bound_contributions(
            data_loader.dataset, m, user_column=opts.user_column, user_ids=opts.user_ids, seed=opts.bounding_seed
        )
        if target_delta is not None:
            warn_if_delta_is_large(target_delta, self.bounding.n_users)
        return bounded

    def _install_accountant(self, sample_rate: float, events: StepEvent) -> None:
        """A fresh accountant of this engine's kind and relation for the mechanism's ``events``."""
        previous = self.accountant
        self.accountant = type(previous)(relation=previous.relation, events=events)
        if not self.accountant.supports_relation(sample_rate):
            raise ValueError(
                f"The {self.accountant.kind} accountant cannot account this mechanism under the "
                f"{previous.relation!r} relation; use PrivacyEngine(accountant='pld')."
            )

    def _make_optimizer(self, optimizer_class, optimizer, module, opts: SetupOptions, *, budget_guard,
                        **mechanism_options) -> UserDPOptimizer:
        """Attach the per-user hooks and wrap ``optimizer`` in the mechanism's ``optimizer_class``."""
        self._row_positions = [RowRelativePositions(module), RowPositions(module)]
        hooks_class = UserGhostHooks if opts.grad_sample_mode == "ghost" else UserGradSampleHooks
        hooks = hooks_class(module, force_functorch=opts.grad_sample_mode == "functorch")
        if distributed.is_sharded(module):  # the hooks key their state by the parameters FSDP2 gathers
            mechanism_options["live_params"] = distributed.gathered_parameters(module)
            hooks.use_gathered_parameters(mechanism_options["live_params"])
        return optimizer_class(
            optimizer,
            hooks=hooks,
            generator=self.secure_rng if self.secure_mode else opts.noise_generator,
            noise_seed=opts.noise_seed,
            step_index=None if opts.noise_seed is None else self.steps_accounted,
            secure_mode=self.secure_mode,
            self_check=opts.self_check,
            budget_guard=budget_guard,
            **mechanism_options,
        )

    def _finish(self, module, dp_optimizer, loader, mechanism: GradientMechanism, total_steps, budget):
        dp_optimizer.attach_step_hook(self._account_step)
        if loader.user_key is None:
            loader.add_batch_callback(dp_optimizer.hooks.set_row_users)
        loader.stop_when = lambda: dp_optimizer.halted  # AUP-RLHF's AboveThreshold can halt a run
        self.mechanism, self.hooks, self.optimizer, self.data_loader = mechanism, dp_optimizer.hooks, dp_optimizer, loader
        self.planned_steps = total_steps
        self.budget = budget
        return module, dp_optimizer, loader

    def _account_step(self, optimizer: UserDPOptimizer) -> None:
        """The optimizer's step hook: one step at (σ, q) in the current accountant."""
        self.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=self.data_loader.sample_rate)

    def get_epsilon(self, delta: float) -> float:
        """The run's ε at ``delta`` so far: the accountant's, as the mechanism reads it (AUP-RLHF adds what
        AboveThreshold and the choice of τ spent).

        Args:
            delta: the δ at which ε is read.

        Returns:
            ε (0 before any step).
        """
        accounted = self.accountant.get_epsilon(delta)
        return accounted if self.mechanism is None else self.mechanism.epsilon(accounted, self.optimizer)

    def steps_accounted(self) -> int:
        """Private steps accounted so far (restored from checkpoints): the position of the next step's noise."""
        return self.accountant.steps_taken

    def budget_allows_step(self) -> bool:
        """Whether one more step at this run's (σ, q) stays within the budget (:meth:`PrivacyBudget.allows_step`).

        Returns:
            The budget's answer; always True without a budget.
        """
        return self.budget is None or self.budget.allows_step(self.accountant, self.optimizer.noise_multiplier,
                                                              self.data_loader.sample_rate)

    def affordable_steps(self) -> int:
        """Most steps at this run's (σ, q) within the budget (:meth:`PrivacyBudget.affordable_steps`)."""
        return self.budget.affordable_steps(self.accountant, self.optimizer.noise_multiplier,
                                            self.data_loader.sample_rate)

    def stop_reason(self) -> Optional[str]:
        """Why the run can take no further step, or None: AUP-RLHF's AboveThreshold halted, or the budget is spent.

        Returns:
            The reason in words, or None while steps remain.
        """
        if self.optimizer is not None and self.optimizer.halted:
            return "AUP-RLHF halted"
        return None if self.budget_allows_step() else "the privacy budget allows no further step"

    def _check_budget(self) -> None:
        """The optimizer's budget guard: refuse a step that would take ε past the budget."""
        if not self.budget_allows_step():
            raise PrivacyBudgetExhausted(self.budget.exhausted(self.accountant.steps_taken))

    def privacy_report(self, delta: float) -> PrivacyReport:
        """What has been spent so far.

        Args:
            delta: the δ at which ε is reported.

        Returns:
            The :class:`~trl_userdp.accountants.PrivacyReport`.

        Raises:
            ValueError: no run was set up.
        """
        if self.optimizer is None:
            raise ValueError("Call make_private_user_level first.")
        return PrivacyReport(**self._report_fields(delta))

    def _report_fields(self, delta: float) -> Dict[str, Any]:
        """The report's fields, with the mechanism's (an engine with more to say extends them)."""
        opt = self.optimizer
        fields = dict(
            mechanism=self.mechanism.report_name,
            n_users=self.bounding.n_users,
            max_samples_per_user=self.bounding.max_samples_per_user,
            sample_rate=self.data_loader.sample_rate,
            noise_multiplier=opt.noise_multiplier,
            steps=self.planned_steps,
            steps_taken=self.steps_accounted(),
            accountant=self.accountant.mechanism(),
            epsilon=self.get_epsilon(delta),
            delta=delta,
            neighboring_relation=self.accountant.relation,
            privacy_unit="user",
            per_user_max_grad_norm=opt.max_grad_norm,
            extra={"expected_units_per_step": getattr(opt, "global_expected_batch_size", opt.expected_batch_size),
                   "clipping_unit": self.mechanism.clipping_unit,
                   "world_size": distributed.world_size()},
        )
        return self.mechanism.report_fields(fields, opt, accounted_epsilon=self.accountant.get_epsilon(delta))

    def detach(self) -> None:
        """Remove the hooks from the model (it trains normally afterwards)."""
        if self.hooks is not None:
            self.hooks.cleanup()
        for adapter in self._row_positions:
            adapter.remove()
        self._row_positions = []

