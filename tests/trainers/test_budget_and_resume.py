"""The budget guard and checkpoint resume in the trainers (issue 6)."""

import os

import pytest

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

from .scripts import reward_script

SETTINGS = dict(accountant="rdp", noise_multiplier=2.0, target_epsilon=6.0)


def test_a_small_budget_stops_at_the_last_affordable_step(tmp_path):
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=200, **SETTINGS)
    engine = trainer.privacy_engine
    taken = engine.accountant.steps_taken
    assert 0 < taken < 200 and trainer.state.global_step == taken
    assert engine.get_epsilon(1e-5) <= 6.0
    assert taken == engine.affordable_steps()  # one more step would exceed 6
    trial = engine.accountant.spawn()
    trial.history = [(2.0, engine.data_loader.sample_rate, taken + 1)]
    assert trial.get_epsilon(1e-5) > 6.0
    assert PrivacyReport.load(str(tmp_path)).steps_taken == taken


def test_resume_continues_the_same_epsilon_curve(tmp_path):
    straight = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "straight"), steps=6, **SETTINGS)
    curve = [e["epsilon"] for e in straight.state.log_history if "learning_rate" in e]
    reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path / "first"), steps=6, save_strategy="steps",
                  save_steps=3, **SETTINGS)
    checkpoint = str(tmp_path / "first" / "checkpoint-3")
    assert os.path.isfile(os.path.join(checkpoint, "privacy_state.pt"))
    # a new process builds the same trainer and resumes from the checkpoint
    resumed = _resume(tmp_path / "first", checkpoint)
    resumed_curve = [e["epsilon"] for e in resumed.state.log_history if "learning_rate" in e]
    assert resumed_curve == pytest.approx(curve)  # steps 1-3 from the checkpoint's history, 4-6 continue it
    assert resumed.privacy_engine.accountant.steps_taken == 6


def _resume(output_dir, checkpoint):
    from ..tiny_models import text_preference_dataset, tiny_tokenizer
    from .scripts import COMMON, tiny_reward_model

    tokenizer = tiny_tokenizer()
    model = tiny_reward_model(tokenizer)
    args = UserDPRewardConfig(output_dir=str(output_dir), max_steps=6, **{**COMMON, **SETTINGS, "save_strategy": "steps",
                                                                          "save_steps": 3})
    trainer = UserDPRewardTrainer(model=model, args=args, train_dataset=text_preference_dataset(n_users=8, pairs_per_user=3),
                                  processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer
