"""AUP-RLHF where its AboveThreshold survives: against user-wise DP-SGD at the same n, ε and users per step ñ, each
beside its noise-free control and the non-private model at its learning rate (docs/users_scaling.md, "AUP-RLHF where
it can run").

The users-needed grid (:mod:`benchmarks.users_scaling`) takes ñ = 2√n users per step, where AUP-RLHF's AboveThreshold
halts (its best-case survival over T = 50 queries is ≤ 0.24 up to ñ = 320 and ≥ 0.98 from ñ = 1,280). Here ñ is
set from that survival table instead (default 1,280 users per step at n = 25,600: q = 0.05), with the same data,
model, T, δ and trainer as that grid.

Tuning, the same budget for both private mechanisms: AUP-RLHF searches its radius τ (``--scales`` × τ₀, τ₀ the 0.9
quantile of the distances between ñ public users' gradients at the initial head) and user-wise DP-SGD its clip C
(``--scales`` × 1), each with every candidate learning rate; the non-private model its learning rate. Each candidate
is the same run on a public population of the same size (n public users, the same ñ, ε and T: the public users see
exactly the private run's noise and AboveThreshold), scored on the pairs of as many other public users by their own
labels; no held-out pair is used.

    python -m benchmarks.aup_regime        # n = 25,600, ñ = 1,280, ε = 3, 3 seeds
    python -m benchmarks.aup_regime --n_users 2000 --users_per_batch 400 --seeds 2 --learning_rates 0.5 2 --scales 1
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List, Optional, Sequence


from benchmarks.common import RESULTS_DIR, fmt, mean_ci, print_table, write_results
from benchmarks.users_scaling import (STEPS, Cell, build_scaling_data, make_payload, map_cells, payload_tau,
                                      registered_control, run_cells, start_workers, survival_table, tune_cell)

#: the private mechanisms compared, and the radius each searches (AUP-RLHF's τ, user-wise DP-SGD's clip C)
PRIVATE = {"aup": "τ", "user_dpsgd": "C"}


def best_candidate(tuning: List[Dict[str, Any]], mechanism: str) -> Dict[str, Any]:
    """The public-user run with the best validation accuracy (on a tie, the smaller learning rate, then radius).

    Args:
        tuning: the public-user runs (:func:`~benchmarks.users_scaling.tune_cell`'s rows).
        mechanism: the mechanism whose candidates compete.

    Returns:
        The winning row.
    """
    rows = [t for t in tuning if t["mechanism"] == mechanism]
    return max(rows, key=lambda t: (t["validation_accuracy"], -t["learning_rate"], -(t["radius"] or 0)))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_users", type=int, default=25600)
    parser.add_argument("--users_per_batch", type=int, default=1280, help="ñ, expected users per step")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[0.03125, 0.125, 0.5, 2.0, 8.0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="the radius candidates: multiples of τ₀ (AUP-RLHF) and of C = 1 (user-wise DP-SGD)")
    parser.add_argument("--pool", type=int, default=12000)
    parser.add_argument("--eval_pairs", type=int, default=1000)
    parser.add_argument("--m", type=int, default=10, help="pairs per user")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--data_seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="processes (one thread each)")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--work_dir", default="runs/aup_regime")
    opts = parser.parse_args(argv)
    if not 0 < opts.users_per_batch < opts.n_users:
        parser.error("--users_per_batch must lie in (0, --n_users)")
    with registered_control():
        return _run(opts)


def _run(opts: argparse.Namespace) -> Dict[str, Any]:
    """Data, τ₀, the public tuning, the cells, the tables and the results file."""
    start = time.time()
    n, n_tilde, eps = opts.n_users, float(opts.users_per_batch), opts.epsilon
    data = build_scaling_data(n, opts.m, opts.pool, n, opts.eval_pairs, opts.data_seed)
    payload = make_payload(data, opts)
    payload["tau"] = tau0 = payload_tau(payload, opts.users_per_batch)
    base = {"aup": tau0, "user_dpsgd": 1.0}
    pool = start_workers(payload, opts)
    try:
        candidates = [Cell("none", None, False, n, 0, lr, users_per_batch=n_tilde) for lr in opts.learning_rates]
        candidates += [Cell(mech, eps, False, n, 0, lr, users_per_batch=n_tilde, radius=scale * base[mech])
                       for mech in PRIVATE for scale in opts.scales for lr in opts.learning_rates]
        tuning = map_cells(tune_cell, candidates, pool, "public tuning")
        chosen = {mech: best_candidate(tuning, mech) for mech in ("none", *PRIVATE)}
        seeds = range(opts.seeds)
        plan = [Cell("none", None, False, n, s, chosen["none"]["learning_rate"], users_per_batch=n_tilde) for s in seeds]
        for mech in PRIVATE:
            lr, radius = chosen[mech]["learning_rate"], chosen[mech]["radius"]
            plan += [Cell(mech, eps, False, n, s, lr, users_per_batch=n_tilde, radius=radius) for s in seeds]
            plan += [Cell(mech, None, True, n, s, lr, f"lr {lr:g}", users_per_batch=n_tilde, radius=radius)
                     for s in seeds]
        for lr in sorted({chosen[mech]["learning_rate"] for mech in PRIVATE} - {chosen["none"]["learning_rate"]}):
            plan += [Cell("none", None, False, n, s, lr, f"lr {lr:g}", users_per_batch=n_tilde) for s in seeds]
        results = [r for rs in map_cells(run_cells, [[c] for c in plan], pool, "reward models") for r in rs]
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    results.sort(key=lambda r: (r["series"], r["seed"]))

    print(f"\nPublic tuning ({n:,} public users, ñ = {n_tilde:g}, ε = {eps:g}): validation accuracy, ⊥ = halted")
    tuning_table = print_table(
        ["mechanism", "radius", *[f"lr {lr:g}" for lr in opts.learning_rates]],
        [[mech, "—" if radius is None else f"{PRIVATE.get(mech, '')} = {radius:.3g}",
          *[next(f"{t['validation_accuracy']:.4f}{' ⊥' if t['halted'] else ''}" for t in tuning
                 if t["mechanism"] == mech and t["radius"] == radius and t["learning_rate"] == lr)
            for lr in opts.learning_rates]]
         for mech, radius in dict.fromkeys((t["mechanism"], t["radius"]) for t in tuning)])

    by_series: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        by_series.setdefault(r["series"], []).append(r)
    survival = survival_table([eps], opts.delta, [n_tilde])[0]["survival"]
    print(f"\nHeld-out pair accuracy ({opts.eval_pairs} pairs), mean ± 95% half-width over {opts.seeds} seeds; n = {n:,}, "
          f"ñ = {n_tilde:g}, T = {STEPS}, ε = {eps:g}, δ = {opts.delta:g}; AboveThreshold's best-case survival "
          f"{survival:.3f}")
    table = print_table(["series", "radius", "lr", "accuracy", "halted", "steps", "ε spent"],
                        [[series, "—" if rs[0]["radius"] is None else f"{rs[0]['radius']:.3g}",
                          f"{rs[0]['learning_rate']:g}", fmt(mean_ci([r["accuracy"] for r in rs])),
                          f"{sum(bool(r['halted']) for r in rs)}/{len(rs)}" if rs[0]["mechanism"].startswith("aup") else "—",
                          f"{min(r['steps_taken'] for r in rs)}–{max(r['steps_taken'] for r in rs)}",
                          "—" if rs[0]["epsilon_spent"] is None else f"{max(r['epsilon_spent'] for r in rs):.3f}"]
                         for series, rs in by_series.items()])
    accuracy = {(r["series"], r["seed"]): r["accuracy"] for r in results}

    def paired(a: str, b: str) -> Optional[Dict[str, float]]:
        gaps = [accuracy[a, s] - accuracy[b, s] for s in seeds if (a, s) in accuracy and (b, s) in accuracy]
        return mean_ci(gaps) if gaps else None

    comparisons = {"aup − user_dpsgd": paired("aup", "user_dpsgd"), "aup − none": paired("aup", "none"),
                   "user_dpsgd − none": paired("user_dpsgd", "none")}
    for mech in PRIVATE:
        lr = chosen[mech]["learning_rate"]
        control = f"{mech} (σ = 0) [lr {lr:g}]"
        comparisons[f"{mech} − its σ = 0 control"] = paired(mech, control)
        same_rate = "none" if lr == chosen["none"]["learning_rate"] else f"none [lr {lr:g}]"
        comparisons[f"{mech} (σ = 0) − {same_rate}"] = paired(control, same_rate)
    print("\nPaired by seed (a seed shares the head's initialisation and the data order)")
    verdict_table = print_table(["difference", "mean ± 95%"],
                                [[k, "—" if v is None else fmt(v)] for k, v in comparisons.items()])
    out = {"arguments": vars(opts), "data_card": data.card, "tau0": tau0, "steps": STEPS,
           "best_case_survival": survival, "chosen": chosen, "tuning": tuning,
           "results": [{k: v for k, v in r.items() if k not in ("head", "report")} for r in results],
           "comparisons": comparisons, "tuning_table": tuning_table, "table": table, "verdict_table": verdict_table,
           "minutes": (time.time() - start) / 60}
    write_results("aup_regime", out, opts.out)
    print(f"\nresults: {os.path.join(opts.out, 'aup_regime.json')}; {out['minutes']:.1f} min")
    return out


if __name__ == "__main__":
    main()
