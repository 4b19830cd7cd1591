"""Helpers shared by the benchmark scripts: confidence intervals, tables, result files."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Dict, Iterable, List, Sequence

import numpy as np
from scipy import stats

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mean_ci(values: Sequence[float], level: float = 0.95) -> Dict[str, float]:
    """Mean and a Student-t confidence interval."""
    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    half = float(stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(v)}


def fmt(ci: Dict[str, float], digits: int = 3) -> str:
    return f"{ci['mean']:.{digits}f} ± {(ci['hi'] - ci['mean']):.{digits}f}"


def print_table(header: List[str], rows: Iterable[List[str]]) -> str:
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text


def write_results(name: str, payload: dict, out_dir: str = RESULTS_DIR) -> str:
    """Write ``<name>.json`` with the payload, the command line, and the machine."""
    os.makedirs(out_dir, exist_ok=True)
    payload = dict(payload)
    module = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    payload["command"] = " ".join(["python", "-m", f"benchmarks.{module}", *sys.argv[1:]])
    payload["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    payload["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def plot_with_intervals(path: str, x: Sequence[float], series: Dict[str, List[Dict[str, float]]], *, xlabel: str,
                        ylabel: str, title: str, dashed: Iterable[str] = ()) -> None:
    """One line per series of :func:`mean_ci` cells over ``x`` (log-log), with their intervals; written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashed = set(dashed)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, cells in series.items():
        ax.errorbar(x, [c["mean"] for c in cells], yerr=[c["hi"] - c["mean"] for c in cells], label=name, marker="o",
                    ms=3, capsize=2, linestyle="--" if name in dashed else "-")
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

