"""UserDPDPOTrainer's per-user gradients equal a per-user autograd loop (σ = 0), full fine-tuning
(untied and tied embeddings, where TRL's fused LM head would be wrong) and LoRA (issue 6)."""

import copy

import pytest
import torch
from peft import LoraConfig
from trl import DPOTrainer

from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer
from trl_userdp.trainers.mixin import USER_KEY

from ..helpers import assert_same_gradient
from ..tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer


def _trainer(tmp_path, tie=False, lora=False):
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer), tie=tie)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
                      task_type="CAUSAL_LM") if lora else None
    args = UserDPDPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                           use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=0, accountant="rdp",
                           noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=1e6, users_per_batch=6.0,
                           max_samples_per_user=3, privacy_seed=11)  # a fixed draw: the test needs a batch of 2 users
    return UserDPDPOTrainer(model=policy, ref_model=None if lora else copy.deepcopy(policy), args=args,
                            train_dataset=text_preference_dataset(n_users=8, pairs_per_user=3), processing_class=tokenizer,
                            peft_config=peft)


@pytest.mark.parametrize("tie,lora", [(False, False), (True, False), (False, True)])
def test_per_user_gradients_match_a_per_user_autograd_loop(tmp_path, tie, lora):
    trainer = _trainer(tmp_path, tie=tie, lora=lora)
    reference = copy.deepcopy(trainer.model)  # before the hooks are attached; the unfused forward comes along
    loader = trainer.get_train_dataloader()
    batch = next(b for b in loader if len(set(b[USER_KEY].tolist())) >= 2)
    batch = trainer._prepare_inputs(batch)
    row_users = batch[USER_KEY].clone()
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(batch)).backward()
    optimizer = trainer.privacy_engine.optimizer
    grads = optimizer.unit_gradients()  # runs the self-check against autograd too
    names = [optimizer.hooks.param_names[p] for p in optimizer.params]
    b = len(row_users) // 2
    for slot, user in enumerate(optimizer.hooks.unit_ids):
        pairs = [i for i in range(b) if int(row_users[i]) == user]
        idx = torch.tensor(pairs + [b + i for i in pairs])
        sub = {k: v[idx] for k, v in batch.items() if k != USER_KEY}
        reference.zero_grad()
        reference.train()
        DPOTrainer.compute_loss(trainer, reference, sub).backward()  # the plain TRL loss on this user's pairs
        expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        assert_same_gradient({n: g[slot] for n, g in zip(names, grads)}, expected)
    assert len(optimizer.hooks.unit_ids) >= 2


@pytest.mark.parametrize("tie,match", [(False, "bypassed the hooks"), (True, "Self-check failed")])
def test_trls_fused_lm_head_would_be_caught(tmp_path, monkeypatch, tie, match):
    """Why the trainer unfuses the head: with TRL's fused head the per-sample gradient of lm_head is
    missing (untied) or silently wrong (tied); the optimizer refuses both."""
    monkeypatch.setattr("trl_userdp.trainers.mixin.unfuse_lm_head", lambda model, temperature: None)
    trainer = _trainer(tmp_path, tie=tie)
    with pytest.raises(ValueError, match=match):
        trainer.train()
