"""Per-user gradients from Opacus's per-sample hooks.

:class:`UserGradSampleHooks` is Opacus's ``GradSampleHooks`` (attached to the model without
wrapping it, so a ``PreTrainedModel`` stays one) with one change: as soon as a layer's per-row
gradients exist, they are summed per privacy unit (a user, or a record for the group baseline)
with ``index_add_``. So ``p.grad_sample`` holds ``[U, *p.shape]`` unit sums instead of
``[R, *p.shape]`` row gradients (R ≥ U rows: pairs are two rows, users bring several pairs), and
only one layer's per-row tensor is alive at a time.

Row gradients follow Opacus's ``loss_reduction="mean"``: for a loss that is the mean over the
batch's R rows, row i's gradient is ∇ℓ_i. Micro-batches of one logical step accumulate into the
same unit slots (each micro-batch's loss is the mean of its own rows, not divided by the number of
micro-batches); the optimizer divides each unit's sum by its row count (the user's average,
AUP-RLHF Alg. 4's ``g_u``) in place before clipping.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, Iterator, List, Optional

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.utils.module_utils import requires_grad, trainable_modules, trainable_parameters
from torch import nn

from . import layer_norm  # noqa: F401  (registers the LayerNorm sampler that allows bias=False)
from .embedding import SCALED_EMBEDDINGS, is_scaled_embedding, record_lookups, register_scaled_embedding
from .rms_norm import register_rms_norm, rms_norm_form
from .user_check import UserCheck, check_user_gradient

#: torch's warning for a module's full backward hook that fires with no input needing a gradient
BACKWARD_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"


#: blocks (by class name) that run their feed-forward layers on the batch's tokens flattened row by row,
#: ``hidden_states.reshape(-1, d)`` of ``[R, T, d]``: their layers' inputs and output gradients are viewed as ``[R, T, …]``
FLATTENING_BLOCKS = frozenset({"OPTDecoderLayer"})


class UserGradSampleHooks(GradSampleHooks):
    """Opacus hooks that keep per-unit gradient sums.

    Before each forward/backward, :meth:`set_row_users` must receive the unit of every row of the
    batch (``UserDataLoader`` does it when it yields a batch). A layer whose per-sample gradient has
    a different number of rows than the batch raises instead of producing a wrong gradient.

    Args:
        m: The model, hooked in place (not wrapped).
        batch_first: Whether the batch dimension comes first in the layers' inputs (Opacus's ``batch_first``).
        strict: Opacus's ``strict``: reject modules with buffers that mix the rows of a batch.
        force_functorch: Compute every layer's per-sample gradients with functorch.
    """

    #: per-unit gradients are materialised (:class:`~trl_userdp.grad_sample.ghost.UserGhostHooks` clips without them)
    ghost = False

    def __init__(self, m: nn.Module, *, batch_first: bool = True, strict: bool = True, force_functorch: bool = False):
        for sub in m.modules():
            if is_scaled_embedding(sub):
                register_scaled_embedding(type(sub))
            elif requires_grad(sub) and (form := rms_norm_form(sub)) is not None:
                register_rms_norm(type(sub), form)
        #: embeddings that compute the ids they look up (OPT's positions), made to keep them; undone on removal
        self._recorded_lookups = record_lookups(m)
        super().__init__(m, batch_first=batch_first, loss_reduction="mean", strict=strict, force_functorch=force_functorch)
        # torch warns, at every backward pass, that a full backward hook fired while no input of its module needed a
        # gradient (token ids; a frozen model's hidden states under LoRA): the per-sample hooks read the output's
        # gradient alone, which they get, so the warning says nothing wrong
        warnings.filterwarnings("ignore", message=BACKWARD_HOOK_WARNING, category=UserWarning)
        self._clone_hooked_outputs(m)
        #: hooked layers inside blocks that flatten the batch's tokens into one dimension (:data:`FLATTENING_BLOCKS`)
        hooked = set(self.iterate_submodules(m))
        self._flattening = {sub for block in m.modules() if type(block).__name__ in FLATTENING_BLOCKS
                            for sub in block.modules() if sub in hooked}
        self.param_names: Dict[nn.Parameter, str] = {p: n for n, p in trainable_parameters(m)}
        self._pending: Optional[torch.Tensor] = None
        self._serial = 0
        #: the first step's self-check is pending: record what it compares (sums, row norms, the model's passes)
        self.record_row_norms = False
        #: the per-user part of the self-check (:mod:`~trl_userdp.grad_sample.user_check`)
        self.user_check = UserCheck(m)
        self.autograd_grad_sample_hooks.append(m.register_forward_hook(self._record_forward, with_kwargs=True))
        self.reset_step()

    # -- the row -> unit map -------------------------------------------------------------
    def set_row_users(self, row_users: Optional[torch.Tensor], *, continuation: bool = False) -> None:
        """Set the unit code of each row of the next batch.

        Every batch the loader draws must be used by one ``optimizer.step()`` before the next is
        drawn: a second draw before the step would merge two Poisson draws into one accounted step,
        and a loader wrapper that reads ahead would pair a batch with the next batch's users.

        Args:
            row_users: The unit code of each row (LongTensor [R]), or None to discard the pending batch unused:
                with it every per-unit sum, count and autograd gradient of the step so far, so nothing of a
                discarded draw reaches a later step.
            continuation: Declares another piece (micro-batch) of the batch already drawn for this step.

        Raises:
            ValueError: If ``continuation`` is True with no batch drawn, or False while a drawn batch has not
                been stepped.
        """
        if row_users is None:
            self.discard_step()
            return
        if continuation and self._pending is None:
            raise ValueError("continuation=True needs a batch drawn for this step first.")
        if not continuation and self._pending is not None:
            raise ValueError(
                "The loader drew a new batch before optimizer.step() used the previous one. Call "
                "optimizer.step() once per batch (also for empty ones), and iterate the loader returned by "
                "make_private_user_level directly: wrappers that read ahead (prefetchers, accelerate.prepare) "
                "would pair a batch with another batch's users, and merging draws breaks the accounting. To skip a "
                "drawn batch on purpose, discard it first with `optimizer.hooks.set_row_users(None)` (nothing is "
                "accounted for it)."
            )
        row_users = torch.as_tensor(row_users, dtype=torch.long)
        self._pending = row_users
        self._serial += 1

    def discard_step(self) -> None:
        """Forget the drawn batch and everything its backward passes left (per-unit sums, the users' norms,
        autograd's ``p.grad``): a discarded draw is not accounted, so none of it may enter the next step's update."""
        self.reset_step(clear_pending=True)
        for p in self.param_names:
            p.grad = None
            p._forward_counter = 0
        for _, module in trainable_modules(self._module):
            module.activations = []  # a forward pass of the discarded batch that had no backward pass
            if hasattr(module, "max_batch_len"):
                del module.max_batch_len
        self._serial += 1

    def reset_step(self, clear_pending: bool = True) -> None:
        """Forget the per-unit sums of the current step.

        Args:
            clear_pending: Also forget the drawn batch (after ``optimizer.step()``; ``zero_grad()`` keeps it, as
                it runs between the draw and the backward pass).
        """
        self.unit_ids: List[int] = []
        self._slot_of: Dict[int, int] = {}
        self.unit_counts = torch.zeros(0)
        self._counted_serial: Optional[int] = None
        self._row_slots: Optional[torch.Tensor] = None
        #: the per-unit averages, once the optimizer has turned the sums into them (in place) for this step
        self.unit_averages: Optional[List[torch.Tensor]] = None
        #: the norms the clip factors of this step were computed from, one tensor per clipping (every unit of the
        #: step once): what adaptive clipping counts (``‖g_u‖ ≤ C``) for the whole draw, whatever its batching
        self.unit_norms: List[torch.Tensor] = []
        if clear_pending:
            self._pending = None
        self.user_check.reset()
        for p in self.param_names:
            p.grad_sample = None
            for attr in ("_unit_grad", "_row_norm_sum", "_row_norm_units", "_check_sum"):
                if hasattr(p, attr):
                    delattr(p, attr)

    @property
    def units_in_step(self) -> int:
        """Units (users, or records for the group baseline) with rows in the current step."""
        return len(self.unit_counts)

    def _slots_for_current_batch(self) -> torch.Tensor:
        if self._pending is None:
            raise ValueError(
                "No row -> user map for this batch: iterate the data loader returned by "
                "make_private_user_level, or call set_row_users() before the forward pass."
            )
        if self._counted_serial != self._serial:  # first layer of this batch's backward pass
            slots = []
            for u in self._pending.tolist():
                if u not in self._slot_of:
                    self._slot_of[u] = len(self.unit_ids)
                    self.unit_ids.append(u)
                slots.append(self._slot_of[u])
            self._row_slots = torch.tensor(slots, dtype=torch.long)
            counts = torch.zeros(len(self.unit_ids))
            counts[: len(self.unit_counts)] = self.unit_counts
            counts.index_add_(0, self._row_slots, torch.ones(len(slots)))
            self.unit_counts = counts
            self._counted_serial = self._serial
        return self._row_slots

    # -- Opacus extension points ------------------------------------------------------
    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[NotImplementedError]:
        """Opacus's check that no trainable layer holds buffers (statistics of the batch, as BatchNorm's, are not
        private), except the layers whose one buffer is a constant and whose samplers are registered here (Gemma's
        scaled embeddings).

        Args:
            module: The model.
            strict: Raise instead of returning the errors.

        Returns:
            The errors, one per layer.

        Raises:
            NotImplementedError: If ``strict`` and a layer holds buffers.
        """
        errors = [NotImplementedError(f"Layer {name!r} ({type(sub).__name__}) is trainable and holds buffers, "
                                      "whose per-sample gradients Opacus does not support; freeze it or replace it.")
                  for name, sub in trainable_modules(module)
                  if list(sub.buffers()) and type(sub) not in SCALED_EMBEDDINGS]
        if strict and errors:
            raise NotImplementedError(errors)
        return errors

    def _clone_hooked_outputs(self, m: nn.Module) -> None:
        """Give every block whose output is a hooked layer's own output (a view made by the backward hook) a copy
        of it instead, so that a caller that adds to it in place (Falcon's ``mlp_output += attention_output``) does
        not modify the hook's view, which autograd forbids."""
        hooked = set(self.iterate_submodules(m))

        def copy_if_hook_view(_module, _args, output):
            if isinstance(output, torch.Tensor) and type(output.grad_fn).__name__ == "BackwardHookFunctionBackward":
                return output.clone()
            return None

        for sub in m.modules():
            if sub not in hooked and any(child in hooked for child in sub.children()):
                self.autograd_grad_sample_hooks.append(sub.register_forward_hook(copy_if_hook_view))

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Opacus's forward hook, for layers whose inputs are tensors with one row per row of the batch.

        Args:
            module: The layer.
            forward_input: Its inputs.
            forward_output: Its output.

        Raises:
            ValueError: The layer ran on a parameter, on a tensor whose first dimension is not the batch's rows, or
                on an argument that is not a tensor.
        """
        if hasattr(module, "looked_up"):  # an embedding that computes its ids: Opacus's samplers take those
            forward_input = (module.__dict__.pop("looked_up"),)
        elif module in self._flattening and forward_input:
            forward_input = (self._per_row(forward_input[0]),) + tuple(forward_input[1:])
        if self.hooks_enabled and self._pending is not None and requires_grad(module) and module.training \
                and torch.is_grad_enabled():
            first = forward_input[0] if forward_input and isinstance(forward_input[0], torch.Tensor) else None
            if first is not None and (isinstance(_root(first), nn.Parameter) or first.dim() == 0
                                      or first.shape[0] != len(self._pending)):
                self._shared_input(module, first)
            if not all(isinstance(t, torch.Tensor) for t in forward_input):
                raise ValueError(
                    f"Layer {self._name(module)!r} ({type(module).__name__}) takes arguments that are not tensors "
                    f"({', '.join(type(t).__name__ for t in forward_input)}): Opacus cannot compute its per-sample "
                    "gradients. Freeze it (`requires_grad_(False)`)."
                )
        super().capture_activations_hook(module, forward_input, forward_output)

    def _per_row(self, t):
        """A tensor of a flattening block's layer, ``[R·T, d]`` viewed as ``[R, T, d]`` (as it is otherwise)."""
        rows = None if self._pending is None else len(self._pending)
        if isinstance(t, torch.Tensor) and t.dim() == 2 and rows and t.shape[0] != rows and t.shape[0] % rows == 0:
            return t.view(rows, t.shape[0] // rows, t.shape[1])
        return t

    def _name(self, module: nn.Module) -> str:
        return next((n for n, sub in self._module.named_modules() if sub is module), type(module).__name__)

    def _shared_input(self, module: nn.Module, first: torch.Tensor) -> None:
        raise ValueError(
            f"Layer {self._name(module)!r} ran on a tensor of shape {tuple(first.shape)}, whose first dimension is "
            f"not the batch's {len(self._pending)} rows, or on a parameter: a computation shared by every row, or "
            "the batch's tokens regrouped across rows. Its per-user gradients cannot be separated, and summing them "
            "would put other users' data in one user's gradient. Freeze it (`requires_grad_(False)`; with LoRA, "
            "leave it out of target_modules)."
        )

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        """Opacus's backward hook, then the layer's fresh per-row gradients summed into the unit slots.

        Args:
            module: The layer.
            _forward_input: Its input gradients (unused).
            forward_output: The gradients of its output.
            loss_reduction: ``"mean"`` or ``"sum"``.
            batch_first: Whether the batch dimension comes first.

        Raises:
            ValueError: If the batch has no row → user map, the per-row gradients have another row count than
                the batch, or the step's gradients were already averaged.
        """
        if not self.hooks_enabled:
            return
        if module in self._flattening:
            forward_output = (self._per_row(forward_output[0]),) + tuple(forward_output[1:])
        super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
        for _, p in trainable_parameters(module):
            fresh = p.grad_sample is not None and p.grad_sample is not getattr(p, "_unit_grad", None)
            if p._forward_counter == 0 and fresh:
                rows = p.grad_sample[-1] if isinstance(p.grad_sample, list) else p.grad_sample
                self._accumulate(p, rows)

    def _accumulate(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        if self.unit_averages is not None:
            raise ValueError("A backward pass ran after this step's per-user gradients were averaged (unit_gradients() "
                             "or the optimizer's step): its rows would be added to averages. Run every micro-batch's "
                             "backward pass before optimizer.step().")
        slots = self._slots_for_current_batch()
        if rows.shape[0] != len(slots):
            self._row_mismatch(p, rows.shape[0], len(slots))
        slots = slots.to(rows.device)
        acc = self._unit_sums(p, len(self.unit_ids), rows)
        acc.index_add_(0, slots, rows)
        if self.record_row_norms and len(slots):
            # for the optimizer's self-check: what autograd's gradient must be (each micro-batch's loss is the mean
            # of its rows) and the size of the summed terms
            n = len(slots)
            p._check_sum = getattr(p, "_check_sum", 0.0) + rows.sum(0) / n
            row_norms = torch.linalg.vector_norm(rows.flatten(1), dim=1, dtype=torch.float32)
            p._row_norm_sum = getattr(p, "_row_norm_sum", 0.0) + float(row_norms.sum()) / n
            self._add_unit_row_norms(p, row_norms, slots)
        p._unit_grad = acc
        p.grad_sample = acc
        p._row_dtype = rows.dtype  # the self-check's tolerance follows it (bf16 rows under autocast)

    def _add_unit_row_norms(self, p: nn.Parameter, row_norms: torch.Tensor, slots: torch.Tensor) -> None:
        """Add each row's gradient norm in ``p`` to its unit's sum (the per-user self-check's tolerance)."""
        sums = torch.zeros(len(self.unit_ids))
        sums.index_add_(0, slots.cpu(), row_norms.float().cpu())
        old = getattr(p, "_row_norm_units", None)
        if old is not None:
            sums[: len(old)] += old
        p._row_norm_units = sums

    def _record_forward(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """The model's forward hook: while the self-check is pending, record each training pass for the per-user
        recomputation (its outputs are handed on tapped, :meth:`UserCheck.record`)."""
        if self.record_row_norms and self.hooks_enabled and self._pending is not None and module.training \
                and torch.is_grad_enabled():
            return self.user_check.record(args, kwargs, output, self._pending)
        return None

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Forward and backward passes in the block leave nothing in the hooks."""
        enabled, self.hooks_enabled = self.hooks_enabled, False
        try:
            yield
        finally:
            self.hooks_enabled = enabled

    def check_users(self, params: List[nn.Parameter], unit_sums: Optional[List[torch.Tensor]]) -> None:
        """The per-user half of the first step's self-check: each checked user's sum ``S_u`` from the hooks against
        its recomputation on its own rows (:class:`~trl_userdp.grad_sample.user_check.UserCheck`).

        Args:
            params: The parameters (as the hooks key them).
            unit_sums: Each parameter's per-unit sums ``[U, *p.shape]`` of the step, before averaging.

        Raises:
            ValueError: A user's sum differs from its recomputation.
        """
        def observed(user: int, i: int) -> Optional[torch.Tensor]:
            slot = self._slot_of.get(user)
            return None if slot is None or slot >= unit_sums[i].shape[0] else unit_sums[i][slot].flatten()

        def row_norms(user: int, i: int) -> float:
            slot, sums = self._slot_of.get(user), getattr(params[i], "_row_norm_units", None)
            return 0.0 if slot is None or sums is None or slot >= len(sums) else float(sums[slot])

        groups = [[i] for i in range(len(params))]
        self.user_check.check(params, self._quiet, lambda user, reference: check_user_gradient(
            user, reference, groups, params, observed, row_norms, lambda p: self.param_names.get(p, "?")))

    @staticmethod
    def _unit_sums(p: nn.Parameter, n_units: int, like: torch.Tensor) -> torch.Tensor:
        """``p``'s per-unit sums of this step, grown with zero rows to ``n_units`` (device and dtype of ``like``
        when new)."""
        acc = getattr(p, "_unit_grad", None)
        if acc is None or acc.shape[0] < n_units:
            grown = torch.zeros((n_units, *like.shape[1:]), device=like.device, dtype=like.dtype)
            if acc is not None:
                grown[: acc.shape[0]] = acc
            acc = grown
        return acc

    def received_gradient(self, p: nn.Parameter) -> bool:
        """Whether autograd gave ``p`` a non-zero gradient in this step (a use the hooks must have seen).

        Args:
            p: A trainable parameter.

        Returns:
            True if ``p.grad`` has a non-zero entry (NaN counts as zero).
        """
        return p.grad is not None and bool(torch.count_nonzero(torch.nan_to_num(p.grad)) > 0)

    def _row_mismatch(self, p: nn.Parameter, got: int, expected: int) -> None:
        raise ValueError(
            f"Parameter {self.param_names.get(p, '?')!r} got per-sample gradients for {got} rows, "
            f"but the batch has {expected} rows. Its module's input has no per-row batch dimension "
            "(learned position embeddings called without `position_ids` of shape (B, T)?) or the user map "
            "does not match the batch layout (`rows_per_example`). Its per-user gradient would be wrong."
        )

    def remove_hooks(self) -> None:
        """Drop the step's per-user state, remove Opacus's hooks and give recording embeddings their class back."""
        self.reset_step()
        super().remove_hooks()
        for sub, cls in self._recorded_lookups:
            sub.__class__ = cls
        self._recorded_lookups = []


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (the backward hooks hand a layer a view of its input)."""
    while t._base is not None:
        t = t._base
    return t
