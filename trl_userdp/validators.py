"""Argument checks shared by every entry point.

Each check raises ``ValueError`` with a message naming the argument and the fix, so that bad
input fails before any work is done instead of silently weakening a privacy guarantee.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Optional


def _is_real(x: Any) -> bool:
    """A real number of any numeric type (Python, NumPy's float32, ...), but not a bool or None."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_epsilon(epsilon: float, name: str = "target_epsilon") -> float:
    """Check that ε is a finite positive number.

    Args:
        epsilon: The privacy budget ε.
        name: The argument's name, for the error message.

    Returns:
        ``epsilon`` as a float.

    Raises:
        ValueError: If ``epsilon`` is not a real number, not finite, or not > 0.
    """
    if not _is_real(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {epsilon!r}.")
    return float(epsilon)


def check_confidence(confidence: float, name: str = "confidence") -> float:
    """Check that an audit's confidence lies strictly between 0 and 1 (at 0 a "lower bound" holds with probability 0).

    Args:
        confidence: The confidence of a bound or test.
        name: The argument's name, for the error message.

    Returns:
        ``confidence`` as a float.

    Raises:
        ValueError: If ``confidence`` is not a real number in (0, 1).
    """
    return _in_open_unit_interval(confidence, name)


def check_delta(delta: float, name: str = "target_delta") -> float:
    """Check that δ lies strictly between 0 and 1.

    Args:
        delta: The privacy parameter δ.
        name: The argument's name, for the error message.

    Returns:
        ``delta`` as a float.

    Raises:
        ValueError: If ``delta`` is not a real number in (0, 1).
    """
    return _in_open_unit_interval(delta, name)


def _in_open_unit_interval(value: float, name: str) -> float:
    if not _is_real(value) or not 0 < value < 1:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}.")
    return float(value)


def warn_if_delta_is_large(delta: float, n_users: int) -> None:
    """Warn when δ ≥ 1/n (the usual rule is δ ≪ 1/n).

    At δ ≥ 1/n, a mechanism that publishes one whole user's data in the clear with probability δ·n ≥ 1
    still meets (ε, δ).

    Args:
        delta: The privacy parameter δ.
        n_users: The number of users n.

    Warns:
        UserWarning: If ``delta * n_users >= 1``.
    """
    if delta * n_users >= 1:
        warnings.warn(f"target_delta={delta:g} is not below 1/n_users = 1/{n_users}: (ε, δ)-DP at such a δ allows "
                      "releasing a user's data outright; take δ well below 1/n_users.", UserWarning, stacklevel=3)


def check_noise_multiplier(sigma: float, name: str = "noise_multiplier") -> float:
    """Check that σ is a finite number ≥ 0.

    Args:
        sigma: The noise multiplier σ (noise standard deviation over the clipping norm); σ = 0 only makes
            sense with privacy switched off.
        name: The argument's name, for the error message.

    Returns:
        ``sigma`` as a float.

    Raises:
        ValueError: If ``sigma`` is not a real number, not finite, or negative.
    """
    if not _is_real(sigma) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {sigma!r}.")
    return float(sigma)


def check_noise_or_target(noise_multiplier: Optional[float], target_epsilon: Optional[float],
                          target_delta: Optional[float], epochs: Optional[float], steps: Optional[int]) -> None:
    """Check how a run's noise is set: a fixed σ (with an optional cap (ε, δ)), or a target (ε, δ) over a plan.

    Args:
        noise_multiplier: a fixed σ, or None (calibrated to the target).
        target_epsilon: the target ε (or the cap of a fixed σ).
        target_delta: the target δ.
        epochs: the planned epochs.
        steps: the planned steps.

    Raises:
        ValueError: neither σ nor a target, or an invalid σ, ε, δ or plan.
    """
    if noise_multiplier is not None:
        check_noise_multiplier(noise_multiplier)
        if target_epsilon is not None:
            check_epsilon(target_epsilon)
            check_delta(target_delta)
    elif target_epsilon is None:
        raise ValueError("Give `noise_multiplier`, or `target_epsilon` with `target_delta` (or both: a fixed σ "
                         "with a cap); make_private_user_level_with_epsilon takes the target alone.")
    else:
        check_target(target_epsilon, target_delta, epochs, steps)


def check_target(target_epsilon: float, target_delta: float, epochs: Optional[float], steps: Optional[int]) -> None:
    """Check a target (ε, δ) and that the plan it is calibrated over is given.

    Args:
        target_epsilon: the target ε.
        target_delta: the target δ.
        epochs: the planned epochs.
        steps: the planned steps.

    Raises:
        ValueError: an invalid ε or δ, or neither ``epochs`` nor ``steps``.
    """
    check_epsilon(target_epsilon)
    check_delta(target_delta)
    if epochs is None and steps is None:
        raise ValueError("With target_epsilon, give `epochs` or `steps`: σ depends on how long you train.")


def check_positive(value: float, name: str) -> float:
    """Check that a number is finite and positive.

    Args:
        value: The number to check.
        name: The argument's name, for the error message.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: If ``value`` is not a real number, not finite, or not > 0.
    """
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_max_samples_per_user(m: Optional[int], name: str = "max_samples_per_user") -> int:
    """Check that the contribution bound m is a whole number ≥ 1.

    Without it there is no user-level guarantee.

    Args:
        m: The maximum number of rows (records) one user contributes.
        name: The argument's name, for the error message.

    Returns:
        ``m`` as an int.

    Raises:
        ValueError: If ``m`` is None, a bool, not an integer, or < 1.
    """
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
        raise ValueError(
            f"{name} must be an integer >= 1, got {m!r}: user-level DP needs a bound on the rows one user contributes."
        )
    return int(m)


def check_sample_rate(q: float, name: str = "sample_rate") -> float:
    """Check that a sampling rate lies in (0, 1].

    Args:
        q: The Poisson sampling rate (of users, or of records for item-level mechanisms).
        name: The argument's name, for the error message.

    Returns:
        ``q`` as a float.

    Raises:
        ValueError: If ``q`` is not a real number in (0, 1].
    """
    if not _is_real(q) or not 0 < q <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {q!r}.")
    return float(q)


def steps_per_epoch(sample_rate: float) -> int:
    """Steps in one pass over a user-level loader.

    Args:
        sample_rate: The user sampling rate q ≤ 1.

    Returns:
        ``round(1/q)``, at least 1.

    Raises:
        ValueError: If ``sample_rate`` is not in (0, 1].
    """
    return int(round(1 / check_sample_rate(sample_rate)))


def check_steps(steps: Optional[int], epochs: Optional[float], sample_rate: float) -> int:
    """The number of steps of a plan given by exactly one of ``steps`` or ``epochs``.

    An epoch is one pass over the user-level loader, ``round(1/q)`` steps (as in Opacus, where an epoch is
    ``len(loader)`` steps), and E epochs are ``ceil(E · round(1/q))`` steps, the count transformers' Trainer
    runs: the plan σ is calibrated for is the run, and the budget guard never cuts the last pass short.

    Args:
        steps: The number of optimizer steps, or None to give ``epochs``.
        epochs: The number of passes E over the user-level loader (may be fractional), or None.
        sample_rate: The user sampling rate q.

    Returns:
        The number of steps, an int ≥ 1.

    Raises:
        ValueError: If both or neither of ``steps`` and ``epochs`` are given, if ``epochs`` is not > 0,
            if ``sample_rate`` is not in (0, 1], or if the step count is not an integer ≥ 1.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("Give exactly one of `steps` or `epochs`.")
    if steps is None:
        check_positive(epochs, "epochs")
        steps = math.ceil(epochs * steps_per_epoch(sample_rate))
    return check_step_count(steps)


def check_step_count(steps: int, minimum: int = 1) -> int:
    """Check that a step count is a whole number of at least ``minimum``.

    Args:
        steps: The number of steps.
        minimum: The least count allowed (a plan needs one step; an accounting event may hold none).

    Returns:
        ``steps`` as an int.

    Raises:
        ValueError: If ``steps`` is a bool, not an integer, or < ``minimum``.
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < minimum:
        raise ValueError(f"steps must be an integer >= {minimum}, got {steps!r}.")
    return int(steps)


def check_users_per_batch(users_per_batch: float, n_users: int) -> float:
    """Check the expected number of users per step ñ: 0 < ñ ≤ n_users.

    Args:
        users_per_batch: The expected number of users per step ñ (a float is fine).
        n_users: The number of users n.

    Returns:
        ``users_per_batch`` as a float.

    Raises:
        ValueError: If ``users_per_batch`` is not a finite number > 0, or exceeds ``n_users``.
    """
    check_positive(users_per_batch, "users_per_batch")
    if users_per_batch > n_users:
        raise ValueError(
            f"users_per_batch ({users_per_batch}) exceeds the number of users ({n_users}); "
            "the user sampling rate q = users_per_batch / n_users must be <= 1."
        )
    return float(users_per_batch)
