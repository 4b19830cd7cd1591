"""The benchmark scripts run end to end in a tiny setting (the real runs are opt-in, see benchmarks/README.md)."""

import copy
import json
import math
import os

import numpy as np
import pytest

from benchmarks import chowdhury_simulation, corruption_separation


def test_chowdhury_simulation_writes_a_table_and_results(tmp_path):
    out = chowdhury_simulation.main(["--reps", "3", "--ns", "300", "600", "--epsilons", "1.0", "--out", str(tmp_path)])
    cell = out["results"]["1.0|600|non-private MLE"]
    assert cell["n"] == 3 and cell["lo"] <= cell["mean"] <= cell["hi"]
    saved = json.load(open(tmp_path / "chowdhury_simulation.json"))
    assert "command" in saved and set(saved["ordering_holds"]) == {"1.0|300", "1.0|600"}
    assert os.path.exists(tmp_path / "chowdhury_simulation.png")


def test_corruption_separation_reports_the_bias_ratio(tmp_path):
    out = corruption_separation.main(["--reps", "2", "--n", "2000", "--alphas", "0", "0.05", "--epsilons", "3",
                                      "--out", str(tmp_path), "--adversary", "random"])
    ratio = out["bias_ratio"]["3.0|0.05"]
    assert math.isnan(ratio) or ratio > 0
    assert os.path.exists(tmp_path / "corruption_separation.json")


@pytest.mark.slow  # a minute of CPU between them: benchmarks are opt-in runs
def test_user_level_theory_runs_a_tiny_grid_on_nested_data(tmp_path):
    from benchmarks import user_level_theory

    out = user_level_theory.main(["--seeds", "2", "--total", "120", "--ms", "4", "12", "--headline-m", "4",
                                  "--epsilons", "3", "--aup-max-users", "20", "--table_ms", "5",
                                  "--table_epsilons", "3", "--regime_users", "600", "--table_pairs", "5000",
                                  "--out", str(tmp_path)])
    by_m = out["results"]
    assert set(by_m) == {"4", "12"} and by_m["4"]["3.0"]["n"] == 30 and by_m["12"]["3.0"]["n"] == 10
    # nested: the same comparisons in every cell of a seed, so the MLE's error is the same across m
    assert by_m["4"]["3.0"]["non-private MLE"] == by_m["12"]["3.0"]["non-private MLE"]
    assert set(user_level_theory.COLUMNS) <= set(by_m["12"]["3.0"])
    assert math.isnan(by_m["4"]["3.0"]["AUP (public τ)"]["mean"])  # n = 30 > 20: AUP left out, not faked
    assert math.isfinite(by_m["12"]["3.0"]["AUP, no noise"]["mean"])
    row = out["noise_table"][0]
    assert row["user_wise"] > 0 and row["aup"] > 0 and 0 <= row["aup_survives_T"] <= 1
    assert os.path.exists(tmp_path / "user_level_theory.png") and os.path.exists(tmp_path / "user_level_theory.json")


@pytest.mark.slow  # 10 s of CPU: benchmarks are opt-in runs
def test_step_cost_benchmark_runs_a_tiny_setting(tmp_path):
    from benchmarks import step_cost

    out = step_cost.main(["--workloads", "llama_lora", "--ms", "2", "--rows", "4", "--seq", "8", "--steps", "1",
                          "--users", "4", "--materialised-limit-gb", "0", "--profile", "--out", str(tmp_path)])
    profile = json.loads((tmp_path / "step_cost.json").read_text())["profile"]
    ghost, plain = profile["user ghost m=2"], profile["non-private"]
    assert ghost["  per-user norms (backward hooks)"] > 0 and plain["  per-user norms (backward hooks)"] == 0
    for part in ("forward pass and loss", "backward pass", "optimizer step"):
        assert 0 < ghost[part] < ghost["whole step"] and 0 < plain[part] < plain["whole step"]
    cells = out["results"]["llama_lora"]["cells"]
    assert {"non-private", "opacus hooks", "opacus ghost", "user hooks m=2", "user ghost m=2"} == set(cells)
    assert cells["non-private"]["time_ratio"] == 1.0 and all(c["median_s"] > 0 for c in cells.values())
    scaling = out["scaling"]["cells"]
    assert scaling["ghost|4"]["s_per_step"] > 0 and "skipped" in scaling["hooks|4"]
    assert os.path.exists(tmp_path / "step_cost.json")


