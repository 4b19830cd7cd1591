"""The benchmark scripts run end to end in a tiny setting (the real runs are opt-in, see benchmarks/README.md)."""

import json
import math
import os

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


def test_user_level_theory_runs_a_tiny_sweep(tmp_path):
    from benchmarks import user_level_theory

    out = user_level_theory.main(["--quick", "--seeds", "2", "--ms", "2", "--n", "60", "--table_ms", "5", "--out", str(tmp_path)])
    cell = out["results"]["m"]["60|2|3.0"]
    assert set(user_level_theory.ESTIMATORS) <= set(cell)
    row = out["noise_table"][0]
    assert row["user_wise"] > 0 and row["aup"] > 0 and 0 <= row["aup_survives_T"] <= 1
    assert os.path.exists(tmp_path / "user_level_theory.png")


def test_adaptive_clipping_benchmark_runs_a_tiny_sweep(tmp_path):
    from benchmarks import adaptive_clipping

    out = adaptive_clipping.main(["--seeds", "2", "--n", "200", "--m", "4", "--epsilons", "3", "--total", "400",
                                  "--nm-ms", "2", "4", "--out", str(tmp_path)])
    assert set(out["fixed_nm"]) == {"2", "4"} and out["fixed_nm"]["4"]["n"] == 100
    assert os.path.exists(tmp_path / "adaptive_clipping_fixed_nm.png")
    cell = out["results"]["3.0"]
    assert set(adaptive_clipping.COLUMNS) <= set(cell) and cell["ratio_to_mle"]["fixed C=1, no noise"]["n"] == 2
    assert os.path.exists(tmp_path / "adaptive_clipping.json") and os.path.exists(tmp_path / "adaptive_clipping.png")


def test_step_cost_benchmark_runs_a_tiny_setting(tmp_path):
    from benchmarks import step_cost

    out = step_cost.main(["--workloads", "llama_lora", "--ms", "2", "--rows", "4", "--seq", "8", "--steps", "1",
                          "--users", "4", "--materialised-limit-gb", "0", "--out", str(tmp_path)])
    cells = out["results"]["llama_lora"]["cells"]
    assert {"non-private", "opacus hooks", "opacus ghost", "user hooks m=2", "user ghost m=2"} == set(cells)
    assert cells["non-private"]["time_ratio"] == 1.0 and all(c["median_s"] > 0 for c in cells.values())
    scaling = out["scaling"]["cells"]
    assert scaling["ghost|4"]["s_per_step"] > 0 and "skipped" in scaling["hooks|4"]
    assert os.path.exists(tmp_path / "step_cost.json")
