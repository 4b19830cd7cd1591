"""Zhou, Wu & Orabona's privacy–corruption separation, in the linear BTL model.

An adversary sets a fraction α of the labels to the wrong side; randomized response at ε either
follows the corruption (CTL: corrupt → privatize) or precedes it (LTC: privatize → corrupt). The
estimator is the same in both orders and needs neither α nor the order: the de-biased MLE on the
observed labels (Zhou et al. eq. 14). Their claim (Remark 5.5): the corruption term is multiplied
by c(ε) = (e^ε + 1)/(e^ε − 1) under LTC and not under CTL.

Adversary: among the samples whose current label (clean under CTL, privatized under LTC) agrees
with sign(xᵀθ*), it takes the ⌊αn⌋ with the largest |xᵀθ*| (the most confident) and sets their
label to the wrong side (``--adversary random``: a uniform choice among them, as in Zhou et al.'s
experiments). Setting: d = 5, n = 20000 comparisons, one θ* (centred, ‖θ*‖ = 1) for all
repetitions, fresh data per repetition, φ ~ N(0, I/d) clipped to ‖φ‖ ≤ 1, estimator on Θ_B' with
B' = 3 (the de-biased loss is unbounded below without a radius); 30 repetitions. Reported: the ℓ2
error, the bias ‖mean θ̂ − θ*‖, and the share of estimates stopped by the radius; the LTC/CTL ratio
of the corruption-induced bias (bias(α) − bias(0)) is compared with c(ε) where neither order hit
the radius (a cut-off bias has no ratio).

    python -m benchmarks.corruption_separation           # ~1 min
    python -m benchmarks.corruption_separation --quick
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, fmt, mean_ci, print_table, write_results
from trl_userdp.experiments.linear import generate_btl_data, rr_debiased_mle, sample_theta_star
from trl_userdp.mechanisms import UserRandomizedResponse


def corrupt(labels: np.ndarray, scores: np.ndarray, alpha: float, adversary: str, rng: np.random.Generator) -> np.ndarray:
    """Flip ⌊αn⌋ labels that agree with sign(xᵀθ*) to the wrong side: the most confident ones
    (``"confident"``) or a uniform choice among them (``"random"``)."""
    right = (labels == (scores > 0)).nonzero()[0]
    k = min(int(alpha * len(labels)), len(right))
    if adversary == "confident":
        hit = right[np.argsort(-np.abs(scores[right]))[:k]]
    else:
        hit = rng.choice(right, size=k, replace=False)
    out = labels.copy()
    out[hit] = 1 - out[hit]
    return out


#: Θ_B' radius of the estimator (‖θ*‖ = 1): the de-biased loss is unbounded below without one.
RADIUS = 3.0


def c_eps(eps: float) -> float:
    return (math.exp(eps) + 1) / (math.exp(eps) - 1)


def run(alphas, epsilons, n, reps, d, seed, adversary) -> Dict:
    estimates: Dict[str, list] = {}
    theta_star = sample_theta_star(d, 1.0, np.random.default_rng(seed))  # one θ*: the bias has one direction
    for rep in tqdm(range(reps), desc="repetitions", leave=False):
        data = generate_btl_data(n_users=n, samples_per_user=1, d=d, L=1.0, theta_star=theta_star, seed=seed + 1 + rep)
        scores = data.x @ data.theta_star
        for eps in epsilons:
            rr = UserRandomizedResponse(eps, 1)
            for alpha in alphas:
                rng = np.random.default_rng([seed, rep, int(eps * 1000), int(alpha * 1000)])
                ctl = rr.privatize_labels(corrupt(data.y, scores, alpha, adversary, rng), rng)
                ltc = corrupt(rr.privatize_labels(data.y, rng), scores, alpha, adversary, rng)
                for order, z in (("CTL", ctl), ("LTC", ltc)):
                    theta = rr_debiased_mle(data.x, z, eps, B=RADIUS)
                    estimates.setdefault(f"{eps}|{alpha}|{order}", []).append(theta)
    out = {}
    for key, thetas in estimates.items():
        thetas = np.asarray(thetas)
        diffs = thetas - theta_star
        out[key] = {
            "error": mean_ci(np.linalg.norm(diffs, axis=1)),
            "bias": float(np.linalg.norm(diffs.mean(0))),
            "at_radius": float(np.mean(np.linalg.norm(thetas, axis=1) > 0.99 * RADIUS)),
        }
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2])
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 3.0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--d", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adversary", choices=["confident", "random"], default="confident")
    p.add_argument("--quick", action="store_true", help="8 repetitions, n = 5000")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--name", default="corruption_separation")
    args = p.parse_args(argv)
    n, reps = (5000, 8) if args.quick else (args.n, args.reps)
    res = run(args.alphas, args.epsilons, n, reps, args.d, args.seed, args.adversary)
    rows, ratios = [], {}
    for eps in args.epsilons:
        base = {o: res[f"{eps}|{args.alphas[0]}|{o}"]["bias"] for o in ("CTL", "LTC")}
        for alpha in args.alphas:
            ctl, ltc = res[f"{eps}|{alpha}|CTL"], res[f"{eps}|{alpha}|LTC"]
            extra_ctl, extra_ltc = ctl["bias"] - base["CTL"], ltc["bias"] - base["LTC"]
            clear = ctl["at_radius"] == 0 and ltc["at_radius"] == 0
            ratio = extra_ltc / extra_ctl if alpha > 0 and extra_ctl > 0 and clear else float("nan")
            ratios[f"{eps}|{alpha}"] = ratio
            rows.append([eps, alpha, fmt(ctl["error"]), fmt(ltc["error"]), f"{ctl['bias']:.3f}", f"{ltc['bias']:.3f}",
                         f"{ctl['at_radius']:.0%} / {ltc['at_radius']:.0%}",
                         "—" if math.isnan(ratio) else f"{ratio:.2f}", f"{c_eps(eps):.2f}"])
    print(f"\nDe-biased MLE, {args.adversary} adversary, n = {n}, d = {args.d}, {reps} repetitions; error = ‖θ̂ − θ*‖ (mean ± 95% CI), "
          "bias = ‖mean θ̂ − θ*‖")
    table = print_table(["ε", "α", "error CTL", "error LTC", "bias CTL", "bias LTC", "at radius CTL/LTC",
                         "LTC/CTL extra bias", "c(ε)"], rows)
    path = write_results(args.name, {"adversary": args.adversary, "n": n, "reps": reps, "alphas": args.alphas, "epsilons": args.epsilons,
                                     "results": res, "bias_ratio": ratios, "table": table}, args.out)
    print(f"results: {path}")
    return {"results": res, "bias_ratio": ratios}


if __name__ == "__main__":
    main()
