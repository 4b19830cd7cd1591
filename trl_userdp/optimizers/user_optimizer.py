"""``UserDPOptimizer``: Opacus's ``DPOptimizer`` on per-user averaged gradients (docs/mechanisms.md, M1).

Per step: ``g_u`` = each unit's average row gradient (from :class:`UserGradSampleHooks`), clipped to
``C`` by Opacus's own ``clip_and_accumulate``, summed, plus ``N(0, σ²C²)``, divided by the
*expected* number of units per step ``ñ`` (a float) — AUP-RLHF Alg. 4, Chua et al. 2024.
"""

from __future__ import annotations

import secrets
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.optim import Optimizer

from ..grad_sample import UserGradSampleHooks
from ..grad_sample.checks import check_unit_sums
from ..grad_sample.precision import product_margin, round_down
from ..seeding import derive_seed
from .noise import add_gaussian_noise_
from .weight_guard import WeightGuard


class PrivacyBudgetExhausted(RuntimeError):
    """Raised instead of a step that would exceed the privacy budget."""


class UserDPOptimizer(DPOptimizer):
    """User-wise DP-SGD around any ``torch.optim.Optimizer``.

    Args:
        optimizer: the wrapped optimizer.
        noise_multiplier: σ; the noise std on the sum is ``σ · max_grad_norm``.
        generator: source of the noise (default: a generator seeded from the OS, on the parameters'
            device; pass a seeded one only for reproducible experiments).
        noise_seed: instead of ``generator``, key each step's noise by ``(noise_seed, step_index())``
            (:func:`~trl_userdp.seeding.derive_seed`): reproducible, and a resumed run continues the noise
            stream instead of replaying it. Keep it secret: whoever knows it can subtract the noise.
        step_index: with ``noise_seed``, the number of steps taken before this one (the engine passes its
            accountant's count, which checkpoints restore).
        max_grad_norm: C, the bound on each unit's averaged gradient.
        expected_batch_size: ñ, expected units per step (``users_per_batch``); the noisy sum is
            divided by it whatever the step's actual number of users.
        hooks: the :class:`UserGradSampleHooks` attached to the model.
        self_check: on the first non-empty step, check that the per-unit gradients add up to autograd's gradient
            (``p.grad = Σ_u S_u / R``) and that a few users' equal their recomputation on their own rows, and on the
            first update that should move a weight, that it moved and no frozen weight did
            (:class:`~trl_userdp.optimizers.weight_guard.WeightGuard`); refuse to train if not.
        budget_guard: called before every step; raises :class:`PrivacyBudgetExhausted` if the step
            would exceed the budget (the engine installs one that reads its accountant).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        hooks: UserGradSampleHooks,
        generator: Optional[torch.Generator] = None,
        noise_seed: Optional[int] = None,
        step_index: Optional[Callable[[], int]] = None,
        secure_mode: bool = False,
        self_check: bool = True,
        budget_guard: Optional[Callable[[], None]] = None,
    ):
        if noise_seed is not None and (generator is not None or secure_mode or step_index is None):
            raise ValueError("noise_seed keys the noise by step: give it with step_index, and without a generator "
                             "or secure_mode.")
        if generator is None and not secure_mode:
            # Opacus would use the global RNG, which training scripts seed with a public value (the
            # Trainer's `seed`): then anyone could replay the noise. Draw the seed from the OS instead.
            device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
            generator = torch.Generator(device=device)
            generator.manual_seed(secrets.randbits(63))
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction="mean",
            generator=generator,
            secure_mode=secure_mode,
        )
        self.hooks = hooks
        self.noise_seed, self.step_index = noise_seed, step_index
        self.self_check = hooks.record_row_norms = self_check
        #: checks the first update that should move a weight (with the self-check)
        self.weight_guard = WeightGuard(hooks._module, optimizer, hooks.param_names) if self_check else None
        self.budget_guard = budget_guard
        #: with True, a step the budget cannot pay for is skipped (no update, nothing accounted) instead of
        #: raising; the trainers use it so that training ends cleanly
        self.skip_when_exhausted = False
        self._warned_non_finite = False

    @property
    def accumulated_iterations(self) -> int:
        """One logical step: micro-batches are merged per unit by the hooks, and an empty step
        (no backward, no ``grad_sample``) still counts as one step for the accountant."""
        return 1

    def _hooked(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """The parameter as the hooks key it: ``p`` itself (a sharded model's optimizer maps its shards)."""
        return p

    def _param_name(self, p: torch.nn.Parameter) -> str:
        return self.hooks.param_names.get(self._hooked(p), f"<parameter of shape {tuple(p.shape)}>")

    def unit_gradients(self) -> List[torch.Tensor]:
        """Each parameter's per-unit *averaged* gradients ``[U, *p.shape]`` for the current step (unit order:
        ``hooks.unit_ids``). The hooks' per-unit sums are divided by the units' row counts in place, so no second
        copy of the per-user gradients is made; calling it again in the same step returns the same tensors.

        A unit whose averaged gradient is not finite in some parameter (a NaN label, an overflowing loss or
        input) gets zero in every parameter: its clip factor is 0, so it adds nothing instead of NaN to
        everyone's update. This is a function of that unit's data alone, so each unit's influence stays
        within its sensitivity (docs/privacy_model.md, "Faults").

        Returns:
            One ``[U, *p.shape]`` tensor per parameter, in :attr:`params` order.

        Raises:
            ValueError: a training forward pass had no backward pass, a parameter bypassed the hooks, or the
                first step's self-check failed.
        """
        if self.hooks.unit_averages is not None:
            return self.hooks.unit_averages
        self._check_backward_complete()
        counts = self.hooks.unit_counts
        n_units = len(counts)
        out = []
        for p in self.params:
            sums = p.grad_sample
            if sums is None:
                if n_units > 0:
                    self._check_not_bypassed(p)
                sums = torch.zeros((n_units, *p.shape), device=p.device, dtype=p.dtype)
            elif sums.shape[0] < n_units:  # unused in a later micro-batch: zero for the new units
                sums = torch.cat([sums, sums.new_zeros((n_units - sums.shape[0], *p.shape))])
            out.append(sums)
        bad = self._non_finite_units(out)
        if self.self_check and n_units > 0:
            if bad is None and self._self_check(out):  # otherwise autograd's sum is not finite: a later step
                self.self_check = self.hooks.record_row_norms = False
        for g in out:
            g.div_(counts.to(g.device, g.dtype).view(-1, *([1] * (g.dim() - 1))))
            if bad is not None:
                g.masked_fill_(bad.to(g.device).view(-1, *([1] * (g.dim() - 1))), 0)
        self.hooks.unit_averages = out
        return out

    def _check_backward_complete(self) -> None:
        stray = [name for p, name in self.hooks.param_names.items() if getattr(p, "_forward_counter", 0) != 0]
        if stray:
            raise ValueError(
                f"A forward pass in training mode had no backward pass ({stray[0]!r} and {len(stray) - 1} more "
                "parameters wait for one), so per-sample gradients are incomplete. Run evaluation under "
                "torch.no_grad() or model.eval(), and backpropagate every training forward pass."
            )

    def _check_not_bypassed(self, p: torch.nn.Parameter) -> None:
        """A parameter with no per-unit term must have no gradient either."""
        if self.hooks.received_gradient(self._hooked(p)):
            raise ValueError(
                f"{self._param_name(p)!r} received a gradient but no per-sample gradient: its forward "
                "bypassed the hooks (TRL's fused LM head, a functional call on the weight). Disable the "
                "fused path or freeze this parameter."
            )

    def _non_finite_units(self, unit_grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """The mask of units with a non-finite averaged gradient (None if there is none). Warns once per
        optimizer, without saying whose gradient or how many: both are private."""
        if not unit_grads or unit_grads[0].shape[0] == 0:
            return None
        bad = torch.zeros(unit_grads[0].shape[0], dtype=torch.bool, device=unit_grads[0].device)
        for g in unit_grads:
            bad |= ~torch.isfinite(g).reshape(g.shape[0], -1).all(1).to(bad.device)
        if not bad.any():
            return None
        self._warn_non_finite()
        return bad

    def _warn_non_finite(self) -> None:
        if not self._warned_non_finite:
            self._warned_non_finite = True
            warnings.warn(
                "Some user's averaged gradient was not finite (NaN or inf: a NaN label or margin, an overflowing "
                "loss or input) and was replaced by zero, so that user adds nothing to such steps; the privacy "
                "guarantee holds. Shown once, and it does not say whose gradient or how often: that is private.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _self_check(self, unit_sums: Optional[List[torch.Tensor]] = None) -> bool:
        """The first step's self-check (refuse to train if the per-user gradients are wrong): their sum against
        autograd's gradient (:func:`~trl_userdp.grad_sample.checks.check_unit_sums`), then a few users' gradients
        against their recomputation on their own rows (:meth:`UserGradSampleHooks.check_users`).

        Args:
            unit_sums: The per-unit sums, in :attr:`params` order (None under ghost clipping).

        Returns:
            True when checked, False when deferred (autograd's sum is not finite).
        """
        if not check_unit_sums(self.params, self._param_name):
            return False
        self.hooks.check_users([self._hooked(p) for p in self.params], unit_sums)
        return True

    def key_randomness(self) -> None:
        """With ``noise_seed``: seed this step's noise from ``(noise_seed, step_index())``."""
        if self.noise_seed is not None:
            self.generator.manual_seed(derive_seed(self.noise_seed, "noise", self.step_index()))

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """Each unit's clip factor ``min(1, C / (‖g_u‖ + 1e-6))`` (Opacus's).

        Args:
            norms: ``[U]``, the norms of the units' averaged gradients.

        Returns:
            ``[U]`` factors in (0, 1].
        """
        return (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)

    def clip_and_accumulate(self) -> None:
        """``p.summed_grad = Σ_u c_u g_u``: Opacus's clipping of the materialised per-unit gradients with
        :meth:`clip_factors`."""
        # norms in fp32 whatever the gradients' dtype (flatten(1): an empty step has 0 rows)
        norms = [torch.linalg.vector_norm(g.flatten(1), dim=-1, dtype=torch.float32) for g in self.grad_samples]
        norms = torch.stack([n.to(norms[0].device) for n in norms], dim=1).norm(2, dim=1)
        self.hooks.unit_norms.append(norms)
        # each unit clipped to the share of C that rounding its product into the parameters' dtype cannot push past C
        factor = self.clip_factors(norms / product_margin(p.dtype for p in self.params))
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            grad_sample = self._get_flat_grad_sample(p).to(p.dtype)  # as Opacus: sums and noise in the parameter's dtype
            # the factor rounded down into that dtype: a unit's clipped gradient never exceeds C by rounding
            unit_factor = round_down(factor, p.dtype).to(grad_sample.device)
            grad = torch.einsum("i,i...", unit_factor, grad_sample)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        """Opacus's ``add_noise`` (``p.grad = p.summed_grad + N(0, σ²C²)``, the same draw), added into the step's sum in
        place, which becomes ``p.grad``: no new parameter-sized tensor kept where Opacus allocates three
        (:func:`~trl_userdp.optimizers.noise.add_gaussian_noise_`)."""
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.grad = add_gaussian_noise_(p.summed_grad, self.noise_multiplier * self.max_grad_norm, self.generator,
                                         self.secure_mode).view_as(p)
            _mark_as_processed(p.summed_grad)

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> Optional[bool]:
        """Key this step's noise, hand Opacus the per-unit averaged gradients, then Opacus's ``pre_step`` (clip,
        sum, noise, scale, step hook)."""
        self.key_randomness()
        self.collect_unit_gradients()
        return super().pre_step(closure)

    def collect_unit_gradients(self) -> None:
        """``p.grad_sample`` = each unit's averaged gradient (:meth:`unit_gradients`: the hooks' own tensors, averaged
        in place; a new one only for an unused parameter)."""
        for p, g in zip(self.params, self.unit_gradients()):
            p.grad_sample = g

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus's ``BatchMemoryManager`` splits a draw by rows, which cuts users apart (their clipped average needs
        all their rows in one step): refused, for :class:`~trl_userdp.utils.UserBatchMemoryManager`."""
        raise ValueError("opacus.utils.batch_memory_manager.BatchMemoryManager splits each batch by rows, cutting users "
                         "apart; use trl_userdp.utils.UserBatchMemoryManager (same arguments), which splits by whole "
                         "users, or micro_batches= in make_private_user_level.")

    def signal_skip_step_whole_users(self, do_skip: bool = True) -> None:
        """Opacus's ``signal_skip_step`` for a physical batch of whole users (from ``UserBatchMemoryManager``): with
        ``do_skip`` the next ``step()`` and ``zero_grad()`` leave the draw's per-user sums to the next physical batch."""
        self._step_skip_queue.append(do_skip)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One private step; it uses up the batch the loader drew, whatever happens. A physical batch that does not
        end its draw (``UserBatchMemoryManager``) takes no step: its users' sums wait for the rest of the draw.

        Args:
            closure: as ``torch.optim.Optimizer.step``'s.

        Returns:
            The wrapped optimizer's result, or None for a skipped step.

        Raises:
            PrivacyBudgetExhausted: the step would exceed the budget (unless :attr:`skip_when_exhausted`).
        """
        if self._step_skip_queue and self._step_skip_queue.pop(0):  # each physical batch's signal, used here once
            self._is_last_step_skipped = True
            return None
        self._is_last_step_skipped = False  # this step ends its draw, even if the budget guard stops it
        try:
            if self.budget_guard is not None:
                try:
                    self.budget_guard()
                except PrivacyBudgetExhausted:
                    if not self.skip_when_exhausted:
                        raise
                    return None
            return super().step(closure)
        finally:
            for p in self.params:
                p.grad_sample = None
                p.summed_grad = None
            self.hooks.reset_step(clear_pending=True)

    #: user-wise DP-SGD never halts (AUP-RLHF's AboveThreshold can)
    halted = False

    def privacy_state_dict(self) -> Dict[str, Any]:
        """State a checkpoint needs beyond the accountant's history (none here; AUP-RLHF's AboveThreshold)."""
        return {}

    def load_privacy_state_dict(self, state: Dict[str, Any], *, accounted_steps: int, source: str = "checkpoint") -> None:
        """Restore :meth:`privacy_state_dict`.

        Args:
            state: the saved state.
            accounted_steps: the steps of the restored accountant, which the state must agree with.
            source: names the checkpoint in the messages.

        Raises:
            ValueError: a state that does not belong to this mechanism or run.
        """
        if state:
            raise ValueError(f"{source}: privacy state {sorted(state)} does not belong to user-wise DP-SGD; refusing to "
                             "resume.")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Opacus's ``zero_grad`` and the hooks' step state, except mid-draw (a physical batch that does not end it)."""
        if self._is_last_step_skipped:  # mid-draw: the per-user sums (and autograd's) carry to the next physical batch
            return
        super().zero_grad(set_to_none)
        self.hooks.reset_step(clear_pending=False)


class UserDPOptimizerFastGradientClipping(UserDPOptimizer, DPOptimizerFastGradientClipping):
    """User-wise DP-SGD with per-user ghost clipping (``grad_sample_mode="ghost"``): Opacus's
    ``DPOptimizerFastGradientClipping`` step (accumulate, noise, scale), where :meth:`accumulate` takes the sum of the
    users' clipped averaged gradients from :class:`~trl_userdp.grad_sample.UserGhostHooks`, which clip by this
    optimizer's :meth:`clip_factors` without materialising per-user gradients. Arguments as :class:`UserDPOptimizer`'s.
    """

    def __init__(self, optimizer: Optimizer, *, hooks: UserGradSampleHooks, **kwargs: Any):
        super().__init__(optimizer, hooks=hooks, **kwargs)
        hooks.clip_factors = self.clip_factors

    def unit_gradients(self) -> List[torch.Tensor]:
        """Never available: ghost clipping does not materialise per-user gradients.

        Raises:
            ValueError: always.
        """
        raise ValueError("Ghost clipping never materialises per-user gradients (grad_sample_mode='ghost'); use "
                         "grad_sample_mode='hooks' to read them.")

    def collect_unit_gradients(self) -> None:
        """Nothing to collect: :meth:`accumulate` reads the hooks' clipped sums."""

    def accumulate(self) -> None:
        """``p.summed_grad = Σ_u c_u ḡ_u`` from the hooks (Opacus's extension point, where its ghost clipping takes
        ``p.grad``), after the checks the materialised path makes on the per-unit gradients: every forward pass
        backpropagated, no parameter bypassing the hooks, non-finite users reported, and the first step's self-check.
        The sums come first: under several processes they may be collectives every process must join before its own
        checks (:class:`StopTogether` shares a failure afterwards)."""
        for p, summed in zip(self.params, self.hooks.clipped_sums([self._hooked(p) for p in self.params])):
            p.summed_grad = summed
        self._check_backward_complete()
        if self.hooks.units_in_step > 0:
            for p in self.params:
                if self._hooked(p) not in self.hooks.touched:
                    self._check_not_bypassed(p)
            if self.hooks.non_finite_units:
                self._warn_non_finite()
            elif self.self_check and self._self_check():
                self.self_check = self.hooks.record_row_norms = False


class StopTogether:
    """A check that fails on one process stops every process: each rank's ``pre_step`` (the single-process checks on
    its own shard: self-check, stray forward, bypassed parameters) shares its failure before the step's remaining
    collectives (a sharded model's clipped sums are exchanged before the checks, by every rank), so no rank waits in
    one for a rank that raised."""

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> Optional[bool]:
        """The wrapped ``pre_step``, its failure shared with every rank.

        Args:
            closure: As ``torch.optim.Optimizer.step``'s.

        Returns:
            The wrapped ``pre_step``'s result.

        Raises:
            Exception: this rank's check failed (its own error).
            ValueError: another rank's did.
        """
        try:
            result, error = super().pre_step(closure), None
        except Exception as err:  # noqa: BLE001 - any failure here must reach the other ranks before it is raised
            result, error = None, err
        failed = torch.tensor([float(error is not None)], device=self.params[0].device if self.params else "cpu")
        torch.distributed.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise ValueError("Another process failed this step's checks (see its error); stopping here too.")
        return result


class DistributedUserDPOptimizer(StopTogether, UserDPOptimizer, DistributedDPOptimizer):
    """User-wise DP-SGD across data-parallel processes: Opacus's ``DistributedDPOptimizer`` on per-user
    gradients.

    Users are sharded by rank (every user's rows on one process, so its averaged gradient and its clip
    are exact there); each rank clips its own users, rank 0 alone adds ``N(0, σ²C²)``, and the sums are
    all-reduced, so every rank applies ``(Σ_all clipped + noise) / ñ``. ``expected_batch_size`` is the
    *global* ñ; each rank scales by ñ/W before Opacus's all-reduce divides by the world size W. A check failing
    on one rank stops every rank (:class:`StopTogether`).
    """

    def __init__(self, optimizer: Optimizer, *, expected_batch_size: float, **kwargs):
        world_size = torch.distributed.get_world_size()
        super().__init__(optimizer, expected_batch_size=expected_batch_size / world_size, **kwargs)
        self.global_expected_batch_size = float(expected_batch_size)

    def add_noise(self) -> None:
        """Opacus's ``DistributedDPOptimizer.add_noise``: rank 0 alone adds the noise (:meth:`UserDPOptimizer.add_noise`,
        which would otherwise come first in this class's order)."""
        if self.rank == 0:
            super().add_noise()
        else:
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)


class DistributedUserDPOptimizerFastGradientClipping(DistributedUserDPOptimizer, UserDPOptimizerFastGradientClipping):
    """:class:`UserDPOptimizerFastGradientClipping` across data-parallel processes, as
    :class:`DistributedUserDPOptimizer` (users sharded by rank, rank 0's noise, one all-reduce of the clipped sums)."""
