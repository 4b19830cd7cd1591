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
    """``x`` [N, d] differential features, ``y`` [N] labels in {0, 1} (1: a¹ preferred),
    ``users`` [N] user index of each row, ``theta_star`` [d], and the bounds ``L`` (on ‖φ‖) and ``B``."""

    x: np.ndarray
    y: np.ndarray
    users: np.ndarray
    theta_star: np.ndarray
    L: float
    B: float

    @property
    def n_users(self) -> int:
        return int(self.users.max()) + 1


def project_theta(theta: np.ndarray, B: Optional[float], sum_zero: bool = True) -> np.ndarray:
    """Euclidean projection onto Θ_B: remove the mean (the hyperplane ⟨1, θ⟩ = 0 passes through the
    origin), then scale into the ball of radius B (centred on the origin, so the order is exact)."""
    if sum_zero:
        theta = theta - theta.mean()
    if B is not None:
        norm = np.linalg.norm(theta)
        if norm > B:
            theta = theta * (B / norm)
    return theta


def sample_theta_star(d: int, norm: float, rng: np.random.Generator) -> np.ndarray:
    """A direction drawn from N(0, I_d), centred (⟨1, θ⟩ = 0) and scaled to ``‖θ*‖ = norm``."""
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
    label_noise: float = 0.0,
    seed: int = 0,
) -> BTLData:
    """``n_users × samples_per_user`` comparisons. φ ~ N(0, I_d/d) clipped to norm L (so ‖φ‖ ≤ L holds
    exactly); ``θ*`` has norm B unless given. ``label_noise`` > 0 gives each user a flip rate
    ``ρ_u ~ Uniform(0, label_noise)`` on top of the BTL draw (heterogeneous annotators)."""
    if not 0 <= label_noise < 0.5:
        raise ValueError(f"label_noise must lie in [0, 0.5), got {label_noise}.")
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
    if label_noise > 0:
        flip = rng.random(n) < rng.uniform(0, label_noise, n_users)[users]
        y = np.where(flip, 1 - y, y)
    return BTLData(x=x, y=y, users=users, theta_star=theta_star, L=L, B=B)
