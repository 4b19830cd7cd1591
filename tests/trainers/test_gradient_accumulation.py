"""gradient_accumulation_steps > 1 under user-level DP: each Poisson draw of users arrives as that many micro-batches
of whole users, the optimizer steps once per draw and the accountant counts one step (issue 13, large logical
batches). With the same seeds the update is the one-batch update: same users, same per-user averages, same noise."""

import pytest
import torch

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import tiny_llama_lm, tiny_tokenizer
from .scripts import SCRIPTS, dpo_script, reward_script, tiny_reward_model


#: σ = 0, no clipping and plain SGD: the update is linear in the per-user averages, so a wrong scale (e.g. the Trainer
#: dividing each micro-batch's loss by gradient_accumulation_steps) shows; with noise, the same draws and noise
EXACT = dict(noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=1e6, optim="sgd", learning_rate=0.5)
NOISY = dict(target_epsilon=8.0, accountant="rdp")  # RDP calibrates σ in a fraction of PLD's time


@pytest.mark.parametrize("settings", [EXACT, NOISY], ids=["noiseless", "noisy"])
@pytest.mark.parametrize("script,trainer_cls,config_cls", SCRIPTS)
def test_micro_batches_of_one_draw_give_the_one_batch_update(tmp_path, script, trainer_cls, config_cls, settings):
    runs = {}
    for ga in (1, 3):
        out = tmp_path / f"ga{ga}"
        trainer = script(trainer_cls, config_cls, str(out), steps=3, gradient_accumulation_steps=ga,
                         users_per_batch=4.0, privacy_seed=11, **settings)
        loader = trainer.get_train_dataloader()
        runs[ga] = (trainer, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out, len(loader))
    (one, params_1, out_1, len_1), (acc, params_3, out_3, len_3) = runs[1], runs[3]
    assert len_3 == 3 * len_1  # each draw as three micro-batches
    assert one.state.global_step == acc.state.global_step == 3
    assert acc.privacy_engine.accountant.history == one.privacy_engine.accountant.history  # one step per draw
    assert PrivacyReport.load(str(out_3)).epsilon == PrivacyReport.load(str(out_1)).epsilon
    tokenizer = tiny_tokenizer()
    fresh = tiny_reward_model(tokenizer) if script is reward_script else tiny_llama_lm(len(tokenizer))
    assert any(not torch.equal(v, params_1[k]) for k, v in fresh.state_dict().items())  # the steps moved it
    for name, value in params_1.items():
        torch.testing.assert_close(params_3[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_the_default_users_per_step_is_the_logical_batch(tmp_path):
    trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, str(tmp_path), steps=1, accountant="rdp",
                            per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert trainer.privacy_engine.data_loader.users_per_batch == 4.0


@pytest.mark.parametrize("script,trainer_cls,config_cls",
                         [SCRIPTS[0], pytest.param(*SCRIPTS[1], marks=pytest.mark.slow)])  # DPO with -m slow
def test_ghost_clipping_trains_the_trainers_to_the_materialised_parameters(tmp_path, script, trainer_cls, config_cls):
    """grad_sample_mode='ghost' in the trainers: with the same seeds (users, noise) and a clip that binds, the same
    parameters as per-user gradients materialised by the hooks, with and without micro-batches (a tied DPO policy:
    its embedding and LM head fall back to materialised sums)."""
    params, ga = {}, 3
    for mode in ("hooks", "ghost"):
        extra = dict(tie=True) if script is dpo_script else {}
        trainer = script(trainer_cls, config_cls, str(tmp_path / mode), steps=3, gradient_accumulation_steps=ga,
                         users_per_batch=4.0, privacy_seed=11, target_epsilon=8.0, accountant="rdp",
                         per_user_max_grad_norm=0.05, grad_sample_mode=mode, **extra)
        assert trainer.privacy_engine.hooks.ghost == (mode == "ghost")
        params[mode] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for name, value in params["hooks"].items():
        # ghost clips a user whose rows nearly cancel (chosen vs rejected) by an upper bound on its norm (the Gram
        # norm's rounding bound, docs/privacy_model.md): within a tenth of one AdamW step (lr 1e-3) of hooks
        torch.testing.assert_close(params["ghost"][name], value, atol=1e-4, rtol=1e-3, msg=name)
