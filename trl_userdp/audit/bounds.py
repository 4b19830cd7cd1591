"""The one-run audit's statistics (Steinke, Nasr and Jagielski 2023, "Privacy auditing with one (1) training run",
Thm. 3.1 and Prop. 5.2; docs/audit.md).

``m`` canaries are each included in the training data with probability ½, independently; after one run the auditor
guesses "in" or "out" for ``r`` of them (abstaining on the rest) and ``v`` guesses are right. For an (ε, δ)-DP run the
number of right guesses is dominated by ``Binomial(r, e^ε/(1+e^ε))`` up to a term in δ, so a large ``v`` rejects the
claim "(ε, δ)-DP" with a p-value, and the largest ε rejected at a confidence level is a lower bound on the run's ε.

The unit is whatever a canary is: here a canary is a whole user, so the bound is on the user-level ε.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import optimize, special, stats

from ..validators import check_confidence


def p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[at least ``correct`` right guesses of ``guesses``] under the claim "(ε, δ)-DP" (Steinke et al. 2023, Thm. 3.1
    with Prop. 5.2's δ term): ``β + 2mδ·α``, where ``β = P[Binomial(r, q) ≥ v]`` with ``q = e^ε/(1+e^ε)``, and
    ``α = max_{1≤i≤v} (P[Binomial(r, q) ≥ v − i] − β)/i``.

    Args:
        m: the number of canaries.
        guesses: r, the guesses made (the other canaries were abstained on).
        correct: v, the right ones.
        epsilon: ε of the claim.
        delta: δ of the claim.

    Returns:
        The p-value, in [0, 1].

    Raises:
        ValueError: counts out of order (``0 ≤ v ≤ r ≤ m``), ε < 0 or δ outside [0, 1].
    """
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got correct={correct}, guesses={guesses}, m={m}.")
    if not epsilon >= 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got epsilon={epsilon}, delta={delta}.")
    q = float(special.expit(epsilon))
    beta = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(beta, 1.0)
    shifts = np.arange(1, correct + 1)
    alpha = float(np.max((stats.binom.sf(correct - shifts - 1, guesses, q) - beta) / shifts))
    return min(beta + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε whose claim "(ε, δ)-DP" the guesses reject at ``confidence``: a lower bound on the run's ε that
    holds with probability at least ``confidence`` (0 when nothing is rejected).

    Args:
        m: the number of canaries.
        guesses: r, the guesses made.
        correct: v, the right ones.
        delta: δ of the claims tested (the run's δ).
        confidence: 1 − the significance level.

    Returns:
        ε_lower ≥ 0.

    Raises:
        ValueError: as :func:`p_value`, or ``confidence`` outside (0, 1).
    """
    significance = 1 - check_confidence(confidence)

    def rejected_by(epsilon: float) -> float:  # > 0 where the claim is rejected; p grows with ε
        return significance - p_value(m, guesses, correct, epsilon, delta)

    if rejected_by(0.0) <= 0:
        return 0.0
    hi = 1.0
    while rejected_by(hi) > 0:
        if hi > 1e3:  # every claim rejected (e.g. δ = 0 and all guesses right): as far as ε can be told apart
            return hi
        hi *= 2
    return float(optimize.brentq(rejected_by, 0.0, hi, xtol=1e-6))


@dataclasses.dataclass(frozen=True)
class Guesses:
    """The auditor's guesses from the canaries' scores: the ``k_in`` highest scored "in", the ``k_out`` lowest "out".

    Args:
        k_in: canaries guessed in.
        k_out: canaries guessed out.
        correct: right guesses.
    """

    k_in: int
    k_out: int
    correct: int

    @property
    def guesses(self) -> int:
        """r = k_in + k_out."""
        return self.k_in + self.k_out


def guess(scores: Sequence[float], included: Sequence[bool], k_in: int, k_out: int) -> Guesses:
    """Guess "in" for the ``k_in`` highest scores and "out" for the ``k_out`` lowest, abstain on the rest, and count
    the right guesses against the secret inclusion draw.

    Args:
        scores: one score per canary, higher meaning "more likely trained on".
        included: the secret draw, True for the canaries that were in the training data.
        k_in: guesses "in".
        k_out: guesses "out".

    Returns:
        The :class:`Guesses`.

    Raises:
        ValueError: mismatched lengths, non-finite scores, or ``k_in + k_out`` above the number of canaries.
    """
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"one score per canary: got {scores.shape} scores for {included.shape} canaries.")
    if not np.isfinite(scores).all():
        raise ValueError("every canary's score must be finite.")
    if not (0 <= k_in and 0 <= k_out and k_in + k_out <= len(scores)):
        raise ValueError(f"k_in={k_in} and k_out={k_out} must be >= 0 and add up to at most {len(scores)} canaries.")
    order = np.argsort(scores, kind="stable")  # ties: the draw's order, not the inclusion
    guessed_out, guessed_in = order[:k_out], order[len(order) - k_in:] if k_in else order[:0]
    correct = int(included[guessed_in].sum() + (~included[guessed_out]).sum())
    return Guesses(k_in, k_out, correct)


def default_abstentions(m: int) -> Tuple[int, ...]:
    """Numbers of guesses tried by :func:`audit_scores`: from 2% of the canaries to all of them, each split evenly
    between "in" and "out" (Steinke et al. 2023 guess only their most confident canaries).

    Args:
        m: the number of canaries.

    Returns:
        Distinct guess counts, increasing.
    """
    return tuple(sorted({max(2, 2 * round(m * share / 2)) for share in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)} - {0}))


@dataclasses.dataclass(frozen=True)
class ScoreAudit:
    """The best of the tried abstentions.

    Args:
        epsilon_lower: the lower bound on ε (at ``confidence``, over every abstention tried).
        guesses: the :class:`Guesses` that gave it.
        confidence: the confidence of the bound.
        tried: the numbers of guesses tried (the significance is split evenly between them).
    """

    epsilon_lower: float
    guesses: Guesses
    confidence: float
    tried: Tuple[int, ...]


def audit_scores(scores: Sequence[float], included: Sequence[bool], delta: float, confidence: float = 0.95,
                 abstentions: Optional[Sequence[int]] = None) -> ScoreAudit:
    """ε_lower from the canaries' scores. Each number of guesses in ``abstentions`` is tried, half "in" and half
    "out"; the significance ``1 − confidence`` is split evenly between them (a union bound), so that choosing the
    best after seeing the result keeps the stated confidence.

    Args:
        scores: one score per canary.
        included: the secret inclusion draw.
        delta: the run's δ (0 for a pure-DP claim).
        confidence: the confidence of the bound.
        abstentions: numbers of guesses to try (default :func:`default_abstentions`).

    Returns:
        The :class:`ScoreAudit`.

    Raises:
        ValueError: as :func:`guess` and :func:`epsilon_lower_bound`.
    """
    if not 0 <= delta < 1:
        raise ValueError(f"delta must lie in [0, 1), got {delta!r}.")
    m = len(scores)
    tried = tuple(abstentions) if abstentions is not None else default_abstentions(m)
    per_test = 1 - (1 - check_confidence(confidence)) / len(tried)
    best: Optional[Tuple[float, Guesses]] = None
    for r in tried:
        found = guess(scores, included, k_in=r // 2, k_out=r - r // 2)
        bound = epsilon_lower_bound(m, found.guesses, found.correct, delta, per_test)
        if best is None or bound > best[0]:
            best = (bound, found)
    return ScoreAudit(best[0], best[1], confidence, tried)


def each_test_confidence(confidence: float, tests: int) -> float:
    """The confidence each of ``tests`` tests runs at so that a verdict that fails when any of them rejects keeps
    ``confidence`` (a union bound: the significance split evenly).

    Args:
        confidence: the verdict's confidence.
        tests: how many tests the verdict combines.

    Returns:
        ``1 − (1 − confidence)/tests``.
    """
    return 1 - (1 - check_confidence(confidence)) / tests


def randomized_response_game(m: int, epsilon: float, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """The canary game whose true ε is known: each of ``m`` canaries is in with probability ½, and the mechanism
    releases, for each, its inclusion bit kept with probability ``e^ε/(1+e^ε)`` (ε-DP randomized response per canary).

    Args:
        m: the number of canaries.
        epsilon: the mechanism's ε.
        rng: the source of the draws.

    Returns:
        ``(scores, included)``: the released bits (1.0 for "in") with a tie-breaking jitter below 0.5, and the draw.
    """
    included = rng.random(m) < 0.5
    kept = rng.random(m) < special.expit(epsilon)
    released = np.where(kept, included, ~included).astype(np.float64)
    return released + 0.4 * rng.random(m), included


def gaussian_game(m: int, mu: float, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """The canary game of the Gaussian mechanism: a canary's score is ``N(μ, 1)`` if it is in and ``N(0, 1)`` if not.

    Args:
        m: the number of canaries.
        mu: the mean shift μ (μ-GDP).
        rng: the source of the draws.

    Returns:
        ``(scores, included)``.
    """
    included = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * included, included


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of μ-GDP at δ (Dong, Roth and Su 2022, Cor. 2.13): the root of ``Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) = δ``.

    Args:
        mu: μ.
        delta: δ.

    Returns:
        ε.
    """
    def excess(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(optimize.brentq(excess, 0.0, hi, xtol=1e-9))
