"""Per-user ghost clipping: the sum of every unit's clipped averaged gradient, without per-unit gradients
(docs/mechanisms.md, "Ghost clipping at the user level").

**Norms.** For a layer whose per-sample gradient is a sum over positions of per-position terms (``nn.Linear``,
``nn.Embedding``, GPT-2's ``Conv1D``), a unit's gradient ``Σ_{r∈u} ∇_W ℓ_r`` is the per-sample gradient of one
"sample" made of the unit's rows laid end to end along the position axis. So the hooks pack each micro-batch's
activations and output gradients as ``[U, L·T, d]`` (``L`` = most rows of one unit, zero padding) and ask Opacus's
per-sample *norm sampler* for the norms (the Gram trick of ghost clipping, Li et al. 2022, here with the cross terms
between a unit's rows: ``O((L·T)²)`` per unit and layer), or, when ``L·T·(d + p) > d·p`` makes the Gram matrices
dearer, its *grad sampler* for this one layer's ``[U, p, d]`` unit gradients, whose norms are taken at once and the
tensor freed. A layer of another type, or one whose parameter is shared with another module (tied embeddings) or
which runs twice in one pass, keeps the materialised per-unit sums of :class:`UserGradSampleHooks` (its cross terms
are not per layer).

**Clipped sum.** With every unit's norm known (all its rows are in one micro-batch), its clip factor ``c_u`` follows,
and the layer's stored activations and output gradients, re-weighted per row by ``c_u / n_u``, give
``Σ_u c_u ḡ_u`` through the same grad sampler on the whole micro-batch as one sample — book-keeping (Bu et al. 2023,
"Differentially private optimization on large model at small cost"): no second backward pass and any scalar loss.
A layer on the direct route keeps its ``[U, p, d]`` unit gradients instead, which are then the smaller of the two
(that is when the direct route is chosen), and lets autograd free its activations. Memory: per packable layer, the
smaller of the two for one micro-batch, freed once the micro-batch is clipped; autograd's own ``p.grad`` (the
unclipped sum, which the update does not use) is dropped as soon as it is accumulated, except while the first step's
self-check needs it.

A unit with a non-finite norm (NaN data, an overflow) gets weight 0 and its rows are zeroed before the sums, so it adds
nothing, as in the materialised path.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping
from opacus.utils.module_utils import trainable_modules, trainable_parameters
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import conv1d  # noqa: F401  (registers Conv1D's samplers with Opacus)
from .user_hooks import UserGradSampleHooks

#: layer types whose per-sample gradient is a sum over positions, so packing a unit's rows along positions is exact
PACKABLE = (nn.Linear, nn.Embedding, Conv1D)
NORM_SAMPLERS = GradSampleHooksFastGradientClipping.NORM_SAMPLERS


def _pack(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``[R, ...]`` -> units ``[U, L·…, d]`` (token ids: ``[U, L·…]``), ``index[u, j]`` = the row of unit ``u``'s
    ``j``-th row or ``R`` (a zero row)."""
    padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[index.to(t.device)]
    return padded.reshape(index.shape[0], -1, t.shape[-1]) if t.is_floating_point() else padded.reshape(index.shape[0], -1)


def _as_one_sample(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, t.shape[-1]) if t.is_floating_point() else t.reshape(1, -1)