@pytest.mark.slow  # a minute of CPU between them: benchmarks are opt-in runs
def test_pipeline_seeds_varies_one_seed_at_a_time(tmp_path):
    from benchmarks import pipeline_seeds

    out = pipeline_seeds.main(["--mechanisms", "user_dpsgd", "--seeds", "2", "--out", str(tmp_path), "--work_dir",
                               str(tmp_path / "runs"), "--pipeline", "n_users=20", "max_samples_per_user=4",
                               "users_per_batch=5", "sft_steps=4", "rl_steps=2", "eval_every=2", "eval_prompts=6",
                               "eval_samples=2", "eval_pairs=20", "rl_completions_per_step=4", "num_generations=2",
                               "completion_tokens=8"])
    assert [(r["reward_seed"], r["rl_seed"]) for r in out["runs"]] == [(0, 0), (1, 0), (0, 1)]
    assert {s["varied"]: s["runs"] for s in out["spread"]} == {"reward seeds": 2, "RL seeds": 2}
    assert all(math.isfinite(s["gain_sd"]) for s in out["spread"])
    assert os.path.exists(tmp_path / "pipeline_seeds.json")


@pytest.mark.slow  # the audit itself is tested in tests/audit; this is the benchmark's table (about 11 s)
def test_the_audit_benchmark_writes_its_table(tmp_path):
    from benchmarks import audit

    out = audit.main(["--seeds", "1", "--canaries", "200", "--large", "0", "--paper_canaries", "0", "--steps", "3",
                      "--epsilons", "4", "--out", str(tmp_path)])
    assert set(out["results"]) == {f"{kind}|4.0|200" for kind in audit.KINDS}
    results = out["results"]
    assert results["σ/4 (claims σ)|4.0|200"]["epsilon_lower"][0] > results["honest|4.0|200"]["mean"]
    assert results["σ/4 (claims σ)|4.0|200"]["fdp_mean"] > results["honest|4.0|200"]["fdp_mean"]
    assert 0 < results["honest|4.0|200"]["ceiling"] < 4.0
    assert (tmp_path / "audit.json").exists()


@pytest.mark.slow  # four pairs of processes building a 19.5 M-parameter model: about a minute
def test_the_sharding_benchmark_halves_the_state_per_rank(tmp_path):
    from benchmarks import sharding

    out = sharding.main(["--steps", "1", "--seq", "16", "--methods", "ddp user ghost", "fsdp2 user ghost",
                         "--out", str(tmp_path)])
    ratio = out["fsdp2 user ghost"]["state_bytes"] / out["ddp user ghost"]["state_bytes"]
    assert 0.4 < ratio < 0.6, ratio  # parameters, gradients and AdamW's state sharded over two ranks
    assert os.path.exists(tmp_path / "sharding.json")


@pytest.mark.slow  # the 19.5 M-parameter Llama in seven copies
def test_step_cost_adds_the_fsdp2_rows_for_full_fine_tuning_only(tmp_path):
    from benchmarks import step_cost

    out = step_cost.main(["--workloads", "llama_lora", "llama_full", "--ms", "2", "--rows", "4", "--seq", "8",
                          "--steps", "1", "--users", "--fsdp2", "--out", str(tmp_path)])
    full, lora = out["results"]["llama_full"]["cells"], out["results"]["llama_lora"]["cells"]
    assert {"fsdp2 non-private", "fsdp2 user ghost m=2"} <= set(full) and not any("fsdp2" in k for k in lora)
    assert full["fsdp2 user ghost m=2"]["time_ratio_to_fsdp2_non_private"] > 0


