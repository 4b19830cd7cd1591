"""The step size of a private run, chosen before training on public users at the run's own noise level.

A private step releases the average of ñ clipped per-user gradients plus Gaussian noise of standard deviation σC/ñ per
coordinate (user-wise DP-SGD; docs/mechanisms.md). σ follows from ε, δ, q = ñ/n and T, so a team knows this noise
before it trains, and the step size that works depends on it: a step tuned without noise, or at another n, is too
large where the noise dominates and too small where it has faded. The rule (docs/users_scaling.md, "Set-up"):
train each candidate step size on public users (never the private users, never held-out data) with the clip of the
private run and the fixed noise multiplier that puts the same noise on their averaged gradient,
σ_pub = σ·ñ_pub/ñ (:func:`public_noise_multiplier`), score each on other public users' pairs, and keep the best
(:func:`choose_learning_rate`). ``trl-userdp account --public_users_per_batch`` prints σ_pub for a setting.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple

from .validators import check_noise_multiplier, check_positive


def averaged_gradient_noise(noise_multiplier: float, max_grad_norm: float, expected_units: float) -> float:
    """The noise on each coordinate of the averaged clipped gradient a step releases: σC/ñ.

    Args:
        noise_multiplier: σ.
        max_grad_norm: C, the clip of each unit's (user's) gradient.
        expected_units: ñ, the expected units per step that the noisy sum is divided by.

    Returns:
        The standard deviation σC/ñ.

    Raises:
        ValueError: σ < 0, or C or ñ not > 0.
    """
    check_noise_multiplier(noise_multiplier)
    check_positive(max_grad_norm, "max_grad_norm")
    check_positive(expected_units, "expected_units")
    return noise_multiplier * max_grad_norm / expected_units


def public_noise_multiplier(noise_multiplier: float, expected_units: float, public_expected_units: float) -> float:
    """The fixed σ of a run on public users (with the private run's clip) whose averaged gradient carries the private
    run's noise: σ_pub·C/ñ_pub = σC/ñ, so σ_pub = σ·ñ_pub/ñ.

    Args:
        noise_multiplier: the private run's σ (calibrated to its ε, δ, q and T).
        expected_units: its ñ.
        public_expected_units: ñ_pub, the public run's expected users per step.

    Returns:
        σ_pub.

    Raises:
        ValueError: σ < 0, or ñ or ñ_pub not > 0.
    """
    check_positive(public_expected_units, "public_expected_units")
    return averaged_gradient_noise(noise_multiplier, 1.0, expected_units) * public_expected_units


def choose_learning_rate(score: Callable[[float], float], learning_rates: Sequence[float]
                         ) -> Tuple[float, Dict[float, float]]:
    """The rule's step size: the candidate whose public-user run scores best.

    Args:
        score: trains on public users at the private run's noise level (:func:`public_noise_multiplier`) with a
            learning rate and returns its score on other public users' pairs (higher is better). It must not look at
            the private users or at held-out data.
        learning_rates: the candidates, the same search budget for every mechanism compared.

    Returns:
        The best learning rate (the smaller one on a tie) and every candidate's score.

    Raises:
        ValueError: no candidate, a candidate not > 0, or a score that is not a finite number.
    """
    if not learning_rates:
        raise ValueError("Give at least one candidate learning rate.")
    scores = {}
    for lr in sorted(learning_rates):
        check_positive(lr, "learning_rate")
        value = float(score(lr))
        if not math.isfinite(value):
            raise ValueError(f"The public-user score at learning_rate={lr:g} is {value}: a run that diverges has no "
                             "score; leave that candidate out or lower it.")
        scores[lr] = value
    best = max(scores, key=lambda lr: (scores[lr], -lr))
    return best, scores
