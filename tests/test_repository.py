"""The repository holds code, docs and small results (issue 43): no wheel or archive is tracked, and the committed
results (benchmarks/results and the data files beside the docs) stay small summaries, under 1 MB in all."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
ARCHIVES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".egg", ".7z", ".rar")


def test_no_wheel_or_archive_is_tracked():
    assert [f for f in TRACKED if f.endswith(ARCHIVES)] == []


def test_the_committed_results_are_under_one_megabyte():
    results = [f for f in TRACKED if f.startswith("benchmarks/results/") or (f.startswith("docs/") and not f.endswith(".md"))]
    sizes = {f: (ROOT / f).stat().st_size for f in results}
    assert len(sizes) > 10  # the results are where this test looks
    assert sum(sizes.values()) < 1_000_000, sorted(sizes.items(), key=lambda item: -item[1])[:5]
