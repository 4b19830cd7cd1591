"""Helpers shared by the benchmark scripts: confidence intervals, tables, result files."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch
from scipy import stats

from trl_userdp.utils.plots import save_figure

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mean_ci(values: Sequence[float], level: float = 0.95) -> Dict[str, float]:
    """Mean and a Student-t confidence interval."""
    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    half = float(stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(v)}


def fmt(ci: Dict[str, float], digits: int = 3) -> str:
    """``mean ± half-width``; "—" for a cell that has no value (NaN)."""
    if np.isnan(ci["mean"]):
        return "—"
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
    payload["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                          "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    payload["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


Series = Dict[str, List[Dict[str, float]]]


def plot_panels(path: str, panels: Sequence[Tuple[str, Sequence[float], Series, str]], *, ylabel: str,
                dashed: Iterable[str] = (), columns: int = 3) -> None:
    """One log-log panel per ``(title, x, series, xlabel)``, one line per series of :func:`mean_ci` cells with their
    95% intervals (``dashed``: references and controls); written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    dashed = set(dashed)
    names = list(dict.fromkeys(name for _, _, series, _ in panels for name in series))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per series in every panel
    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for ax, (title, x, series, xlabel) in zip(axes.flat, panels):
        for name, cells in series.items():
            ax.errorbar(x, [c["mean"] for c in cells], yerr=[c["hi"] - c["mean"] for c in cells], label=name,
                        color=colors[name], marker="o", ms=3, capsize=2, linestyle="--" if name in dashed else "-")
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
        ax.set_xticks(list(x), [f"{v:g}" for v in x])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    if len(panels) == 1:
        axes.flat[0].legend(fontsize=7)
    else:
        fig.legend([handles[n] for n in names], names, loc="lower center", ncol=min(len(names), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0.03 * (1 + len(names) // 4) if len(panels) > 1 else 0, 1, 1))
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_with_intervals(path: str, x: Sequence[float], series: Series, *, xlabel: str, ylabel: str, title: str,
                        dashed: Iterable[str] = ()) -> None:
    """One panel of :func:`plot_panels`."""
    plot_panels(path, [(title, x, series, xlabel)], ylabel=ylabel, dashed=dashed)
