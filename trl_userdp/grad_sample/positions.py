"""Absolute position embeddings under per-user hooks: the model's own positions, one row of them per batch row.

Hugging Face models with a learned absolute position embedding (GPT-2's ``wpe``, BERT's and DistilBERT's
``position_embeddings``) look positions up once for the whole batch, as a ``(1, T)`` tensor broadcast over the rows.
Opacus cannot split that lookup's gradient per row. :class:`RowPositions` repeats the model's own positions once per
row before the lookup (the same values, so the same forward the user calls: RoBERTa's count from ``padding_idx + 1``
and positions the caller passes are kept), which gives the lookup a per-row gradient.

It also refuses positions that couple users: with left padding, positions counted from the batch's first column
(GPT-2, BERT, DistilBERT when no ``position_ids`` are passed) shift a row by the padding that the batch's longest
row (another user's) puts in front of it, so removing one user would change every other user's gradient
(docs/architectures.md, "Why a cell is refused")."""

from __future__ import annotations

import inspect
import math
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

#: Names of learned absolute position embeddings in Hugging Face models (GPT-2, BERT, DistilBERT, RoBERTa, ...).
POSITION_EMBEDDING_NAMES = ("wpe", "position_embeddings")


def position_embeddings(module: nn.Module) -> List[Tuple[str, nn.Embedding]]:
    """The learned absolute position embeddings of a model: plain ``nn.Embedding`` layers named as in
    :data:`POSITION_EMBEDDING_NAMES` (subclasses that compute their own positions, as OPT's, are not among them).

    Args:
        module: The model.

    Returns:
        ``(name, layer)`` pairs.
    """
    return [(name, sub) for name, sub in module.named_modules()
            if type(sub) is nn.Embedding and name.rsplit(".", 1)[-1] in POSITION_EMBEDDING_NAMES]


class RowPositions:
    """Forward pre-hooks that give each batch row its own copy of the model's positions, and refuse positions that
    depend on other rows' padding.

    Args:
        module: The model (hooked in place; :meth:`remove` takes the hooks off).
    """

    def __init__(self, module: nn.Module):
        self.handles: List[RemovableHandle] = []
        self._rows: Optional[int] = None
        self._mask: Optional[torch.Tensor] = None
        layers = position_embeddings(module)
        if not layers:
            return
        params = list(inspect.signature(module.forward).parameters)
        self._mask_index = params.index("attention_mask") if "attention_mask" in params else None
        self.handles.append(module.register_forward_pre_hook(self._read_batch, with_kwargs=True))
        for name, layer in layers:
            self.handles.append(layer.register_forward_pre_hook(self._positions_hook(name)))

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _read_batch(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's pre-hook: the batch's row count and attention mask, for the position layers' hooks."""
        given = (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None)
        ids = next((t for t in given if isinstance(t, torch.Tensor)), None)
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_index is not None and len(args) > self._mask_index:
            mask = args[self._mask_index]
        self._rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == self._rows else None

    def _positions_hook(self, name: str):
        def hook(layer: nn.Embedding, args: tuple):
            positions = args[0] if args else None
            if not (torch.is_grad_enabled() and layer.training and isinstance(positions, torch.Tensor)
                    and positions.dim() == 2 and self._rows is not None):
                return None
            if self._mask is not None:
                self._check_not_coupled(name, positions)
            if positions.shape[0] == 1 and self._rows > 1 and layer.weight.requires_grad:
                return (positions.expand(self._rows, -1),) + tuple(args[1:])
            return None

        return hook

    def _check_not_coupled(self, name: str, positions: torch.Tensor) -> None:
        """Refuse positions whose offset from a row's own token count differs between rows (left padding with
        positions counted from the batch's first column).

        Raises:
            ValueError: The positions of a row depend on the other rows' padding.
        """
        mask = self._mask[:, -positions.shape[1]:].long().to(positions.device)
        if mask.shape != (self._rows, positions.shape[1]):
            return
        real = mask.bool()
        offsets = (positions.expand_as(mask) - (mask.cumsum(-1) - 1)).float()  # exact below 2**24 positions
        # one host sync per forward pass: the spread of the offsets over the real tokens (-inf if there are none)
        spread = offsets.masked_fill(~real, -math.inf).amax() - offsets.masked_fill(~real, math.inf).amin()
        if bool(spread > 0):
            raise ValueError(
                f"The batch is left-padded and the model's absolute position embedding {name!r} numbers positions "
                "from the batch's first column: a row's positions then depend on how long other users' rows are, "
                "so one user would change every other user's gradient. Pad on the right "
                "(tokenizer.padding_side = 'right'), or pass position_ids that count each row's own tokens, "
                "e.g. (attention_mask.cumsum(-1) - 1).clamp(min=0)."
            )
