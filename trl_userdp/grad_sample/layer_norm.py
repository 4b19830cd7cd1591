"""Opacus's per-sample gradients of ``nn.LayerNorm``, for layers without a bias too (``bias=False``, as in
ModernBERT), registered over Opacus's, which reads ``layer.bias.requires_grad`` unconditionally."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

import torch
from opacus.grad_sample import register_grad_sampler
from opacus.grad_sample.layer_norm import compute_layer_norm_grad_sample
from torch import nn

#: stands for a missing bias in Opacus's sampler: a tensor that needs no gradient
_NO_BIAS = torch.empty(0)


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(layer: nn.LayerNorm, activations: List[torch.Tensor],
                           backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus's per-sample gradients of a LayerNorm, with or without a bias.

    Args:
        layer: The layer.
        activations: Its inputs.
        backprops: The gradients of its output.

    Returns:
        ``{parameter: per-sample gradients}`` for its trainable parameters.
    """
    if layer.bias is not None:
        return compute_layer_norm_grad_sample(layer, activations, backprops)
    view = SimpleNamespace(weight=layer.weight, bias=_NO_BIAS, normalized_shape=layer.normalized_shape, eps=layer.eps)
    return compute_layer_norm_grad_sample(view, activations, backprops)
