"""Checks of per-sample gradients: of the model before training (settings under which they would be missing or
wrong must fail here, with the fix in the message; docs/stack_findings.md), and of the first step's per-user
gradients against autograd's (:func:`check_unit_sums`)."""

from __future__ import annotations

import math
import re
from typing import Callable, List, Sequence

import torch
from opacus.validators import ModuleValidator
from opacus.validators.errors import UnsupportedModuleError
from torch import nn

#: float attributes Hugging Face attention layers pass as ``dropout=`` to their attention function in training mode
DROPOUT_RATE_ATTRIBUTES = ("attention_dropout", "attn_dropout", "attn_drop", "dropout", "dropout_p", "dropout_prob")


def _dropout_config_fields(module: nn.Module) -> List[str]:
    config = getattr(module, "config", None)
    fields = vars(config) if config is not None and hasattr(config, "__dict__") else {}
    return [name for name, value in fields.items() if ("dropout" in name or "pdrop" in name)
            and isinstance(value, float) and value > 0]


def active_dropout(module: nn.Module) -> List[str]:
    """Where a model draws dropout masks in training mode: dropout layers with ``p > 0``, attention layers whose
    dropout rate (:data:`DROPOUT_RATE_ATTRIBUTES`) is above 0, and the model config's dropout fields above 0.

    Dropout draws one mask for the whole batch from torch's global stream (which the public ``seed`` sets), so one
    user's rows move every other user's mask: under user-level DP it must be off (docs/privacy_model.md, "The run's
    randomness").

    Args:
        module: The model.

    Returns:
        The names found (``"transformer.h.0.attn.attn_dropout (p=0.1)"``, ``"config.resid_pdrop=0.1"``); empty if none.
    """
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            found.append(f"{name or 'model'} (p={sub.p:g})")
        for attribute in DROPOUT_RATE_ATTRIBUTES:
            rate = vars(sub).get(attribute)
            if isinstance(rate, float) and rate > 0:
                found.append(f"{name or 'model'}.{attribute}={rate:g}")
        found += [f"{name + '.' if name else ''}config.{field}" for field in _dropout_config_fields(sub)]
    return list(dict.fromkeys(found))


def disable_dropout(module: nn.Module) -> None:
    """Turn every dropout :func:`active_dropout` finds off: TRL's ``disable_dropout_in_model`` (dropout layers) plus the
    attention layers' rates and the config's fields (read by some models in their forward pass).

    Args:
        module: The model, changed in place.
    """
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for attribute in DROPOUT_RATE_ATTRIBUTES:
            if isinstance(vars(sub).get(attribute), float):
                setattr(sub, attribute, 0.0)
        for field in _dropout_config_fields(sub):
            setattr(sub.config, field, 0.0)


#: class names of mixture-of-experts blocks in transformers (Mixtral, Qwen-MoE, OLMoE: ``*SparseMoeBlock``; DeepSeek,
#: Granite: ``*MoE``/``*Moe``) and of their parts (``*Experts``, ``*Router``)
MIXTURE_OF_EXPERTS = re.compile(r"Experts$|Sparse(Moe|MoE)Block$|(Moe|MoE|MoELayer)$|Router$")


def check_module(module: nn.Module) -> None:
    """Reject a model whose per-sample gradients would be missing or wrong.

    Args:
        module: The model to train.

    Raises:
        ValueError: If the model is in eval mode, has layers Opacus cannot compute per-sample gradients for,
            trains a mixture-of-experts block, or uses non-reentrant gradient checkpointing (it silently loses most
            per-sample gradients).
    """
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
        if MIXTURE_OF_EXPERTS.search(type(sub).__name__) and any(p.requires_grad for p in sub.parameters()):
            raise ValueError(
                f"{name!r} ({type(sub).__name__}) is a mixture-of-experts block with trainable weights: it regroups the "
                "batch's tokens by expert, so its layers never see one row per user and no user's gradient can be "
                "separated there. Freeze it (`requires_grad_(False)` on its parameters; with LoRA, target the "
                "attention projections only) and train the rest, which stays exact."
            )
        if getattr(sub, "gradient_checkpointing", False) is True:
            func = getattr(sub, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant") is not True:
                raise ValueError(
                    f"Gradient checkpointing is on (module {name or type(sub).__name__!r}) in non-reentrant mode, "
                    "which loses per-sample gradients. Fix: `model.gradient_checkpointing_disable()` (TRL: "
                    "gradient_checkpointing=False), or enable it with "
                    "gradient_checkpointing_kwargs={'use_reentrant': True}."
                )


def check_unit_sums(params: Sequence[nn.Parameter], name_of: Callable[[nn.Parameter], str]) -> bool:
    """The self-check of a step's per-user gradients, before their clipping.

    Refuse to train if the per-row gradients the hooks summed per unit do not add up to autograd's gradient:
    ``p.grad = Σ_k (1/R_k) Σ_{r ∈ k} g_r`` over the step's micro-batches k (the hooks keep that weighted sum while
    the check is pending; one micro-batch: ``Σ_u S_u / R``).

    Float error is relative to the size of what was summed, so each parameter's tolerance is
    ``rtol · max(‖p.grad‖, Σ_r ‖row gradient‖ / R, ‖whole gradient‖ · √(numel_p / numel))`` with ``rtol`` set
    by the dtype's precision: the second term covers cancelling rows (a reward head's bias gets +g from the
    chosen row and −g from the rejected one), the third parameters whose true gradient is zero (BERT's key
    bias: softmax ignores it), whose computed gradient is float noise of the layer's scale. Returns False, deferring
    the check to a later step, when autograd's gradient is not finite although every user's is (a sum that
    overflowed): there is nothing to compare to.

    Args:
        params: the optimizer's parameters, after the step's backward passes (``p.grad`` and the hooks' sums).
        name_of: a parameter's name, for the message.

    Returns:
        True when checked, False when deferred.

    Raises:
        ValueError: the sums differ from autograd's gradient beyond the tolerance.
    """
    checked = [(p, getattr(p, "_check_sum", None)) for p in params if p.grad is not None]
    whole = math.sqrt(sum(float(torch.linalg.vector_norm(p.grad.float())) ** 2 for p, _ in checked))
    if not math.isfinite(whole):  # autograd's sum overflowed (huge but finite users): nothing to compare to
        return False
    numel = sum(p.numel() for p, _ in checked)
    for p, s in checked:
        expected = p.grad.reshape(p.shape).float()
        s = torch.zeros_like(expected) if s is None else s.float()
        err = float(torch.linalg.vector_norm(s - expected))
        # the precision the row gradients were computed in (bf16 under autocast, whatever the parameter's)
        rtol = max(1e-3, 16 * torch.finfo(p.dtype).eps, 16 * torch.finfo(getattr(p, "_row_dtype", p.dtype)).eps)
        scale = max(float(torch.linalg.vector_norm(expected)), getattr(p, "_row_norm_sum", 0.0),
                    whole * math.sqrt(p.numel() / numel))
        if not err <= rtol * scale + 1e-12:
            raise ValueError(
                f"Self-check failed for {name_of(p)!r}: the per-user gradients add up to a different "
                f"gradient than autograd's (relative error {err / max(scale, 1e-30):.2e}, tolerance {rtol:.1e} for "
                f"{p.dtype}). Training would be wrong, so it stops here. Common causes: a forward that uses a "
                "weight outside its module (fused or functional heads on tied embeddings, e.g. TRL's fused LM "
                "head); non-reentrant gradient checkpointing; several backward passes per batch; a layer that "
                "mixes the rows of a batch; non-finite values (NaN data) that reach several users' rows."
            )
    return True
