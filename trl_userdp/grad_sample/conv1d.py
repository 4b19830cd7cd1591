"""Per-sample gradient and norm samplers for GPT-2's ``Conv1D`` (``y = x W + b`` with ``W`` of shape [in, out]),
registered in Opacus's registries, which have none for it (without them Opacus falls back to functorch and ghost
clipping to materialised gradients)."""

from __future__ import annotations

from typing import Dict, List

import torch
from opacus.grad_sample import register_grad_sampler, register_norm_sampler
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn
from transformers.pytorch_utils import Conv1D


@register_grad_sampler(Conv1D)
def compute_conv1d_grad_sample(layer: Conv1D, activations: List[torch.Tensor],
                               backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a ``Conv1D``.

    Args:
        layer: The layer.
        activations: Its inputs, ``[activations]`` with ``a`` of shape ``[n, ..., in]``.
        backprops: The gradients of its output, ``[n, ..., out]``.

    Returns:
        ``{weight: Σ_t a_t g_tᵀ}`` ([n, in, out], the transpose of ``nn.Linear``'s) and ``{bias: Σ_t g_t}``
        ([n, out]), for the trainable parameters.
    """
    a = activations[0].to(backprops.dtype)
    ret = {}
    if layer.weight.requires_grad:
        ret[layer.weight] = torch.einsum("n...i,n...j->nij", a, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = torch.einsum("n...k->nk", backprops)
    return ret


@register_norm_sampler(Conv1D)
def compute_conv1d_norm_sample(layer: Conv1D, activations: List[torch.Tensor],
                               backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms of a ``Conv1D``: those of ``nn.Linear`` (a norm does not see the transpose).

    Args:
        layer: The layer.
        activations: Its inputs, ``[activations]`` with ``a`` of shape ``[n, ..., in]``.
        backprops: The gradients of its output, ``[n, ..., out]``.

    Returns:
        ``{param: [n] norms}``, keyed by this layer's parameters.
    """
    return compute_linear_norm_sample(layer, activations, backprops)
