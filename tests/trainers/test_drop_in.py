"""The drop-in contract (issue 6): TRL scripts run with our classes and a user_id column."""

import json
import os

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from .scripts import dpo_script, reward_script

CASES = [
    (reward_script, RewardTrainer, RewardConfig, UserDPRewardTrainer, UserDPRewardConfig),
    (dpo_script, DPOTrainer, DPOConfig, UserDPDPOTrainer, UserDPDPOConfig),
]


@pytest.mark.end_to_end
@pytest.mark.parametrize("script,trl_trainer,trl_config,our_trainer,our_config", CASES)
def test_a_trl_script_runs_with_the_class_swap_only(tmp_path, script, trl_trainer, trl_config, our_trainer, our_config):
    script(trl_trainer, trl_config, str(tmp_path / "trl"))  # the script is a valid TRL script
    trainer = script(our_trainer, our_config, str(tmp_path / "ours"))
    logs = trainer.state.log_history
    assert all("epsilon" in entry for entry in logs)
    report = PrivacyReport.load(str(tmp_path / "ours"))
    assert report.mechanism == "user_dpsgd" and report.steps_taken == 4
    assert report.epsilon == pytest.approx(trainer.privacy_engine.get_epsilon(1e-5))
    assert logs[-1]["epsilon"] == pytest.approx(report.epsilon)
    # independent dp-accounting computation from what the run used
    q, sigma = report.sample_rate, report.noise_multiplier
    independent = pld.PLDAccountant().compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 4))
    assert report.epsilon == pytest.approx(independent.get_epsilon(1e-5), rel=1e-9)
    assert report.epsilon <= 8.0  # the default target_epsilon


@pytest.mark.parametrize("script,trl_trainer,trl_config,our_trainer,our_config", CASES)
def test_private_training_changes_the_parameters(tmp_path, script, trl_trainer, trl_config, our_trainer, our_config):
    """Each trainable parameter, before and after three private steps of one run (issue 12: a comparison between
    two runs could pass on initialisation differences alone)."""
    record = {}

    class Before(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            record.update({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    trainer = script(our_trainer, our_config, str(tmp_path / "ours"), steps=3, accountant="rdp", callbacks=[Before()])
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(after) == set(record) and record
    unchanged = [n for n in record if torch.equal(record[n], after[n])]
    assert not unchanged, unchanged  # σ > 0: noise reaches every parameter, every step


def test_logs_and_saved_files_hold_no_raw_gradient_norm_or_private_metrics(tmp_path):
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=4, save_strategy="steps",
                            save_steps=2, accountant="rdp")
    for entry in trainer.state.log_history:
        assert "grad_norm" not in entry and "loss" not in entry and "accuracy" not in entry
        assert set(entry) <= {"epsilon", "delta", "privacy_steps", "learning_rate", "epoch", "step"}
    keys = set()

    def collect(obj):
        if isinstance(obj, dict):
            keys.update(obj)
            for value in obj.values():
                collect(value)
        elif isinstance(obj, list):
            for value in obj:
                collect(value)

    for root, _, files in os.walk(tmp_path):
        for name in files:
            if name.endswith(".json"):
                collect(json.load(open(os.path.join(root, name))))
    assert "per_user_max_grad_norm" in keys  # the clip norm C is public and reported
    assert "grad_norm" not in keys
    assert os.path.isfile(tmp_path / "checkpoint-2" / "privacy_report.json")
    # the opt-in shows private metrics (so this test can fail): they are computed on private batches
    opted = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "opt"), steps=2, log_private_metrics=True,
                          accountant="rdp")
    assert any("loss" in entry for entry in opted.state.log_history)
    assert not any("grad_norm" in entry for entry in opted.state.log_history)
    state = json.load(open(tmp_path / "checkpoint-4" / "trainer_state.json"))
    assert all("grad_norm" not in entry for entry in state["log_history"])
    assert state["total_flos"] == 0  # would follow the private batches' sizes


def test_train_returns_no_private_loss_and_eval_logs_no_training_token_count(tmp_path):
    from ..tiny_models import text_preference_dataset

    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=2, accountant="rdp")
    output = trainer.train()  # a second call: the budget is spent, no step is taken, and no loss is returned
    assert "train_loss" not in output.metrics and output.training_loss != output.training_loss  # NaN
    metrics = trainer.evaluate(text_preference_dataset(n_users=2, pairs_per_user=2))
    assert not any(k.endswith("num_tokens") for k in metrics)
    # TRL's log() re-adds the training-token count from its own eval metrics: it must not reach the logs
    assert "eval_loss" in trainer.state.log_history[-1]
    assert not any(k.endswith("num_tokens") for entry in trainer.state.log_history for k in entry)
    assert trainer.model.privacy_report.steps_taken == trainer.privacy_engine.accountant.steps_taken
