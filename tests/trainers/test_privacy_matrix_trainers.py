"""The privacy test matrix's trainer axis (issue 24; the engine's axes are in tests/test_privacy_matrix.py): one step of
the reward or DPO trainer, {hooks, ghost} × {fp32, bf16 autocast} × ``gradient_accumulation_steps`` {1, 3} ×
{user_dpsgd, user_dpsgd_adaptive_clip, group}, with a generated adversarial user written as text (one pair, m pairs, the
same pair m times, the same pair with both label orders so that its gradients nearly cancel, long texts). Every user is
drawn (q = 1), σ = 0 and the optimizer is SGD with learning rate 1, so the update is the released mean and ``ñ`` times
it the released sum; user 0's influence is the difference between the sums with and without it, which must stay within
its sensitivity · (1 + the dtype's tolerance) plus the rounding of the sums (docs/privacy_model.md, "Precision and
paths"). The step is accounted once."""

import os
import tempfile

import pytest
import torch
from datasets import Dataset, concatenate_datasets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import TrainerCallback

from ..tiny_models import text_preference_dataset
from .scripts import SCRIPTS

settings.register_profile("trainers", max_examples=6, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("trainers-slow", max_examples=60, deadline=None, derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = "trainers-slow" if os.environ.get("HYPOTHESIS_PROFILE") == "slow" else "trainers"

M = 3  # max_samples_per_user
CLIP = 0.05  # binds for every user of the tiny models
TOLERANCE = {"fp32": 1e-3, "bf16-autocast": 1e-3}  # as in tests/test_privacy_matrix.py
SUM_ROUNDING = {"fp32": 1e-5, "bf16-autocast": 2.0 ** -7}
KINDS = ["one_pair", "m_pairs", "same_pair", "both_orders", "long"]


class _Start(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = torch.cat([p.detach().float().flatten().clone() for p in model.parameters() if p.requires_grad])


def _user_zero(kind: str, seed: int) -> Dataset:
    """User 0's pairs, of an adversarial ``kind``."""
    pairs = text_preference_dataset(n_users=1, pairs_per_user=M, seed=seed + 1000).to_dict()
    if kind == "one_pair":
        pairs = {k: v[:1] for k, v in pairs.items()}
    elif kind == "same_pair":
        pairs = {k: v[:1] * M for k, v in pairs.items()}
    elif kind == "both_orders":  # (a ≻ b) and (b ≻ a): nearly opposite gradients at initialisation
        pairs = {**{k: v[:2] for k, v in pairs.items()},
                 "chosen": [pairs["chosen"][0], pairs["rejected"][0]],
                 "rejected": [pairs["rejected"][0], pairs["chosen"][0]]}
    elif kind == "long":
        pairs["chosen"] = [c * 12 for c in pairs["chosen"]]
        pairs["rejected"] = [r * 12 for r in pairs["rejected"]]
    pairs["user_id"] = ["user0"] * len(pairs["user_id"])
    return Dataset.from_dict(pairs)


@st.composite
def scenarios(draw):
    return dict(script=draw(st.sampled_from([0, 1])),  # index into SCRIPTS: reward, DPO
                kind=draw(st.sampled_from(KINDS)),
                mode=draw(st.sampled_from(["hooks", "ghost"])),
                dtype=draw(st.sampled_from(["fp32", "bf16-autocast"])),
                gradient_accumulation_steps=draw(st.sampled_from([1, 3])),
                mechanism=draw(st.sampled_from(["user_dpsgd", "user_dpsgd_adaptive_clip", "group"])),
                others=draw(st.integers(1, 3)),
                seed=draw(st.integers(0, 2 ** 16)))


def _released_sum(s, dataset: Dataset, out: str):
    script, trainer_cls, config_cls = SCRIPTS[s["script"]]
    n_users = len(set(dataset["user_id"]))
    start = _Start()
    trainer = script(trainer_cls, config_cls, out, steps=1, dataset=dataset, callbacks=[start],
                     bf16=s["dtype"] == "bf16-autocast", gradient_accumulation_steps=s["gradient_accumulation_steps"],
                     privacy_mechanism=s["mechanism"], grad_sample_mode=s["mode"], max_samples_per_user=M,
                     users_per_batch=float(n_users), privacy_seed=11, noise_multiplier=0.0, target_epsilon=None,
                     per_user_max_grad_norm=CLIP, learning_rate=1.0, optim="sgd")
    end = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters() if p.requires_grad])
    expected_units = trainer.privacy_engine.optimizer.expected_batch_size  # users, or records for group
    assert trainer.privacy_engine.accountant.history == [(0.0, 1.0, 1)]  # one step, every unit drawn
    return (start.params - end) * expected_units


@settings(settings.get_profile(PROFILE))
@given(s=scenarios())
def test_no_user_moves_the_trainers_update_beyond_its_sensitivity(tmp_path, s):
    others = text_preference_dataset(n_users=s["others"] + 1, pairs_per_user=M, seed=s["seed"])
    others = others.filter(lambda row: row["user_id"] != "user0")
    user = _user_zero(s["kind"], s["seed"])
    with_user = _released_sum(s, concatenate_datasets([user, others]), tempfile.mkdtemp(dir=tmp_path))
    without = _released_sum(s, others, tempfile.mkdtemp(dir=tmp_path))
    sensitivity = CLIP * (len(user) if s["mechanism"] == "group" else 1)
    dtype = s["dtype"]
    allowed = sensitivity * (1 + TOLERANCE[dtype]) + SUM_ROUNDING[dtype] * float(
        torch.linalg.vector_norm(with_user) + torch.linalg.vector_norm(without))
    got = float(torch.linalg.vector_norm(with_user - without))
    assert got <= allowed, f"user 0 ({s['kind']}) moved the sum by {got / sensitivity:.4f}× its sensitivity"
    assert got > 0  # the user was drawn and moved it


@pytest.mark.slow
def test_the_slow_profile_runs_many_trainer_examples(tmp_path_factory):
    """``-m slow``: the trainer axis with many examples."""
    inner = test_no_user_moves_the_trainers_update_beyond_its_sensitivity.hypothesis.inner_test
    settings(settings.get_profile("trainers-slow"))(given(s=scenarios())(
        lambda s: inner(tmp_path_factory.mktemp("matrix"), s)))()
