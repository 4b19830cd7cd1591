"""DeBERTa-v2/v3's relative positions one copy per row (issue 40): the same model the user calls, undone on removal,
and refused by name where a transformers version would compute the bias otherwise."""

import pytest
import torch

from trl_userdp.grad_sample import RowRelativePositions
from trl_userdp.grad_sample import relative_positions

from .test_architectures import ARCHITECTURES, batch, build


@pytest.mark.parametrize("arch", ["DeBERTa-v3", "DeBERTa-v2 (separate position projections, convolution)"])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_the_per_row_model_computes_what_the_model_computes_and_is_undone(arch, tuning):
    model = build(arch, "reward", tuning, torch.float32)
    ids, mask, _ = batch("left", ARCHITECTURES[arch][1]["pad_token_id"])
    classes = [type(m) for m in model.modules()]
    expected = model(input_ids=ids, attention_mask=mask).logits
    adapter = RowRelativePositions(model)
    assert len(adapter.swapped) == 1 + 2  # the encoder and both layers' attention
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, rtol=1e-5, atol=1e-6)
    adapter.remove()
    assert [type(m) for m in model.modules()] == classes


def test_a_version_that_computes_the_bias_otherwise_is_refused_by_name(monkeypatch):
    original = relative_positions.DisentangledSelfAttention.disentangled_attention_bias
    monkeypatch.setattr(relative_positions.DisentangledSelfAttention, "disentangled_attention_bias",
                        lambda *args: 2 * original(*args))
    model = build("DeBERTa-v3", "reward", "full", torch.float32)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="DeBERTa attention layer 'deberta.encoder.layer.0.attention.self'"):
        RowRelativePositions(model)
    assert [type(m) for m in model.modules()] == classes  # left as it was


def test_models_without_relative_positions_are_left_alone():
    assert RowRelativePositions(build("BERT", "reward", "full", torch.float32)).swapped == []
