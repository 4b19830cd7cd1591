"""Every example with its own defaults, in order, as a user runs them (opt-in: about 10 minutes on 2 CPU cores;
``./scripts/test -m slow``). The default test run covers each one in a reduced mode (test_trl_examples.py)."""

import os
import pathlib
import subprocess
import sys

import pytest

from trl_userdp import PrivacyReport

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
#: online_rl reads the reward model that reward_modeling saved in runs/reward
ORDER = ["opacus_user_level", "reward_modeling", "dpo", "online_rl", "tldr_summarization"]


@pytest.mark.slow
def test_every_example_runs_with_its_defaults_and_reports_epsilon(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ORDER:
        done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        assert "ε" in done.stdout, name
    for run in ("reward", "dpo", "online_rl"):
        report = PrivacyReport.load(str(tmp_path / "runs" / run))
        assert 0 < report.epsilon <= 8.0, run
