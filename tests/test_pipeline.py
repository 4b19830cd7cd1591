"""The main job's pipeline end to end in a tiny setting (the real run is ./scripts/main)."""

import json
import os

from trl_userdp.pipeline import PipelineArguments, run_pipeline


def test_pipeline_runs_every_stage_and_writes_results(tmp_path, capsys):
    args = PipelineArguments(n_users=20, max_samples_per_user=4, users_per_batch=5, epsilons=[8.0],
                             mechanisms=["none", "randomized_response", "user_dpsgd"], sft_steps=4, rl_steps=2,
                             eval_every=1, eval_prompts=6, eval_pairs=20, output_dir=str(tmp_path))
    payload = run_pipeline(args)
    assert [r["mechanism"] for r in payload["results"]] == ["none", "randomized_response", "user_dpsgd"]
    for r in payload["results"]:
        assert len(r["curve"]) == 3 and r["curve"][0]["step"] == 0  # start, step 1, step 2
    private = payload["results"][2]
    assert 0 < private["epsilon_spent"] <= 8.0
    assert private["privacy_report"]["mechanism"] == "post-processing"
    assert "gold reward (95% CI)" in capsys.readouterr().out
    saved = json.load(open(tmp_path / "pipeline_results.json"))
    assert saved["data_card"]["users"].startswith("20 private users")
    assert os.path.exists(tmp_path / "reward_vs_kl.png")
