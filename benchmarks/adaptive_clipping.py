"""Adaptive per-user clipping against fixed clips in the linear BTL world, with a schedule that converges and
noise-free controls, so that every gap measures privacy and not the optimiser (issue 15; docs/mechanisms.md, M1a).

Every estimator uses every user at every step (ñ = n, q = 1), T steps of ``min(lr0, 1/(μ(t+1)))`` from θ = 0,
projection onto Θ_B (B = 1), the average of the last half of the iterates. σ from dp-accounting's PLD under the
"replace one user" relation (the papers' Def. 2), δ = 1e-5, the same σ for fixed and adaptive clips (the adaptive
clip's count is paid for inside σ). Columns:

- non-private MLE;
- user-wise DP-SGD, fixed C = 1 (the users' norms are ≈ 0.15: a loose clip nobody would know to avoid), without
  noise (control) and private;
- user-wise DP-SGD, oracle clip: C = the median of the users' averaged-gradient norms at θ* (needs θ*);
- user-wise DP-SGD, adaptive clip from C₀ = 1 towards the γ = 0.5 quantile, without noise (control) and private;
- group DP-SGD: item-level DP-SGD on records (record clip 1, records sampled with their users) made user-level by
  group privacy over a user's m records, without noise (control) and private;
- user-level objective perturbation (Chowdhury et al. §5.2 with L → m·L).

A second sweep holds the data budget fixed, n·m = 20000 comparisons, at ε = 3, over m ∈ {1, 5, 10, 20, 50}
(``results/adaptive_clipping_fixed_nm.png``).

Each cell: paired seeds (the same θ*, data and noise streams for every column) with 95% intervals; the ε sweep
reuses one dataset per seed (nested across ε).

    python -m benchmarks.adaptive_clipping            # 10 seeds, ε ∈ {0.5, 1, 2, 3, 5, 8}, about 4 min on 2 CPU cores
    python -m benchmarks.adaptive_clipping --seeds 3 --epsilons 3
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, fmt, mean_ci, plot_with_intervals, print_table, write_results
from trl_userdp.experiments.linear import (
    generate_btl_data,
    group_dpsgd,
    mle,
    sample_theta_star,
    user_dpsgd,
    user_dpsgd_adaptive,
    user_gradients,
    user_objective_perturbation,
)

D, DELTA, RELATION, B = 5, 1e-5, "replace", 1.0
STEPS, LR0, MU = 300, 5.0, 0.05
COLUMNS = ("non-private MLE", "fixed C=1, no noise", "fixed C=1", "oracle clip", "adaptive, no noise", "adaptive",
           "group, no noise", "group", "objective perturbation")


def schedule(t: int) -> float:
    """``min(lr0, 1/(μ(t+1)))``: the logistic loss here is about μ-strongly convex, so SGD converges."""
    return min(LR0, 1.0 / (MU * (t + 1)))


def one_seed(n: int, m: int, epsilons: Sequence[float], seed: int, quantile: float) -> Dict[str, Dict[str, float]]:
    rng = np.random.default_rng([seed, n, m])
    theta_star = sample_theta_star(D, 1.0, rng)
    data = generate_btl_data(n_users=n, samples_per_user=m, d=D, theta_star=theta_star, seed=int(rng.integers(2**31)))
    err = lambda theta: float(np.linalg.norm(theta - theta_star))  # noqa: E731
    oracle = float(np.median(np.linalg.norm(
        user_gradients(theta_star, data.x.reshape(n, m, D), data.y.reshape(n, m)), axis=1)))
    sgd = dict(users_per_batch=float(n), steps=STEPS, lr=schedule, B=B, relation=RELATION, tail_average=True)
    adaptive = dict(initial_clip=1.0, target_quantile=quantile, clip_learning_rate=0.2)
    stream = lambda eps: np.random.default_rng([seed, n, m, int(eps * 100)])  # noqa: E731 - paired across columns
    base = {"non-private MLE": err(mle(data.x, data.y, B=B)),
            "fixed C=1, no noise": err(user_dpsgd(data, None, DELTA, max_grad_norm=1.0, rng=stream(0), **sgd).theta),
            "adaptive, no noise": err(user_dpsgd_adaptive(data, None, DELTA, rng=stream(0), **adaptive, **sgd).theta),
            "group, no noise": err(group_dpsgd(data, None, DELTA, max_grad_norm=1.0, rng=stream(0), **sgd).theta),
            "oracle_clip_value": oracle}
    out = {}
    for eps in epsilons:
        out[str(eps)] = {
            **base,
            "fixed C=1": err(user_dpsgd(data, eps, DELTA, max_grad_norm=1.0, rng=stream(eps), **sgd).theta),
            "oracle clip": err(user_dpsgd(data, eps, DELTA, max_grad_norm=oracle, rng=stream(eps), **sgd).theta),
            "adaptive": err(user_dpsgd_adaptive(data, eps, DELTA, rng=stream(eps), **adaptive, **sgd).theta),
            "group": err(group_dpsgd(data, eps, DELTA, max_grad_norm=1.0, rng=stream(eps), **sgd).theta),
            "objective perturbation": err(user_objective_perturbation(data, eps, DELTA, rng=stream(eps), B=B)),
        }
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--m", type=int, default=10)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0, 5.0, 8.0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--quantile", type=float, default=0.5)
    parser.add_argument("--total", type=int, default=20000, help="n·m of the fixed-budget sweep")
    parser.add_argument("--nm-ms", type=int, nargs="*", default=[1, 5, 10, 20, 50],
                        help="m values of the fixed n·m sweep (none: skip it)")
    parser.add_argument("--nm-epsilon", type=float, default=3.0)
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--name", default="adaptive_clipping")
    args = parser.parse_args(argv)
    runs = [one_seed(args.n, args.m, args.epsilons, s, args.quantile) for s in tqdm(range(args.seeds), desc="seeds")]
    results: Dict[str, Dict] = {}
    for eps in map(str, args.epsilons):
        cell = {k: mean_ci([r[eps][k] for r in runs]) for k in runs[0][eps]}
        mle_err = np.array([r[eps]["non-private MLE"] for r in runs])
        cell["ratio_to_mle"] = {k: mean_ci(np.array([r[eps][k] for r in runs]) / mle_err) for k in COLUMNS}
        results[eps] = cell
    print(f"\nℓ2 error of θ̂ (mean ± 95% half-width over {args.seeds} paired seeds), n = {args.n} users, m = {args.m}, "
          f"δ = {DELTA}, relation {RELATION!r}, T = {STEPS}, step min({LR0}, 1/({MU}(t+1))), tail average")
    table = print_table(["ε", *COLUMNS], [[eps, *(fmt(results[eps][k], 4) for k in COLUMNS)] for eps in results])
    print("\nRatio to the non-private MLE's error (per seed, then averaged)")
    ratios = print_table(["ε", *COLUMNS[1:]],
                         [[eps, *(fmt(results[eps]["ratio_to_mle"][k], 2) for k in COLUMNS[1:])] for eps in results])
    tables = [table, ratios]
    fixed: Dict[str, Dict] = {}
    if args.nm_ms:
        eps = str(args.nm_epsilon)
        for m in tqdm(args.nm_ms, desc=f"n·m = {args.total}"):
            runs_m = [one_seed(args.total // m, m, [args.nm_epsilon], s, args.quantile) for s in range(args.seeds)]
            mle_err = np.array([r[eps]["non-private MLE"] for r in runs_m])
            fixed[str(m)] = {"n": args.total // m, **{k: mean_ci([r[eps][k] for r in runs_m]) for k in COLUMNS},
                             "ratio_to_mle": {k: mean_ci(np.array([r[eps][k] for r in runs_m]) / mle_err)
                                              for k in COLUMNS}}
        print(f"\nFixed n·m = {args.total} comparisons, ε = {args.nm_epsilon}: ℓ2 error (mean ± 95% half-width over "
              f"{args.seeds} paired seeds)")
        tables.append(print_table(["m", "n", *COLUMNS], [[m, c["n"], *(fmt(c[k], 4) for k in COLUMNS)]
                                                          for m, c in fixed.items()]))
        plot_fixed_budget(fixed, os.path.join(args.out, f"{args.name}_fixed_nm.png"), args)
    settings = {"n": args.n, "m": args.m, "d": D, "delta": DELTA, "relation": RELATION, "steps": STEPS, "lr0": LR0,
                "mu": MU, "B": B, "quantile": args.quantile, "initial_clip": 1.0, "clip_learning_rate": 0.2,
                "group_record_clip": 1.0, "fixed_nm_total": args.total, "fixed_nm_epsilon": args.nm_epsilon}
    path = write_results(args.name, {"seeds": args.seeds, "settings": settings, "results": results,
                                     "fixed_nm": fixed, "tables": tables}, args.out)
    plot(results, os.path.splitext(path)[0] + ".png", args)
    print(f"results: {path}")
    return {"results": results, "fixed_nm": fixed}


def plot(results: Dict, path: str, args) -> None:
    plot_with_intervals(path, [float(e) for e in results], {name: [results[e][name] for e in results] for name in COLUMNS},
                        xlabel="ε (user level, replace one user; δ = 1e-5)", ylabel="‖θ̂ − θ*‖₂",
                        title=f"Privacy–utility, n = {args.n} users, m = {args.m}",
                        dashed=[c for c in COLUMNS if "no noise" in c or c == "non-private MLE"])


def plot_fixed_budget(fixed: Dict, path: str, args) -> None:
    plot_with_intervals(path, [float(m) for m in fixed], {name: [fixed[m][name] for m in fixed] for name in COLUMNS},
                        xlabel=f"m comparisons per user (n = {args.total} / m users)", ylabel="‖θ̂ − θ*‖₂",
                        title=f"Fixed n·m = {args.total}, ε = {args.nm_epsilon} (replace)",
                        dashed=[c for c in COLUMNS if "no noise" in c or c == "non-private MLE"])


if __name__ == "__main__":
    main()
