"""How many guesses to make, chosen from the claim before any score is seen (docs/audit.md).

Both one-run bounds test a number of guesses ``k``; trying several and keeping the best costs a union bound. A
white-box auditor knows what an honest run of the claimed ε would show: the Gaussian game ``N(μ, 1)`` in, ``N(0, 1)``
out, with μ the Gaussian mechanism's of the same ``(ε, δ)``. The ``k`` that maximises each bound at that game's
*expected* counts depends on the claim alone, so testing only it keeps the full confidence (the choice is fixed before
the run) and is, on average, what the best choice after the fact would give without the union bound's price.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import numpy as np
from scipy import optimize, stats

from .bounds import epsilon_lower_bound, gaussian_epsilon
from .fdp import TradeOffCurve, rejects


def gaussian_precision(mu: float, share: float) -> float:
    """The share of canaries that were in among those scored above the threshold that keeps ``share`` of all above,
    in the Gaussian game (half in, ``N(μ, 1)``; half out, ``N(0, 1)``); by symmetry also the share out among those
    below the mirror threshold.

    Args:
        mu: the game's mean shift.
        share: the share of canaries above the threshold, in (0, 1).

    Returns:
        The precision.
    """
    t = optimize.brentq(lambda x: 0.5 * stats.norm.sf(x - mu) + 0.5 * stats.norm.sf(x) - share, -40, 40)
    return float(0.5 * stats.norm.sf(t - mu) / share)


def gdp_epsilon_rejected(m: int, guesses: int, correct: int, delta: float, significance: float) -> float:
    """ε at ``delta`` of the strongest μ-GDP claim the guesses reject (:func:`~trl_userdp.audit.fdp.rejects` on
    :meth:`~trl_userdp.audit.fdp.TradeOffCurve.gaussian`; 0 when none).

    Args:
        m: the canaries.
        guesses: the guesses made.
        correct: the right ones.
        delta: δ.
        significance: the test's level.

    Returns:
        ε.
    """
    lo, hi = 1e-3, 20.0  # μ rejected below, accepted above
    if not rejects(TradeOffCurve.gaussian(lo), m, guesses, correct, significance):
        return 0.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(TradeOffCurve.gaussian(mid), m, guesses, correct, significance) else (lo, mid)
    return gaussian_epsilon(lo, delta)


def expected_bounds(mu: float, canaries: int, guesses: Iterable[int], delta: float, confidence: float = 0.95,
                    fdp: bool = True) -> Dict[str, Dict[str, float]]:
    """Both bounds at the Gaussian game's expected counts for each number of guesses (half "in", half "out"), and the
    best: what each reaches on average with ``canaries`` canaries when ``k`` is fixed in advance.

    Args:
        mu: the game's mean shift.
        canaries: m.
        guesses: the numbers of guesses to try.
        delta: δ of the claims.
        confidence: the confidence of the bounds.
        fdp: also the f-DP audit's (in the μ-GDP family).

    Returns:
        ``{"steinke": {"epsilon": ε, "guesses": k}, "fdp": {...}}`` (no ``"fdp"`` when ``fdp`` is False).
    """
    best = {"steinke": {"epsilon": 0.0, "guesses": 0}, **({"fdp": {"epsilon": 0.0, "guesses": 0}} if fdp else {})}
    for k in guesses:
        right = int(round(gaussian_precision(mu, k / 2 / canaries) * k))
        found = {"steinke": epsilon_lower_bound(canaries, k, right, delta, confidence)}
        if fdp:
            found["fdp"] = gdp_epsilon_rejected(canaries, k, right, delta, 1 - confidence)
        for name, epsilon in found.items():
            if epsilon > best[name]["epsilon"]:
                best[name] = {"epsilon": epsilon, "guesses": k}
    return best


def plan_guesses(epsilon: float, delta: float, canaries: int, confidence: float = 0.95,
                 candidates: Optional[Iterable[int]] = None) -> Dict[str, int]:
    """The number of guesses each bound should make on ``canaries`` canaries of a run that claims ``(ε, δ)``.

    Args:
        epsilon: the claimed ε (> 0).
        delta: the claimed δ.
        canaries: m.
        confidence: the confidence of the bounds.
        candidates: the numbers of guesses considered (default: 30 even numbers, geometric from 10 to m).

    Returns:
        ``{"steinke": k, "fdp": k}`` (all ``m`` canaries when no k rejects anything, e.g. an infinite claim).
    """
    everything = {"steinke": canaries, "fdp": canaries}
    if canaries < 2 or not 0 < delta < 1:  # too few canaries to split, or a δ no Gaussian mechanism has
        return everything
    if not gaussian_epsilon(1e-4, delta) < epsilon < gaussian_epsilon(20.0, delta):  # no claim to plan for: all
        return everything
    mu = optimize.brentq(lambda x: gaussian_epsilon(x, delta) - epsilon, 1e-4, 20.0)
    if candidates is None:
        candidates = sorted({min(canaries, 2 * round(k / 2)) for k in np.geomspace(10, canaries, 30)})
    best = expected_bounds(mu, canaries, candidates, delta, confidence)
    return {name: found["guesses"] or canaries for name, found in best.items()}
