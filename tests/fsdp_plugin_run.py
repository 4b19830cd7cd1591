"""One run of the tiny reward model's TRL script, for tests/test_cuda.py: ``python tests/fsdp_plugin_run.py OUT plugin``
under torchrun trains under accelerate's FSDP2 plugin, ``... OUT plain`` without it; σ = 0, no user clipped. Saves the
trained parameters (full), the Trainer's wrapper and whether the plugin was on to ``OUT/result.pt``."""

import sys

import torch

from tests.trainers.scripts import reward_script
from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

out, mode = sys.argv[1], sys.argv[2]
settings = dict(noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=1e6, optim="sgd", learning_rate=0.5,
                steps=4, users_per_batch=4.0, privacy_seed=11, grad_sample_mode="ghost", use_cpu=False)
if mode == "plugin":
    settings.update(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
trainer = reward_script(UserDPRewardTrainer, UserDPRewardConfig, out, **settings)
params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
          for k, v in trainer.model.state_dict().items()}
torch.save({"params": params, "wrapped": type(trainer.model_wrapped).__name__, "fsdp": trainer.is_fsdp_enabled},
           f"{out}/result.pt")
