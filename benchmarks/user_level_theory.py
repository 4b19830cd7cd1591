"""User-level label DP in the linear BTL model: AUP-RLHF against its baselines (AUP-RLHF §4–6).

Part A — ℓ2 error of θ* estimates, ≥ 20 seeds per cell, for: non-private MLE; user-level RR (ε/m
per label) + de-biased MLE; group-privacy DP-SGD; user-wise DP-SGD; AUP-RLHF with Thm 4's τ and η;
AUP-RLHF with τ from public users; central objective perturbation at user level. Sweeps: m at fixed
n, n at fixed m, ε at fixed (n, m); δ = 1e-5.

Choices: d = 5, L = B = 1, θ* centred with ‖θ*‖ = 1 (one θ* per seed), φ ~ N(0, I/d) clipped to
‖φ‖ ≤ 1. SGD-type estimators use every user at every step (ñ = n, Thm 4's choice; with Poisson
batches of ñ ≪ n AUP-RLHF halts within a few steps, see part B), T = 100 steps, step 0.5 (AUP with
Thm 4: its η), C = 1, projection onto Θ_B, average iterate. "τ from public users": the 0.9-quantile
of the distances between per-user gradients at θ = 0 on 200 fresh public users. σ from
dp-accounting's PLD (truncated-Poisson event for AUP at (ε/2, δ/2); group conversion for group privacy).

Part B — the paper's Table 1/2 analogue: the per-coordinate noise std on the averaged gradient,
user-wise DP-SGD ``σ·C/ñ`` against AUP-RLHF ``τ·σ'·√(8 log(e^ε T/δ))/ñ``, in the TL;DR setting
(≈ 90k pairs, ñ·m = 500 pairs per step, 5 epochs), with C = 1 and τ = C/√m (the spread of an
average of m gradients of norm ≤ C); plus the chance that AUP's AboveThreshold lets all T steps through in the best
case (every sampled user within τ of every other: score |U_t|²/ñ with truncated Poisson |U_t|, the Laplace noise of
the threshold and of each query included; ``aup.survival_probability``), and the users per step it needs for that
at n = 2000, T = 500, ε = 3.

    python -m benchmarks.user_level_theory            # 20 seeds, about 11 min on 2 CPU cores
    python -m benchmarks.user_level_theory --quick    # m sweep only, 5 seeds, about 2 min
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, fmt, mean_ci, plot_with_intervals, print_table, write_results
from trl_userdp.accountants.events import PoissonGaussian
from trl_userdp.experiments.linear import (
    aup_rlhf,
    generate_btl_data,
    group_dpsgd,
    mle,
    sample_theta_star,
    user_dpsgd,
    user_gradients,
    user_objective_perturbation,
    user_rr_mle,
)
from trl_userdp.mechanisms import aup
from trl_userdp.validators import check_steps
from trl_userdp.mechanisms.aup import pairwise_distances

ESTIMATORS = ("non-private MLE", "user RR + de-biased MLE", "group DP-SGD", "user-wise DP-SGD", "AUP (Thm 4 τ, η)",
              "AUP (public τ)", "objective perturbation")
D, DELTA, STEPS, LR, C = 5, 1e-5, 100, 0.5, 1.0
#: every ε here is under the papers' neighbouring relation, "replace one user's labels" (docs/privacy_model.md): user RR
#: and objective perturbation are ε-DP under it as defined; the DP-SGD family is calibrated to it by
#: dp-accounting's PLD (add/remove-calibrated σ would give them about 2ε under replacement)
RELATION = "replace"


def public_tau(theta_star: np.ndarray, m: int, seed: int, coverage: float = 0.9) -> float:
    pub = generate_btl_data(n_users=200, samples_per_user=m, d=D, theta_star=theta_star, seed=seed)
    g = user_gradients(np.zeros(D), pub.x.reshape(200, m, D), pub.y.reshape(200, m))
    dist = pairwise_distances([torch.from_numpy(g)]).numpy()
    return float(np.quantile(dist[~np.eye(200, dtype=bool)], coverage))


def one_cell(n: int, m: int, eps: float, seed: int) -> Dict[str, float]:
    rng = np.random.default_rng([seed, n, m, int(eps * 100)])
    theta_star = sample_theta_star(D, 1.0, rng)
    data = generate_btl_data(n_users=n, samples_per_user=m, d=D, theta_star=theta_star, seed=int(rng.integers(2**31)))
    err = lambda th: float(np.linalg.norm(th - theta_star))  # noqa: E731
    sgd = dict(users_per_batch=float(n), steps=STEPS, rng=rng, B=1.0, relation=RELATION)
    aup_thm = aup_rlhf(data, eps, DELTA, **sgd)
    aup_pub = aup_rlhf(data, eps, DELTA, tau=public_tau(theta_star, m, seed + 7), lr=LR, **sgd)
    return {
        "non-private MLE": err(mle(data.x, data.y, B=1.0)),
        "user RR + de-biased MLE": err(user_rr_mle(data, eps, rng=rng, B=1.0)),
        "group DP-SGD": err(group_dpsgd(data, eps, DELTA, lr=LR, max_grad_norm=C, **sgd).theta),
        "user-wise DP-SGD": err(user_dpsgd(data, eps, DELTA, lr=LR, max_grad_norm=C, **sgd).theta),
        "AUP (Thm 4 τ, η)": err(aup_thm.theta),
        "AUP (public τ)": err(aup_pub.theta),
        "objective perturbation": err(user_objective_perturbation(data, eps, DELTA, rng=rng, B=1.0)),
        "aup_thm_steps": aup_thm.steps_taken,
        "aup_pub_steps": aup_pub.steps_taken,
    }


def sweep(cells, seeds: int) -> Dict[str, Dict]:
    out = {}
    for n, m, eps in tqdm(cells, desc="cells"):
        runs = [one_cell(n, m, eps, s) for s in range(seeds)]
        out[f"{n}|{m}|{eps}"] = {k: mean_ci([r[k] for r in runs]) for k in runs[0]}
    return out


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
            _, eps_gauss, delta_gauss = aup.split_budget(eps, DELTA, svt_fraction=0.5)
            sigma_aup = aup.gaussian_noise_multiplier(eps_gauss, delta_gauss, sample_rate=q, steps=steps, n_users=n,
                                                      max_users_per_batch=n_max, relation=RELATION, tol=1e-3)
            tau = C / math.sqrt(m)
            eps_svt = aup.split_budget(eps, DELTA, svt_fraction=0.5)[0]
            rows.append({
                "epsilon": eps, "m": m, "n": n, "users_per_step": n_tilde, "steps": steps,
                "user_wise": sigma_user * C / n_tilde,
                "aup": aup.noise_std(tau, sigma_aup, eps, steps, DELTA, n_tilde),
                # best case (every user concentrated), with AboveThreshold's Laplace noise on the threshold and queries
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
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--m", type=int, default=10)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 5, 10, 20, 50])
    p.add_argument("--ns", type=int, nargs="+", default=[200, 500, 1000, 2000])
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    p.add_argument("--table_ms", type=int, nargs="+", default=[5, 10, 20, 50])
    p.add_argument("--quick", action="store_true", help="m sweep only, 5 seeds, noise table at ε = 3")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--name", default="user_level_theory")
    args = p.parse_args(argv)
    seeds = 5 if args.quick else args.seeds
    sweeps = {"m": [(args.n, m, args.epsilon) for m in args.ms]}
    if not args.quick:
        sweeps["n"] = [(n, args.m, args.epsilon) for n in args.ns]
        sweeps["epsilon"] = [(args.n, args.m, e) for e in args.epsilons]
    results, tables = {}, []
    for name, cells in sweeps.items():
        res = sweep(cells, seeds)
        results[name] = res
        print(f"\nSweep over {name}: ℓ2 error ‖θ̂ − θ*‖, mean ± 95% CI over {seeds} seeds "
              f"(δ = {DELTA}, every ε under the {RELATION!r} relation)")
        rows = []
        for n, m, eps in cells:
            cell = res[f"{n}|{m}|{eps}"]
            rows.append([n, m, eps] + [fmt(cell[e]) for e in ESTIMATORS]
                        + [f"{cell['aup_thm_steps']['mean']:.0f}/{cell['aup_pub_steps']['mean']:.0f}"])
        tables.append(print_table(["n", "m", "ε", *ESTIMATORS, "AUP steps (Thm4/pub)"], rows))
    table_eps = [3.0] if args.quick else args.epsilons
    noise = noise_table(args.table_ms, table_eps)
    print("\nPer-coordinate noise std on the averaged gradient, TL;DR setting (90k pairs, ñ·m = 500, 5 epochs), "
          f"C = 1, τ = C/√m, σ under the {RELATION!r} relation")
    tables.append(print_table(
        ["ε", "m", "n", "ñ", "T", "user-wise DP-SGD", "AUP-RLHF", "AUP/user-wise", "P(AUP survives T steps)"],
        [[r["epsilon"], r["m"], r["n"], f"{r['users_per_step']:g}", r["steps"], f"{r['user_wise']:.4f}",
          f"{r['aup']:.4f}", f"{r['aup'] / r['user_wise']:.2f}", f"{r['aup_survives_T']:.2e}"] for r in noise],
    ))
    regime = regime_table()
    print("\nP(AUP-RLHF runs T = 500 steps without halting) against users per step ñ, n = 2000, ε = 3 (ε_svt = 1.5), "
          "best case (every pair of users within τ), AboveThreshold's noise included")
    tables.append(print_table(["ñ", "P(survives T steps)"], [[r["users_per_step"], f"{r['survives']:.3g}"] for r in regime]))
    settings = {"d": D, "delta": DELTA, "steps": STEPS, "lr": LR, "C": C, "neighboring_relation": RELATION}
    path = write_results(args.name, {"seeds": seeds, "settings": settings, "results": results, "noise_table": noise,
                                     "regime_table": regime, "tables": tables}, args.out)
    plot(results["m"], sweeps["m"], os.path.splitext(path)[0] + ".png")
    print(f"results: {path}")
    return {"results": results, "noise_table": noise}


def plot(res: Dict, cells, path: str) -> None:
    n, _, eps = cells[0]
    plot_with_intervals(path, [m for _, m, _ in cells],
                        {name: [res[f"{n_}|{m}|{e}"][name] for n_, m, e in cells] for name in ESTIMATORS},
                        xlabel="m (comparisons per user)", ylabel="‖θ̂ − θ*‖₂", title=f"n = {n} users, ε = {eps}, δ = {DELTA}")


if __name__ == "__main__":
    main()
