"""Online RL on a private reward model is post-processing: it needs the reward model's privacy report,
never sees preference labels, and carries the report to the policy (issue 6)."""

import math

import pytest
from datasets import Dataset
from trl import GRPOConfig, RLOOConfig

from trl_userdp import PrivacyReport
from trl_userdp.trainers import PublicPromptGRPOTrainer, UserDPRewardConfig, UserDPRewardTrainer, PublicPromptRLOOTrainer

from ..tiny_models import tiny_llama_lm, tiny_tokenizer
from .scripts import reward_script

PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "i loved the", "the plot"] * 2})
ONLINE = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=6, max_steps=2, learning_rate=1e-3,
              use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, beta=0.0,
              gradient_checkpointing=False, logging_steps=1)


@pytest.fixture(scope="module")
def private_reward(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(out), steps=2, accountant="rdp")
    return trainer.model, str(out)


@pytest.mark.parametrize("trainer_cls,config_cls", [(PublicPromptGRPOTrainer, GRPOConfig), (PublicPromptRLOOTrainer, RLOOConfig)])
def test_online_rl_runs_on_a_private_reward_model_and_carries_its_report(tmp_path, private_reward, trainer_cls, config_cls):
    reward_model, reward_dir = private_reward
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer))
    trainer = trainer_cls(model=policy, reward_funcs=reward_model, args=config_cls(output_dir=str(tmp_path), **ONLINE),
                          train_dataset=PROMPTS, processing_class=tokenizer, reward_processing_classes=tokenizer)
    trainer.train()
    trainer.save_model()
    carried = PrivacyReport.load(str(tmp_path))
    original = PrivacyReport.load(reward_dir)
    assert carried.mechanism == "post-processing" and carried.epsilon == pytest.approx(original.epsilon)
    assert carried.extra["reward_model_reports"][0]["mechanism"] == "user_dpsgd"
    assert trainer.state.global_step == 2
    card = (tmp_path / "README.md").read_text()
    assert f"(ε = {carried.epsilon:.4g}, δ = {carried.delta:g})" in card and "post-processing of their guarantee" in card
    logged = [h for h in trainer.state.log_history if "loss" in h or "train_loss" in h]
    assert logged and all(h["epsilon"] == pytest.approx(original.epsilon) and h["delta"] == original.delta for h in logged)


def test_a_reward_model_without_a_report_is_refused_unless_declared_public(tmp_path):
    tokenizer = tiny_tokenizer()
    unknown = tiny_llama_lm(len(tokenizer))
    args = GRPOConfig(output_dir=str(tmp_path), **ONLINE)
    with pytest.raises(ValueError, match="no privacy report"):
        PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=unknown, args=args, train_dataset=PROMPTS,
                                processing_class=tokenizer)
    length_reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    trainer = PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=length_reward, args=args,
                                      train_dataset=PROMPTS, processing_class=tokenizer, reward_model_is_public=True)
    assert trainer.carried_privacy_report().epsilon == 0.0


def test_preference_labels_never_reach_the_online_trainer(tmp_path, private_reward):
    tokenizer = tiny_tokenizer()
    with_labels = PROMPTS.add_column("chosen", ["x"] * len(PROMPTS))
    with pytest.raises(ValueError, match=r"columns \['chosen'\] besides"):
        PublicPromptRLOOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=private_reward[0],
                                args=RLOOConfig(output_dir=str(tmp_path), **ONLINE), train_dataset=with_labels,
                                processing_class=tokenizer)


def test_a_reward_model_trained_without_privacy_is_not_private(tmp_path):
    """Refused by default; as a baseline (allow_non_private_reward) its policy states ε = ∞ in its report and logs,
    never the ε = 0 of public rewards (issue 17)."""
    none = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "rm"), steps=1, privacy_mechanism="none")
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "policy"), **ONLINE)
    for public in (False, True):  # declaring it public does not make it so
        with pytest.raises(ValueError, match="without privacy"):
            PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=none.model, args=args,
                                    train_dataset=PROMPTS, processing_class=tokenizer, reward_model_is_public=public)
    trainer = PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=none.model, args=args,
                                      train_dataset=PROMPTS, processing_class=tokenizer,
                                      reward_processing_classes=tokenizer,
                                      allow_non_private_reward=True)
    trainer.train()
    trainer.save_model()
    carried = PrivacyReport.load(str(tmp_path / "policy"))
    assert math.isinf(carried.epsilon) and carried.extra["reward_model_reports"][0]["mechanism"] == "none"
    logged = [h for h in trainer.state.log_history if "loss" in h or "train_loss" in h]
    assert logged and all(math.isinf(h["epsilon"]) for h in logged)


