"""RobustDPOLoss against TRL's own loss_type="robust" on a real DPOTrainer batch."""

import copy

import pytest
import torch
from trl import DPOConfig, DPOTrainer

from trl_userdp.losses import RobustDPOLoss

from .tiny_models import text_preference_dataset, tiny_llama_lm, tiny_tokenizer


@pytest.mark.parametrize("rho", [0.0, 0.1, 0.3])
def test_robust_dpo_loss_equals_trl_robust(tmp_path, rho):
    tok = tiny_tokenizer()
    policy = tiny_llama_lm(len(tok))
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # move the policy away from the reference so margins are not zero
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    beta = 0.5
    args = DPOConfig(output_dir=str(tmp_path), loss_type=["robust"], label_smoothing=rho, beta=beta, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False, per_device_train_batch_size=6, max_steps=1)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=text_preference_dataset(),
                         processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, batch)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True)
        seq = batch["completion_mask"].shape[1] - 1
        logps = trainer.model(**kw).log_probs[:, -seq:].sum(1)
        ref_logps = trainer.ref_model(**kw).log_probs[:, -seq:].sum(1)
    delta = (logps - ref_logps).chunk(2)
    margin = beta * (delta[0] - delta[1])
    assert margin.abs().max() > 1e-3
    assert RobustDPOLoss(flip_rate=rho)(margin) == pytest.approx(float(trl_loss), abs=1e-6)
