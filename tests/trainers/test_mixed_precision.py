"""Mixed precision in the trainers (issue 24): ``bf16=True`` (autocast) trains the reward and DPO trainers privately in
both gradient modes, with gradient accumulation, and the two modes take the same update to bf16's precision."""

import pytest
import torch
from transformers import TrainerCallback

from .scripts import SCRIPTS


class _Start(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = torch.cat([p.detach().float().flatten().clone() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("script,trainer_cls,config_cls",
                         [SCRIPTS[0], pytest.param(*SCRIPTS[1], marks=pytest.mark.slow)])  # DPO with -m slow
def test_bf16_autocast_trains_privately_in_both_modes(tmp_path, script, trainer_cls, config_cls):
    updates = {}
    for mode in ("hooks", "ghost"):
        start = _Start()
        trainer = script(trainer_cls, config_cls, str(tmp_path / mode), steps=2, bf16=True, callbacks=[start],
                         gradient_accumulation_steps=2, users_per_batch=4.0, privacy_seed=0, noise_multiplier=0.0,
                         target_epsilon=None, per_user_max_grad_norm=0.05, grad_sample_mode=mode, learning_rate=1.0,
                         optim="sgd")  # SGD: the update is the private gradient itself (AdamW rescales coordinates)
        assert trainer.args.bf16 and trainer.privacy_engine.accountant.steps_taken == 2
        end = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters() if p.requires_grad])
        updates[mode] = end - start.params
        assert torch.isfinite(updates[mode]).all() and updates[mode].abs().sum() > 0
    diff = torch.linalg.vector_norm(updates["ghost"] - updates["hooks"]) / torch.linalg.vector_norm(updates["hooks"])
    assert diff < 2e-2, float(diff)
