"""Model checks that run before training: settings under which per-sample gradients would be
missing or wrong must fail here, with the fix in the message (docs/stack_findings.md)."""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from opacus.validators import ModuleValidator
from opacus.validators.errors import UnsupportedModuleError
from torch import nn
from torch.utils.hooks import RemovableHandle

#: Names of learned absolute position embeddings in Hugging Face models (GPT-2, BERT, OPT, ...).
POSITION_EMBEDDING_NAMES = ("wpe", "position_embeddings", "embed_positions")


def check_module(module: nn.Module) -> None:
    """Reject modules Opacus cannot compute per-sample gradients for, and non-reentrant
    gradient checkpointing (it silently loses most per-sample gradients)."""
    if not module.training:
        raise ValueError("The model is in eval mode (as from_pretrained leaves it): call model.train() first; "
                         "per-sample gradients are only captured in training mode.")
    try:
        ModuleValidator.validate(module, strict=True)
    except UnsupportedModuleError as err:
        raise ValueError(
            f"The model has layers Opacus cannot compute per-sample gradients for: {err}. "
            "Fix: `model = opacus.validators.ModuleValidator.fix(model)` (e.g. BatchNorm -> GroupNorm) "
            "before creating the optimizer."
        ) from None
    for name, sub in module.named_modules():
        if getattr(sub, "gradient_checkpointing", False) is True:
            func = getattr(sub, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant") is not True:
                raise ValueError(
                    f"Gradient checkpointing is on (module {name or type(sub).__name__!r}) in non-reentrant mode, "
                    "which loses per-sample gradients. Fix: `model.gradient_checkpointing_disable()` (TRL: "
                    "gradient_checkpointing=False), or enable it with "
                    "gradient_checkpointing_kwargs={'use_reentrant': True}."
                )


def _has_trainable_learned_positions(module: nn.Module) -> bool:
    return any(
        isinstance(sub, nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_EMBEDDING_NAMES and sub.weight.requires_grad
        for name, sub in module.named_modules()
    )


def supply_position_ids(module: nn.Module) -> Optional[RemovableHandle]:
    """If ``module`` has a trainable learned position embedding (GPT-2's ``wpe``, BERT's
    ``position_embeddings``), pass ``position_ids = arange(T)`` repeated per row on every call that
    does not give them. These are the positions Hugging Face uses by default, but as a (1, T)
    tensor, which Opacus cannot split per row. Returns the hook handle, or None if not needed."""
    if not _has_trainable_learned_positions(module):
        return None
    params = inspect.signature(module.forward).parameters
    if "position_ids" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None  # cannot pass them; the hooks' row-count check raises if the gradient would be wrong

    def add_position_ids(mod, args, kwargs):
        if kwargs.get("position_ids") is not None:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return None
        batch, length = ids.shape
        kwargs["position_ids"] = torch.arange(length, device=ids.device).repeat(batch, 1)
        return args, kwargs

    return module.register_forward_pre_hook(add_position_ids, with_kwargs=True)