@pytest.mark.slow  # 25 s of CPU: benchmarks are opt-in runs (its paired gaps and bootstrap are tested below)
def test_users_scaling_runs_every_mechanism_with_its_control_in_a_tiny_grid(tmp_path):
    from benchmarks import users_scaling

    out = users_scaling.main(["--n_users", "16", "--seeds", "2", "--epsilons", "3", "--learning_rates", "0.5", "2",
                              "--pool", "200", "--public_users", "36", "--eval_pairs", "60", "--workers", "1", "--no_rl",
                              "--survival_grid", "40", "--out", str(tmp_path), "--work_dir", str(tmp_path / "runs")])
    # one public tuning per mechanism here (one n, one ε), each of the 2 candidates
    assert {t["mechanism"] for t in out["tuning"]} == set(users_scaling.MECHANISMS) and len(out["tuning"]) == 12
    rule = out["rule"]
    key = lambda mech, eps: "|".join(map(str, users_scaling.tuning_key(mech, eps, 16)))  # noqa: E731
    # the step size follows the noise: the public users (ñ_pub = 2·√36 = 12) train at σ_pub = σ·12/8, the cell's noise
    for mech in users_scaling.NOISE_FOLLOWING:
        sigma = users_scaling.target_sigma(mech, 16, 3.0, 10, 1e-5)
        assert rule["public_noise_multiplier"][key(mech, 3.0)] == pytest.approx(sigma * 12 / 8)
        assert all(t["noise_multiplier"] == pytest.approx(sigma * 12 / 8) for t in out["tuning"] if t["mechanism"] == mech)
    assert all(t["noise_multiplier"] is None for t in out["tuning"] if t["mechanism"] not in users_scaling.NOISE_FOLLOWING)
    series = {(r["series"], r["epsilon"]) for r in out["results"]}
    private = [m for m in users_scaling.MECHANISMS if m != "none"]
    rates = {m: rule["learning_rate"][key(m, 3.0)] for m in private}
    expected = {("none", None)} | {(m, 3.0) for m in private} | {(f"{m} (σ = 0) [lr {rates[m]:g}]", None)
                                                                   for m in private if m != "randomized_response"}
    tuned = rule["learning_rate"][key("none", None)]
    assert series == expected | {(f"none [lr {r:g}]", None) for r in set(rates.values()) - {tuned}}  # step-size control
    for k, by_n in out["summary"]["cells"].items():  # every cell has its seeds
        assert set(by_n) == {"16"} and by_n["16"]["n"] == 2, k
    for r in out["results"]:
        assert 0 <= r["accuracy"] <= 1 and r["steps_taken"] <= users_scaling.STEPS
        spent = r["epsilon_spent"]
        assert (spent is None) == (r["epsilon"] is None), r["series"]  # a control spends no ε, a private cell ≤ its ε
        assert spent is None or 0 < spent <= 3.0 + 1e-6
        if not r["variant"]:  # the rule's cells train at their tuned step; the controls at a private cell's
            assert r["learning_rate"] == rule["learning_rate"][key(r["mechanism"], r["epsilon"])]
    assert rule["users_per_batch"] == "2*sqrt(n)" and users_scaling.users_per_batch(400) == 40
    assert 0 <= out["aup_regime"][0]["survival"] <= 1
    assert os.path.exists(tmp_path / "users_scaling.json") and os.path.exists(tmp_path / "users_scaling.png")
    from trl_userdp.mechanisms import mechanism_names

    assert "aup_noise_free" not in mechanism_names()  # the control (no privacy) is registered only while it runs


