"""The unfused LM head gives TRL's fused head's outputs, at GRPO's temperature too, and each row's outputs do not
depend on the other rows' padding (positions come from the row's own attention mask)."""

import copy
import inspect

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from trl.trainer.utils import add_fused_lm_head

from trl_userdp.trainers import unfuse_lm_head

from ..tiny_models import tiny_llama_lm


def _batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])  # right-padded: TRL's and ours agree
    mask = (ids != 0).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return ids, mask, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_unfused_head_equals_trls_fused_head(temperature):
    fused, ours = tiny_llama_lm(64), tiny_llama_lm(64)
    add_fused_lm_head(fused, temperature=temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ours, temperature=temperature, outputs=("log_probs", "entropy"))
    unfuse_lm_head(ours, temperature=temperature)
    ids, mask, labels = _batch()
    a = fused(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=1e-5)


def test_a_left_padded_rows_outputs_are_its_own_with_absolute_positions():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    plain = copy.deepcopy(model)
    unfuse_lm_head(model)
    row = torch.tensor([[5, 6, 7, 8]])
    padded = torch.tensor([[0, 0, 0, 5, 6, 7, 8]])
    mask = (torch.arange(7) >= 3).long().unsqueeze(0)
    alone = model(input_ids=row, attention_mask=torch.ones_like(row), labels=row, fused_lm_head=True).log_probs
    left = model(input_ids=padded, attention_mask=mask, labels=padded.masked_fill(mask == 0, -100),
                 fused_lm_head=True).log_probs[:, 3:]
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)
    # without positions from the mask the row's outputs would follow the padding in front of it
    shifted = plain(input_ids=padded, attention_mask=mask).logits[:, 3:-1].log_softmax(-1)
    shifted = shifted.gather(-1, padded[:, 4:].unsqueeze(-1)).squeeze(-1)
    assert (shifted - alone).abs().max() > 1e-3


def test_generation_keeps_the_models_signature_and_a_left_padded_rows_positions():
    """``generate`` reads the forward's signature to pass positions from the mask: a left-padded row generates what
    it generates alone (greedy), with learned absolute positions."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=0,
                                       eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    unfuse_lm_head(model)
    assert "position_ids" in inspect.signature(model.forward).parameters
    row, padded = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 0, 0, 5, 6, 7, 8]])
    alone = model.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=6, do_sample=False)
    left = model.generate(padded, attention_mask=(padded != 0).long(), max_new_tokens=6, do_sample=False)
    assert torch.equal(left[:, 3:], alone)
