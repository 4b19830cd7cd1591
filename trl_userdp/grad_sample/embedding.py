"""Per-sample gradient and norm samplers for ``nn.Embedding`` that honour ``padding_idx``, registered over Opacus's.

Autograd never updates an embedding's ``padding_idx`` row (``nn.Embedding``'s backward drops the gradient at those
positions), but Opacus's samplers scatter every position's gradient, that row's included. Hugging Face causal LMs set
``padding_idx = config.pad_token_id``, and the pad token is often a real token too (the EOS that ends every
completion, a token a policy samples): the per-user gradients would then update a row the model keeps fixed, and the
optimizer's self-check stops training. Here the output gradients at the padding positions are zeroed first, as
autograd does, and Opacus's samplers do the rest."""

from __future__ import annotations

from typing import Dict, List

import torch
from opacus.grad_sample import register_grad_sampler, register_norm_sampler
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from torch import nn


def _without_padding(layer: nn.Embedding, activations: List[torch.Tensor], backprops: torch.Tensor) -> torch.Tensor:
    """``backprops`` with the positions of ``padding_idx`` tokens zeroed (unchanged without a ``padding_idx``)."""
    if layer.padding_idx is None:
        return backprops
    return backprops.masked_fill((activations[0] == layer.padding_idx).unsqueeze(-1), 0)


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(layer: nn.Embedding, activations: List[torch.Tensor],
                          backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus's per-sample embedding gradients, with nothing for the ``padding_idx`` row.

    Args:
        layer: The layer.
        activations: Its inputs, ``[token ids]``.
        backprops: The gradients of its output.

    Returns:
        ``{weight: per-sample gradients}`` as Opacus's, the ``padding_idx`` row zero.
    """
    return compute_embedding_grad_sample(layer, activations, _without_padding(layer, activations, backprops))


@register_norm_sampler(nn.Embedding)
def embedding_norm_sample(layer: nn.Embedding, activations: List[torch.Tensor],
                          backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus's per-sample embedding gradient norms, without the ``padding_idx`` row.

    Args:
        layer: The layer.
        activations: Its inputs, ``[token ids]``.
        backprops: The gradients of its output.

    Returns:
        ``{weight: per-sample gradient norms}`` as Opacus's.
    """
    return compute_embedding_norm_sample(layer, activations, _without_padding(layer, activations, backprops))