@pytest.mark.slow  # a minute of CPU: benchmarks are opt-in runs (its choice of candidate is tested below)
def test_aup_regime_tunes_both_radii_alike_and_runs_each_mechanism_beside_its_controls(tmp_path):
    from benchmarks import aup_regime

    out = aup_regime.main(["--n_users", "40", "--users_per_batch", "20", "--seeds", "2", "--learning_rates", "0.5", "2",
                           "--scales", "1", "2", "--pool", "200", "--eval_pairs", "60", "--workers", "1",
                           "--out", str(tmp_path), "--work_dir", str(tmp_path / "runs")])
    # the same search for both private mechanisms: every radius with every learning rate, on 40 public users at ñ = 20
    for mech, base in (("aup", out["tau0"]), ("user_dpsgd", 1.0)):
        grid = {(t["radius"], t["learning_rate"]) for t in out["tuning"] if t["mechanism"] == mech}
        assert grid == {(s * base, lr) for s in (1, 2) for lr in (0.5, 2)}
    assert all(t["n"] == 40 and t["users_per_batch"] == 20 and t["epsilon"] == (None if t["mechanism"] == "none" else 3)
               for t in out["tuning"])
    chosen, private = out["chosen"], ("aup", "user_dpsgd")
    rates = {chosen[m]["learning_rate"] for m in private}
    expected = {"none", *private} | {f"{m} (σ = 0) [lr {chosen[m]['learning_rate']:g}]" for m in private}
    series = [r["series"] for r in out["results"]]
    assert set(series) == expected | {f"none [lr {lr:g}]" for lr in rates - {chosen["none"]["learning_rate"]}}
    for r in out["results"]:
        assert r["users_per_batch"] == 20 and r["n"] == 40 and series.count(r["series"]) == 2  # ñ, n and the seeds
        if r["mechanism"] != "none":  # each private cell and its control at the chosen radius and step
            mine = chosen[r["mechanism"]]
            assert (r["radius"], r["learning_rate"]) == (mine["radius"], mine["learning_rate"])
        assert (r["epsilon_spent"] is None) == (r["epsilon"] is None)
        assert r["epsilon_spent"] is None or 0 < r["epsilon_spent"] <= 3.0 + 1e-6
    assert set(out["comparisons"]) >= {"aup − user_dpsgd", "aup − its σ = 0 control", "user_dpsgd − its σ = 0 control"}
    assert os.path.exists(tmp_path / "aup_regime.json")


def test_aup_regime_picks_the_best_public_run_and_the_smaller_step_on_a_tie():
    from benchmarks.aup_regime import best_candidate

    runs = [{"mechanism": "aup", "radius": r, "learning_rate": lr, "validation_accuracy": a}
            for r, lr, a in ((1.0, 0.5, 0.70), (2.0, 0.5, 0.74), (2.0, 2.0, 0.74), (1.0, 2.0, 0.60))]
    runs.append({"mechanism": "user_dpsgd", "radius": 1.0, "learning_rate": 8.0, "validation_accuracy": 0.9})
    assert best_candidate(runs, "aup") == runs[1]


def test_users_scaling_finds_the_smallest_n_within_a_point_of_each_reference():
    """The verdict's table: per (mechanism, ε), the first n whose seed mean is within 1 point of the tuned non-private
    mean, and of the non-private mean at the mechanism's own learning rate."""
    from benchmarks import users_scaling

    def cells(series, epsilon, lr, accuracies, variant=""):
        return [{"series": series, "epsilon": epsilon, "learning_rate": lr, "variant": variant, "n": n, "seed": seed,
                 "accuracy": a} for n, pair in accuracies.items() for seed, a in enumerate(pair)]

    results = (cells("none", None, 0.5, {100: (0.70, 0.72), 400: (0.75, 0.77)})
               + cells("none [lr 0.1]", None, 0.1, {100: (0.66, 0.68), 400: (0.70, 0.72)}, "lr 0.1")
               + cells("user_dpsgd", 3.0, 0.1, {100: (0.60, 0.62), 400: (0.70, 0.71)})  # 0.705: 5.5 and 0.5 below
               + cells("group", 3.0, 0.1, {100: (0.50, 0.52), 400: (0.60, 0.62)}))
    reached = {r["mechanism"]: r for r in users_scaling._summary(results, [100, 400])["reached"]}
    assert reached["user_dpsgd"]["smallest_n_within_1_point"] is None
    assert reached["user_dpsgd"]["smallest_n_within_1_point_of_same_rate"] == 400
    assert reached["group"]["smallest_n_within_1_point_of_same_rate"] is None
    gap = reached["user_dpsgd"]["gap_at_largest_n_of_same_rate"]  # paired by seed: 0.70 − 0.70 and 0.71 − 0.72
    assert gap["n"] == 2 and abs(gap["mean"] + 0.005) < 1e-9


