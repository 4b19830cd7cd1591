"""The proof that a TRL trainer is a config plus a small subclass (issue 12): ``UserDPKTOTrainer`` on unpaired
feedback, under the same cooperative ``__init__`` and hooks as the reward and DPO trainers."""

import copy

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from datasets import Dataset
from dp_accounting import pld
from trl import KTOConfig, KTOTrainer

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPKTOConfig, UserDPKTOTrainer

from ..tiny_models import tiny_llama_lm, tiny_tokenizer
from .scripts import COMMON


def unpaired_dataset(n_users=8, rows_per_user=3, seed=0):
    rng = np.random.default_rng(seed)
    good = [" the movie was great", " i loved the acting", " great and fun"]
    bad = [" the movie was bad", " i hated the plot", " bad and boring"]
    n = n_users * rows_per_user
    label = rng.random(n) < 0.5
    return Dataset.from_dict({
        "prompt": ["review:"] * n,
        "completion": [(good if y else bad)[i] for y, i in zip(label, rng.integers(0, 3, n))],
        "label": label.tolist(),
        "user_id": [f"user{u}" for u in np.repeat(np.arange(n_users), rows_per_user)],
    })


def kto_script(trainer_cls, config_cls, output_dir, *, steps=3, **config):
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer))
    args = config_cls(output_dir=output_dir, max_steps=steps, loss_type="apo_zero_unpaired",
                      **{**COMMON, **config})
    trainer = trainer_cls(model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=unpaired_dataset(),
                          processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    return trainer


@pytest.mark.end_to_end
def test_a_trl_kto_script_runs_privately_with_the_class_swap_only(tmp_path):
    kto_script(KTOTrainer, KTOConfig, str(tmp_path / "trl"))  # the script is a valid TRL script
    before = {n: p.detach().clone() for n, p in tiny_llama_lm(len(tiny_tokenizer())).named_parameters()}
    trainer = kto_script(UserDPKTOTrainer, UserDPKTOConfig, str(tmp_path / "ours"), accountant="pld")
    assert not trainer.privacy_engine.optimizer.self_check  # the per-user gradients passed the self-check
    report = PrivacyReport.load(str(tmp_path / "ours"))
    assert report.mechanism == "user_dpsgd" and report.steps_taken == 3
    q, sigma = report.sample_rate, report.noise_multiplier
    independent = pld.PLDAccountant().compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 3))
    assert report.epsilon == pytest.approx(independent.get_epsilon(1e-5), rel=1e-9)
    assert all("epsilon" in entry for entry in trainer.state.log_history)
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not unchanged, unchanged


def test_kto_settings_that_couple_users_are_refused(tmp_path):
    tokenizer = tiny_tokenizer()
    policy = tiny_llama_lm(len(tokenizer))
    args = UserDPKTOConfig(output_dir=str(tmp_path), max_steps=1, loss_type="kto", **COMMON)
    with pytest.raises(ValueError, match="KL baseline from other examples"):
        UserDPKTOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=unpaired_dataset(),
                         processing_class=tokenizer)
    args = UserDPKTOConfig(output_dir=str(tmp_path), max_steps=1, loss_type="apo_zero_unpaired",
                           privacy_mechanism="randomized_response", **COMMON)
    with pytest.raises(ValueError, match="no de-biased loss for UserDPKTOTrainer"):
        UserDPKTOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=unpaired_dataset(),
                         processing_class=tokenizer)
    with pytest.raises(ValueError, match="needs `args=UserDPKTOConfig"):
        UserDPKTOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=KTOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True),
                         train_dataset=unpaired_dataset(), processing_class=tokenizer)
