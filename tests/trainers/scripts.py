"""TRL scripts written for trl.RewardTrainer / trl.DPOTrainer, parameterized only by the trainer and
config classes (the drop-in contract: swap the classes, add a user_id column, nothing else)."""

import copy

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification, TrainerCallback

from trl_userdp.distributed import shard_model
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer

COMMON = dict(per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False,
              save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)


def tiny_reward_model(tokenizer):
    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))


def reward_script(trainer_cls, config_cls, output_dir, *, steps=4, dataset=None, peft_config=None, callbacks=None,
                  resume_from_checkpoint=None, sharded=False, **config):
    tokenizer = tiny_tokenizer()
    model = tiny_reward_model(tokenizer)
    if sharded:
        model = shard_model(model)
    args = config_cls(output_dir=output_dir, max_steps=steps, **{**COMMON, **config})
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset or text_preference_dataset(n_users=8, pairs_per_user=3),
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model()
    return trainer


def dpo_script(trainer_cls, config_cls, output_dir, *, steps=4, dataset=None, peft_config=None, tie=False,
               callbacks=None, sharded=False, **config):
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer), tie=tie)
    reference = None if peft_config is not None else copy.deepcopy(policy)
    if sharded:
        policy = shard_model(policy)
    args = config_cls(output_dir=output_dir, max_steps=steps, **{**COMMON, **config})
    trainer = trainer_cls(model=policy, ref_model=reference, args=args,
                          train_dataset=dataset or text_preference_dataset(n_users=8, pairs_per_user=3),
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    trainer.train()
    trainer.save_model()
    return trainer


#: (script, trainer class, config class) for the reward and the DPO trainer
SCRIPTS = [(reward_script, UserDPRewardTrainer, UserDPRewardConfig), (dpo_script, UserDPDPOTrainer, UserDPDPOConfig)]


class _Start(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = torch.cat([p.detach().float().flatten().clone() for p in model.parameters() if p.requires_grad])


def bf16_updates_by_mode(script, trainer_cls, config_cls, output_dir, **config):
    """Two private steps of ``script`` with ``bf16=True`` (autocast), σ = 0 and every user clipped (C = 0.05), once per
    gradient mode: {mode: (trained parameters − initial ones, as one flat fp32 vector)}. With SGD at learning rate 1
    the update is the private gradient itself (AdamW would rescale coordinates)."""
    updates = {}
    for mode in ("hooks", "ghost"):
        start = _Start()
        trainer = script(trainer_cls, config_cls, f"{output_dir}/{mode}", steps=2, bf16=True, callbacks=[start],
                         gradient_accumulation_steps=2, users_per_batch=4.0, privacy_seed=11, noise_multiplier=0.0,
                         target_epsilon=None, per_user_max_grad_norm=0.05, grad_sample_mode=mode, learning_rate=1.0,
                         optim="sgd", **config)
        assert trainer.args.bf16 and trainer.privacy_engine.accountant.steps_taken == 2
        end = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters() if p.requires_grad])
        updates[mode] = end.cpu() - start.params.cpu()
    return updates