def test_declaring_a_rule_public_keeps_the_private_reward_models_report(tmp_path, private_reward):
    """reward_model_is_public covers the rewards without a report; a private reward model's ε is still carried."""
    reward_model, reward_dir = private_reward
    tokenizer = tiny_tokenizer()
    length_reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    trainer = PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=[reward_model, length_reward],
                                      args=GRPOConfig(output_dir=str(tmp_path), **ONLINE), train_dataset=PROMPTS,
                                      processing_class=tokenizer, reward_processing_classes=[tokenizer, None],
                                      reward_model_is_public=True)
    carried = trainer.carried_privacy_report()
    assert carried.mechanism == "post-processing"
    assert carried.epsilon == pytest.approx(PrivacyReport.load(reward_dir).epsilon) and carried.epsilon > 0


@pytest.mark.parametrize("as_dict", [False, True])
def test_preference_labels_in_the_eval_dataset_are_refused(tmp_path, private_reward, as_dict):
    tokenizer = tiny_tokenizer()
    with_labels = PROMPTS.add_column("chosen", ["x"] * len(PROMPTS))
    eval_dataset = {"heldout": with_labels} if as_dict else with_labels
    with pytest.raises(ValueError, match=r"eval_dataset.* has columns \['chosen'\] besides"):
        PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=private_reward[0],
                                args=GRPOConfig(output_dir=str(tmp_path), **ONLINE), train_dataset=PROMPTS,
                                eval_dataset=eval_dataset, processing_class=tokenizer)


def test_a_randomized_response_reward_leaves_the_texts_unprotected_in_the_policys_statement(tmp_path):
    rr = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "rm"), steps=1,
                       privacy_mechanism="randomized_response")
    tokenizer = tiny_tokenizer()
    trainer = PublicPromptGRPOTrainer(model=tiny_llama_lm(len(tokenizer)), reward_funcs=rr.model,
                                      args=GRPOConfig(output_dir=str(tmp_path / "policy"), **ONLINE),
                                      train_dataset=PROMPTS,
                                      processing_class=tokenizer, reward_processing_classes=tokenizer)
    carried = trainer.carried_privacy_report()
    assert carried.extra["protects"] == "labels only" and carried.neighboring_relation == "replace"
    assert "prompts and responses (randomized response privatizes the preference labels only)" in carried.to_markdown()


def test_a_private_starting_policy_is_composed_in_and_relations_must_agree(tmp_path, private_reward):
    """A policy that starts from a private model (e.g. user-level DPO) carries that release too; reports under
    different neighbouring relations cannot be added."""
    reward_model, reward_dir = private_reward
    reward = PrivacyReport.load(reward_dir)
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer))
    policy.privacy_report = reward  # as the trainers attach it to the models they train
    trainer = PublicPromptGRPOTrainer(model=policy, reward_funcs=reward_model,
                                      args=GRPOConfig(output_dir=str(tmp_path / "policy"), **ONLINE),
                                      train_dataset=PROMPTS,
                                      processing_class=tokenizer, reward_processing_classes=tokenizer)
    carried = trainer.carried_privacy_report()
    assert carried.epsilon == pytest.approx(2 * reward.epsilon) and carried.delta == pytest.approx(2 * reward.delta)
    assert carried.extra["initial_policy_report"]["epsilon"] == reward.epsilon
    policy.privacy_report = PrivacyReport.from_dict({**reward.to_dict(), "neighboring_relation": "replace"})
    with pytest.raises(ValueError, match="different neighbouring relations"):
        PublicPromptGRPOTrainer(model=policy, reward_funcs=reward_model,
                                args=GRPOConfig(output_dir=str(tmp_path / "policy2"), **ONLINE), train_dataset=PROMPTS,
                                processing_class=tokenizer, reward_processing_classes=tokenizer)
