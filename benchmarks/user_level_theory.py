"""User-level label DP in the linear BTL model: every mechanism against the non-private MLE, with a schedule that
converges and noise-free controls, so that every gap measures privacy and not the optimiser (AUP-RLHF §4–6; issue 15).

Part A — ℓ2 error of θ̂, 10 paired seeds per cell. Each seed draws θ* (d = 5, ‖θ*‖ = B = L = 1, φ ~ N(0, I/d) clipped
to ‖φ‖ ≤ 1) and *one* pool of n·m = 20000 comparisons. Every cell of that seed regroups the same pool into n = 20000/m
users of m comparisons, m ∈ {1, 5, 10, 20, 50}, and runs ε ∈ {0.5, 1, 2, 3, 5, 8} on it: the data are nested across
cells, so the non-private MLE is the same in every cell of a seed and only what one user is (and ε) changes. The row
m = 10 (n = 2000) is the fixed-n privacy–utility curve; the grid is the fixed-n·m one. Every ε is user-level under the
papers' relation, replacing one user's labels (Def. 2), δ = 1e-5. Columns:

- non-private MLE; user-level randomized response (ε/m per label) + the de-biased MLE;
- user-wise DP-SGD with a fixed clip C = 1 (the users' norms are ≈ 0.15: a loose clip nobody would know to avoid),
  with an oracle clip (the median of the users' averaged-gradient norms at θ*: needs θ*), and with the adaptive clip
  (docs/mechanisms.md, M1a; from C₀ = 1 towards the median, its count paid for inside σ);
- group DP-SGD: item-level DP-SGD on records (record clip 1) made user-level by group privacy over m records;
- AUP-RLHF (Alg. 2 with the sensitivity correction of docs/mechanisms.md, M4) with τ from public users: the
  0.9-quantile of the distances between per-user gradients at θ = 0 on 200 fresh users; only where n ≤ 2000 (its
  concentration score compares every pair of sampled users, O(n²) per step). Its "steps" column is the number of
  steps it ran before AboveThreshold halted it;
- user-level objective perturbation (Chowdhury et al. §5.2 with L → m·L).

Every SGD estimator (user-wise, group, AUP) uses every user at every step (ñ = n, Thm 4's choice), T = 300 steps of
``min(5, 1/(0.05(t+1)))`` from θ = 0, projection onto Θ_B, the average of the last half of the iterates, and has a
"no noise" control: the same steps with ε = ∞ (no noise, exact counts, no AboveThreshold). The control shows that the
schedule converges (≈ the MLE), so each private column's gap to its control is what privacy costs. Paired seeds: the
same θ*, data and noise streams for every column of a cell.

Part B — the paper's Table 1/2 analogue: the per-coordinate noise std on the averaged gradient, user-wise DP-SGD
``σ·C/ñ`` against AUP-RLHF ``τ·σ'·√(8 log(e^ε T/δ))/ñ``, in the TL;DR setting (≈ 90k pairs, ñ·m = 500 pairs per step,
5 epochs), with C = 1 and τ = C/√m; the chance that AboveThreshold lets all T steps through in the best case (every
sampled user within τ of every other, the Laplace noise of the threshold and of each query included;
``aup.survival_probability``), and the users per step AUP needs for that at n = 2000, T = 500, ε = 3.

    python -m benchmarks.user_level_theory            # 10 seeds, the full grid; about 22 min on 2 CPU cores
    python -m benchmarks.user_level_theory --quick    # m = 10 only, ε ∈ {1, 3, 8}, 3 seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, fmt, mean_ci, plot_panels, print_table, write_results
from trl_userdp.accountants.events import PoissonGaussian
from trl_userdp.experiments.linear import (
    BTLData,
    aup_rlhf,
    generate_btl_data,
    group_dpsgd,
    mle,
    sample_theta_star,
    theorem4_tau,
    user_dpsgd,
    user_dpsgd_adaptive_clip,
    user_gradients,
    user_objective_perturbation,
    user_rr_mle,
)
from trl_userdp.mechanisms import aup
from trl_userdp.mechanisms.aup import pairwise_distances
from trl_userdp.validators import check_steps

D, DELTA, B, C = 5, 1e-5, 1.0, 1.0
STEPS, LR0, MU = 300, 5.0, 0.05
#: every ε here is under the papers' neighbouring relation, "replace one user's labels" (docs/privacy_model.md): user RR
#: and objective perturbation are ε-DP under it as defined; the DP-SGD family and AUP's Gaussian half are calibrated to
#: it by dp-accounting's PLD (add/remove-calibrated σ would give them about 2ε under replacement)
RELATION = "replace"
PRIVATE = ("user RR + de-biased MLE", "fixed C=1", "oracle clip", "adaptive", "group", "AUP (public τ)",
           "objective perturbation")
COLUMNS = ("non-private MLE", "user RR + de-biased MLE", "fixed C=1, no noise", "fixed C=1", "oracle, no noise",
           "oracle clip", "adaptive, no noise", "adaptive", "group, no noise", "group", "AUP, no noise",
           "AUP (public τ)", "objective perturbation")


def schedule(t: int) -> float:
    """``min(lr0, 1/(μ(t+1)))``: the logistic loss here is about μ-strongly convex, so SGD converges."""
    return min(LR0, 1.0 / (MU * (t + 1)))


def regroup(pool: BTLData, m: int) -> BTLData:
    """The same comparisons as ``pool``, ``m`` per user (the cells of one seed are nested: only the grouping differs)."""
    if len(pool.y) % m:
        raise ValueError(f"n·m = {len(pool.y)} is not a multiple of m = {m}.")
    return dataclasses.replace(pool, users=np.repeat(np.arange(len(pool.y) // m), m))


def public_tau(theta_star: np.ndarray, m: int, seed: int, coverage: float = 0.9) -> float:
    """τ proposed from 200 public users (the role of ``propose_concentration_radius``)."""
    pub = generate_btl_data(n_users=200, samples_per_user=m, d=D, theta_star=theta_star, seed=seed)
    g = user_gradients(np.zeros(D), pub.x.reshape(200, m, D), pub.y.reshape(200, m))
    dist = pairwise_distances([torch.from_numpy(g)]).numpy()
    return float(np.quantile(dist[~np.eye(200, dtype=bool)], coverage))


def infeasible_as_nan(run) -> float:
    """``run()``, or NaN where no noise multiplier up to 10⁴ reaches the target ε (group privacy at ε = 0.5 and
    m = 50 asks each record for ε/m = 0.01): the table prints "—" there."""
    try:
        return run()
    except ValueError as err:
        if "needs a noise multiplier above" not in str(err):
            raise
        return math.nan


def one_seed(seed: int, total: int, ms: Sequence[int], epsilons: Sequence[float], quantile: float,
             aup_max_users: int) -> Dict[int, Dict[str, Dict[str, float]]]:
    """Every cell (m, ε) of one seed, on one pool of ``total`` comparisons."""
    rng = np.random.default_rng(seed)
    theta_star = sample_theta_star(D, 1.0, rng)
    pool = generate_btl_data(n_users=total, samples_per_user=1, d=D, theta_star=theta_star,
                             seed=int(rng.integers(2**31)))
    err = lambda theta: float(np.linalg.norm(theta - theta_star))  # noqa: E731
    mle_err = err(mle(pool.x, pool.y, B=B))  # the same comparisons in every cell
    out = {}
    for m in ms:
        data, n = regroup(pool, m), total // m
        stream = lambda eps: np.random.default_rng([seed, m, int(eps * 100)])  # noqa: E731 - paired across columns
        sgd = dict(users_per_batch=float(n), steps=STEPS, lr=schedule, B=B, relation=RELATION, tail_average=True)
        adaptive = dict(initial_clip=1.0, target_quantile=quantile, clip_learning_rate=0.2)
        oracle = float(np.median(np.linalg.norm(
            user_gradients(theta_star, data.x.reshape(n, m, D), data.y.reshape(n, m)), axis=1)))
        with_aup = n <= aup_max_users
        tau = public_tau(theta_star, m, seed + 7) if with_aup else math.nan
        base = {"non-private MLE": mle_err, "oracle_clip_value": oracle, "public_tau": tau,
                "fixed C=1, no noise": err(user_dpsgd(data, None, DELTA, max_grad_norm=C, rng=stream(0), **sgd).theta),
                "oracle, no noise": err(user_dpsgd(data, None, DELTA, max_grad_norm=oracle, rng=stream(0),
                                                   **sgd).theta),
                "adaptive, no noise": err(user_dpsgd_adaptive_clip(data, None, DELTA, rng=stream(0), **adaptive,
                                                              **sgd).theta),
                "group, no noise": err(group_dpsgd(data, None, DELTA, max_grad_norm=C, rng=stream(0), **sgd).theta),
                "AUP, no noise": err(aup_rlhf(data, None, DELTA, tau=tau, rng=stream(0), **sgd).theta)
                if with_aup else math.nan}
        out[m] = {}
        for eps in epsilons:
            aup_run = aup_rlhf(data, eps, DELTA, tau=tau, rng=stream(eps), **sgd) if with_aup else None
            out[m][str(eps)] = {
                **base,
                "user RR + de-biased MLE": err(user_rr_mle(data, eps, rng=stream(eps), B=B)),
                "fixed C=1": err(user_dpsgd(data, eps, DELTA, max_grad_norm=C, rng=stream(eps), **sgd).theta),
                "oracle clip": err(user_dpsgd(data, eps, DELTA, max_grad_norm=oracle, rng=stream(eps), **sgd).theta),
                "adaptive": err(user_dpsgd_adaptive_clip(data, eps, DELTA, rng=stream(eps), **adaptive, **sgd).theta),
                "group": infeasible_as_nan(lambda: err(group_dpsgd(data, eps, DELTA, max_grad_norm=C,
                                                                   rng=stream(eps), **sgd).theta)),
                "AUP (public τ)": err(aup_run.theta) if with_aup else math.nan,
                "AUP steps": aup_run.steps_taken if with_aup else math.nan,
                "objective perturbation": err(user_objective_perturbation(data, eps, DELTA, rng=stream(eps), B=B)),
            }
    return out


def grid(args) -> Dict[str, Dict[str, Dict]]:
    """``results[m][ε]``: each column's mean ± 95% interval over seeds, and its per-seed ratio to the MLE's error."""
    runs = [one_seed(s, args.total, args.ms, args.epsilons, args.quantile, args.aup_max_users)
            for s in tqdm(range(args.seeds), desc="seeds")]
    results: Dict[str, Dict[str, Dict]] = {}
    for m in args.ms:
        results[str(m)] = {}
        for eps in map(str, args.epsilons):
            cells = [r[m][eps] for r in runs]
            mle_err = np.array([c["non-private MLE"] for c in cells])
            cell = {k: mean_ci([c[k] for c in cells]) for k in cells[0]}
            cell["n"] = args.total // m
            cell["ratio_to_mle"] = {k: mean_ci(np.array([c[k] for c in cells]) / mle_err) for k in COLUMNS}
            results[str(m)][eps] = cell
    return results


def noise_table(ms: Sequence[int], epsilons: Sequence[float], total_pairs: int = 90_000, pairs_per_step: int = 500,
                epochs: int = 5) -> List[Dict[str, float]]:
    rows = []
    for eps in epsilons:
        for m in ms:
            n, n_tilde = total_pairs // m, pairs_per_step / m
            q = n_tilde / n
            steps = check_steps(None, epochs, q)  # the engine's plan: ceil(E·round(1/q))
            n_max = aup.default_max_users_per_batch(n_tilde)
            sigma_user = PoissonGaussian().calibrate(eps, DELTA, sample_rate=q, steps=steps, accountant="pld",
                                                     relation=RELATION, tol=1e-3)
            eps_svt, eps_gauss, delta_gauss = aup.split_budget(eps, DELTA, svt_fraction=0.5)
            sigma_aup = aup.gaussian_noise_multiplier(eps_gauss, delta_gauss, sample_rate=q, steps=steps, n_users=n,
                                                      max_users_per_batch=n_max, relation=RELATION, tol=1e-3)
            rows.append({
                "epsilon": eps, "m": m, "n": n, "users_per_step": n_tilde, "steps": steps,
                "user_wise": sigma_user * C / n_tilde,
                "aup": aup.noise_std(C / math.sqrt(m), sigma_aup, eps, steps, DELTA, n_tilde),
                "aup_survives_T": aup.survival_probability(n_tilde, n_max, eps_svt, steps),
            })
    return rows


def regime_table(n: int = 2000, steps: int = 500, epsilon: float = 3.0,
                 users_per_step: Sequence[int] = (100, 200, 400, 600, 800, 1000, 1200, 1500)) -> List[Dict[str, float]]:
    """How many users per step AUP-RLHF needs to run ``steps`` steps without halting (best case, as the noise table)."""
    eps_svt = aup.split_budget(epsilon, DELTA, svt_fraction=0.5)[0]
    return [{"n": n, "steps": steps, "epsilon": epsilon, "users_per_step": u,
             "survives": aup.survival_probability(float(u), aup.default_max_users_per_batch(u), eps_svt, steps)}
            for u in users_per_step]


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--total", type=int, default=20000, help="n·m, the comparisons of every cell")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 5, 10, 20, 50])
    p.add_argument("--headline-m", type=int, default=10, help="the fixed-n row (n = total/m)")
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0, 5.0, 8.0])
    p.add_argument("--quantile", type=float, default=0.5, help="the adaptive clip's target quantile")
    p.add_argument("--aup-max-users", type=int, default=2000, help="run AUP-RLHF only where n is at most this")
    p.add_argument("--table_ms", type=int, nargs="+", default=[5, 10, 20, 50])
    p.add_argument("--table_epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    p.add_argument("--table_pairs", type=int, default=90_000, help="pairs in the noise table's setting (TL;DR: 90k)")
    p.add_argument("--regime_users", type=int, nargs="+", default=[100, 200, 400, 600, 800, 1000, 1200, 1500],
                   help="users per step of the AUP survival table")
    p.add_argument("--quick", action="store_true", help="m = 10 only, ε ∈ {1, 3, 8}, 3 seeds")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--name", default="user_level_theory")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.ms, args.epsilons, args.table_epsilons = 3, [args.headline_m], [1.0, 3.0, 8.0], [3.0]
    if args.headline_m not in args.ms:
        args.headline_m = args.ms[0]
    results = grid(args)
    head = results[str(args.headline_m)]
    n_head = args.total // args.headline_m
    tables = []
    print(f"\nℓ2 error of θ̂ (mean ± 95% half-width over {args.seeds} paired seeds), n = {n_head} users, "
          f"m = {args.headline_m}, δ = {DELTA}, relation {RELATION!r}, T = {STEPS}, step min({LR0}, 1/({MU}(t+1))), "
          "tail average; AUP steps: mean steps run before halting")
    tables.append(print_table(["ε", *COLUMNS, "AUP steps"],
                              [[e, *(fmt(c[k], 4) for k in COLUMNS), fmt(c["AUP steps"], 0)] for e, c in head.items()]))
    print(f"\nRatio to the non-private MLE's error (per seed, then mean ± 95% half-width), fixed n·m = {args.total} "
          "comparisons regrouped into n = n·m/m users (the same comparisons in every row of a seed)")
    tables.append(print_table(
        ["m", "n", "ε", *COLUMNS[1:], "AUP steps"],
        [[m, results[m][e]["n"], e, *(fmt(results[m][e]["ratio_to_mle"][k], 2) for k in COLUMNS[1:]),
          fmt(results[m][e]["AUP steps"], 0)] for m in results for e in results[m]]))
    thm4 = theorem4_tau(1.0, n_head, D, args.headline_m, 3.0, STEPS, DELTA)
    print(f"\nAUP-RLHF with Thm 4's τ instead: τ = {thm4:.1f} at n = {n_head}, m = {args.headline_m}, ε = 3, T = {STEPS}, "
          "while per-user gradients have norm ≤ 2L = 2 (distances ≤ 4): nothing is ever removed and its noise scales "
          "with τ, so the benchmark uses the public τ (column 'public_tau' in the JSON)")
    noise = noise_table(args.table_ms, args.table_epsilons, total_pairs=args.table_pairs)
    setting = "TL;DR setting" if args.table_pairs == 90_000 else "setting"
    print(f"\nPer-coordinate noise std on the averaged gradient, {setting} ({args.table_pairs:,} pairs, ñ·m = 500, "
          f"5 epochs), C = 1, τ = C/√m, σ under the {RELATION!r} relation")
    tables.append(print_table(
        ["ε", "m", "n", "ñ", "T", "user-wise DP-SGD", "AUP-RLHF", "AUP/user-wise", "P(AUP survives T steps)"],
        [[r["epsilon"], r["m"], r["n"], f"{r['users_per_step']:g}", r["steps"], f"{r['user_wise']:.4f}",
          f"{r['aup']:.4f}", f"{r['aup'] / r['user_wise']:.2f}", f"{r['aup_survives_T']:.2e}"] for r in noise],
    ))
    regime = regime_table(users_per_step=args.regime_users)
    print("\nP(AUP-RLHF runs T = 500 steps without halting) against users per step ñ, n = 2000, ε = 3 (ε_svt = 1.5), "
          "best case (every pair of users within τ), AboveThreshold's noise included")
    tables.append(print_table(["ñ", "P(survives T steps)"],
                              [[r["users_per_step"], f"{r['survives']:.3g}"] for r in regime]))
    settings = {"d": D, "delta": DELTA, "relation": RELATION, "steps": STEPS, "lr0": LR0, "mu": MU, "B": B,
                "fixed_clip": C, "group_record_clip": C, "quantile": args.quantile, "initial_clip": 1.0,
                "clip_learning_rate": 0.2, "total_comparisons": args.total, "headline_m": args.headline_m,
                "aup_max_users": args.aup_max_users, "theorem4_tau_headline_eps3": thm4}
    path = write_results(args.name, {"seeds": args.seeds, "settings": settings, "results": results,
                                     "noise_table": noise, "regime_table": regime, "tables": tables}, args.out)
    plot(results, os.path.splitext(path)[0] + ".png", args)
    print(f"results: {path}")
    return {"results": results, "noise_table": noise, "regime_table": regime}


def plot(results: Dict, path: str, args) -> None:
    """One privacy–utility panel per m (fixed n·m; the headline m is the fixed-n curve), and the grid at ε = 3 over m."""
    shown = ("non-private MLE", *PRIVATE)

    def series(cells: List[Dict]) -> Dict[str, List[Dict]]:  # AUP is left out where it did not run (n too large)
        return {k: [c[k] for c in cells] for k in shown if not all(math.isnan(c[k]["mean"]) for c in cells)}

    panels = [(f"n = {next(iter(cells.values()))['n']} users × m = {m}", [float(e) for e in cells],
               series(list(cells.values())), "ε (user level, replace one user; δ = 1e-5)")
              for m, cells in results.items()]
    if len(results) > 1 and all("3.0" in cells for cells in results.values()):
        panels.append((f"fixed n·m = {args.total}, ε = 3", [float(m) for m in results],
                       series([cells["3.0"] for cells in results.values()]), "m comparisons per user (n = n·m / m)"))
    plot_panels(path, panels, ylabel="‖θ̂ − θ*‖₂ (mean, 95% interval)", dashed=["non-private MLE"])


if __name__ == "__main__":
    main()
