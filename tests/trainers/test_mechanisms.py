"""Every privacy mechanism runs 3+ steps in each trainer (issue 6)."""

import math

import pytest
import torch

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import text_preference_dataset
from .scripts import dpo_script, reward_script

MECHANISMS = {
    "user_dpsgd": {"accountant": "rdp"},  # RDP calibrates faster; PLD runs in test_drop_in
    "group": {"accountant": "rdp"},
    "user_dpsgd_adaptive_clip": {"accountant": "rdp", "per_user_max_grad_norm": 5.0, "target_unclipped_quantile": 0.5},
    # AUP-RLHF needs large steps or it halts (docs/benchmarks.md): every one of 40 users in every step
    # seeded: AboveThreshold's Laplace draws from the OS halt a few runs in a hundred, which is not under test here
    "aup": {"concentration_radius": 5.0, "users_per_batch": 40.0, "max_users_per_batch": 40, "privacy_seed": 11,
            "dataset": text_preference_dataset(n_users=40, pairs_per_user=1)},
    "randomized_response": {},
    "none": {},
}


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
@pytest.mark.parametrize("script,trainer_cls,config_cls", [
    (reward_script, UserDPRewardTrainer, UserDPRewardConfig),
    (dpo_script, UserDPDPOTrainer, UserDPDPOConfig),
])
def test_mechanism_trains_three_steps(tmp_path, mechanism, script, trainer_cls, config_cls):
    trainer = script(trainer_cls, config_cls, str(tmp_path), steps=3, privacy_mechanism=mechanism,
                     **MECHANISMS[mechanism])
    assert trainer.state.global_step == 3
    report = PrivacyReport.load(str(tmp_path))
    assert report.mechanism == mechanism
    card = (tmp_path / "README.md").read_text()  # TRL's model card, with the same statement (issue 17)
    assert "## Privacy" in card and "user-level-dp" in card and f"mechanism: `{mechanism}`" in card
    if mechanism == "none":
        assert "without differential privacy (ε = ∞)" in card
    else:
        assert f"(ε = {report.epsilon:.4g}, δ = {report.delta:g})-differential privacy for one user" in card
        assert ("labels only" in card) == (mechanism == "randomized_response")
    if mechanism == "none":
        assert math.isinf(report.epsilon)
    elif mechanism == "randomized_response":
        assert report.epsilon == 8.0 and report.delta == 0.0
        assert report.extra["epsilon_per_label"] == pytest.approx(8.0 / 10)
        if trainer_cls is UserDPDPOTrainer:
            assert trainer.args.loss_type == ["robust"]
            assert trainer.args.label_smoothing == pytest.approx(1 / (1 + math.exp(0.8)))
    else:
        assert 0 < report.epsilon <= 8.0 and report.steps_taken >= 1
        assert trainer.privacy_engine.accountant.steps_taken == report.steps_taken
        if mechanism == "user_dpsgd_adaptive_clip":  # the clip moved from its start, and the report says where it is
            assert report.extra["initial_per_user_max_grad_norm"] == 5.0 and report.per_user_max_grad_norm != 5.0
        if mechanism == "aup":
            assert report.concentration_radius == 5.0 and report.extra["svt_queries"] == 3
            assert not report.extra["halted"] and report.steps_taken == 3


def test_the_reward_trainers_randomized_response_loss_is_the_normalised_debiased_one(tmp_path):
    """Under randomized response at ε/m per label (s = σ(ε/m)) the reward trainer's loss is
    ((2s − 1)·softplus(−z) − (1 − s)·z) / (2s − 1) on the observed margins z: an unbiased estimate of the clean BTL
    loss's gradient, so the learning rate means what it means without privacy (as rDPO in the DPO trainer)."""
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=1,
                            privacy_mechanism="randomized_response", target_epsilon=3.0, max_samples_per_user=3)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        chosen, rejected = trainer.model(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).logits.squeeze(-1).chunk(2)
    z, s = chosen - rejected, 1 / (1 + math.exp(-3.0 / 3))
    expected = (((2 * s - 1) * torch.nn.functional.softplus(-z) - (1 - s) * z) / (2 * s - 1)).mean()
    torch.testing.assert_close(loss, expected)
