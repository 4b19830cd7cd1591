"""The black-box audit of a reward model: canary users whose pairs only they hold. A model trained without privacy
gives them away (ε_lower ≥ 1); a private one stays below its claim."""

import math

import numpy as np
import pytest

from trl_userdp import UserDPRewardConfig, UserDPRewardTrainer
from trl_userdp.audit import PreferenceCanaries

from ..tiny_models import text_preference_dataset, tiny_tokenizer
from ..trainers.scripts import COMMON, tiny_reward_model


def _audit(mechanism, tmp_path, steps=150, **privacy):
    tokenizer = tiny_tokenizer()
    canaries = PreferenceCanaries.make(tokenizer, 60, tokens=1, pairs_per_user=4, seed=0)  # 120 of its 134 whole tokens
    data = canaries.add_to(text_preference_dataset(n_users=20, pairs_per_user=3))
    args = UserDPRewardConfig(output_dir=str(tmp_path / mechanism), max_steps=steps, privacy_mechanism=mechanism,
                              max_samples_per_user=4, **{**COMMON, "learning_rate": 3e-2,
                                                         "per_device_train_batch_size": 16, "logging_steps": 50},
                              **privacy)
    trainer = UserDPRewardTrainer(model=tiny_reward_model(tokenizer), args=args, train_dataset=data,
                                  processing_class=tokenizer)
    trainer.train()
    return canaries.audit(trainer.model, tokenizer, delta=1e-5, epsilon_claimed=trainer.privacy_report().epsilon)


def test_a_reward_model_without_privacy_gives_its_canary_users_away(tmp_path):
    report = _audit("none", tmp_path)
    assert math.isinf(report.epsilon_claimed) and report.epsilon_lower >= 1.0, report.summary()
    assert np.mean(report.scores_in) > np.mean(report.scores_out)


def test_a_private_reward_model_audits_below_its_claim(tmp_path):
    report = _audit("user_dpsgd", tmp_path, steps=50, target_epsilon=2.0, target_delta=1e-5, users_per_batch=32.0,
                    accountant="rdp")
    assert report.epsilon_claimed == pytest.approx(2.0, rel=1e-2) and report.consistent, report.summary()


def test_canary_users_join_a_dataset_with_ids_of_its_type_and_strings_of_their_own():
    tokenizer = tiny_tokenizer()
    canaries = PreferenceCanaries.make(tokenizer, 20, tokens=2, pairs_per_user=3, seed=1)
    assert len(set(canaries.chosen + canaries.rejected)) == 40  # every canary string its own
    strings = canaries.add_to(text_preference_dataset(n_users=4, pairs_per_user=2))
    members = np.flatnonzero(canaries.draw.included)
    assert len(strings) == 8 + 3 * len(members) and strings[-1]["user_id"] == f"canary-{members[-1]}"
    integers = text_preference_dataset(n_users=4, pairs_per_user=2)
    integers = integers.map(lambda row: {"user_id": int(row["user_id"][4:])})
    joined = canaries.add_to(integers)
    assert joined[-1]["user_id"] == 4 + members[-1] and joined.features["user_id"].dtype == "int64"
    clash = text_preference_dataset(n_users=2).map(lambda row: {"user_id": "canary-" + row["user_id"]})
    with pytest.raises(ValueError, match="canaries' prefix"):
        canaries.add_to(clash)


@pytest.mark.parametrize("mechanism,privacy", [("none", {}), ("user_dpsgd", dict(
    target_epsilon=2.0, target_delta=1e-5, users_per_batch=32.0, accountant="rdp"))])
def test_a_dpo_policy_is_audited_by_its_implicit_reward_margin(mechanism, privacy, tmp_path):
    """DPO without privacy gives its canary users away (ε_lower ≥ 1 from the log-ratio margins against the reference);
    with user-wise DP-SGD at ε = 2 the audit stays below the claim."""
    import copy

    from trl_userdp import UserDPDPOConfig, UserDPDPOTrainer

    from ..tiny_models import tiny_llama_lm

    tokenizer = tiny_tokenizer()
    canaries = PreferenceCanaries.make(tokenizer, 60, tokens=1, pairs_per_user=4, prompt="review:", seed=0)
    policy = tiny_llama_lm(len(tokenizer))
    reference = copy.deepcopy(policy)
    args = UserDPDPOConfig(output_dir=str(tmp_path), max_steps=100 if mechanism == "none" else 30,
                           privacy_mechanism=mechanism, max_samples_per_user=4,
                           **{**COMMON, "learning_rate": 1e-2, "per_device_train_batch_size": 16, "logging_steps": 50},
                           **privacy)
    trainer = UserDPDPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                               train_dataset=canaries.add_to(text_preference_dataset(n_users=20, pairs_per_user=3)))
    trainer.train()
    report = canaries.audit(trainer.model, tokenizer, reference=reference, delta=1e-5,
                            epsilon_claimed=trainer.privacy_report().epsilon)
    assert "implicit reward margin" in report.auditor
    if mechanism == "none":
        assert report.epsilon_lower >= 1.0, report.summary()
    else:
        assert report.epsilon_claimed == pytest.approx(2.0, rel=1e-2) and report.consistent, report.summary()
