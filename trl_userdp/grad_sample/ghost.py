"""Per-user ghost clipping: the sum of every unit's clipped averaged gradient, without per-unit gradients
(docs/mechanisms.md, "Ghost clipping at the user level").

**Norms.** For a layer whose per-sample gradient is a sum over positions of per-position terms (``nn.Linear``,
``nn.Embedding``, GPT-2's ``Conv1D``), a unit's gradient ``Σ_{r∈u} ∇_W ℓ_r`` is the per-sample gradient of one
"sample" made of the unit's rows laid end to end along the position axis. So the hooks pack each micro-batch's
activations and output gradients as ``[U, L·T, d]`` (``L`` = most rows of one unit, zero padding) and ask Opacus's
per-sample *norm sampler* for the norms (the Gram trick of ghost clipping, Li et al. 2022, here with the cross terms
between a unit's rows: ``O((L·T)²)`` per unit and layer), or, when ``L·T·(d + p) > d·p`` makes the Gram matrices
dearer, its *grad sampler* for this one layer's ``[U, p, d]`` unit gradients, whose norms are taken at once and the
tensor freed. A weight tied between an embedding and a linear layer, or two linear layers, takes the two layers'
cross term (:func:`tied_cross_terms`). A layer of another type, one whose parameter is shared otherwise, or one which
runs twice in one pass, keeps the materialised per-unit sums of :class:`UserGradSampleHooks`.

**Clipped sum.** With every unit's norm known (all its rows are in one micro-batch), its clip factor ``c_u`` follows,
and the layer's stored activations and output gradients, re-weighted per row by ``c_u / n_u``, give
``Σ_u c_u ḡ_u`` through the same grad sampler on the whole micro-batch as one sample — book-keeping (Bu et al. 2023,
"Differentially private optimization on large model at small cost"): no second backward pass and any scalar loss.
A layer on the direct route keeps its ``[U, p, d]`` unit gradients instead, which are then the smaller of the two
(that is when the direct route is chosen), and lets autograd free its activations. Memory: per packable layer, the
smaller of the two for one micro-batch, freed once the micro-batch is clipped; autograd's own ``p.grad`` (the
unclipped sum, which the update does not use) is not computed after the first step, whose self-check needs it
(:meth:`UserGhostHooks._without_weight_gradient`).

**Precision and passes.** Norms and book-kept sums are computed in fp32 whatever the layer's dtype, each Gram norm
with a rounding bound that is added when it is not negligible, so a unit's norm bounds what is added for it; several
backward passes through a layer in one micro-batch are clipped as their sum (docs/privacy_model.md, "Precision and
paths").

A unit with a non-finite norm (NaN data, an overflow) gets weight 0 and its rows are zeroed before the sums, so it adds
nothing, as in the materialised path.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping
from opacus.utils.module_utils import trainable_modules, trainable_parameters
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import conv1d  # noqa: F401  (registers Conv1D's samplers with Opacus)
from .embedding import RECORDING_EMBEDDINGS
from .precision import product_margin, round_down
from .user_check import check_user_gradient
from .user_hooks import UserGradSampleHooks

#: layer types whose per-sample gradient is a sum over positions, so packing a unit's rows along positions is exact
PACKABLE = (nn.Linear, nn.Embedding, Conv1D)
NORM_SAMPLERS = GradSampleHooksFastGradientClipping.NORM_SAMPLERS


def _pack(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``[R, ...]`` -> units ``[U, L·…, d]`` (token ids: ``[U, L·…]``), ``index[u, j]`` = the row of unit ``u``'s
    ``j``-th row or ``R`` (a zero row); a view of ``t``, no copy, when the units' rows are its rows in order
    (every unit ``L`` rows, one after the other)."""
    in_order = index.numel() == t.shape[0] and bool(torch.equal(index.flatten(), torch.arange(index.numel())))
    padded = t if in_order else torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[index.to(t.device)]
    return padded.reshape(index.shape[0], -1, t.shape[-1]) if t.is_floating_point() else padded.reshape(index.shape[0], -1)


def packing_index(slots: torch.Tensor, n_units: int) -> torch.Tensor:
    """The rows of each unit in order, padded.

    Args:
        slots: The unit of each row ``[R]`` (``slots[r]`` = row ``r``'s unit, in ``[0, n_units)``).
        n_units: The number of units U.

    Returns:
        A LongTensor ``[U, L]`` (``L`` = most rows of one unit) of row indices, padded with ``R`` (a zero row).
    """
    n_rows = len(slots)
    counts = torch.bincount(slots, minlength=n_units)
    order = torch.argsort(slots, stable=True)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n_rows) - start[slots[order]]
    index = torch.full((n_units, int(counts.max()) if n_rows else 0), n_rows, dtype=torch.long)
    index[slots[order], rank] = order
    return index


def _by_recorded(module: nn.Module, grads: Dict[nn.Parameter, torch.Tensor],
                 params: List[nn.Parameter]) -> Dict[nn.Parameter, torch.Tensor]:
    """A sampler's ``{parameter: tensor}`` keyed by the layer's parameters as its backward pass saw them (``params``,
    in ``trainable_parameters`` order): a layer sharded by FSDP2 holds its gathered parameters while it runs and its
    shards afterwards, when the sums are taken."""
    recorded = dict(zip([p for _, p in trainable_parameters(module)], params))
    return {recorded[p]: g for p, g in grads.items() if p in recorded}


def _as_one_sample(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, t.shape[-1]) if t.is_floating_point() else t.reshape(1, -1)


