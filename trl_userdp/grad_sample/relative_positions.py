"""DeBERTa-v2/v3's relative-position embeddings under per-user hooks: one copy per batch row.

``DebertaV2Encoder`` takes its relative-position table once for the whole batch (``rel_embeddings.weight``,
layer-normalised by ``encoder.LayerNorm``), and every ``DisentangledSelfAttention`` projects it once (``query_proj`` and
``key_proj`` with ``share_att_key``, else ``pos_query_proj`` and ``pos_key_proj``) and repeats the projection over the
batch's rows. The gradient of those shared computations is the sum over every row, which Opacus cannot split: it would
land on the first row, one user (docs/architectures.md). :class:`RowRelativePositions` gives each row its own copy
before any trainable layer touches it: the table is looked up through its embedding layer with one row of positions per
batch row and layer-normalised per row (when either is trainable; otherwise the shared result is expanded, a view), and
each attention layer projects every row's copy, without the repeat. The values are the same, so the user trains the
forward they call; the relative projections then cost ``2 · position_buckets`` positions per row and layer.

The per-row attention bias is transformers' ``DisentangledSelfAttention.disentangled_attention_bias`` with only the
projections changed; :class:`RowRelativePositions` checks, layer by layer at set-up, that it gives the original's
values, and refuses by name if a transformers version computes them otherwise.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from transformers.models.deberta_v2.modeling_deberta_v2 import (
    DebertaV2Encoder,
    DisentangledSelfAttention,
    build_relative_position,
    build_rpos,
    scaled_size_sqrt,
)


class RowRelativeEncoder(DebertaV2Encoder):
    """``DebertaV2Encoder`` whose relative-position embeddings come one copy per batch row ``[R, P, D]``."""

    def forward(self, hidden_states, *args, **kwargs):  # noqa: D102
        first = hidden_states[0] if isinstance(hidden_states, (list, tuple)) else hidden_states
        self._rows = first.shape[0]
        return super().forward(hidden_states, *args, **kwargs)

    def get_rel_embedding(self) -> Optional[torch.Tensor]:
        """The relative-position embeddings, one copy per row of the batch the encoder runs on.

        Returns:
            ``[R, P, D]``, or None without relative attention.
        """
        if not self.relative_attention:
            return None
        table, norm = self.rel_embeddings, getattr(self, "LayerNorm", None)
        normed = "layer_norm" in self.norm_rel_ebd
        trainable = table.weight.requires_grad or (normed and any(p.requires_grad for p in norm.parameters()))
        if not trainable:  # nothing to split per row: the shared computation, expanded (a view)
            return super().get_rel_embedding().unsqueeze(0).expand(self._rows, -1, -1)
        positions = torch.arange(table.num_embeddings, device=table.weight.device).expand(self._rows, -1)
        rel = table(positions)
        return norm(rel) if normed else rel


class RowRelativeAttention(DisentangledSelfAttention):
    """``DisentangledSelfAttention`` whose relative projections run on every row's copy of the embeddings."""

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        """transformers' ``DisentangledSelfAttention.disentangled_attention_bias`` (5.x), on ``[R, P, D]`` embeddings:
        each row's projections are its own, so no repeat over the batch (a ``[P, D]`` table takes the original).

        Args:
            query_layer: ``[R·heads, T, d]``.
            key_layer: ``[R·heads, T, d]``.
            relative_pos: The relative positions (or None).
            rel_embeddings: ``[R, P, D]`` (or ``[P, D]``).
            scale_factor: The attention's scale factor.

        Returns:
            The c2p and p2c attention scores.
        """
        if rel_embeddings.dim() == 2:
            return super().disentangled_attention_bias(query_layer, key_layer, relative_pos, rel_embeddings,
                                                       scale_factor)
        if relative_pos is None:
            relative_pos = build_relative_position(query_layer, key_layer, bucket_size=self.position_buckets,
                                                   max_position=self.max_relative_positions)
        if relative_pos.dim() == 2:
            relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
        elif relative_pos.dim() == 3:
            relative_pos = relative_pos.unsqueeze(1)
        elif relative_pos.dim() != 4:
            raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
        att_span = self.pos_ebd_size
        relative_pos = relative_pos.to(device=query_layer.device, dtype=torch.long)
        rel_embeddings = rel_embeddings[:, 0: att_span * 2, :]

        def project(layer: nn.Module) -> torch.Tensor:  # [R·heads, 2·span, d], row r's heads at r·heads + h
            return self.transpose_for_scores(layer(rel_embeddings), self.num_attention_heads)

        score = 0
        if "c2p" in self.pos_att_type:
            pos_key_layer = project(self.key_proj if self.share_att_key else self.pos_key_proj)
            scale = scaled_size_sqrt(pos_key_layer, scale_factor)
            c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
            c2p_att = torch.gather(
                c2p_att, dim=-1,
                index=c2p_pos.squeeze(0).expand([query_layer.size(0), query_layer.size(1), relative_pos.size(-1)]))
            score += c2p_att / scale.to(dtype=c2p_att.dtype)
        if "p2c" in self.pos_att_type:
            pos_query_layer = project(self.query_proj if self.share_att_key else self.pos_query_proj)
            scale = scaled_size_sqrt(pos_query_layer, scale_factor)
            r_pos = build_rpos(query_layer, key_layer, relative_pos, self.max_relative_positions,
                               self.position_buckets)
            p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
            p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
            p2c_att = torch.gather(
                p2c_att, dim=-1,
                index=p2c_pos.squeeze(0).expand([query_layer.size(0), key_layer.size(-2), key_layer.size(-2)]),
            ).transpose(-1, -2)
            score += p2c_att / scale.to(dtype=p2c_att.dtype)
        return score


