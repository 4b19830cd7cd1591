"""Per-sample gradients of Hugging Face's RMSNorm layers, registered at Opacus's extension point.

Opacus has no grad sampler for them, so it falls back to functorch: every step re-runs each norm layer's forward and
backward pass per sample under ``vmap``. On a full fine-tuning of SmolLM-135M (61 norm layers) that route made the
median private step 0.4 s (3%) slower on the CPU (docs/benchmarks.md, "Cost of a step at a realistic size"). The
gradient of the scale ``w`` of ``y = w ⊙ x̂`` (``x̂ = x / √(mean(x²) + ε)`` per position: RMSNorm, Zhang & Sennrich
2019) is ``Σ_t g_t ⊙ x̂_t`` over a sample's positions ``t``, for output gradients ``g_t``: one product and one sum a
sample.

A layer class is registered only when its ``forward`` (and ``_norm``) is, apart from comments and layout, one of the
bodies in :data:`FORMS`: the formula, and the dtype each product is taken in, are then those the sampler computes.
Any other norm class keeps Opacus's functorch route, which is exact for any layer.
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from typing import Callable, Dict, List, Optional

import torch
from opacus.grad_sample import register_grad_sampler
from torch import nn


def _body(function: Callable) -> str:
    """A method's body without its ``def`` line, comments or layout (the text :data:`FORMS` holds)."""
    lines = textwrap.dedent(inspect.getsource(function)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":")) + 1  # after the signature
    code = (re.sub(r"#.*", "", line) for line in lines[start:])
    return " ".join(" ".join(code).split())


#: form name -> the bodies of ``forward`` and of ``_norm`` (``""``: none) of the layers it covers, as :func:`_body`
#: writes them. "llama": the scale multiplies the normalised input cast back to the input's dtype (Llama, Qwen2,
#: Qwen3, Mistral, Phi-3, Mixtral, Granite and 130-odd more in transformers 5); "fp32": the product is taken in fp32
#: and cast after (OLMo 2, Helium); "gemma": the normalised input in fp32 times ``1 + w`` (Gemma 1 to 3, Qwen3.5)
FORMS: Dict[str, List[tuple]] = {
    "llama": [("input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
               "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
               "self.variance_epsilon) return self.weight * hidden_states.to(input_dtype)", "")],
    "fp32": [("input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
              "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
              f"self.variance_epsilon) return ({weight} * hidden_states).to(input_dtype)", "")
             for weight in ("self.weight", "self.weight.to(torch.float32)")],
    "gemma": [("output = self._norm(x.float()) output = output * (1.0 + self.weight.float()) return output.type_as(x)",
               "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)")],
}


@functools.lru_cache(maxsize=None)
def _form_of_class(cls: type) -> Optional[str]:
    if any(inspect.unwrap(f) is not f for f in (cls.forward, getattr(cls, "_norm", None)) if f is not None):
        return None  # a decorated method: the source read is the wrapped one's, not what runs
    try:
        forward = _body(cls.forward)
        norm = _body(cls._norm) if hasattr(cls, "_norm") else ""
    except (OSError, TypeError):  # no source (built at run time)
        return None
    return next((name for name, bodies in FORMS.items() if (forward, norm) in bodies), None)


def rms_norm_form(module: nn.Module) -> Optional[str]:
    """The name of the :data:`FORMS` entry that ``module``'s class computes, or None.

    Args:
        module: A layer.

    Returns:
        ``"llama"``, ``"fp32"`` or ``"gemma"`` for a layer of such a class whose one parameter is a vector ``weight``
        and which holds no buffer; None otherwise.
    """
    weight = getattr(module, "weight", None)
    if (not isinstance(weight, nn.Parameter) or weight.dim() != 1
            or [n for n, _ in module.named_parameters()] != ["weight"] or any(True for _ in module.buffers())):
        return None
    return _form_of_class(type(module))


def _grad_sample(form: str, layer: nn.Module, activations: List[torch.Tensor],
                 backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of a norm layer's scale: ``Σ_t g_t ⊙ x̂_t`` over each sample's positions, with ``x̂``
    computed as the layer's forward computes it and the product in the dtype autograd's takes it in."""
    x = activations[0]
    wide = x.to(torch.float32)
    eps = layer.eps if form == "gemma" else layer.variance_epsilon
    normalised = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    if form == "llama":  # w * x̂.to(input dtype): the product in the promoted dtype of w and x
        product = backprops * normalised.to(x.dtype)
    else:  # the product in fp32 (x̂ is fp32): the output gradient is cast up first
        product = backprops.to(torch.float32) * normalised
    grad = product.reshape(product.shape[0], -1, product.shape[-1]).sum(1)
    return {layer.weight: grad.to(layer.weight.dtype)}


#: norm classes registered by :func:`register_rms_norm`
RMS_NORMS: Dict[type, str] = {}


def register_rms_norm(cls: type, form: str) -> None:
    """Register the per-sample gradient sampler of a norm class that computes ``form`` (:func:`rms_norm_form`).

    Args:
        cls: The layer's class.
        form: Its :data:`FORMS` entry.
    """
    if cls not in RMS_NORMS:
        register_grad_sampler(cls)(functools.partial(_grad_sample, form))
        RMS_NORMS[cls] = form