def _rows_view(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return mask.to(t.device).view(-1, *([1] * (t.dim() - 1)))


class UserGhostHooks(UserGradSampleHooks):
    """:class:`UserGradSampleHooks` that clip per unit with ghost norms and book-keeping (module docstring).

    The optimizer sets :attr:`clip_factors` (norms ``[U]`` -> factors ``[U]``) and, after the last micro-batch's
    backward pass, takes :meth:`clipped_sums`. Each micro-batch must hold its units' rows whole (the loader's
    ``micro_batches`` draws whole users); a unit met again in a later micro-batch of the same step raises.
    """

    ghost = True

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        owners: Dict[nn.Parameter, int] = {}
        for _, module in trainable_modules(m):
            for _, p in trainable_parameters(module):
                owners[p] = owners.get(p, 0) + 1
        #: the modules clipped by ghost norms; the others keep materialised per-unit sums
        self.ghost_modules: Set[nn.Module] = {
            module for _, module in trainable_modules(m)
            if type(module) in PACKABLE and type(module) in NORM_SAMPLERS and type(module) in self.GRAD_SAMPLERS
            and all(owners[p] == 1 for _, p in trainable_parameters(module))
        }
        self.clip_factors: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._drop_grad) for p in self.param_names]
        #: how packable layers' unit norms are computed: "auto" (the cheaper per layer), "gram" or "direct"
        self.norm_route = "auto"

    # -- per step and per micro-batch state ---------------------------------------------------
    def reset_step(self, clear_pending: bool = True) -> None:
        super().reset_step(clear_pending)
        self._reset_micro_batch()
        #: Σ_u c_u ḡ_u so far in this step, per parameter
        self.clipped: Dict[nn.Parameter, torch.Tensor] = {}
        #: parameters that received per-unit terms in this step
        self.touched: Set[nn.Parameter] = set()
        self.units_seen: Set[int] = set()
        self.non_finite_units = False
        self.closed = False
        for p in self.param_names:
            p._grad_nonzero = None

    def _drop_grad(self, p: nn.Parameter) -> None:
        """Autograd's ``p.grad`` (the unclipped sum) is not part of the update: note whether it was non-zero (a use
        the hooks did not see) and free it, unless the self-check still needs it."""
        if self.record_row_norms or not self.hooks_enabled:
            return
        nonzero = p.grad.ne(0).any()
        p._grad_nonzero = nonzero if getattr(p, "_grad_nonzero", None) is None else p._grad_nonzero | nonzero
        p.grad = None

    def received_gradient(self, p: nn.Parameter) -> bool:
        flag = getattr(p, "_grad_nonzero", None)
        return super().received_gradient(p) or (flag is not None and bool(flag))

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("A backward pass ran after this step's users were clipped (optimizer.step()): run every "
                             "micro-batch's backward pass before optimizer.step().")

    def _reset_micro_batch(self) -> None:
        #: per packable layer: (module, activations, output gradients, their scale) or (module, {param: [U, *p.shape]},
        #: None, 1.0)
        self._records: List[Tuple[nn.Module, Any, Optional[torch.Tensor], float]] = []
        self._norm2: Optional[torch.Tensor] = None
        self._index: Optional[torch.Tensor] = None
        self.unit_ids, self._slot_of, self.unit_counts = [], {}, torch.zeros(0)
        self._counted_serial, self._row_slots = None, None
        for p in self.param_names:
            p.grad_sample = None
            if hasattr(p, "_unit_grad"):
                del p._unit_grad

    @property
    def units_in_step(self) -> int:
        return len(self.units_seen)

    def set_row_users(self, row_users: Optional[torch.Tensor], *, continuation: bool = False) -> None:
        if row_users is not None and continuation and self._pending is not None:
            self._flush()  # the previous micro-batch's units are complete: clip them and free their tensors
        super().set_row_users(row_users, continuation=continuation)

    def _slots_for_current_batch(self) -> torch.Tensor:
        fresh = self._counted_serial != self._serial
        slots = super()._slots_for_current_batch()
        if fresh and not self.units_seen.isdisjoint(self.unit_ids):
            raise ValueError("Ghost clipping needs each user's rows in one micro-batch, but a user of an earlier "
                             "micro-batch of this step came back: draw whole users per micro-batch (the loader's "
                             "micro_batches does) or use grad_sample_mode='hooks'.")
        return slots

    # -- Opacus extension points --------------------------------------------------------------
    def capture_activations_hook(self, module, forward_input, forward_output):
        super().capture_activations_hook(module, forward_input, forward_output)
        if module in self.ghost_modules and any(p._forward_counter > 1 for _, p in trainable_parameters(module)):
            self.ghost_modules.discard(module)  # runs twice per pass: cross terms between its calls; materialise it

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        if not self.hooks_enabled:
            return
        if module not in self.ghost_modules:
            super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
            return
        self._check_open()
        # the output gradient as autograd gave it, without Opacus's copy scaled by the batch size for a mean loss: the
        # scale joins the norms and weights instead (one copy less of the largest tensor, e.g. an LM head's logits)
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction="sum", batch_first=batch_first)
        scale = float(module.max_batch_len) if loss_reduction == "mean" else 1.0
        if not module.activations and hasattr(module, "max_batch_len"):
            del module.max_batch_len
        params = [p for _, p in trainable_parameters(module)]
        for p in params:
            p._forward_counter -= 1
        slots = self._slots_for_current_batch()
        if backprops.shape[0] != len(slots):
            self._row_mismatch(params[0], backprops.shape[0], len(slots))
        if not len(slots):  # an empty micro-batch: no unit, nothing to clip
            return
        if self.record_row_norms:  # the self-check's tolerance: Σ_r ‖row gradient‖ / R
            for p, norms in NORM_SAMPLERS[type(module)](module, activations, backprops).items():
                p._row_norm_sum = getattr(p, "_row_norm_sum", 0.0) + scale * float(norms.sum()) / len(slots)
        norm2, unit_grads = self._unit_norms2(module, activations, backprops, slots)
        norm2 = norm2 * scale ** 2
        self._norm2 = norm2 if self._norm2 is None else self._norm2 + norm2.to(self._norm2.device)
        if unit_grads is None:
            self._records.append((module, activations, backprops, scale))
        else:
            self._records.append((module, {p: g.mul_(scale) for p, g in unit_grads.items()}, None, 1.0))
        self.touched.update(params)

    def _accumulate(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        self._check_open()
        super()._accumulate(p, rows)
        self.touched.add(p)

    # -- norms and clipped sums ---------------------------------------------------------------
    def _packing_index(self, slots: torch.Tensor) -> torch.Tensor:
        """``[U, L]``: the rows of each unit of this micro-batch in order, padded with ``R`` (cached per micro-batch)."""
        if self._index is None:
            n_rows, n_units = len(slots), len(self.unit_ids)
            counts = torch.bincount(slots, minlength=n_units)
            order = torch.argsort(slots, stable=True)
            start = torch.cumsum(counts, 0) - counts
            rank = torch.arange(n_rows) - start[slots[order]]
            self._index = torch.full((n_units, int(counts.max()) if n_rows else 0), n_rows, dtype=torch.long)
            self._index[slots[order], rank] = order
        return self._index

    def _unit_norms2(self, module: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                     slots: torch.Tensor) -> Tuple[torch.Tensor, Optional[Dict[nn.Parameter, torch.Tensor]]]:
        """``‖Σ_{r∈u} ∇ℓ_r‖²`` over this layer's parameters, per unit ``[U]``; on the direct route also the unit
        gradients ``{param: [U, *p.shape]}`` (kept instead of the activations: then they are smaller). With one row per
        unit the rows are the units (no packed copies), reordered."""
        index = self._packing_index(slots)
        one_row = index.shape[1] == 1
        if one_row:
            rows = index[:, 0].to(backprops.device)
            packed_a, packed_g = activations, backprops
        else:
            packed_a, packed_g = [_pack(a, index) for a in activations], _pack(backprops, index)
        weight = getattr(module, "weight", None)
        positions = index.shape[1] * (backprops[0].numel() // backprops.shape[-1])
        gram_cost = positions * (activations[0].shape[-1] + backprops.shape[-1])
        direct = gram_cost > weight.numel() if self.norm_route == "auto" and weight is not None else self.norm_route == "direct"
        if direct and not isinstance(module, nn.Embedding):
            grads = {p: g if not one_row else g.index_select(0, rows)
                     for p, g in self.GRAD_SAMPLERS[type(module)](module, packed_a, packed_g).items() if p.requires_grad}
            return torch.stack([g.flatten(1).float().pow(2).sum(1) for g in grads.values()]).sum(0), grads
        norms = NORM_SAMPLERS[type(module)](module, packed_a, packed_g)
        norm2 = torch.stack([n.float().pow(2) for p, n in norms.items() if p.requires_grad]).sum(0)
        return (norm2.index_select(0, rows) if one_row else norm2), None

    def _whole_batch_gradient(self, module: nn.Module, activations: List[torch.Tensor],
                              backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        grads = self.GRAD_SAMPLERS[type(module)](module, [_as_one_sample(a) for a in activations],
                                                 _as_one_sample(backprops))
        return {p: g[0] for p, g in grads.items() if p.requires_grad}

    def _add(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        grad = grad.to(p.dtype)
        self.clipped[p] = grad if p not in self.clipped else self.clipped[p] + grad

    def _flush(self) -> None:
        """Clip the current micro-batch's units and add ``Σ_u c_u ḡ_u`` to the step's sums; free its tensors."""
        n_units = len(self.unit_ids)
        if n_units == 0 or self._row_slots is None:
            self._reset_micro_batch()
            return
        if self.clip_factors is None:
            raise ValueError("UserGhostHooks needs clip_factors (the optimizer sets it).")
        counts = self.unit_counts
        norm2 = self._norm2.cpu() if self._norm2 is not None else torch.zeros(n_units)
        fallback = [(p, p._unit_grad) for p in self.param_names if getattr(p, "_unit_grad", None) is not None]
        for _, sums in fallback:
            norm2 = norm2 + sums.flatten(1).float().pow(2).sum(1).cpu()
        materialised = len(fallback)  # the direct route's unit gradients join below (their norms are in norm2)
        norms = norm2.sqrt() / counts  # the norm of each unit's average
        bad = ~torch.isfinite(norms)
        norms = norms.masked_fill(bad, 0.0)
        weights = torch.where(bad, torch.zeros(()), self.clip_factors(norms).cpu() / counts)  # c_u / n_u
        row_slots = self._row_slots
        rows_bad, row_weights = bad[row_slots], weights[row_slots]
        for module, activations, backprops, scale in self._records:
            if backprops is None:  # the direct route's unit gradients
                fallback.extend(activations.items())
                continue
            if self.record_row_norms:  # what autograd's gradient of this micro-batch must be: Σ_r ∇ℓ_r / R
                check = backprops if scale == len(row_slots) else backprops * (scale / len(row_slots))
                for p, g in self._whole_batch_gradient(module, activations, check).items():
                    p._check_sum = getattr(p, "_check_sum", 0.0) + g
            if bad.any():
                backprops = backprops.masked_fill(_rows_view(rows_bad, backprops), 0)
                activations = [a.masked_fill(_rows_view(rows_bad, a), 0) if a.is_floating_point() else a
                               for a in activations]
            scaled = backprops * _rows_view(row_weights * scale, backprops).to(backprops.dtype)
            for p, g in self._whole_batch_gradient(module, activations, scaled).items():
                self._add(p, g)
        for i, (p, sums) in enumerate(fallback):
            if self.record_row_norms and i >= materialised:  # the hooks recorded the others' check sums already
                p._check_sum = getattr(p, "_check_sum", 0.0) + sums.sum(0) / len(row_slots)
            if bad.any():
                sums = sums.masked_fill(_rows_view(bad, sums), 0)
            self._add(p, torch.einsum("u,u...->...", weights.to(sums.device, sums.dtype), sums))
        self.units_seen.update(self.unit_ids)
        self.non_finite_units |= bool(bad.any())
        self._reset_micro_batch()

    def remove_hooks(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        super().remove_hooks()

    def clipped_sums(self, params: List[nn.Parameter]) -> List[torch.Tensor]:
        """Clip the last micro-batch and return ``Σ_u c_u ḡ_u`` for each of ``params`` (zeros where no unit reached
        it); no backward pass may follow in this step."""
        self._flush()
        self.closed = True
        return [self.clipped[p] if p in self.clipped else torch.zeros_like(p) for p in params]
