"""Argument checks shared by every entry point.

Each check raises ``ValueError`` with a message naming the argument and the fix, so that bad
input fails before any work is done instead of silently weakening a privacy guarantee.
"""

from __future__ import annotations

import math
from typing import Optional


def check_epsilon(epsilon: float, name: str = "target_epsilon") -> float:
    """ε must be a finite positive number."""
    if epsilon is None or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {epsilon!r}.")
    return float(epsilon)


def check_delta(delta: float, name: str = "target_delta") -> float:
    """δ must lie strictly between 0 and 1."""
    if delta is None or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"{name} must lie in (0, 1), got {delta!r}.")
    return float(delta)


def check_noise_multiplier(sigma: float, name: str = "noise_multiplier") -> float:
    """σ must be a finite number ≥ 0 (σ = 0 only makes sense with privacy switched off)."""
    if sigma is None or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {sigma!r}.")
    return float(sigma)


def check_positive(value: float, name: str) -> float:
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_max_samples_per_user(m: Optional[int], name: str = "max_samples_per_user") -> int:
    """The contribution bound m is a whole number ≥ 1; without it there is no user-level guarantee."""
    if m is None or isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(
            f"{name} must be an integer >= 1, got {m!r}: user-level DP needs a bound on the rows one user contributes."
        )
    return m


def check_sample_rate(q: float, name: str = "sample_rate") -> float:
    if q is None or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {q!r}.")
    return float(q)


def steps_per_epoch(sample_rate: float) -> int:
    """Steps in one pass over a user-level loader at user sampling rate q ≤ 1: ``round(1/q)`` ≥ 1."""
    return int(round(1 / check_sample_rate(sample_rate)))


def check_steps(steps: Optional[int], epochs: Optional[float], sample_rate: float) -> int:
    """Exactly one of ``steps`` or ``epochs``. An epoch is one pass over the user-level loader,
    ``round(1/q)`` steps (as in Opacus, where an epoch is ``len(loader)`` steps), and E epochs are
    ``ceil(E · round(1/q))`` steps, the count transformers' Trainer runs: the plan σ is calibrated for
    is the run, and the budget guard never cuts the last pass short."""
    if (steps is None) == (epochs is None):
        raise ValueError("Give exactly one of `steps` or `epochs`.")
    if steps is None:
        check_positive(epochs, "epochs")
        steps = math.ceil(epochs * steps_per_epoch(sample_rate))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
    return steps


def check_users_per_batch(users_per_batch: float, n_users: int) -> float:
    """ñ is the expected number of users per step: 0 < ñ ≤ n_users (a float is fine)."""
    check_positive(users_per_batch, "users_per_batch")
    if users_per_batch > n_users:
        raise ValueError(
            f"users_per_batch ({users_per_batch}) exceeds the number of users ({n_users}); "
            "the user sampling rate q = users_per_batch / n_users must be <= 1."
        )
    return float(users_per_batch)