def _rows_view(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return mask.to(t.device).view(-1, *([1] * (t.dim() - 1)))


def _weights_on_input(module: nn.Module, params: List[nn.Parameter], activations: List[torch.Tensor],
                      backprops: torch.Tensor) -> bool:
    """Whether a book-kept sum ``Σ_r w_r a_rᵀ g_r`` may weight the rows of the input ``a`` instead of the output
    gradient ``g`` (the same product, the smaller copy): a layer whose one trainable parameter is its weight (a bias's
    gradient is ``Σ_r w_r g_r``), with a floating input narrower than its output."""
    return (not isinstance(module, nn.Embedding) and len(params) == 1 and params[0] is getattr(module, "weight", None)
            and activations[0].is_floating_point() and activations[0].shape[-1] < backprops.shape[-1])


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors in fp32 (no copy when they are), token ids as they are."""
    return t.float() if t.is_floating_point() else t


#: the direct route is taken while a layer's unit gradients hold at most this many times the memory of its stored
#: input and output gradient (the Gram route's): 1.25 lets a square projection with a user's positions at 0.45 of its
#: width (SmolLM's q and o, 256 positions) save its Gram matrices at 1.13× that memory, and keeps a 576 × 1,536 MLP layer
#: (1.64×) on the Gram route
DIRECT_MEMORY_SLACK = 1.25
#: the unit roundoff of fp32, in which every ghost norm and book-kept sum is computed
FP32_UNIT_ROUNDOFF = 2.0 ** -24
#: a Gram norm is used as computed while its rounding bound is at most this share of it (else the bound is added)
TRUSTED_SHARE = 1e-2


def tied_cross_terms(first: Tuple[nn.Module, List[torch.Tensor], torch.Tensor],
                     second: Tuple[nn.Module, List[torch.Tensor], torch.Tensor],
                     index: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """``⟨G¹_u, G²_u⟩`` per unit for a weight that two layers share, in fp32: with it a unit's norm over both layers
    is ``‖G¹_u‖² + ‖G²_u‖² + 2⟨G¹_u, G²_u⟩`` without either unit gradient (a tied embedding's is vocabulary-sized).

    For an embedding (token ids ``i_t``, output gradients ``b_t``) and a linear layer with the same ``[V, D]`` weight
    (inputs ``h_s``, output gradients ``g_s``), ``⟨G¹, G²⟩ = Σ_{t,s} g_s[i_t] ⟨b_t, h_s⟩``; for two linear layers,
    ``Σ_{s,t} ⟨g¹_s, g²_t⟩ ⟨a¹_s, a²_t⟩`` (the Gram trick's cross terms), over each unit's positions.

    Args:
        first: ``(layer, activations, output gradients)`` of one layer's pass (output gradients unscaled).
        second: The same for the other layer.
        index: The packing index ``[U, L]`` (:func:`packing_index`).

    Returns:
        The cross terms ``[U]``, and the relative constant of their rounding error (as :meth:`UserGhostHooks._gram_norms2`'s,
        for inner products of both lengths and both layers' positions).
    """
    if isinstance(second[0], nn.Embedding):
        first, second = second, first
    (layer1, acts1, grads1), (_, acts2, grads2) = first, second
    if isinstance(layer1, nn.Embedding) and layer1.padding_idx is not None:  # autograd drops the padding row
        grads1 = grads1.masked_fill((acts1[0] == layer1.padding_idx).unsqueeze(-1), 0)
    one = index.shape[1] == 1  # each unit's one row, in row order (reordered at the end): no packed copies
    pack = (lambda t: t.reshape(t.shape[0], -1, t.shape[-1]) if t.is_floating_point() else t.reshape(t.shape[0], -1)
            ) if one else (lambda t: _pack(t, index))
    x2, g2 = pack(_fp32(acts2[0])), pack(_fp32(grads2))
    if isinstance(layer1, nn.Embedding):  # Σ_{t,s} g_s[i_t] ⟨b_t, h_s⟩
        ids, b = pack(acts1[0]), pack(_fp32(grads1))
        inner = torch.bmm(b, x2.transpose(1, 2))  # [U, P1, P2]: ⟨b_t, h_s⟩
        picked = torch.gather(g2, 2, ids.unsqueeze(1).expand(-1, g2.shape[1], -1))  # [U, P2, P1]: g_s[i_t]
        cross = (inner * picked.transpose(1, 2)).sum((1, 2))
        lengths = (b.shape[-1], g2.shape[-1], ids.shape[1] + x2.shape[1])
    else:  # Σ_{s,t} ⟨g¹_s, g²_t⟩ ⟨a¹_s, a²_t⟩
        x1, g1 = pack(_fp32(acts1[0])), pack(_fp32(grads1))
        cross = (torch.bmm(g1, g2.transpose(1, 2)) * torch.bmm(x1, x2.transpose(1, 2))).sum((1, 2))
        lengths = (x1.shape[-1], g1.shape[-1], x1.shape[1] + x2.shape[1])
    if one:
        cross = cross.index_select(0, index[:, 0].to(cross.device))
    rounding = 4 * FP32_UNIT_ROUNDOFF * (math.sqrt(lengths[0]) + math.sqrt(lengths[1]) + lengths[2])
    return cross, rounding


def tied_cross_direct(embedding: nn.Module, passes: List[Tuple[List[torch.Tensor], torch.Tensor, float]],
                      unit_grads: torch.Tensor, index: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """``⟨G¹_u, G²_u⟩`` per unit for a weight tied between an embedding (Gram route: its passes' token ids ``i_t`` and
    output gradients ``b_t``) and a linear layer on the direct route (its unit gradients ``G²_u``, ``[U, V, D]``):
    ``Σ_t ⟨b_t, G²_u[i_t]⟩`` over the unit's positions, in fp32; a unit's rows long enough make the linear layer's unit
    gradient cheaper than its Gram matrices (an LM head's ``(L·T)²·V``).

    Args:
        embedding: The embedding.
        passes: Its backward passes' ``(activations, output gradients, scale)`` (output gradients unscaled).
        unit_grads: The linear layer's unit gradients of the shared weight.
        index: The packing index ``[U, L]`` (:func:`packing_index`).

    Returns:
        The cross terms ``[U]``, and the relative constant of their rounding error (``4u(√D + N)`` for ``N``
        positions: each is within it times ``S_u ‖G²_u‖``, ``S_u`` the embedding's bound).
    """
    cross = torch.zeros(unit_grads.shape[0], device=unit_grads.device)
    positions = 0
    for activations, backprops, scale in passes:
        ids, b = _pack(activations[0], index).to(unit_grads.device), _pack(_fp32(backprops), index)
        if embedding.padding_idx is not None:  # autograd drops the padding row
            b = b.masked_fill((ids == embedding.padding_idx).unsqueeze(-1), 0)
        picked = torch.gather(unit_grads, 1, ids.unsqueeze(-1).expand(-1, -1, unit_grads.shape[-1]))  # G²_u[i_t]
        cross += torch.einsum("upd,upd->u", picked.float(), b.to(unit_grads.device)) * scale
        positions += ids.shape[1]
    return cross, 4 * FP32_UNIT_ROUNDOFF * (math.sqrt(unit_grads.shape[-1]) + positions)


@dataclass
class LayerRecord:
    """What one packable layer left in the current micro-batch.

    Args:
        params: The layer's trainable parameters.
        passes: Gram route: each backward pass's ``(activations, output gradients, scale)``, kept until the flush,
            whose book-kept sum consumes them.
        unit_grads: Direct route, or several passes of a layer whose shapes differ: ``{param: [U, *p.shape]}``,
            summed over the passes, their norms taken at the flush from the very tensors that are added (each popped
            once its weighted sum is taken).
        norm2: Gram route: the units' ``‖G_u‖²`` ``[U]``.
        bound: Gram route: ``S_u = Σ_{positions of u} ‖a‖‖g‖`` ``[U]`` (≥ ‖G_u‖, the scale of the rounding error).
        rounding: The rounding error's relative constant.
    """

    params: List[nn.Parameter]
    passes: List[Tuple[List[torch.Tensor], torch.Tensor, float]] = field(default_factory=list)
    unit_grads: Optional[Dict[nn.Parameter, torch.Tensor]] = None
    norm2: Optional[torch.Tensor] = None
    bound: Optional[torch.Tensor] = None
    rounding: float = 0.0


class UserGhostHooks(UserGradSampleHooks):
    """:class:`UserGradSampleHooks` that clip per unit with ghost norms and book-keeping (module docstring).

    The optimizer sets :attr:`clip_factors` (norms ``[U]`` -> factors ``[U]``) and, after the last micro-batch's
    backward pass, takes :meth:`clipped_sums`. Each micro-batch must hold its units' rows whole (the loader's
    ``micro_batches`` draws whole users); a unit met again in a later micro-batch of the same step raises.

    Args:
        m: The model, hooked in place (not wrapped).
        **kwargs: Passed to :class:`UserGradSampleHooks` (``batch_first``, ``strict``, ``force_functorch``).
    """

    ghost = True

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        owners: Dict[nn.Parameter, List[nn.Module]] = {}
        for _, module in trainable_modules(m):
            for _, p in trainable_parameters(module):
                owners.setdefault(p, []).append(module)
        packable = {module for _, module in trainable_modules(m)
                    if (type(module) in PACKABLE or type(module) in RECORDING_EMBEDDINGS.values())
                    and type(module) in NORM_SAMPLERS and type(module) in self.GRAD_SAMPLERS}
        #: weights shared by two layers whose cross term the norms take (:func:`tied_cross_terms`: a tied embedding
        #: and LM head, two linear layers), ``{weight: (layer, layer)}``; other shared weights stay materialised
        self.tied: Dict[nn.Parameter, Tuple[nn.Module, nn.Module]] = {
            p: tuple(mods) for p, mods in owners.items()
            if len(mods) == 2 and all(mod in packable and mod.weight is p for mod in mods)
            and {type(mod) for mod in mods} in ({nn.Embedding, nn.Linear}, {nn.Linear})}
        #: the modules clipped by ghost norms; the others keep materialised per-unit sums
        self.ghost_modules: Set[nn.Module] = {
            module for module in packable
            if all(len(owners[p]) == 1 or p in self.tied for _, p in trainable_parameters(module))
        }
        self.clip_factors: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        #: for a model sharded by FSDP2: ``{gathered parameter: its shard (DTensor)}``; the step's sums are then kept
        #: as this rank's shards of the sums over all ranks (:meth:`_emit`)
        self.shards: Optional[Dict[nn.Parameter, nn.Parameter]] = None
        self._placeholder = False
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._drop_grad) for p in self.param_names]
        self.autograd_grad_sample_hooks.extend(
            module.register_forward_pre_hook(self._without_weight_gradient) for module in self.ghost_modules)
        #: how packable layers' unit norms are computed: "auto" (the cheaper per layer), "gram" or "direct"
        self.norm_route = "auto"

    # -- per step and per micro-batch state ---------------------------------------------------
    def reset_step(self, clear_pending: bool = True) -> None:
        """:meth:`UserGradSampleHooks.reset_step`, plus the step's clipped sums and the micro-batch's records."""
        super().reset_step(clear_pending)
        self._reset_micro_batch()
        #: Σ_u c_u ḡ_u so far in this step, per parameter
        self.clipped: Dict[nn.Parameter, torch.Tensor] = {}
        #: parameters that received per-unit terms in this step
        self.touched: Set[nn.Parameter] = set()
        self.units_seen: Set[int] = set()
        self.non_finite_units = False
        self.closed = False
        #: the per-user self-check's norms: ``{unit code: {layer's parameters: (norm of S_u, Σ_r∈u ‖g_r‖)}}``
        self.check_norms: Dict[int, Dict[Tuple[nn.Parameter, ...], Tuple[float, float]]] = {}
        for p in self.param_names:
            p._grad_nonzero = None

    def _drop_grad(self, p: nn.Parameter) -> None:
        """Autograd's ``p.grad`` (the unclipped sum) is not part of the update: note whether it was non-zero (a use
        the hooks did not see) and free it, unless the self-check still needs it."""
        if self._placeholder:
            p.grad = None
            return
        if self.record_row_norms or not self.hooks_enabled:
            return
        nonzero = p.grad.ne(0).any()
        p._grad_nonzero = nonzero if getattr(p, "_grad_nonzero", None) is None else p._grad_nonzero | nonzero
        p.grad = None

    def _without_weight_gradient(self, module: nn.Module, args: tuple) -> None:
        """A ghost layer's forward pre-hook: autograd need not compute its weights' gradient (the unclipped sum, which
        the update does not use; the clipped sum comes from the stored activations and output gradients), so its
        weights are marked as not needing one while the layer's operation is recorded, and marked again in
        :meth:`capture_activations_hook` right after, which also puts an output that then needs no gradient (the
        layer's input needed none: token ids, a frozen model's hidden states under LoRA) back on the backward path.
        That saves one matrix product per linear layer in the backward pass, and an embedding's dense
        vocabulary-sized gradient. On one process's model (not under FSDP2), and not while the self-check needs
        autograd's gradient."""
        for p in module.__dict__.pop("_weights_marked", ()):  # left by a forward pass that raised
            p.requires_grad_(True)
        if (self.hooks_enabled and not self.record_row_norms and self.shards is None and module.training
                and torch.is_grad_enabled() and module in self.ghost_modules):
            weights = [p for _, p in trainable_parameters(module)]
            for p in weights:
                p.requires_grad_(False)
            module._weights_marked = weights

    def discard_step(self) -> None:
        """:meth:`UserGradSampleHooks.discard_step`, and the layers' call counts of the discarded passes."""
        super().discard_step()
        for _, module in trainable_modules(self._module):
            module.__dict__.pop("_ghost_calls", None)

    def use_gathered_parameters(self, gathered: Dict[nn.Parameter, nn.Parameter]) -> None:
        """Key the per-parameter state by the parameters FSDP2 gathers while a layer runs (one object per sharded
        parameter, :func:`~trl_userdp.distributed.gathered_parameters`) instead of the shards the hooks were built on.

        Args:
            gathered: ``{sharded parameter: its unsharded parameter}``.
        """
        for handle in self._grad_hooks:
            handle.remove()
        self.ghost_modules -= {module for pair in self.tied.values() for module in pair}  # materialised when sharded
        self.tied = {}
        self.param_names = {gathered[p]: name for p, name in self.param_names.items()}
        for p in self.param_names:
            p.grad_sample = None
            p._forward_counter = 0
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._drop_grad) for p in self.param_names]
        self.reset_step()

    @contextlib.contextmanager
    def placeholder_pass(self) -> Iterator[None]:
        """Forward and backward passes inside the block add nothing to the step: the hooks record nothing and
        autograd's gradient is freed as it is accumulated.

        On a model sharded by FSDP2 every rank must run every layer in every step (each layer's parameters are
        gathered by a collective), also a rank whose shard of the draw has no user: it runs a placeholder batch (any
        public input of the model's shape) in this block while the others run their users' rows.

        Yields:
            Nothing.
        """
        self.disable_hooks()
        self._placeholder = True
        try:
            yield
        finally:
            self._placeholder = False
            self.enable_hooks()

    def received_gradient(self, p: nn.Parameter) -> bool:
        """:meth:`UserGradSampleHooks.received_gradient`, also counting gradients freed by the hooks."""
        flag = getattr(p, "_grad_nonzero", None)
        return super().received_gradient(p) or (flag is not None and bool(flag))

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("A backward pass ran after this step's users were clipped (optimizer.step()): run every "
                             "micro-batch's backward pass before optimizer.step().")

    def _reset_micro_batch(self) -> None:
        #: per packable layer of the current micro-batch, what its backward passes left
        self._records: Dict[nn.Module, LayerRecord] = {}
        self._index: Optional[torch.Tensor] = None
        self.unit_ids, self._slot_of, self.unit_counts = [], {}, torch.zeros(0)
        self._counted_serial, self._row_slots = None, None
        for p in self.param_names:
            p.grad_sample = None
            for attr in ("_unit_grad", "_row_norm_units"):  # per micro-batch, by its slots
                if hasattr(p, attr):
                    delattr(p, attr)

    @property
    def units_in_step(self) -> int:
        """Units with rows in the current step, over its micro-batches."""
        return len(self.units_seen)

    def set_row_users(self, row_users: Optional[torch.Tensor], *, continuation: bool = False) -> None:
        """:meth:`UserGradSampleHooks.set_row_users`; a continuation first clips the previous micro-batch."""
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
        """Opacus's forward hook; a layer that runs twice in one pass leaves the ghost route (materialised); a layer
        whose weights :meth:`_without_weight_gradient` marked is trainable again.

        Args:
            module: The layer.
            forward_input: Its inputs.
            forward_output: Its output.

        Returns:
            The output put back on the backward path when it needs no gradient only because the weights were marked,
            else None (the output as it is).
        """
        marked = module.__dict__.pop("_weights_marked", ())
        for p in marked:  # trainable again, as soon as the operation is recorded
            p.requires_grad_(True)
        params = [p for _, p in trainable_parameters(module)]
        counted = [p._forward_counter for p in params]
        super().capture_activations_hook(module, forward_input, forward_output)
        if module in self.ghost_modules and params and params[0]._forward_counter > counted[0]:
            # this layer's calls in the pass (its weight's counter also counts the other layer of a shared weight)
            module._ghost_calls = getattr(module, "_ghost_calls", 0) + 1
            if module._ghost_calls > 1:  # runs twice per pass: cross terms between its calls; materialise it, and
                # the other layer of its shared weight (Opacus sums a weight's per-sample gradients over all its calls)
                self.ghost_modules -= {module}.union(*(self.tied.get(p, ()) for p in params))
        if marked and isinstance(forward_output, torch.Tensor) and not forward_output.requires_grad:
            # back on the backward path through a zero that needs a gradient, so that the layer's output gradient
            # still reaches its backward hook
            return forward_output + torch.zeros((), dtype=forward_output.dtype, device=forward_output.device,
                                                requires_grad=True)
        return None

    def capture_backprops_hook(self, module, _forward_input, forward_output, loss_reduction, batch_first):
        """Record a ghost layer's backward pass (norms by the Gram or direct route); other layers as the base class.

        Args:
            module: The layer.
            _forward_input: Its input gradients (unused).
            forward_output: The gradients of its output.
            loss_reduction: ``"mean"`` or ``"sum"``.
            batch_first: Whether the batch dimension comes first.

        Raises:
            ValueError: If the step's users were already clipped, the batch has no row → user map, its row
                count differs from the layer's, or a user of an earlier micro-batch of the step came back.
        """
        if not self.hooks_enabled:
            return
        if module not in self.ghost_modules:
            super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
            return
        self._check_open()
        # the output gradient as autograd gave it, without Opacus's copy scaled by the batch size for a mean loss: the
        # scale joins the norms and weights instead (one copy less of the largest tensor, e.g. an LM head's logits)
        backprops = forward_output[0].detach()
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=self._per_row(backprops) if module in self._flattening else backprops,
            loss_reduction="sum", batch_first=batch_first)
        scale = float(module.max_batch_len) if loss_reduction == "mean" else 1.0
        if not module.activations and hasattr(module, "max_batch_len"):
            del module.max_batch_len
        params = [p for _, p in trainable_parameters(module)]
        for p in params:
            p._forward_counter -= 1
            p._row_dtype = backprops.dtype  # the self-check's tolerance follows it (bf16 rows under autocast)
        module._ghost_calls = getattr(module, "_ghost_calls", 1) - 1
        slots = self._slots_for_current_batch()
        if backprops.shape[0] != len(slots):
            self._row_mismatch(params[0], backprops.shape[0], len(slots))
        if not len(slots):  # an empty micro-batch: no unit, nothing to clip
            return
        if self.record_row_norms:  # the self-check's tolerance: Σ_r ‖row gradient‖ / R, and per unit
            for p, norms in NORM_SAMPLERS[type(module)](module, activations, backprops).items():
                p._row_norm_sum = getattr(p, "_row_norm_sum", 0.0) + scale * float(norms.sum()) / len(slots)
                self._add_unit_row_norms(p, scale * norms.float(), slots)
        record = self._records.get(module)
        if record is None:
            record = self._records[module] = LayerRecord(params)
            if self._direct_route(module, activations, backprops, slots):
                record.unit_grads = self._unit_grads(module, params, activations, backprops, slots, scale)
            else:
                record.passes.append((activations, backprops, scale))
                record.norm2, record.bound, record.rounding = self._gram_norms2(module, record.passes, slots)
        elif record.unit_grads is not None:  # another backward pass through a layer on the direct route
            for p, g in self._unit_grads(module, params, activations, backprops, slots, scale).items():
                record.unit_grads[p] += g
        else:  # another backward pass through a layer on the Gram route: its norms are those of the summed passes
            record.passes.append((activations, backprops, scale))
            record.norm2 = None  # computed at the flush over all passes (cross terms between them included)
        self.touched.update(params)

    def _accumulate(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        self._check_open()
        super()._accumulate(p, rows)
        self.touched.add(p)

    # -- norms and clipped sums ---------------------------------------------------------------
    def _packing_index(self, slots: torch.Tensor) -> torch.Tensor:
        """:func:`packing_index` of this micro-batch (cached)."""
        if self._index is None:
            self._index = packing_index(slots, len(self.unit_ids))
        return self._index

    def _direct_route(self, module: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor,
                      slots: torch.Tensor) -> bool:
        """Whether this layer takes the direct route: its unit gradients ``[U, p, d]`` (``L·T·d·p`` operations a unit,
        which also give the clipped sum) instead of its Gram matrices (``(L·T)²·(d + p)``, plus the book-kept sum's
        ``L·T·d·p``). Fewer operations, but large unit gradients cost memory traffic (on a CPU, SmolLM's MLP layers and
        LM head measured slower on it, docs/benchmarks.md): it is taken unless it holds more than
        :data:`DIRECT_MEMORY_SLACK` times the memory of the stored input and output gradient (``L·T·(d + p)`` a unit),
        and never for an embedding (its unit gradient is a vocabulary-sized table)."""
        weight = getattr(module, "weight", None)
        if weight in self.tied and not (isinstance(module, nn.Linear) and any(
                isinstance(other, nn.Embedding) for other in self.tied[weight])):
            return False  # two tied linear layers: their cross term needs both Gram routes' tensors
        if isinstance(module, nn.Embedding) or self.norm_route != "auto" or weight is None:
            return self.norm_route == "direct" and not isinstance(module, nn.Embedding)
        positions = self._packing_index(slots).shape[1] * (backprops[0].numel() // backprops.shape[-1])
        return DIRECT_MEMORY_SLACK * positions * (activations[0].shape[-1] + backprops.shape[-1]) >= weight.numel()

    def _unit_grads(self, module: nn.Module, params: List[nn.Parameter], activations: List[torch.Tensor],
                    backprops: torch.Tensor, slots: torch.Tensor, scale: float) -> Dict[nn.Parameter, torch.Tensor]:
        """The direct route: each unit's gradient ``{param: [U, *p.shape]}`` from Opacus's grad sampler on the packed
        rows (views of the rows when each unit's rows lie in order: with one row per unit, always)."""
        index = self._packing_index(slots)
        grads = _by_recorded(module, self.GRAD_SAMPLERS[type(module)](
            module, [_pack(a, index) for a in activations], _pack(backprops, index)), params)
        return {p: g.mul_(scale) if scale != 1.0 else g for p, g in grads.items()}

    def _gram_norms2(self, module: nn.Module, passes: List[Tuple[List[torch.Tensor], torch.Tensor, float]],
                     slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, float]:
        """The Gram route, in fp32 whatever the layer's dtype: ``(‖G_u‖², S_u, e)`` per unit ``[U]``, where
        ``G_u = Σ_k Σ_{r∈u} ∇ℓ_r`` over the backward passes ``k`` of this micro-batch (their rows laid end to end, so
        the cross terms between passes count), ``S_u`` the sum over the unit's positions of ``‖a‖·‖g‖`` (plus
        ``‖g‖`` for a bias; ``‖G_u‖ ≤ S_u``) and ``e`` the relative rounding constant: the computed ``‖G_u‖²`` is
        within ``e·S_u²`` of the exact one, with ``e = 4u(√d + √p + N)`` for fp32's unit roundoff ``u``, inner
        products of lengths ``d`` and ``p`` and a sum of ``N²`` Gram terms (probabilistic rounding bounds,
        Higham & Mary 2019, with margin)."""
        if len(passes) == 1:
            activations, backprops, scale = passes[0]
            index = self._packing_index(slots)
        else:
            try:
                activations = [torch.cat([ps[0][i] for ps in passes]) for i in range(len(passes[0][0]))]
                backprops = torch.cat([_fp32(ps[1]) * ps[2] for ps in passes])  # scaled in fp32, not in bf16
            except RuntimeError as err:
                raise ValueError("Ghost clipping: several backward passes through one layer in one micro-batch need "
                                 "inputs of one shape; use grad_sample_mode='hooks'.") from err
            scale, slots = 1.0, slots.repeat(len(passes))
            index = packing_index(slots, len(self.unit_ids))
        activations, backprops = [_fp32(a) for a in activations], _fp32(backprops)
        if index.shape[1] == 1:
            order = index[:, 0].to(backprops.device)
            norms = NORM_SAMPLERS[type(module)](module, activations, backprops)
            norm2 = torch.stack([n.float().pow(2) for p, n in norms.items() if p.requires_grad]).sum(0)
            norm2 = norm2.index_select(0, order)
        else:
            norms = NORM_SAMPLERS[type(module)](module, [_pack(a, index) for a in activations], _pack(backprops, index))
            norm2 = torch.stack([n.float().pow(2) for p, n in norms.items() if p.requires_grad]).sum(0)
        # S_u: per row, Σ over positions of ‖a‖‖g‖ (weight; ‖g‖ alone for an embedding) and ‖g‖ (bias), per unit
        g_norm = torch.linalg.vector_norm(backprops, dim=-1).reshape(backprops.shape[0], -1)
        a = activations[0]
        weight_terms = g_norm if not a.is_floating_point() else \
            g_norm * torch.linalg.vector_norm(a, dim=-1).reshape(a.shape[0], -1)
        per_row = [weight_terms.sum(1)]
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.requires_grad:
            per_row.append(g_norm.sum(1))
        slots_dev = slots.to(g_norm.device)
        bound2 = sum(torch.zeros(len(self.unit_ids), device=g_norm.device).index_add_(0, slots_dev, t).pow(2)
                     for t in per_row)
        d = a.shape[-1] if a.is_floating_point() else 1
        positions = index.shape[1] * (backprops[0].numel() // backprops.shape[-1])
        rounding = 4 * FP32_UNIT_ROUNDOFF * (math.sqrt(d) + math.sqrt(backprops.shape[-1]) + positions)
        return norm2 * scale ** 2, bound2.sqrt() * scale, rounding

    def _whole_batch_gradient(self, module: nn.Module, params: List[nn.Parameter], activations: List[torch.Tensor],
                              backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        grads = self.GRAD_SAMPLERS[type(module)](module, [_as_one_sample(a) for a in activations],
                                                 _as_one_sample(backprops))
        return {p: g[0] for p, g in _by_recorded(module, grads, params).items()}

    def _sum_dtype(self, p: nn.Parameter) -> torch.dtype:
        """The dtype of the step's sums: the parameter's, or its shard's under FSDP2 (whose mixed precision can gather
        the parameter in a lower one)."""
        return p.dtype if self.shards is None else self.shards[p].dtype

    def _add(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        grad = grad.to(p.dtype)
        self.clipped[p] = grad if p not in self.clipped else self.clipped[p].add_(grad)  # the step's own tensor

    def _emit(self, groups: Dict[nn.Parameter, Callable[[], Dict[nn.Parameter, torch.Tensor]]]) -> None:
        """Add a micro-batch's clipped sums to the step's: ``groups[p]()`` computes the sums of ``p``'s layer (once
        for all its parameters).

        With :attr:`shards` (a model sharded by FSDP2), each parameter's sum over this rank's users is summed over the
        ranks and scattered to the shards at once, in the model's parameter order on every rank (zeros where this
        rank has nothing), so that no rank holds more than one layer's full sums: :attr:`clipped` keeps this rank's
        shard of ``Σ_{all ranks' users} c_u ḡ_u``."""
        if self.shards is None:
            for group in dict.fromkeys(groups.values()):
                for p, g in group().items():
                    self._add(p, g)
            return
        from torch.distributed.tensor import DTensor, Partial

        computed: Dict[nn.Parameter, torch.Tensor] = {}
        done = set()
        for p in self.param_names:  # the same order on every rank
            group = groups.get(p)
            if group is not None and group not in done:
                computed.update(group())  # this layer's sums, each freed once scattered
                done.add(group)
            shard = self.shards[p]
            full = computed.pop(p, None)
            full = torch.zeros(p.shape, dtype=shard.dtype, device=p.device) if full is None else full.to(shard.dtype)
            local = DTensor.from_local(full, shard.device_mesh, [Partial()], shape=shard.shape, stride=shard.stride()
                                       ).redistribute(shard.device_mesh, shard.placements).to_local()
            del full
            self.clipped[p] = local if p not in self.clipped else self.clipped[p].add_(local)

    def _flush(self) -> None:
        """Clip the current micro-batch's units and add ``Σ_u c_u ḡ_u`` to the step's sums; free its tensors.

        A unit's norm is an upper bound on the norm of what is added for it: the direct route's and the materialised
        layers' norms are taken from the very tensors that are added, and a Gram norm whose rounding bound ``e·S_u²``
        exceeds :data:`TRUSTED_SHARE` of it is raised by that bound (a unit whose rows nearly cancel, in any dtype),
        so that rounding never lets a unit past the clip (docs/privacy_model.md, "Precision and paths")."""
        n_units = len(self.unit_ids)
        if n_units == 0 or self._row_slots is None:
            if self.shards is not None:  # no user here, but every rank joins each parameter's reduce-scatter
                self._emit({})
            self._reset_micro_batch()
            return
        if self.clip_factors is None:
            raise ValueError("UserGhostHooks needs clip_factors (the optimizer sets it).")
        counts, row_slots = self.unit_counts, self._row_slots
        for module, record in list(self._records.items()):
            if self.record_row_norms:  # what autograd's gradient of this micro-batch must be: Σ_r ∇ℓ_r / R
                self._add_check_sums(module, record, len(row_slots))
            if any(getattr(p, "_unit_grad", None) is not None for p in record.params):
                # the layer also went through the materialised hooks in this micro-batch (it ran twice in a later
                # forward pass): its passes join those sums, so the norm is the norm of their total
                for p, g in self._record_unit_grads(module, record, row_slots).items():
                    self._accumulate_unit_sum(p, g)
                del self._records[module]
        pairs = self._tied_pairs(row_slots)
        materialised = [(p, p._unit_grad) for p in self.param_names if getattr(p, "_unit_grad", None) is not None]
        direct = [(p, g) for record in self._records.values() if record.unit_grads is not None
                  for p, g in record.unit_grads.items()]
        norm2, rounding2 = torch.zeros(n_units), torch.zeros(n_units)
        direct_norm2 = {p: torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float32).pow(2).cpu()
                        for p, g in materialised + direct}
        for n2 in direct_norm2.values():
            norm2 += n2
        # the norms the self-check compares: {layers: (their parameters, [U] squared norms)}
        components: Dict[Tuple[nn.Module, ...], Tuple[Tuple[nn.Parameter, ...], torch.Tensor]] = {}
        for module, record in self._records.items():
            if record.unit_grads is None:
                if record.norm2 is None:  # several passes: the norms of their sum
                    record.norm2, record.bound, record.rounding = self._gram_norms2(module, record.passes, row_slots)
                norm2 += record.norm2.cpu()
                rounding2 += record.rounding * record.bound.cpu().pow(2)
                components[(module,)] = (tuple(record.params), record.norm2.cpu())
        checked_per_param = materialised + direct
        for (first, one), (second, other) in pairs:  # a shared weight: the cross term of its two layers
            params = tuple(dict.fromkeys(one.params + other.params))
            if other.unit_grads is not None:  # an embedding (Gram route) and a linear layer on the direct route
                weight = one.params[0]  # the embedding's one parameter, the shared weight
                cross, rounding = tied_cross_direct(first, one.passes, other.unit_grads[weight],
                                                    self._packing_index(row_slots))
                cross = 2 * cross.cpu()
                rounding2 += 2 * max(rounding, one.rounding) * one.bound.cpu() * direct_norm2[weight].sqrt()
                head_norm2 = sum(direct_norm2[p] for p in other.unit_grads)  # the weight's, and a bias's
                components[(first, second)] = (params, components.pop((first,))[1] + head_norm2 + cross)
                checked_per_param = [(p, g) for p, g in checked_per_param if p not in other.unit_grads]
            else:
                cross, rounding = tied_cross_terms((first, *one.passes[0][:2]), (second, *other.passes[0][:2]),
                                                   self._packing_index(row_slots))
                cross = 2 * cross.cpu() * one.passes[0][2] * other.passes[0][2]
                rounding2 += 2 * max(rounding, one.rounding, other.rounding) * (one.bound * other.bound).cpu()
                components[(first, second)] = (params,
                                               components.pop((first,))[1] + components.pop((second,))[1] + cross)
            norm2 += cross
        if self.record_row_norms:
            self._keep_check_norms(checked_per_param, components)
        norm2 = torch.where(rounding2 > TRUSTED_SHARE * norm2, norm2 + rounding2, norm2)
        norms = norm2.sqrt() / counts  # (a bound on) the norm of each unit's average
        bad = ~torch.isfinite(norms)
        norms = norms.masked_fill(bad, 0.0)
        self.unit_norms.append(norms)
        # c_u / n_u, each unit clipped to the share of C that its sums' rounding (bf16) cannot push past C
        margin = product_margin(self._sum_dtype(p) for p in self.param_names)
        weights = torch.where(bad, torch.zeros(()), self.clip_factors(norms / margin).cpu() / counts)
        rows_bad, row_weights = bad[row_slots], weights[row_slots]

        # each layer's sums are computed once, from its record's tensors, which are then let go: the micro-batch's
        # stored inputs and output gradients shrink while the sums grow, instead of both being held at once
        def book_kept(module: nn.Module, record: LayerRecord) -> Dict[nn.Parameter, torch.Tensor]:
            total: Dict[nn.Parameter, torch.Tensor] = {}
            while record.passes:
                activations, backprops, scale = record.passes.pop(0)
                if bad.any():
                    backprops = backprops.masked_fill(_rows_view(rows_bad, backprops), 0)
                    activations = [a.masked_fill(_rows_view(rows_bad, a), 0) if a.is_floating_point() else a
                                   for a in activations]
                # the book-kept sum in fp32 (weights c_u/n_u per row), cast to the parameter's dtype once; the
                # weights scale the smaller of the layer's input and output gradient (an LM head's: its input)
                w = (row_weights * scale).to(backprops.device)
                if _weights_on_input(module, record.params, activations, backprops):
                    activations = [activations[0] * _rows_view(w, activations[0]), *activations[1:]]
                else:
                    backprops = backprops * _rows_view(w, backprops)  # fp32 weights: an fp32 product
                for p, g in self._whole_batch_gradient(module, record.params, [_fp32(a) for a in activations],
                                                       _fp32(backprops)).items():
                    g = g.to(self._sum_dtype(p))
                    total[p] = g if p not in total else total[p].add_(g)  # in place: one layer-sized tensor
            return total

        def weighted(p: nn.Parameter, held: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
            sums = held.pop(p)
            if bad.any():
                sums = sums.masked_fill(_rows_view(bad, sums), 0)
            unit_weights = round_down(weights, sums.dtype).to(sums.device)
            return {p: torch.einsum("u,u...->...", unit_weights, sums)}

        def together(*parts: Callable[[], Dict[nn.Parameter, torch.Tensor]]) -> Dict[nn.Parameter, torch.Tensor]:
            total: Dict[nn.Parameter, torch.Tensor] = {}
            for part in parts:
                for p, g in part().items():  # a shared weight's two sums, added in place (an embedding's size)
                    total[p] = g if p not in total else total[p].add_(g)
            return total

        groups: Dict[nn.Parameter, Callable[[], Dict[nn.Parameter, torch.Tensor]]] = {}
        for module, record in self._records.items():
            if record.passes:
                group = functools.partial(book_kept, module, record)
                groups.update({p: group for p in record.params})
        groups.update({p: functools.partial(weighted, p, {p: g}) for p, g in materialised})
        for record in self._records.values():
            for p in record.unit_grads or ():
                groups[p] = functools.partial(weighted, p, record.unit_grads)
        for layers in pairs:  # one group for both layers of a shared weight, so that each sum is added once; an
            # embedding's last, so that the head's output gradients (the logits': the largest record) are let go first
            ordered = sorted(layers, key=lambda layer: isinstance(layer[0], nn.Embedding))
            parts = [part for module, record in ordered for part in (
                [functools.partial(book_kept, module, record)] if record.unit_grads is None else
                [functools.partial(weighted, p, record.unit_grads) for p in record.unit_grads])]  # weight, and a bias
            group = functools.partial(together, *parts)
            groups.update({p: group for _, record in layers for p in record.params})
        del direct, checked_per_param  # the direct route's unit gradients are held by their records alone
        self._emit(groups)
        self.units_seen.update(self.unit_ids)
        self.non_finite_units |= bool(bad.any())
        self._reset_micro_batch()

    def _tied_pairs(self, row_slots: torch.Tensor) -> List[Tuple[Tuple[nn.Module, LayerRecord], ...]]:
        """The two layers of each shared weight (:attr:`tied`) that both ran in this micro-batch, with their records:
        both on the Gram route, or an embedding on the Gram route first and a linear layer on the direct route second.
        A pair of Gram routes with several backward passes through either layer is materialised instead (both layers'
        unit gradients summed, their norm taken from the sum)."""
        pairs = []
        for first, second in self.tied.values():
            one, other = self._records.get(first), self._records.get(second)
            if one is None or other is None:
                continue
            if one.unit_grads is not None:
                (first, one), (second, other) = (second, other), (first, one)
            # the direct route is only ever the linear layer's beside an embedding, whose cross term takes any passes
            if other.unit_grads is not None or (len(one.passes) == 1 and len(other.passes) == 1):
                pairs.append(((first, one), (second, other)))
                continue
            for module, record in ((first, one), (second, other)):
                for p, g in self._record_unit_grads(module, record, row_slots).items():
                    self._accumulate_unit_sum(p, g)
                del self._records[module]
        return pairs

    def _keep_check_norms(self, per_param: List[Tuple[nn.Parameter, torch.Tensor]],
                          components: Dict[Tuple[nn.Module, ...], Tuple[Tuple[nn.Parameter, ...], torch.Tensor]]
                          ) -> None:
        """For the per-user self-check: the checked users' sums' norms in this micro-batch, per layer on the Gram
        route (both layers of a shared weight together) and per parameter otherwise, with the sums of their
        row-gradient norms there.

        Args:
            per_param: The materialised and direct-route ``(parameter, [U, *p.shape] sums)``.
            components: ``{layers: (parameters, [U] squared norms)}`` of the Gram-route layers.
        """
        wanted = {u: slot for u, slot in self._slot_of.items() if u in self.user_check.users}
        groups = [((p,), torch.linalg.vector_norm(sums.flatten(1), dim=1, dtype=torch.float32).cpu())
                  for p, sums in per_param]
        groups += [(params, norm2.clamp(min=0).sqrt()) for params, norm2 in components.values()]
        for params, norms in groups:
            for user, slot in wanted.items():
                rows = sum(float(p._row_norm_units[slot]) for p in params
                           if slot < len(getattr(p, "_row_norm_units", ())))
                self.check_norms.setdefault(user, {})[params] = (float(norms[slot]), rows)

    def check_users(self, params: List[nn.Parameter], unit_sums: Optional[List[torch.Tensor]] = None) -> None:
        """The per-user half of the first step's self-check on norms, as ghost clipping keeps no per-user gradient:
        each checked user's norm per layer (Gram route) or parameter against its recomputation on its own rows.

        Args:
            params: The parameters (as the hooks key them).
            unit_sums: Unused (ghost clipping has none).

        Raises:
            ValueError: A user's norm differs from its recomputation's.
        """
        index = {p: i for i, p in enumerate(params)}
        keys = [k for k in dict.fromkeys(k for kept in self.check_norms.values() for k in kept)
                if all(p in index for p in k)]

        def kept(user: int, g: int, which: int) -> Optional[float]:
            value = self.check_norms.get(user, {}).get(keys[g])
            return None if value is None else value[which]

        groups = [[index[p] for p in k] for k in keys]
        self.user_check.check(params, self._quiet, lambda user, reference: check_user_gradient(
            user, reference, groups, params, lambda u, g: None if kept(u, g, 0) is None else torch.tensor([kept(u, g, 0)]),
            lambda u, g: kept(u, g, 1) or 0.0, lambda p: self.param_names.get(p, "?"), norms_only=True))

    def _add_check_sums(self, module: nn.Module, record: LayerRecord, n_rows: int) -> None:
        """Add a record's ``Σ_r ∇ℓ_r / R`` (each pass's) to the self-check's sums (the hooks add the materialised
        layers' themselves)."""
        for p, g in (record.unit_grads or {}).items():
            p._check_sum = getattr(p, "_check_sum", 0.0) + g.sum(0) / n_rows
        for activations, backprops, scale in record.passes:
            check = backprops if scale == n_rows else backprops * (scale / n_rows)
            for p, g in self._whole_batch_gradient(module, record.params, activations, check).items():
                p._check_sum = getattr(p, "_check_sum", 0.0) + g

    def _record_unit_grads(self, module: nn.Module, record: LayerRecord,
                           row_slots: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        """A record's unit gradients ``{param: [U, *p.shape]}``, summed over its passes (materialised if on the Gram
        route)."""
        if record.unit_grads is not None:
            return record.unit_grads
        total: Dict[nn.Parameter, torch.Tensor] = {}
        for activations, backprops, scale in record.passes:
            for p, g in self._unit_grads(module, record.params, activations, backprops, row_slots, scale).items():
                total[p] = g if p not in total else total[p] + g
        return total

    def _accumulate_unit_sum(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """Add unit gradients ``g`` ``[U, *p.shape]`` to ``p``'s materialised per-unit sums."""
        acc = self._unit_sums(p, g.shape[0], g)
        acc[: g.shape[0]] += g.to(acc.dtype)
        p._unit_grad = p.grad_sample = acc

    def remove_hooks(self) -> None:
        """Remove the gradient-freeing hooks and the per-sample hooks."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        super().remove_hooks()

    def clipped_sums(self, params: List[nn.Parameter]) -> List[torch.Tensor]:
        """Clip the last micro-batch and return the step's clipped sums; no backward pass may follow in this step.

        Args:
            params: The parameters whose sums are wanted.

        Returns:
            ``Σ_u c_u ḡ_u`` for each of ``params``, in order (zeros where no unit reached it); with :attr:`shards`,
            this rank's shard of the sum over every rank's units.

        Raises:
            ValueError: If :attr:`clip_factors` is not set while units are pending.
        """
        self._flush()
        self.closed = True
        return [self.clipped[p] if p in self.clipped else torch.zeros_like(p) for p in params]
