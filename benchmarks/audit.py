"""One-run user-level audits of the engine (docs/audit.md): white-box gradient canary users through
``PrivacyEngine.make_private_user_level`` at claimed ε ∈ {2, 8}, with their controls.

Rows, each over ``--seeds`` seeds (the canary draw, the sampling and the noise):

- ``honest``: user-wise DP-SGD, ``--canaries`` canary users, T full-batch steps (q = 1), σ calibrated to ε: the
  audited bound must stay below the claim;
- ``ideal Gaussian game``: the control that says how far a one-run audit can get on this mechanism: canaries whose
  scores are exactly ``N(√T/σ, 1)`` in and ``N(0, 1)`` out, scored by the same bound;
- ``ghost bf16 micro-batches``: the honest run on the ghost-clipping path with bf16 parameters and two micro-batches;
- ``Poisson q = 0.2, steps score``: users sampled at q = 0.2, scored by every step's likelihood ratio;
- ``σ/4 (claims σ)`` and ``clip 8× C``: broken runs (a quarter of the noise, users worth 8 times the clip) that
  report the honest ε: the audit must rise above the claim.

    python -m benchmarks.audit                        # 5 seeds, 1,000 canaries, and 10,000 at ε = 2; about 3 min
    python -m benchmarks.audit --seeds 2 --canaries 200 --large 0
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, print_table, write_results
from trl_userdp.accountants.events import PoissonGaussian
from trl_userdp.audit import audit_gradient_canaries, audit_scores
from trl_userdp.audit.bounds import gaussian_game
from trl_userdp.optimizers import UserDPOptimizer

DELTA = 1e-5


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


def _run(kind: str, epsilon: float, canaries: int, steps: int, seed: int) -> Dict[str, float]:
    """One audit of ``kind``: its bound and the claim."""
    common = dict(steps=steps, target_epsilon=epsilon, delta=DELTA, seed=seed)
    if kind == "ideal Gaussian game":  # the honest run's σ (T full-batch steps): the sum of updates is N(√T/σ, 1)
        sigma = PoissonGaussian().calibrate(epsilon, DELTA, sample_rate=1.0, steps=steps)
        found = audit_scores(*gaussian_game(canaries, math.sqrt(steps) / sigma, np.random.default_rng(seed)), DELTA)
        return {"epsilon_lower": found.epsilon_lower, "epsilon_claimed": epsilon}
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
    return {"epsilon_lower": report.epsilon_lower, "epsilon_claimed": report.epsilon_claimed}


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
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--large", type=int, default=10_000, help="canaries of the extra honest run at ε = 2 (0: none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    cells = [(kind, eps, args.canaries) for eps in args.epsilons for kind in KINDS]
    if args.large:
        cells += [("honest", args.epsilons[0], args.large), ("ideal Gaussian game", args.epsilons[0], args.large)]
    results: Dict[str, dict] = {}
    rows: List[List[str]] = []
    for kind, eps, m in tqdm(cells, desc="audits"):
        runs = [_run(kind, eps, m, args.steps, seed) for seed in range(args.seeds)]
        bounds = [r["epsilon_lower"] for r in runs]
        claimed = runs[0]["epsilon_claimed"]
        cell = {"kind": kind, "canaries": m, "epsilon_claimed": claimed, "epsilon_lower": bounds,
                "mean": float(np.mean(bounds)), "min": float(min(bounds)), "max": float(max(bounds)),
                "above_claim": int(sum(b > claimed for b in bounds)), "ratio": float(np.mean(bounds) / claimed)}
        results[f"{kind}|{eps}|{m}"] = cell
        rows.append([kind, f"{eps:g}", str(m), f"{claimed:.3g}", f"{cell['mean']:.2f}",
                     f"{cell['min']:.2f}–{cell['max']:.2f}", f"{cell['ratio']:.2f}",
                     f"{cell['above_claim']}/{len(bounds)}"])
    table = print_table(["run", "target ε", "canaries", "ε claimed", "ε_lower mean", "range", "mean/claimed",
                         "above claim"], rows)
    payload = {"results": results, "table": table, "delta": DELTA, "confidence": 0.95, "steps": args.steps,
               "seeds": args.seeds}
    write_results("audit", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
