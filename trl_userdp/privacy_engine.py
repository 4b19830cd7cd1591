"""``trl_userdp.PrivacyEngine``: Opacus's ``PrivacyEngine`` with ``make_private_user_level``.

Mechanisms (docs/mechanisms.md):

* ``"user_dpsgd"`` (M1): users are Poisson-sampled with ``q = users_per_batch / n_users``; each
  user's averaged gradient is clipped to C; noise ``N(0, σ²C²)``; division by ``users_per_batch``.
  Accounted as ``T`` Poisson-subsampled Gaussian steps at rate q (add/remove one user).
* ``"group"`` (M2): the item-level baseline. Records (pairs) are Poisson-sampled at the same q,
  each record's gradient is clipped, and the user-level guarantee comes from group privacy over
  the ``m`` records of a user (``group_accounting="conversion"``) or from ELS accounting
  (``"els"``, Charles et al. 2024, PLD only).

Every privacy number comes from dp-accounting through the accountants of
:mod:`trl_userdp.accountants`.
"""

from __future__ import annotations

import math
import os
from itertools import chain
from typing import IO, Any, BinaryIO, Dict, Optional, Sequence, Tuple, Union

import opacus
import torch
from torch import nn, optim
from torch.utils.data import DataLoader

from .accountants import DPAccountingAccountant, PrivacyReport, calibrate_noise_multiplier
from .checkpoints import load_plain
from .accountants.accountant import accountant_class
from .data import DEFAULT_USER_COLUMN, UserDataLoader, bound_contributions
from .data.bounding import BoundingReport
from .grad_sample import UserGradSampleHooks, check_module, supply_position_ids
from . import distributed
from .optimizers import DistributedUserDPOptimizer, PrivacyBudgetExhausted, UserDPOptimizer
from .validators import (
    check_delta,
    check_epsilon,
    check_max_samples_per_user,
    check_noise_multiplier,
    check_positive,
    check_steps,
    steps_per_epoch,
    warn_if_delta_is_large,
)

MECHANISMS = ("user_dpsgd", "group")
#: Key of the private optimizer's own state in a checkpoint written by :meth:`PrivacyEngine.save_checkpoint`.
OPTIMIZER_STATE_KEY = "trl_userdp_optimizer_state"
GROUP_ACCOUNTING = ("conversion", "els")


