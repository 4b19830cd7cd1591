"""Per-sample gradient and norm samplers for ``nn.Embedding`` that honour ``padding_idx``, registered over Opacus's.

Autograd never updates an embedding's ``padding_idx`` row (``nn.Embedding``'s backward drops the gradient at those
positions), but Opacus's samplers scatter every position's gradient, that row's included. Hugging Face causal LMs set
``padding_idx = config.pad_token_id``, and the pad token is often a real token too (the EOS that ends every
completion, a token a policy samples): the per-user gradients would then update a row the model keeps fixed, and the
optimizer's self-check stops training. Here the output gradients at the padding positions are zeroed first, as
autograd does, and Opacus's samplers do the rest."""

from __future__ import annotations

from typing import Callable, Dict, List, Set

import torch
from opacus.grad_sample import register_grad_sampler, register_norm_sampler
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from torch import nn


def _honouring_padding(sampler: Callable, what: str) -> Callable:
    """``sampler`` (one of Opacus's embedding samplers) on output gradients whose ``padding_idx`` positions are zeroed,
    as autograd's embedding backward does, and on contiguous token ids.

    Args:
        sampler: Opacus's sampler.
        what: what it returns (for the docstring).

    Returns:
        ``(layer, [token ids], backprops) -> {weight: what}``.
    """
    def sample(layer: nn.Embedding, activations: List[torch.Tensor],
               backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        ids = activations[0].contiguous()  # Opacus's norm sampler views them (BERT's token types come expanded)
        if layer.padding_idx is not None:
            backprops = backprops.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0)
        return sampler(layer, [ids, *activations[1:]], backprops)

    sample.__doc__ = f"Opacus's {what} of ``nn.Embedding``, without the ``padding_idx`` row."
    return sample


#: registered over Opacus's own for ``nn.Embedding``
embedding_grad_sample = register_grad_sampler(nn.Embedding)(
    _honouring_padding(compute_embedding_grad_sample, "per-sample gradients"))
embedding_norm_sample = register_norm_sampler(nn.Embedding)(
    _honouring_padding(compute_embedding_norm_sample, "per-sample gradient norms"))


def _scaled(sampler: Callable) -> Callable:
    """``sampler`` for an embedding whose output is multiplied by its constant ``embed_scale`` buffer (Gemma's
    ``*ScaledWordEmbedding``): the output gradient times the scale, as autograd's chain rule gives."""
    def sample(layer: nn.Embedding, activations: List[torch.Tensor],
               backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        return sampler(layer, activations, backprops * layer.embed_scale.to(backprops.dtype))

    return sample


#: embedding classes registered by :func:`register_scaled_embedding`: their one buffer is a constant of the layer
SCALED_EMBEDDINGS: Set[type] = set()


def is_scaled_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` whose forward multiplies the lookup by a constant scalar buffer
    ``embed_scale`` and nothing else (Gemma, Gemma 2, Gemma 3: ``GemmaTextScaledWordEmbedding`` and kin).

    Args:
        module: A layer.

    Returns:
        True for such a layer.
    """
    scale = getattr(module, "embed_scale", None)
    return (isinstance(module, nn.Embedding) and isinstance(scale, torch.Tensor) and scale.numel() == 1
            and [name for name, _ in module.named_buffers()] == ["embed_scale"])


def register_scaled_embedding(cls: type) -> None:
    """Register per-sample gradient and norm samplers for a scaled embedding class (:func:`is_scaled_embedding`),
    at Opacus's extension point, and record that its buffer does not mix the rows of a batch.

    Args:
        cls: The layer's class.
    """
    if cls not in SCALED_EMBEDDINGS:
        register_grad_sampler(cls)(_scaled(embedding_grad_sample))
        register_norm_sampler(cls)(_scaled(embedding_norm_sample))
        SCALED_EMBEDDINGS.add(cls)


class _LookupRecorder(nn.Embedding):
    """Keeps the ids of its last lookup (:func:`record_lookups`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
        self.looked_up = input
        return super().forward(input)


#: embedding class -> its recording subclass (:func:`record_lookups`), with Opacus's samplers registered
RECORDING_EMBEDDINGS: Dict[type, type] = {}


def computes_own_ids(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` whose own forward turns its arguments into the ids it looks up and
    returns the lookup (OPT's and BART's learned positions compute them from the attention mask and the cache
    length), so that Opacus, which reads a layer's first argument as its ids, would read the wrong ones.

    Args:
        module: A layer.

    Returns:
        True for such a layer (not for a scaled embedding, whose ids are its argument).
    """
    return (isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward
            and not is_scaled_embedding(module) and type(module) not in RECORDING_EMBEDDINGS.values())


def record_lookups(module: nn.Module) -> List[tuple]:
    """Make every trainable layer of ``module`` that :func:`computes_own_ids` keep the ids it looks up: its class
    becomes a subclass whose ``nn.Embedding.forward`` (reached through the layer's own ``super().forward``) stores
    them as ``looked_up``; the hooks hand Opacus's embedding samplers those ids instead of the layer's arguments.

    Args:
        module: The model, changed in place.

    Returns:
        ``(layer, its original class)`` for each layer changed, to undo it.
    """
    changed = []
    for sub in module.modules():
        if computes_own_ids(sub) and sub.weight.requires_grad:
            cls = type(sub)
            if cls not in RECORDING_EMBEDDINGS:
                recording = type(cls.__name__, (cls, _LookupRecorder), {"__module__": cls.__module__})
                register_grad_sampler(recording)(embedding_grad_sample)
                register_norm_sampler(recording)(embedding_norm_sample)
                RECORDING_EMBEDDINGS[cls] = recording
            sub.__class__ = RECORDING_EMBEDDINGS[cls]
            changed.append((sub, cls))
    return changed
