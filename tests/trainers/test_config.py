"""Unsafe settings are rejected before training, or overridden with a warning where the safe value is
unambiguous (issue 6, docs/stack_findings.md)."""

import copy
import logging

import pytest
from datasets import Dataset

from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from .scripts import COMMON, dpo_script, reward_script


def _cfg(cls, **kw):
    return cls(output_dir="unused", **{**COMMON, **kw})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(privacy_mechanism="laplace"), "privacy_mechanism must be one of"),
        (dict(target_epsilon=0.0), "target_epsilon"),
        (dict(target_delta=1.0), "target_delta"),
        (dict(max_samples_per_user=0), "max_samples_per_user"),
        (dict(privacy_mechanism="aup"), "concentration_radius"),
        (dict(accountant="gdp"), "accountant must be one of"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(privacy_mechanism="group", group_accounting="els", accountant="rdp"), "'els' needs accountant='pld'"),
        (dict(privacy_mechanism="group", group_accounting="exact"), "group_accounting must be one of"),
    ],
)
def test_bad_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cfg(UserDPRewardConfig, **kwargs)


def test_padding_free_and_batch_coupled_dpo_losses_are_refused(tmp_path):
    with pytest.raises(ValueError, match="padding_free"):
        _cfg(UserDPDPOConfig, padding_free=True)
    for loss in (["aot"], ["aot_unpaired"], ["sigmoid", "sft"]):
        with pytest.raises(ValueError, match="couples the pairs"):
            dpo_script(UserDPDPOTrainer, UserDPDPOConfig, str(tmp_path), loss_type=loss,
                       loss_weights=[1.0] * len(loss))


def test_unsafe_defaults_are_overridden_with_a_note_and_unsafe_choices_with_a_warning(caplog):
    """TRL's defaults (max_grad_norm=1.0, gradient checkpointing on) are overridden with an INFO note: the user did not
    set them (issue 44, item 6); a value the user chose is overridden with a warning."""
    with caplog.at_level(logging.INFO, logger="trl_userdp"):
        cfg = _cfg(UserDPRewardConfig, max_grad_norm=1.0, gradient_checkpointing=True)
    assert cfg.max_grad_norm == 0.0 and cfg.gradient_checkpointing is False
    assert "max_grad_norm" in caplog.text and "gradient_checkpointing" in caplog.text
    assert {r.levelno for r in caplog.records if "max_grad_norm" in r.getMessage()} == {logging.INFO}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_userdp"):
        chosen = _cfg(UserDPRewardConfig, max_grad_norm=0.5)
    assert chosen.max_grad_norm == 0.0
    assert [r.levelno for r in caplog.records if "max_grad_norm=0.5" in r.getMessage()] == [logging.WARNING]
    kept = _cfg(UserDPRewardConfig, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert kept.gradient_checkpointing  # reentrant checkpointing keeps per-sample gradients
    plain = _cfg(UserDPRewardConfig, privacy_mechanism="none", max_grad_norm=1.0)
    assert plain.max_grad_norm == 1.0  # no privacy, no override


def test_a_dataset_without_the_user_column_fails_at_construction(tmp_path):
    no_users = Dataset.from_dict({"prompt": ["p"] * 4, "chosen": [" good"] * 4, "rejected": [" bad"] * 4})
    with pytest.raises(ValueError, match="no user column 'user_id'"):
        reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), dataset=no_users)


def test_the_trainer_needs_its_own_config(tmp_path):
    from trl import RewardConfig

    with pytest.raises(ValueError, match="UserDPRewardConfig"):
        reward_script(UserDPRewardTrainer, RewardConfig, str(tmp_path))


def test_privacy_fields_changed_after_the_config_was_built_are_checked_again(tmp_path):
    from ..tiny_models import text_preference_dataset, tiny_tokenizer
    from .scripts import tiny_reward_model

    tokenizer = tiny_tokenizer()
    args = _cfg(UserDPRewardConfig)
    args.target_delta = 1.0  # after __post_init__'s checks
    with pytest.raises(ValueError, match="target_delta must lie in"):
        UserDPRewardTrainer(model=tiny_reward_model(tokenizer), args=args, train_dataset=text_preference_dataset(),
                            processing_class=tokenizer)


def test_a_mixture_of_experts_router_loss_is_refused_under_dp(tmp_path):
    """The router's load-balancing loss is a statistic of the whole batch: it couples users."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from ..tiny_models import text_preference_dataset, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           num_local_experts=2, num_experts_per_tok=1, pad_token_id=0))
    args = _cfg(UserDPDPOConfig)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
        UserDPDPOTrainer(model=moe, ref_model=copy.deepcopy(moe), args=args, train_dataset=text_preference_dataset(),
                         processing_class=tokenizer)


@pytest.mark.parametrize("kind", ["reward", "dpo"])
def test_dropout_is_turned_off_under_dp_and_refused_when_kept(tmp_path, kind):
    """Issue 39, finding 2, for every trainer: ``disable_dropout=True`` (the default) also turns off what TRL's switch
    misses (a Llama's attention dropout rate, read by its attention function), and ``disable_dropout=False`` with
    dropout in the model is refused before training."""
    from trl_userdp.grad_sample.checks import active_dropout

    from ..tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer
    from .scripts import tiny_reward_model

    def build(**config):
        tokenizer = tiny_tokenizer()
        model = tiny_reward_model(tokenizer) if kind == "reward" else tiny_llama_lm(len(tokenizer))
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.1
        trainer_cls, config_cls = ((UserDPRewardTrainer, UserDPRewardConfig) if kind == "reward"
                                   else (UserDPDPOTrainer, UserDPDPOConfig))
        extra = {} if kind == "reward" else {"ref_model": copy.deepcopy(model)}
        return trainer_cls(model=model, args=config_cls(output_dir=str(tmp_path), max_steps=1, **{**COMMON, **config}),
                           train_dataset=text_preference_dataset(), processing_class=tokenizer, **extra)

    assert not active_dropout(build().model)
    with pytest.raises(ValueError, match="disable_dropout=False with dropout in the model"):
        build(disable_dropout=False)
