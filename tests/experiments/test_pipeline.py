"""The main job's pipeline end to end in a tiny setting (the real run is ./scripts/main)."""

import json
import math
import os

import numpy as np
import pytest

from trl_userdp.experiments.pipeline import PipelineArguments, run_pipeline
from trl_userdp.mechanisms.randomized_response import OUTPUT_DIR as RR_OUTPUT_DIR


@pytest.mark.end_to_end
def test_pipeline_runs_every_stage_and_writes_results(tmp_path, capsys):
    args = PipelineArguments(n_users=20, max_samples_per_user=4, users_per_batch=5, epsilons=[8.0],
                             mechanisms=["none", "randomized_response", "user_dpsgd"], sft_steps=4, rl_steps=2,
                             eval_every=1, eval_prompts=6, eval_samples=2, eval_pairs=20, rl_completions_per_step=4,
                             num_generations=2, completion_tokens=8, output_dir=str(tmp_path))
    payload = run_pipeline(args)
    assert [r["mechanism"] for r in payload["results"]] == ["none", "randomized_response", "user_dpsgd"]
    for r in payload["results"]:
        assert [p["step"] for p in r["curve"]] == [0, 1, 2]  # start, step 1, step 2
        numbers = [r["gold_reward"], r["gold_reward_se"], r["kl"], r["kl_se"], r["ended"],
                   r["reward_model_pair_accuracy"], *r["gain_over_sft"].values(),
                   *(v for p in r["curve"] for v in p.values())]
        assert all(math.isfinite(v) for v in numbers) and 0 <= r["ended"] <= 1
        assert r["curve"][0]["gold_reward"] == payload["sft_policy"]["gold_reward"]  # one SFT evaluation, paired
    baseline = payload["results"][0]["privacy_report"]  # its reward head saw the users without privacy: not public
    assert baseline["epsilon"] == "inf" and baseline["extra"]["reward_model_reports"][0]["mechanism"] == "none"
    assert payload["results"][0]["epsilon_spent"] is None  # the table's "∞ (none)"
    private = payload["results"][2]
    assert 0 < private["epsilon_spent"] <= 8.0
    assert private["privacy_report"]["extra"]["reward_model_reports"][0]["neighboring_relation"] == "replace"
    assert payload["results"][0]["reward_model_vs_none_p"] is None and "vs_none" not in payload["results"][0]
    for r in payload["results"][1:]:
        assert 0 <= r["reward_model_vs_none_p"] <= 1 and 0 <= r["vs_none"]["p"] <= 1
        assert r["share_of_gain"] is None or math.isfinite(r["share_of_gain"])
    assert private["privacy_report"]["mechanism"] == "post-processing"
    # the reward models came from UserDPRewardTrainer: ñ = 5 of 20 users for 5 epochs is 20 accounted steps, and
    # randomized response kept its one draw in the trainer's output folder
    assert private["privacy_report"]["extra"]["reward_model_reports"][0]["steps_taken"] == 20
    assert (tmp_path / "reward_models" / "randomized_response_eps8" / RR_OUTPUT_DIR).is_dir()
    out = capsys.readouterr().out
    assert "gain over SFT" in out and "p vs none" in out and "ended: share of completions" in out
    saved = json.load(open(tmp_path / "pipeline_results.json"))
    assert saved["data_card"]["users"].startswith("20 private users")
    assert set(saved["minutes"]) == {"data and gold reward", "reward models", "SFT policy", "online RL", "total"}
    assert os.path.exists(tmp_path / "privacy_utility.png")