def test_users_scaling_shares_the_gain_with_a_bootstrap_interval_over_prompts():
    from benchmarks import users_scaling

    rng = np.random.default_rng(0)
    sft = rng.normal(0, 1, 256)
    none, private = sft + 1.0 + rng.normal(0, 0.5, 256), sft + 0.3 + rng.normal(0, 0.5, 256)
    lo, hi = users_scaling._share_interval(private, none, sft)
    share = (private - sft).mean() / (none - sft).mean()
    assert lo < share < hi and 0.15 < lo and hi < 0.45  # the share 0.3, both gains resampled


def test_step_cost_runs_only_the_methods_asked_for_beside_the_control_and_its_copy(tmp_path):
    from benchmarks import step_cost

    out = step_cost.main(["--workloads", "llama_lora", "--ms", "1", "2", "--rows", "4", "--seq", "8", "--steps", "1",
                          "--users", "--methods", "user ghost", "--control-copy", "--out", str(tmp_path)])
    cells = out["results"]["llama_lora"]["cells"]
    assert set(cells) == {"non-private", "non-private copy", "user ghost m=1", "user ghost m=2"}
    assert cells["non-private copy"]["time_ratio"] > 0 and cells["non-private"]["time_ratio"] == 1.0
    assert all(c["peak_live_bytes"] > 0 and c["page_faults"] >= 0 and c["system_s"] >= 0 for c in cells.values())


def test_step_cost_control_of_the_norm_sampler_sends_the_norms_to_functorch():
    """--functorch-norms: the control method's RMSNorm layers compute what they did, but their per-user gradients take
    Opacus's functorch route, while the default method's take the registered sampler."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks import step_cost

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    control = copy.deepcopy(model)
    ids = torch.randint(3, 64, (2, 8))
    plain = step_cost.UserLevel(model, step_cost.lm_losses, 2, m=1, mode="ghost")
    by_functorch = step_cost.UserLevel(control, step_cost.lm_losses, 2, m=1, mode="ghost", functorch_norms=True)
    norms = [[m for m in method.model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormByFunctorch"))]
             for method in (plain, by_functorch)]
    assert len(norms[0]) == len(norms[1]) == 5
    assert not any(hasattr(m, "ft_compute_sample_grad") for m in norms[0])
    assert all(hasattr(m, "ft_compute_sample_grad") for m in norms[1])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, control(ids).logits, rtol=0, atol=0)


def test_the_live_memory_of_a_step_is_its_largest_set_of_tensors_held_at_once():
    """Memory.live_peak_extra: 8 MB and 4 MB held together in one part of the step, then freed, then 8 MB alone in
    another: the peak is 12 MB, whatever glibc kept of the freed memory (the CPU's counterpart of
    torch.cuda.max_memory_allocated), and each part's own peak is its own."""
    import torch

    from benchmarks.step_cost import Memory, phase

    def step():
        with phase("forward"):
            a, b = torch.ones(2 * 2**20), torch.ones(2**20)  # 8 MB and 4 MB of fp32
            del a, b
        with phase("optimizer"):
            c = torch.ones(2 * 2**20)
            del c

    peak, by_phase = Memory.live_peak_extra(step)
    assert 12 * 2**20 <= peak < 12 * 2**20 + 2**16
    assert 12 * 2**20 <= by_phase["forward"] < 12 * 2**20 + 2**16
    assert 8 * 2**20 <= by_phase["optimizer"] < 8 * 2**20 + 2**16
    assert "backward" not in by_phase
