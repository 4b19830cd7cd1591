"""The one-run audit of a trade-off curve (Mahloujifar, Melis and Chaudhuri 2024, "Auditing f-differential privacy
in one run", the guessing game's bound; docs/audit.md).

Steinke et al.'s bound (:mod:`~trl_userdp.audit.bounds`) tests one point ``(ε, δ)`` of the run's privacy. A run's
accountant claims more: a whole trade-off curve ``f`` (the least type-II error of any test of "this user was in" at
each type-I error; Dong, Roth and Su 2022, Def. 2.1). Here ``f`` is read from the accountant's own privacy profile
``δ(ε)``: ``f(α) = max_ε max(0, 1 − δ(ε) − e^ε·α, e^{−ε}·(1 − δ(ε) − α))`` over a grid of ε, a curve the mechanism
meets whenever it meets every ``(ε, δ(ε))``, so testing it is as sound as the accountant. The guesses are Steinke et
al.'s: "in" for the ``k/2`` highest scores, "out" for the ``k/2`` lowest (the paper's game, Thm. 3.1, allows both
and abstentions; jax_privacy's ``epsilon_one_run_fdp`` guesses "in" only, which halves what a score shows).

What a rejection means. Rejecting the claimed curve (``scale = 1``) is assumption-free: the run is not as private as
its accountant says. The reported ``ε_lower`` is the ε of the weakest rejected claim in the family "the same run at
``scale·σ``" (same sampling, steps, relation): a lower bound on ε *for runs whose curve has the claimed shape*, the
convention of Mahloujifar et al.'s empirical ε; Steinke et al.'s ``ε_lower`` needs no such assumption.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import dp_accounting as dpa
import numpy as np
from scipy import stats

from ..accountants.accountant import DPAccountingAccountant
from ..accountants.analysis import make_accountant
from ..mechanisms import GradientMechanism
from ..validators import check_confidence
from .bounds import default_abstentions, guess

#: PLD discretisation of the audit's curves (coarser than the accountant's: dp-accounting rounds pessimistically,
#: so a coarser curve is a weaker claim and its rejection still sound)
AUDIT_PLD_DISCRETIZATION = 1e-3


@dataclasses.dataclass(frozen=True)
class TradeOffCurve:
    """A symmetric trade-off function bounded from below by a privacy profile: the upper envelope of the
    ``(ε_i, δ_i)``-DP curves ``max(0, 1 − δ_i − e^{ε_i}·α, e^{−ε_i}·(1 − δ_i − α))`` (Dong, Roth and Su 2022, Prop. 2.12).

    Args:
        epsilons: the grid of ε (≥ 0).
        deltas: δ(ε) at each, an upper bound on the mechanism's.
    """

    epsilons: np.ndarray
    deltas: np.ndarray

    @classmethod
    def from_accountant(cls, accountant: dpa.PrivacyAccountant, points: int = 400) -> "TradeOffCurve":
        """The curve of a composed dp-accounting accountant, on ``points`` values of ε from 0 to 1.5 × the first ε of
        1, 2, 4, … (up to 1024) where δ(ε) < 1e-12, or to the ε of the smallest δ found (a group-privacy profile is
        not monotone: every point of it is a valid guarantee, the envelope of any of them a valid curve).

        Args:
            accountant: an accountant that has composed the run's event (any with ``get_delta``).
            points: the grid's size.

        Returns:
            The curve.

        Raises:
            ValueError: the accountant gives a δ that is not a number in [0, 1].
        """
        probes = [2.0 ** i for i in range(11)]
        deltas = []
        for epsilon in probes:
            deltas.append(accountant.get_delta(epsilon))
            if deltas[-1] < 1e-12:
                break
        top = 1.5 * probes[int(np.argmin(deltas))]
        epsilons = np.linspace(0.0, top, points)
        deltas = np.array([accountant.get_delta(float(e)) for e in epsilons], dtype=np.float64)
        if not np.all((deltas >= 0) & (deltas <= 1)):  # NaN included
            raise ValueError("The accountant's δ(ε) is not a number in [0, 1] on the audit's grid.")
        return cls(epsilons, deltas)

    @classmethod
    def gaussian(cls, mu: float, points: int = 600) -> "TradeOffCurve":
        """μ-GDP's curve ``G_μ`` from its closed-form profile ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)`` (Dong, Roth
        and Su 2022, Cor. 2.13), on ``points`` values of ε up to where δ(ε) < 1e-12.

        Args:
            mu: μ > 0.
            points: the grid's size.

        Returns:
            The curve.
        """
        top = max(1.0, mu * mu / 2 + 7.1 * mu)  # δ(ε) ≤ Φ(−ε/μ + μ/2) < 1e-12 beyond
        epsilons = np.linspace(0.0, top, points)
        deltas = stats.norm.cdf(-epsilons / mu + mu / 2) - np.exp(epsilons) * stats.norm.cdf(-epsilons / mu - mu / 2)
        return cls(epsilons, np.clip(deltas, 0.0, 1.0))

    @classmethod
    def epsilon_delta(cls, epsilon: float, delta: float) -> "TradeOffCurve":
        """The curve of ``(ε, δ)``-DP alone.

        Args:
            epsilon: ε.
            delta: δ.

        Returns:
            The curve.
        """
        return cls(np.array([float(epsilon)]), np.array([float(delta)]))

    def __call__(self, alpha: float) -> float:
        """``f(α)``, the least type-II error at type-I error ``α``.

        Args:
            alpha: α in [0, 1].

        Returns:
            ``f(α)``.
        """
        kept = 1.0 - self.deltas
        return float(max(0.0, np.max(np.maximum(kept - np.exp(self.epsilons) * alpha,
                                                np.exp(-self.epsilons) * (kept - alpha)))))


def rejects(curve: TradeOffCurve, m: int, guesses: int, correct: int, significance: float) -> bool:
    """Whether ``correct`` right guesses ("in" or "out") out of ``guesses`` among ``m`` canaries reject the claim "the
    run is ``curve``-DP" at ``significance`` (Mahloujifar et al. 2024, Thm. 3.1 and Alg. 3 with two symbols, as
    jax_privacy's ``_epsilon_one_run_fdp`` runs it, with the blow-up inverse ``y ↦ f(1 − y)`` of a symmetric ``f``).

    Args:
        curve: the claimed trade-off curve.
        m: the canaries.
        guesses: k, the guesses made (the other canaries abstained on).
        correct: v, the right ones.
        significance: the test's level.

    Returns:
        True where the claim is rejected.

    Raises:
        ValueError: counts out of order or ``significance`` outside (0, 1).
    """
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got correct={correct}, guesses={guesses}, m={m}.")
    if not 0 < significance < 1:
        raise ValueError(f"significance must lie in (0, 1), got {significance}.")
    right, wrong = significance * correct / m, significance * (guesses - correct) / m
    for i in range(correct - 1, -1, -1):
        widened = max(wrong, curve(1.0 - right))
        if widened == wrong:
            break
        right, wrong = min(right + i / (guesses - i) * (widened - wrong), 1.0), widened
    return right + wrong - guesses / m > 0


def audits_curve(mechanism: GradientMechanism) -> bool:
    """Whether a mechanism's claim is its accountant's curve: its run's ε is the accountant's alone. AUP-RLHF also
    spends ε on AboveThreshold and on its radius, outside the accountant; its Gaussian steps' curve is a stronger claim
    than its own, so an honest run could fail it.

    Args:
        mechanism: the run's mechanism.

    Returns:
        True where :func:`audit_curve` tests the run's claim.
    """
    return type(mechanism).epsilon is GradientMechanism.epsilon


def run_curves(accountant: DPAccountingAccountant, delta: float) -> Callable[[float], Tuple[TradeOffCurve, float]]:
    """The family of claims "the same run at ``scale·σ``" of a Gaussian run's accountant: its steps' sampling rates
    and counts, its relation and its mechanism's events, every σ multiplied by ``scale``.

    Args:
        accountant: the run's accountant (its history of ``(σ, q, steps)``).
        delta: the δ at which each claim's ε is read.

    Returns:
        ``scale ↦ (curve, ε at delta)``.

    Raises:
        ValueError: an accountant without Gaussian steps (σ = 0 throughout).
    """
    history = [tuple(step) for step in accountant.history]
    if not any(sigma > 0 for sigma, _, _ in history):
        raise ValueError("The f-DP audit scales the run's noise: audit a run with σ > 0.")
    events = accountant.events

    @functools.lru_cache(maxsize=None)
    def at(scale: float) -> Tuple[TradeOffCurve, float]:
        composed = make_accountant(
            "pld", accountant.relation, events.group_size,
            value_discretization_interval=max(AUDIT_PLD_DISCRETIZATION,
                                              events.accountant_options.get("value_discretization_interval", 0.0)),
        ).compose(events.composed([(sigma * scale, q, n) for sigma, q, n in history]))
        return TradeOffCurve.from_accountant(composed), float(composed.get_epsilon(delta))

    return at


@dataclasses.dataclass(frozen=True)
class CurveAudit:
    """The f-DP audit of a run.

    Args:
        claim_rejected: whether the run's own curve (``scale = 1``) is rejected.
        epsilon_lower: ε of the weakest rejected claim of the family (0 when none is).
        scale: that claim's noise scale (``inf`` when none is rejected).
        guesses: the guesses of the abstention that rejected it (or of the most guesses tried).
        correct: the right ones.
        confidence: the confidence of the test.
        tried: the numbers of guesses tried (the significance split evenly between them).
    """

    claim_rejected: bool
    epsilon_lower: float
    scale: float
    guesses: int
    correct: int
    confidence: float
    tried: Tuple[int, ...]


def audit_curve(scores: Sequence[float], included: Sequence[bool], curves: Callable[[float], Tuple[TradeOffCurve, float]],
                confidence: float = 0.95, abstentions: Optional[Sequence[int]] = None, tolerance: float = 0.01
                ) -> CurveAudit:
    """Test the claimed curve, then find the weakest claim of the family the guesses reject (bisection on the noise
    scale: a claim with more noise is stronger, so the rejected scales are an interval ``[s*, ∞)``).

    Args:
        scores: one score per canary.
        included: the secret inclusion draw.
        curves: ``scale ↦ (curve, ε)`` (:func:`run_curves`).
        confidence: the confidence of the test.
        abstentions: numbers of guesses to try, half "in" and half "out" (default
            :func:`~trl_userdp.audit.bounds.default_abstentions`);
            a claim is rejected where any of them rejects it at ``(1 − confidence)/len(abstentions)``.
        tolerance: the bisection's relative width on the scale.

    Returns:
        The :class:`CurveAudit`.
    """
    m = len(scores)
    tried = tuple(abstentions) if abstentions is not None else default_abstentions(m)
    found = [guess(scores, included, k_in=k // 2, k_out=k - k // 2) for k in tried]
    significance = (1 - check_confidence(confidence)) / len(tried)

    def rejecting(curve: TradeOffCurve) -> Optional[int]:
        for i, g in enumerate(found):
            if rejects(curve, m, g.guesses, g.correct, significance):
                return i
        return None

    claim_rejected = rejecting(curves(1.0)[0]) is not None
    if claim_rejected:  # rejected scales run down from 1: halve until a claim survives (weaker claims survive)
        lo, hi = 0.5, 1.0
        while rejecting(curves(lo)[0]) is not None:
            lo, hi = lo / 2, lo
            if lo < 1e-3:  # even σ/1000 is rejected: report that claim's ε
                lo = hi
                break
    else:  # the claim survives: double until a claim is rejected
        lo, hi = 1.0, 2.0
        while rejecting(curves(hi)[0]) is None:
            lo, hi = hi, 2 * hi
            if hi > 1e3:
                g = found[-1]
                return CurveAudit(False, 0.0, math.inf, g.guesses, g.correct, confidence, tried)
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if rejecting(curves(mid)[0]) is None:
            lo = mid
        else:
            hi = mid
    curve, epsilon = curves(hi)
    g = found[rejecting(curve)]
    return CurveAudit(claim_rejected, epsilon, hi, g.guesses, g.correct, confidence, tried)