class RowRelativePositions:
    """Give a DeBERTa-v2/v3 model's relative-position computations one copy per batch row (module docstring), in
    place: its encoders and attention layers become :class:`RowRelativeEncoder` and :class:`RowRelativeAttention`
    (the same parameters and values), until :meth:`remove`. Models without them are left alone.

    Args:
        module: The model.

    Raises:
        ValueError: An attention layer's per-row bias differs from the original's (a transformers version that
            computes it otherwise); the message names the layer.
    """

    def __init__(self, module: nn.Module):
        self.swapped: List[Tuple[nn.Module, type]] = []
        try:
            for name, sub in module.named_modules():
                if type(sub) is DebertaV2Encoder and sub.relative_attention:
                    self._swap(sub, RowRelativeEncoder)
                elif type(sub) is DisentangledSelfAttention and sub.relative_attention:
                    self._swap(sub, RowRelativeAttention)
                    _check_same_bias(name, sub)
        except ValueError:
            self.remove()  # the model as the user gave it
            raise

    def _swap(self, sub: nn.Module, cls: type) -> None:
        self.swapped.append((sub, type(sub)))
        sub.__class__ = cls

    def remove(self) -> None:
        """Give the layers their own classes back."""
        for sub, cls in self.swapped:
            sub.__class__ = cls
        self.swapped = []


def _check_same_bias(name: str, attention: RowRelativeAttention) -> None:
    """The per-row bias of one layer against the original's on a random two-row input (no gradient).

    Raises:
        ValueError: They differ.
    """
    g = torch.Generator().manual_seed(0)
    weight = next(attention.parameters())
    heads, d = attention.num_attention_heads, attention.attention_head_size
    span = attention.pos_ebd_size
    width = attention.query_proj.in_features
    with torch.no_grad():
        q, k = (torch.randn(2 * heads, 5, d, generator=g).to(weight) for _ in range(2))
        rel = torch.randn(2 * span, width, generator=g).to(weight)
        original = DisentangledSelfAttention.disentangled_attention_bias(attention, q, k, None, rel, 3)
        per_row = attention.disentangled_attention_bias(q, k, None, rel.unsqueeze(0).expand(2, -1, -1), 3)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(per_row.float(), original.float(), rtol=tolerance, atol=tolerance):
        raise ValueError(
            f"DeBERTa attention layer {name!r}: this transformers version computes its relative-position bias "
            "differently from the per-row copy trl_userdp uses to give each user its own gradient. Freeze the "
            "relative-position layers (encoder.rel_embeddings, encoder.LayerNorm, and query_proj/key_proj, or "
            "pos_query_proj/pos_key_proj), or use transformers 5.x."
        )
