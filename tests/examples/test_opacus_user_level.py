"""The plain-PyTorch example runs offline in a reduced mode and spends exactly its budget."""

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "opacus_user_level.py"


@pytest.mark.end_to_end
def test_example_runs_and_reports_epsilon_per_epoch(capsys):
    spec = importlib.util.spec_from_file_location("opacus_user_level", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--n_users", "120", "--users_per_batch", "12", "--epochs", "2", "--n_eval_pairs", "100",
                       "--vocab_size", "300", "--max_length", "40", "--target_epsilon", "4"])
    eps = [h["epsilon"] for h in out["history"]]
    assert len(eps) == 2 and eps[0] < eps[1] <= 4.0 and eps[1] == pytest.approx(4.0, abs=0.05)
    assert out["report"].steps_taken == 20 and out["report"].mechanism == "user_dpsgd"
    printed = capsys.readouterr().out
    assert "epoch 1: ε =" in printed and "epoch 2: ε =" in printed
