"""The RMSNorm grad samplers: each form's per-sample gradients equal autograd's per sample, in fp32 and bf16; the
classes of the common architectures are registered (no functorch route); any other forward is not."""

import functools

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from trl_userdp.grad_sample import UserGradSampleHooks
from trl_userdp.grad_sample.rms_norm import RMS_NORMS, register_rms_norm, rms_norm_form

CLASSES = {LlamaRMSNorm: "llama", Olmo2RMSNorm: "fp32", HeliumRMSNorm: "fp32", GemmaRMSNorm: "gemma"}


def _per_sample_autograd(layer, x, g):
    """Each sample's gradient of the scale, by autograd on that sample alone."""
    return torch.stack([torch.autograd.grad((layer(x[i:i + 1]) * g[i:i + 1]).sum(), layer.weight)[0]
                        for i in range(x.shape[0])])


@pytest.mark.parametrize("cls", list(CLASSES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_form_gives_autograds_per_sample_gradient(cls, dtype):
    torch.manual_seed(0)
    layer = cls(16).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
    assert rms_norm_form(layer) == CLASSES[cls]
    register_rms_norm(cls, CLASSES[cls])
    x = (torch.randn(3, 5, 16) * 3).to(dtype)
    g = torch.randn(3, 5, 16).to(layer(x).dtype)
    got = GradSampleModule.GRAD_SAMPLERS[cls](layer, [x], g)[layer.weight]
    want = _per_sample_autograd(layer, x, g)
    assert got.dtype == want.dtype == layer.weight.dtype
    # the operations autograd runs, in its dtypes and order: equal to the bit (in bf16 a product taken in fp32, or
    # an x̂ left in fp32, is not)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_norms_of_a_llama_take_the_sampler_not_functorch():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    hooks = UserGradSampleHooks(model)
    try:
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        assert len(norms) == 5 and RMS_NORMS[LlamaRMSNorm] == "llama"
        assert not any(hasattr(m, "ft_compute_sample_grad") for m in norms)  # Opacus's functorch route
    finally:
        hooks.remove_hooks()


def test_a_norm_whose_forward_differs_is_not_registered():
    class Shifted(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1.0

    class Buffered(LlamaRMSNorm):  # the same forward, but a buffer the formula does not know
        def __init__(self, size):
            super().__init__(size)
            self.register_buffer("scale", torch.ones(()))

    class Wrapped(LlamaRMSNorm):  # the same source, read through a decorator that changes what runs
        @functools.wraps(LlamaRMSNorm.forward)
        def forward(self, hidden_states):
            return LlamaRMSNorm.forward(self, hidden_states * 2)

    assert rms_norm_form(Shifted(8)) is None
    assert rms_norm_form(Buffered(8)) is None
    assert rms_norm_form(Wrapped(8)) is None
    model = torch.nn.Sequential(Shifted(8))
    hooks = UserGradSampleHooks(model)
    try:
        assert Shifted not in RMS_NORMS and hasattr(model[0], "ft_compute_sample_grad")
    finally:
        hooks.remove_hooks()
