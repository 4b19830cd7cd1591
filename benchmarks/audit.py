"""One-run user-level audits of the engine (docs/audit.md): white-box gradient canary users through
``PrivacyEngine.make_private_user_level`` at claimed ε ∈ {2, 8}, with their controls.

Rows, each over ``--seeds`` seeds (the canary draw, the sampling and the noise):

- ``honest``: user-wise DP-SGD, ``--canaries`` canary users, T full-batch steps (q = 1), σ calibrated to ε: the
  audited bound must stay below the claim;
- ``ideal Gaussian game``: the control that says how far a one-run audit can get on this mechanism: canaries whose
  scores are exactly ``N(√T/σ, 1)`` in and ``N(0, 1)`` out, scored by the same bounds with the same planned guesses;
- ``ghost bf16 micro-batches``: the honest run on the ghost-clipping path with bf16 parameters and two micro-batches;
- ``Poisson q = 0.2, steps score``: users sampled at q = 0.2, scored by every step's likelihood ratio;
- ``σ/4 (claims σ)`` and ``clip 8× C``: broken runs (a quarter of the noise, users worth 8 times the clip) that
  report the honest ε: the audit must rise above the claim.

Each row has Steinke et al.'s bound and the f-DP audit of the run's own curve (:func:`trl_userdp.audit.audit_curve`:
its ε in the family "the same run at another σ", and how many seeds reject the claimed curve), each testing the number
of guesses planned from the claim (:func:`trl_userdp.audit.planning.plan_guesses`). Extra rows: the honest
run and the ideal game with ``--large`` canaries at the first ε, and with ``--paper_canaries`` at ε = 4, Steinke et
al.'s white-box setting (their Wide ResNet on CIFAR-10: ε_lower ≈ 1.8 at ε = 4). ``ceiling`` is the bound's value at
the ideal game's *expected* counts with the best number of guesses fixed in advance (no union bound): what Steinke et
al.'s bound can reach on average with that many canaries.

    python -m benchmarks.audit                        # 10 seeds, 1,000 canaries, 10,000 at ε = 2, 5,000 at ε = 4; ~4 min
    python -m benchmarks.audit --seeds 2 --canaries 200 --large 0 --paper_canaries 0
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, print_table, write_results
from trl_userdp.accountants.accountant import DPPldAccountant
from trl_userdp.accountants.events import PoissonGaussian
from trl_userdp.audit import audit_curve, audit_gradient_canaries, audit_scores, run_curves
from trl_userdp.audit.bounds import each_test_confidence, gaussian_epsilon, gaussian_game
from trl_userdp.audit.planning import expected_bounds, plan_guesses
from trl_userdp.optimizers import UserDPOptimizer

DELTA = 1e-5
CONFIDENCE = 0.95


def quarter_noise(engine, optimizer) -> None:
    """A broken run: the optimizer adds σ/4 of noise while its accountant (and its report) keep σ.

    Args:
        engine: the run's engine (unused: its accountant is left honest about σ).
        optimizer: the private optimizer, whose ``add_noise`` is replaced.
    """
    add_noise = optimizer.add_noise

    def quiet():
        optimizer.noise_multiplier /= 4
        try:
            add_noise()
        finally:
            optimizer.noise_multiplier *= 4

    optimizer.add_noise = quiet


def _full_batch(epsilon: float, steps: int) -> DPPldAccountant:
    """The accountant of the honest run: T full-batch steps at the σ calibrated to ε."""
    accountant = DPPldAccountant()
    sigma = PoissonGaussian().calibrate(epsilon, DELTA, sample_rate=1.0, steps=steps)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    return accountant


def ceiling(epsilon: float, canaries: int, steps: int) -> float:
    """Steinke et al.'s bound on average with ``canaries`` canaries, at the best number of guesses
    (:func:`~trl_userdp.audit.planning.expected_bounds` of the honest run's μ = √T/σ).

    Args:
        epsilon: the claimed ε (σ calibrated to it for ``steps`` full-batch steps).
        canaries: m.
        steps: T.

    Returns:
        The bound.
    """
    mu = math.sqrt(steps) / PoissonGaussian().calibrate(epsilon, DELTA, sample_rate=1.0, steps=steps)
    return expected_bounds(mu, canaries, range(10, canaries + 1, max(2, canaries // 200) * 2), DELTA,
                           fdp=False)["steinke"]["epsilon"]


#: Mahloujifar et al. 2024, Table 1 (one Gaussian mechanism of noise σ, sensitivity 1, δ = 1e-5): σ, canaries, their
#: Steinke et al. column, their f-DP column
PUBLISHED_IDEALIZED = ((2.0, 100_000, 1.33, 1.59), (1.0, 100_000, 2.61, 3.61))


def _run(kind: str, epsilon: float, canaries: int, steps: int, seed: int) -> Dict[str, float]:
    """One audit of ``kind``: its bounds and the claim."""
    common = dict(steps=steps, target_epsilon=epsilon, delta=DELTA, seed=seed)
    if kind == "ideal Gaussian game":  # the honest run's σ (T full-batch steps): the sum of updates is N(√T/σ, 1)
        accountant = _full_batch(epsilon, steps)
        scores, included = gaussian_game(canaries, math.sqrt(steps) / accountant.history[0][0],
                                         np.random.default_rng(seed))
        level = each_test_confidence(CONFIDENCE, 2)  # as the white-box auditor: its two tests
        plan = plan_guesses(epsilon, DELTA, canaries, level)  # and its plan for the same claim
        curve = audit_curve(scores, included, run_curves(accountant, DELTA), level, abstentions=[plan["fdp"]])
        found = audit_scores(scores, included, DELTA, level, abstentions=[plan["steinke"]])
        return {"epsilon_lower": found.epsilon_lower, "epsilon_claimed": epsilon,
                "epsilon_lower_fdp": curve.epsilon_lower, "fdp_claim_rejected": curve.claim_rejected}
    options = {
        "honest": {},
        "ghost bf16 micro-batches": {"grad_sample_mode": "ghost", "dtype": "bf16", "micro_batches": 2},
        "Poisson q = 0.2, steps score": {"users_per_batch": 0.1 * canaries, "score": "steps", "steps": 3 * steps},
        "σ/4 (claims σ)": {"before_training": quarter_noise},
    }.get(kind, {})
    if options.get("dtype") == "bf16":
        import torch

        options["dtype"] = torch.bfloat16
    common.update(options)
    if kind == "clip 8× C":
        clip_factors = UserDPOptimizer.clip_factors
        UserDPOptimizer.clip_factors = lambda self, norms: 8 * clip_factors(self, norms)
        try:
            report = audit_gradient_canaries(canaries, **common)
        finally:
            UserDPOptimizer.clip_factors = clip_factors
    else:
        report = audit_gradient_canaries(canaries, **common)
    return {"epsilon_lower": report.epsilon_lower, "epsilon_claimed": report.epsilon_claimed,
            "epsilon_lower_fdp": report.epsilon_lower_fdp, "fdp_claim_rejected": report.fdp_claim_rejected}


KINDS = ("honest", "ideal Gaussian game", "ghost bf16 micro-batches", "Poisson q = 0.2, steps score", "σ/4 (claims σ)",
         "clip 8× C")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the audits, print the table and write ``benchmarks/results/audit.json``.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The results written.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--large", type=int, default=10_000, help="canaries of the extra honest run at ε = 2 (0: none)")
    parser.add_argument("--paper_canaries", type=int, default=5000,
                        help="canaries of the extra honest run at ε = 4, Steinke et al.'s white-box setting (0: none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    cells = [(kind, eps, args.canaries) for eps in args.epsilons for kind in KINDS]
    if args.large:
        cells += [("honest", args.epsilons[0], args.large), ("ideal Gaussian game", args.epsilons[0], args.large)]
    if args.paper_canaries:
        cells += [(kind, 4.0, m) for m in sorted({args.canaries, args.paper_canaries})
                  for kind in ("honest", "ideal Gaussian game")]
    results: Dict[str, dict] = {}
    rows: List[List[str]] = []
    ceilings: Dict[tuple, float] = {}
    for kind, eps, m in tqdm(cells, desc="audits"):
        runs = [_run(kind, eps, m, args.steps, seed) for seed in range(args.seeds)]
        bounds = [r["epsilon_lower"] for r in runs]
        fdp = [r["epsilon_lower_fdp"] for r in runs]
        claimed = runs[0]["epsilon_claimed"]
        top = ceilings.setdefault((eps, m), ceiling(eps, m, args.steps))
        cell = {"kind": kind, "canaries": m, "epsilon_claimed": claimed, "epsilon_lower": bounds,
                "mean": float(np.mean(bounds)), "min": float(min(bounds)), "max": float(max(bounds)),
                "above_claim": int(sum(b > claimed for b in bounds)), "ratio": float(np.mean(bounds) / claimed),
                "ceiling": top, "epsilon_lower_fdp": fdp, "fdp_mean": float(np.mean(fdp)),
                "fdp_claim_rejected": int(sum(bool(r["fdp_claim_rejected"]) for r in runs))}
        results[f"{kind}|{eps}|{m}"] = cell
        rows.append([kind, f"{eps:g}", str(m), f"{claimed:.3g}", f"{cell['mean']:.2f}",
                     f"{cell['min']:.2f}–{cell['max']:.2f}", f"{cell['ratio']:.2f}", f"{top:.2f}",
                     f"{cell['above_claim']}/{len(bounds)}", f"{cell['fdp_mean']:.2f}",
                     f"{cell['fdp_claim_rejected']}/{len(runs)}"])
    table = print_table(["run", "target ε", "canaries", "ε claimed", "ε_lower mean", "range", "mean/claimed",
                         "ceiling", "above claim", "f-DP mean", "f-DP rejects"], rows)
    idealized, rows = [], []
    for sigma, m, their_steinke, their_fdp in PUBLISHED_IDEALIZED if args.paper_canaries else ():
        found = expected_bounds(1 / sigma, m, (200, 500, 800, 1000, 1500, 2000, 3000), DELTA)
        ours = {name: best["epsilon"] for name, best in found.items()}
        idealized.append({"sigma": sigma, "canaries": m, "epsilon": gaussian_epsilon(1 / sigma, DELTA),
                          "steinke": ours["steinke"], "published_steinke": their_steinke, "fdp": ours["fdp"],
                          "published_fdp": their_fdp})
        rows.append([f"{sigma:g}", str(m), f"{idealized[-1]['epsilon']:.2f}", f"{ours['steinke']:.2f}",
                     f"{their_steinke:.2f}", f"{ours['fdp']:.2f}", f"{their_fdp:.2f}"])
    if rows:
        print("\nMahloujifar et al. 2024, Table 1's idealized setting (expected counts, best number of guesses):")
        table += "\n\n" + print_table(["σ", "canaries", "ε", "Steinke (ours)", "Steinke (published)", "f-DP (ours)",
                                        "f-DP (published)"], rows)
    payload = {"results": results, "table": table, "delta": DELTA, "confidence": CONFIDENCE, "steps": args.steps,
               "seeds": args.seeds, "idealized": idealized}
    write_results("audit", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