def test_a_gold_reward_cached_by_another_version_is_refitted(tmp_path, monkeypatch, caplog):
    """A cache whose pickle names a module that no longer exists (the package moved it) must not crash the job."""
    import joblib

    from trl_userdp.experiments.pipeline import gold

    texts = [f"a good fine film number {i}" for i in range(20)] + [f"a bad awful film number {i}" for i in range(20)]
    labels = np.array([1] * 20 + [0] * 20)
    monkeypatch.setattr(gold, "CACHE_DIR", str(tmp_path))
    path = tmp_path / f"gold_tfidf_{len(texts)}.joblib"
    joblib.dump(_Stale(), path)
    old, new = b"tests.experiments.test_pipeline", b"trl_userdp.pipeline.gold_legacy"  # same length: a valid pickle
    assert len(old) == len(new) and old in path.read_bytes()
    path.write_bytes(path.read_bytes().replace(old, new))
    refitted = gold.TfidfGoldReward.cached(texts, labels)
    assert isinstance(refitted, gold.TfidfGoldReward) and "No module named 'trl_userdp.pipeline'" in caplog.text
    assert isinstance(joblib.load(path), gold.TfidfGoldReward)  # the cache was replaced
    assert refitted(["a good film"])[0] > refitted(["a bad film"])[0]


class _Stale:
    """Stands for a class pickled under a module path that no longer exists."""


def test_mcnemar_p_is_the_exact_binomial_test_on_discordant_pairs():
    import torch
    from scipy import stats

    from trl_userdp.experiments.pipeline.embedding_reward import mcnemar_p

    reference = torch.tensor([True] * 30 + [False] * 20)
    same = reference.clone()
    assert mcnemar_p(same, reference) == 1.0
    better = reference.clone()
    better[30:42] = True  # 12 pairs only this one gets right
    better[:2] = False  # 2 pairs only the reference gets right
    expected = stats.binomtest(2, 14, 0.5).pvalue
    assert abs(mcnemar_p(better, reference) - expected) < 1e-12 and expected < 0.05


def test_randomized_response_cannot_be_compared_under_add_or_remove():
    import pytest

    with pytest.raises(ValueError, match="one relation"):
        PipelineArguments(neighboring_relation="add_or_remove", mechanisms=["none", "randomized_response"])


def test_the_sft_policy_is_reused_only_with_its_settings_and_evaluation_keeps_the_training_rng(tmp_path):
    """A saved SFT policy built with other settings is rebuilt, not silently reused; an evaluation inside GRPO draws
    from its own stream, so each run's rl_seed governs all of its training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_userdp.experiments.pipeline.arguments import SFT_SETTINGS_FILE
    from trl_userdp.experiments.pipeline.data import build_sentiment_data
    from trl_userdp.experiments.pipeline.evaluation import evaluate_policy
    from trl_userdp.experiments.pipeline.policy import build_sft_policy

    args = PipelineArguments(n_users=20, max_samples_per_user=4, users_per_batch=5, sft_steps=1, eval_prompts=6,
                             eval_samples=2, eval_pairs=20, completion_tokens=4, output_dir=str(tmp_path))
    data = build_sentiment_data(args)
    path = build_sft_policy(data, args)
    settings = os.path.join(path, SFT_SETTINGS_FILE)
    assert json.load(open(settings))["sft_steps"] == 1
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert build_sft_policy(data, args) == path and os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp
    args.sft_steps = 2
    build_sft_policy(data, args)
    assert json.load(open(settings))["sft_steps"] == 2  # rebuilt
    policy = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    point = evaluate_policy(policy, policy, AutoTokenizer.from_pretrained(path), data.test_prompts, data.gold, args,
                            seed=1)
    assert torch.equal(torch.get_rng_state(), before) and math.isfinite(point["gold_reward"])


def test_aup_rlhf_and_only_it_takes_its_radius_from_the_public_users():
    """The pipeline asks the public users for τ when a mechanism is AUP-RLHF's (it used to read an `adaptive` flag that
    the mechanisms no longer carry, so AUP-RLHF would have run without τ)."""
    from trl_userdp.experiments.pipeline.reward import needs_public_tau
    from trl_userdp.mechanisms import mechanism_names

    assert [name for name in mechanism_names() if needs_public_tau(name)] == ["aup"]
