"""Each example runs offline on CPU in a reduced mode (issue 7)."""

import importlib.util
import pathlib

import pytest

from trl_userdp import PrivacyReport

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward")
    _load("reward_modeling").main(["--output_dir", str(out), "--max_steps", "2", "--n_users", "20",
                                   "--per_device_train_batch_size", "4", "--logging_steps", "1"])
    return out


@pytest.mark.end_to_end
def test_reward_modeling_saves_a_private_reward_model(reward_dir):
    report = PrivacyReport.load(str(reward_dir))
    assert report.mechanism == "user_dpsgd" and 0 < report.epsilon <= 8.0 and report.steps_taken == 2


@pytest.mark.end_to_end
def test_online_rl_inherits_the_reward_models_report(reward_dir, tmp_path):
    trainer = _load("online_rl").main(["--reward_model", str(reward_dir), "--output_dir", str(tmp_path), "--max_steps", "2",
                                       "--n_prompts", "8"])
    assert PrivacyReport.load(str(tmp_path)).epsilon == pytest.approx(PrivacyReport.load(str(reward_dir)).epsilon)
    assert trainer.state.global_step == 2


# DPO, full and LoRA, through the command line runs by default (tests/test_readme.py); the example's with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--use_peft"]])
def test_dpo_full_and_lora(tmp_path, extra):
    trainer = _load("dpo").main(["--output_dir", str(tmp_path), "--max_steps", "2", "--n_users", "10", *extra])
    assert PrivacyReport.load(str(tmp_path)).steps_taken == 2 and trainer.state.global_step == 2


@pytest.mark.slow
def test_tldr_recipe_falls_back_to_local_data_offline(tmp_path, capsys):
    _load("tldr_summarization").main(["--source", "hub", "--output_dir", str(tmp_path), "--max_steps", "2", "--n_users", "6",
                                      "--comparisons_per_user", "5", "--max_samples_per_user", "5"])
    out = capsys.readouterr().out
    assert "using the local stand-in" in out and "per labeller" in out
    report = PrivacyReport.load(str(tmp_path))
    assert report.n_users == 6 and report.max_samples_per_user == 5


@pytest.mark.slow  # 20 s: the SFT policy, four GRPO runs and their evaluations, each in a tiny setting
def test_the_private_prompts_grpo_recipe_runs_every_arm(tmp_path):
    results = _load("grpo_private_prompts").main([
        "--output_dir", str(tmp_path), "--n_users", "8", "--prompts_per_user", "2", "--users_per_batch", "4",
        "--steps", "1", "--sft_steps", "1", "--eval_prompts", "4", "--eval_samples", "1", "--epsilons", "8"])
    runs = {r["name"]: r for r in results["runs"]}
    assert list(runs) == ["none", "sigma0", "eps8"]
    assert runs["none"]["epsilon"] is None and runs["sigma0"]["noise_multiplier"] == 0.0
    assert 0 < runs["eps8"]["epsilon"] <= 8.0 and runs["eps8"]["steps"] == 1
    assert all(set(r["gain_over_sft"]) == {"mean", "half_width", "p"} for r in runs.values())
    assert (tmp_path / "results.json").is_file() and (tmp_path / "eps8" / "privacy_report.json").is_file()