class PrivacyEngine(opacus.PrivacyEngine):
    """Opacus's engine, plus user-level DP.

    Args:
        accountant: ``"rdp"`` or ``"pld"`` (dp-accounting; ``"prv"`` is taken as ``"pld"``, and the
            registered names ``"dp_rdp"`` / ``"dp_pld"`` are accepted).
        secure_mode: as in Opacus (needs ``torchcsprng``).
        neighboring_relation: ``"add_or_remove"`` (default) or ``"replace"`` one user (PLD only).
    """

    def __init__(self, *, accountant: str = "pld", secure_mode: bool = False, neighboring_relation: str = "add_or_remove"):
        cls = accountant_class(accountant)
        super().__init__(accountant=cls.mechanism(), secure_mode=secure_mode)
        self.accountant: DPAccountingAccountant = cls(relation=neighboring_relation)
        self.mechanism: Optional[str] = None
        self.bounding: Optional[BoundingReport] = None
        self.hooks: Optional[UserGradSampleHooks] = None
        self.optimizer: Optional[UserDPOptimizer] = None
        self.data_loader: Optional[UserDataLoader] = None
        self.planned_steps: Optional[int] = None
        #: (ε, δ) the accountant may reach; the budget guard refuses steps beyond it
        self.budget: Optional[Tuple[float, float]] = None
        self._calibrated = False  # σ was calibrated to the budget over planned_steps
        self._affordable: Optional[int] = None
        self._position_hook = None

    def make_private_user_level(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        data_loader: DataLoader,
        max_grad_norm: float,
        max_samples_per_user: int,
        users_per_batch: float,
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        user_ids: Optional[Sequence[Any]] = None,
        user_column: str = DEFAULT_USER_COLUMN,
        mechanism: str = "user_dpsgd",
        group_accounting: str = "conversion",
        rows_per_example: int = 1,
        bounding_seed: Optional[int] = 0,
        sampling_seed: Optional[int] = None,
        noise_generator: Optional[torch.Generator] = None,
        noise_seed: Optional[int] = None,
        self_check: bool = True,
        grad_sample_mode: str = "hooks",
        user_key: Optional[str] = None,
    ) -> Tuple[nn.Module, UserDPOptimizer, UserDataLoader]:
        """Make ``(module, optimizer, data_loader)`` user-level private.

        Give ``noise_multiplier``, or ``target_epsilon`` + ``target_delta`` + ``epochs``/``steps`` (σ is
        then calibrated with this engine's accountant for that many steps), or both ``noise_multiplier``
        and ``target_epsilon``/``target_delta`` (σ fixed, ε capped). With a target the optimizer refuses
        any step that would exceed it (:meth:`budget_allows_step`). ``data_loader`` supplies the dataset and collate function; it is replaced by a
        :class:`~trl_userdp.data.UserDataLoader` over the contribution-bounded dataset (at most
        ``max_samples_per_user`` rows per user, a seeded draw). ``user_ids`` (one per row) or a
        ``user_column`` of a ``datasets.Dataset`` say who wrote each row; ``rows_per_example=2`` for
        collators that emit ``[chosen; rejected]`` rows, stacked in two blocks (row i and row B + i are
        one example, as in TRL; an interleaved layout would be mis-assigned and is not detectable).
        The noise comes from ``noise_generator``, or with ``noise_seed`` from a generator keyed by (seed, step),
        which a resumed run continues instead of replaying (default: seeded from the OS).
        Every batch the loader yields must be used by one ``optimizer.step()``. With ``user_key`` the
        loader puts each batch's row -> user map into the (dict) batch under that key, and the training
        loop hands it to ``optimizer.hooks.set_row_users`` itself (for loops that prefetch batches).
        The loss must be the mean over the batch's rows; each user counts as the average of its rows.
        Under ``torch.distributed`` (one process per device, the plain module on each) every rank draws the
        same users and keeps its shard (``user % world_size == rank``), parameters start from rank 0's,
        and a :class:`~trl_userdp.optimizers.DistributedUserDPOptimizer` all-reduces the clipped sums with
        one noise draw (rank 0's). Returns the model itself (hooks attached),
        the :class:`~trl_userdp.optimizers.UserDPOptimizer` and the loader. One epoch is
        ``round(1/q)`` steps.
        """
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}.")
        if group_accounting not in GROUP_ACCOUNTING:
            raise ValueError(f"group_accounting must be one of {GROUP_ACCOUNTING}, got {group_accounting!r}.")
        check_positive(max_grad_norm, "max_grad_norm")
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError("Give `noise_multiplier`, or `target_epsilon` with `target_delta` (or both: a fixed σ with a cap).")
        if noise_multiplier is None:
            self._check_target(target_epsilon, target_delta, epochs, steps)
        else:
            check_noise_multiplier(noise_multiplier)
            if target_epsilon is not None:
                check_epsilon(target_epsilon)
                check_delta(target_delta)
        if mechanism == "group" and group_accounting == "els" and self.accountant.kind != "pld":
            raise ValueError("ELS accounting needs the PLD accountant: PrivacyEngine(accountant='pld').")
        m = self._check_model(module, optimizer, grad_sample_mode, max_samples_per_user)
        bounding_seed, sampling_seed = self._join_processes(module, bounding_seed, sampling_seed)

        loader, expected_units = self._make_loader(
            data_loader, mechanism, m, users_per_batch, user_ids, user_column, rows_per_example, bounding_seed,
            sampling_seed, user_key=user_key,
        )
        if target_delta is not None:
            warn_if_delta_is_large(target_delta, self.bounding.n_users)
        self._install_accountant(
            loader.sample_rate,
            group_size=m if mechanism == "group" else None,
            els=mechanism == "group" and group_accounting == "els",
        )
        total_steps = None if steps is None and epochs is None else check_steps(steps, epochs, loader.sample_rate)
        self._calibrated = noise_multiplier is None
        if self._calibrated:
            noise_multiplier = self._calibrate(target_epsilon, target_delta, loader.sample_rate, total_steps)
        hooks = self._attach_hooks(module, grad_sample_mode)
        optimizer_class = DistributedUserDPOptimizer if distributed.world_size() > 1 else UserDPOptimizer
        dp_optimizer = optimizer_class(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_units,
            hooks=hooks,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            noise_seed=noise_seed,
            step_index=None if noise_seed is None else self.steps_accounted,
            secure_mode=self.secure_mode,
            self_check=self_check,
            budget_guard=self._check_budget if target_epsilon is not None else None,
        )
        budget = None if target_epsilon is None else (target_epsilon, target_delta)
        return self._finish(module, dp_optimizer, loader, mechanism, total_steps, budget)

    # -- pieces shared with AdaptiveUserPrivacyEngine ------------------------------------------
    @staticmethod
    def _check_target(target_epsilon, target_delta, epochs, steps) -> None:
        check_epsilon(target_epsilon)
        check_delta(target_delta)
        if epochs is None and steps is None:
            raise ValueError("With target_epsilon, give `epochs` or `steps`: σ depends on how long you train.")

    def _check_model(self, module, optimizer, grad_sample_mode: str, max_samples_per_user: int) -> int:
        if grad_sample_mode not in ("hooks", "functorch"):
            raise ValueError(
                "grad_sample_mode must be 'hooks' or 'functorch': per-user averages need per-sample "
                f"gradients, which ghost clipping does not produce (got {grad_sample_mode!r})."
            )
        if self.hooks is not None:
            raise ValueError("This engine already made a model private; create a new PrivacyEngine.")
        m = check_max_samples_per_user(max_samples_per_user)
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "Pass the plain module, not a DistributedDataParallel wrapper: DDP would average the raw gradients "
                "across processes; the engine shards users by rank and all-reduces the clipped, noised sums itself."
            )
        model_params = set(module.parameters())
        if any(p not in model_params for p in chain.from_iterable(g["params"] for g in optimizer.param_groups)):
            raise ValueError("Module parameters are different than optimizer parameters.")
        check_module(module)
        return m

    def _make_loader(
        self, data_loader, mechanism, m, users_per_batch, user_ids, user_column, rows_per_example, bounding_seed,
        sampling_seed, max_users_per_batch=None, user_key=None,
    ) -> Tuple[UserDataLoader, float]:
        """Bound contributions and build the Poisson loader; returns it and the expected units per step."""
        bounded, self.bounding = bound_contributions(
            data_loader.dataset, m, user_column=user_column, user_ids=user_ids, seed=bounding_seed
        )
        kwargs = dict(
            num_replicas=distributed.world_size(),
            rank=distributed.rank(),
            collate_fn=data_loader.collate_fn,
            num_workers=data_loader.num_workers,
            pin_memory=data_loader.pin_memory,
            rows_per_example=rows_per_example,
            seed=sampling_seed,
            user_column=user_column,
            user_key=user_key,
        )
        if mechanism != "group":
            loader = UserDataLoader(
                bounded, users_per_batch=users_per_batch, max_samples_per_user=m,
                max_users_per_batch=max_users_per_batch, **kwargs,
            )
            return loader, loader.users_per_batch
        # group: every record is its own sampling and clipping unit, at the users' rate q
        q = users_per_batch / self.bounding.n_users
        loader = UserDataLoader(
            bounded, users_per_batch=q * len(bounded), user_ids=range(len(bounded)), steps=steps_per_epoch(q), **kwargs
        )
        return loader, q * len(bounded)

    @staticmethod
    def _join_processes(module: nn.Module, bounding_seed, sampling_seed):
        """With several processes: the same bounding and sampling seeds and starting parameters on every
        rank (a seed left to the OS is drawn on rank 0 and shared)."""
        if distributed.world_size() > 1:
            bounding_seed, sampling_seed = distributed.shared_seed(bounding_seed), distributed.shared_seed(sampling_seed)
            distributed.broadcast_parameters(module)
        return bounding_seed, sampling_seed

    def _install_accountant(self, sample_rate: float, **config) -> None:
        previous = self.accountant
        self.accountant = type(previous)(relation=previous.relation, **config)
        if not self.accountant.supports_relation(sample_rate):
            raise ValueError(
                f"The {self.accountant.kind} accountant cannot account this mechanism under the "
                f"{previous.relation!r} relation; use PrivacyEngine(accountant='pld')."
            )

    def _calibrate(self, epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
        return calibrate_noise_multiplier(
            lambda s: self.accountant.step_event(s, sample_rate, steps),
            target_epsilon=epsilon,
            target_delta=delta,
            accountant=self.accountant.kind,
            relation=self.accountant.relation,
            group_size=self.accountant.conversion_group_size,
            **self.accountant.options,
        )

    def _attach_hooks(self, module: nn.Module, grad_sample_mode: str) -> UserGradSampleHooks:
        self._position_hook = supply_position_ids(module)
        return UserGradSampleHooks(module, force_functorch=grad_sample_mode == "functorch")

    def _finish(self, module, dp_optimizer, loader, mechanism, total_steps, budget):
        dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=loader.sample_rate))
        if loader.user_key is None:
            loader.add_batch_callback(dp_optimizer.hooks.set_row_users)
        self.mechanism, self.hooks, self.optimizer, self.data_loader = mechanism, dp_optimizer.hooks, dp_optimizer, loader
        self.planned_steps = total_steps
        self.budget = budget
        return module, dp_optimizer, loader

    def steps_accounted(self) -> int:
        """Private steps accounted so far (restored from checkpoints): the position of the next step's noise."""
        return self.accountant.steps_taken

    def budget_allows_step(self) -> bool:
        """Whether one more step stays within the budget, read from the accountant (so it survives
        checkpoint resumes). With one (σ, q) throughout, a step is allowed while fewer than the T steps
        σ was calibrated for are accounted; otherwise ε of the history plus one step is computed."""
        if self.budget is None:
            return True
        eps, delta = self.budget
        step = (self.optimizer.noise_multiplier, self.data_loader.sample_rate)
        history = self.accountant.history
        if all((s, q) == step for s, q, _ in history):
            return self.accountant.steps_taken < self.affordable_steps()
        trial = self.accountant.spawn()
        trial.history = list(history)
        trial.step(noise_multiplier=step[0], sample_rate=step[1])
        return trial.get_epsilon(delta) <= eps

    def affordable_steps(self) -> int:
        """Most steps at this run's (σ, q) within the budget: the planned T when σ was calibrated to it,
        otherwise found by search (once) with the engine's accountant."""
        if self.planned_steps is not None and self._calibrated:
            return self.planned_steps
        if self._affordable is None:
            eps, delta = self.budget
            sigma, q = self.optimizer.noise_multiplier, self.data_loader.sample_rate

            def eps_after(t: int) -> float:
                trial = self.accountant.spawn()
                trial.history = [(sigma, q, t)]
                return trial.get_epsilon(delta)

            if eps_after(1) > eps:
                self._affordable = 0
            else:
                lo, hi = 1, 2
                while eps_after(hi) <= eps and hi < 10**7:
                    lo, hi = hi, 2 * hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if eps_after(mid) <= eps else (lo, mid)
                self._affordable = lo
        return self._affordable

    def _check_budget(self) -> None:
        """The optimizer's budget guard: refuse a step that would take ε past the budget."""
        if not self.budget_allows_step():
            eps, delta = self.budget
            raise PrivacyBudgetExhausted(
                f"Another step would take ε past target_epsilon={eps} (δ={delta}); "
                f"{self.accountant.steps_taken} steps are already accounted. Stop training here."
            )

    def save_checkpoint(self, *, path, module: nn.Module, optimizer: Optional[optim.Optimizer] = None,
                        checkpoint_dict: Optional[Dict[str, Any]] = None, **kwargs) -> None:
        """Opacus's ``save_checkpoint``, plus the private optimizer's own state (AUP-RLHF's AboveThreshold: a secret
        of the mechanism; keep such checkpoints private)."""
        checkpoint_dict = dict(checkpoint_dict or {})
        if self.optimizer is not None:
            checkpoint_dict[OPTIMIZER_STATE_KEY] = self.optimizer.privacy_state_dict()
        super().save_checkpoint(path=path, module=module, optimizer=optimizer, checkpoint_dict=checkpoint_dict, **kwargs)

    def load_checkpoint(
        self,
        *,
        path: Union[str, os.PathLike, BinaryIO, IO[bytes]],
        module: nn.Module,
        optimizer: Optional[optim.Optimizer] = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
        torch_load_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Dict:
        """Opacus's ``load_checkpoint`` for a run set up by :meth:`make_private_user_level`, but a checkpoint is data,
        never code (``weights_only=True``; Opacus's runs whatever a tampered pickle holds), and its privacy state is
        checked against this run (:meth:`restore_privacy_state`) before anything is loaded."""
        checkpoint = load_plain(path, **(torch_load_kwargs or {}))
        self.restore_privacy_state(checkpoint["privacy_accountant_state_dict"], checkpoint.get(OPTIMIZER_STATE_KEY, {}),
                                   source=str(path))
        module.load_state_dict(checkpoint["module_state_dict"], **(module_load_dict_kwargs or {}))
        optimizer_state = checkpoint.pop("optimizer_state_dict", {})
        if optimizer is not None and optimizer_state:
            optimizer.load_state_dict(optimizer_state)
        for scheduler, key in ((noise_scheduler, "noise_scheduler_state_dict"),
                               (grad_clip_scheduler, "grad_clip_scheduler_state_dict")):
            scheduler_state = checkpoint.pop(key, {})
            if scheduler is not None and scheduler_state:
                scheduler.load_state_dict(scheduler_state)
        return checkpoint

    def restore_privacy_state(self, accountant_state: Dict[str, Any], optimizer_state: Dict[str, Any], *,
                              source: str = "checkpoint") -> None:
        """Resume the privacy of a checkpoint in this run (after :meth:`make_private_user_level`): its accountant must
        be this run's configuration with every step at this run's (σ, q), and the optimizer's own state must agree
        with it (AUP-RLHF: one AboveThreshold query per accounted step); otherwise nothing is restored and it raises.
        Then the sampling continues at the accounted step (with a seed: no replayed draws)."""
        if self.optimizer is None:
            raise ValueError("Call make_private_user_level first: a checkpoint's privacy state is checked against the "
                             "run it resumes.")
        if len(getattr(self, "phase_accountants", ())) > 1:
            raise ValueError("Checkpoints of a multi-phase AUP-RLHF run cannot be resumed; run the phases in one go.")
        restored = self.accountant.spawn()
        restored.load_state_dict(accountant_state)
        run = (self.optimizer.noise_multiplier, self.data_loader.sample_rate)
        for sigma, q, n in restored.history:
            if not (math.isclose(sigma, run[0], rel_tol=1e-9) and math.isclose(q, run[1], rel_tol=1e-9)):
                raise ValueError(
                    f"{source}: the saved accountant holds {n} steps at σ={sigma:.6g}, q={q:.6g}, but this run's settings "
                    f"give σ={run[0]:.6g}, q={run[1]:.6g}: the state belongs to another run or was edited; refusing to "
                    "resume."
                )
        self.optimizer.load_privacy_state_dict(optimizer_state, accounted_steps=restored.steps_taken, source=source)
        self.accountant.history = restored.history
        self.data_loader.user_sampler.position = self.steps_accounted()

    def privacy_report(self, delta: float) -> PrivacyReport:
        """The :class:`PrivacyReport` of what has been spent so far, at ``delta``."""
        if self.optimizer is None:
            raise ValueError("Call make_private_user_level first.")
        opt = self.optimizer
        return PrivacyReport(
            mechanism=self.mechanism if not self.accountant.els else "group_els",
            n_users=self.bounding.n_users,
            max_samples_per_user=self.bounding.max_samples_per_user,
            sample_rate=self.data_loader.sample_rate,
            noise_multiplier=opt.noise_multiplier,
            steps=self.planned_steps,
            steps_taken=self.accountant.steps_taken,
            accountant=self.accountant.mechanism(),
            epsilon=self.get_epsilon(delta),
            delta=delta,
            neighboring_relation=self.accountant.relation,
            privacy_unit="user",
            max_grad_norm=opt.max_grad_norm,
            extra={"expected_units_per_step": getattr(opt, "global_expected_batch_size", opt.expected_batch_size),
                   "clipping_unit": "record" if self.mechanism == "group" else "user",
                   "world_size": distributed.world_size()},
        )

    def detach(self) -> None:
        """Remove the hooks from the model (it trains normally afterwards)."""
        if self.hooks is not None:
            self.hooks.cleanup()
        if self._position_hook is not None:
            self._position_hook.remove()
