"""Multi-user data from the linear Bradley–Terry–Luce model of the theory papers.

``P[y = 1 | x] = σ(xᵀθ*)`` with ``x = φ(s, a¹) − φ(s, a⁰)``, ``‖φ‖ ≤ L`` and
``θ* ∈ Θ_B = {⟨1, θ⟩ = 0, ‖θ‖ ≤ B}`` (Chowdhury et al. Assumption 2.1; AUP-RLHF §3).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass
class BTLData:
    """Comparisons of the linear BTL model, grouped by user.

    Args:
        x: The differential features ``φ(s, a¹) − φ(s, a⁰)`` [N, d].
        y: The labels in {0, 1} [N] (1: a¹ preferred).
        users: The user index of each row [N].
        theta_star: The true parameter θ* [d].
        L: The bound on ‖φ‖.
        B: The bound on ‖θ*‖ (the radius of Θ_B).
    """

    x: np.ndarray
    y: np.ndarray
    users: np.ndarray
    theta_star: np.ndarray
    L: float
    B: float

    @property
    def n_users(self) -> int:
        """The number of users (largest user index + 1)."""
        return int(self.users.max()) + 1


def project_theta(theta: np.ndarray, B: Optional[float], sum_zero: bool = True) -> np.ndarray:
    """Euclidean projection onto Θ_B.

    Removes the mean (the hyperplane ⟨1, θ⟩ = 0 passes through the origin), then scales into the ball of
    radius B (centred on the origin, so the order is exact).

    Args:
        theta: The point θ [d].
        B: The radius of the ball, or None for no ball.
        sum_zero: Whether to project onto the hyperplane ⟨1, θ⟩ = 0.

    Returns:
        The projection [d].
    """
    if sum_zero:
        theta = theta - theta.mean()
    if B is not None:
        norm = np.linalg.norm(theta)
        if norm > B:
            theta = theta * (B / norm)
    return theta


def sample_theta_star(d: int, norm: float, rng: np.random.Generator) -> np.ndarray:
    """A random θ*: a direction drawn from N(0, I_d), centred (⟨1, θ⟩ = 0) and scaled.

    Args:
        d: The dimension.
        norm: The norm ‖θ*‖.
        rng: The generator.

    Returns:
        θ* [d].
    """
    theta = rng.standard_normal(d)
    theta -= theta.mean()
    return theta * (norm / np.linalg.norm(theta))


def generate_btl_data(
    *,
    n_users: int,
    samples_per_user: int,
    d: int,
    B: float = 1.0,
    L: float = 1.0,
    theta_star: Optional[np.ndarray] = None,
    max_flip_rate: float = 0.0,
    seed: int = 0,
) -> BTLData:
    """``n_users × samples_per_user`` comparisons of the linear BTL model.

    Args:
        n_users: The number of users.
        samples_per_user: Comparisons per user.
        d: The feature dimension.
        B: The norm of θ* when it is drawn, and the radius of Θ_B.
        L: The bound on ‖φ‖: φ ~ N(0, I_d/d) clipped to norm L (so ‖φ‖ ≤ L holds exactly).
        theta_star: θ* [d]; default a draw of :func:`sample_theta_star` with norm B.
        max_flip_rate: If > 0, each user gets a flip rate ``ρ_u ~ Uniform(0, max_flip_rate)`` on top of the BTL
            draw (heterogeneous annotators).
        seed: The seed of the draws.

    Returns:
        The data, rows grouped by user.

    Raises:
        ValueError: If ``max_flip_rate`` is not in [0, 0.5).
    """
    if not 0 <= max_flip_rate < 0.5:
        raise ValueError(f"max_flip_rate must lie in [0, 0.5), got {max_flip_rate}.")
    rng = np.random.default_rng(seed)
    if theta_star is None:
        theta_star = sample_theta_star(d, B, rng)
    n = n_users * samples_per_user

    def phi() -> np.ndarray:
        f = rng.standard_normal((n, d)) / np.sqrt(d)
        norms = np.linalg.norm(f, axis=1, keepdims=True)
        return f * np.minimum(1.0, L / np.maximum(norms, 1e-12))

    x = phi() - phi()
    y = (rng.random(n) < 1 / (1 + np.exp(-x @ theta_star))).astype(np.int64)
    users = np.repeat(np.arange(n_users), samples_per_user)
    if max_flip_rate > 0:
        flip = rng.random(n) < rng.uniform(0, max_flip_rate, n_users)[users]
        y = np.where(flip, 1 - y, y)
    return BTLData(x=x, y=y, users=users, theta_star=theta_star, L=L, B=B)
