"""Estimators of θ* in the linear BTL model (Chowdhury et al. 2024; Zhou et al.; AUP-RLHF §4).

Convex objectives are solved to tolerance by accelerated projected gradient (FISTA) on Θ_B; the
label-DP guarantee of objective perturbation holds for the exact minimiser only (Chowdhury et al.
L332), so the solver's tolerance is part of that mechanism.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...losses import flip_rate_from_epsilon
from ...validators import check_delta, check_epsilon
from .btl import project_theta


def _sigmoid(u: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * u))


def fit_logistic(
    x: np.ndarray,
    targets: np.ndarray,
    *,
    B: Optional[float] = None,
    sum_zero: bool = True,
    l2: float = 0.0,
    linear: Optional[np.ndarray] = None,
    tol: float = 1e-9,
    max_iter: int = 200_000,
) -> np.ndarray:
    """argmin over Θ_B of ``mean_i[softplus(x_iᵀθ) − t_i x_iᵀθ] + (l2/2)‖θ‖² + linearᵀθ``, by FISTA.

    With targets ``t = y`` this is the BTL negative log-likelihood; with the de-biased labels of
    randomized response (targets outside [0, 1]) it is the de-biased loss, still convex (its
    Hessian does not depend on the targets).

    Args:
        x: The features [n, d].
        targets: The targets t [n].
        B: The radius of Θ_B, or None for no ball.
        sum_zero: Whether Θ_B lies in the hyperplane ⟨1, θ⟩ = 0.
        l2: The ridge coefficient.
        linear: The linear term [d] (default zero).
        tol: Stop when the gradient-mapping norm is below this.
        max_iter: The most iterations.

    Returns:
        The minimiser θ̂ [d].

    Raises:
        RuntimeError: If ``tol`` is not reached in ``max_iter`` iterations.
    """
    n, d = x.shape
    t = np.asarray(targets, dtype=float)
    lin = np.zeros(d) if linear is None else np.asarray(linear, dtype=float)
    lip = np.linalg.eigvalsh(x.T @ x / n)[-1] / 4 + l2  # σ' ≤ 1/4
    step = 1.0 / lip

    def grad(theta: np.ndarray) -> np.ndarray:
        return x.T @ (_sigmoid(x @ theta) - t) / n + l2 * theta + lin

    theta = project_theta(np.zeros(d), B, sum_zero)
    z, k = theta.copy(), 1.0
    for _ in range(max_iter):
        new = project_theta(z - step * grad(z), B, sum_zero)
        if np.linalg.norm(new - z) * lip < tol:
            return new
        k_next = (1 + math.sqrt(1 + 4 * k * k)) / 2
        z = new + ((k - 1) / k_next) * (new - theta)
        if (z - new) @ (new - theta) > 0:  # restart when momentum points uphill
            z, k_next = new.copy(), 1.0
        theta, k = new, k_next
    raise RuntimeError(f"fit_logistic did not reach tol={tol} in {max_iter} iterations.")


def mle(x: np.ndarray, y: np.ndarray, *, B: Optional[float] = None, sum_zero: bool = True) -> np.ndarray:
    """Non-private BTL maximum-likelihood estimate (Zhu et al. 2023).

    Args:
        x: The features [n, d].
        y: The labels in {0, 1} [n].
        B: The radius of Θ_B, or None.
        sum_zero: Whether Θ_B lies in the hyperplane ⟨1, θ⟩ = 0.

    Returns:
        θ̂ [d].

    Raises:
        RuntimeError: If the solver does not converge.
    """
    return fit_logistic(x, y, B=B, sum_zero=sum_zero)


def debiased_labels(y_tilde: np.ndarray, epsilon: float) -> np.ndarray:
    """De-biased randomized-response labels, unbiased for the clean label (Chowdhury et al. §2.4).

    Args:
        y_tilde: The RR labels ỹ in {0, 1}.
        epsilon: The per-label ε.

    Returns:
        ``ȳ = (ỹ − ρ)/(1 − 2ρ)`` with ρ = σ(−ε).

    Raises:
        ValueError: If ``epsilon`` is not a finite number > 0.
    """
    rho = flip_rate_from_epsilon(epsilon)
    return (np.asarray(y_tilde, dtype=float) - rho) / (1 - 2 * rho)


def rr_debiased_mle(
    x: np.ndarray, y_tilde: np.ndarray, epsilon: float, *, B: Optional[float] = None, sum_zero: bool = True
) -> np.ndarray:
    """θ̂_RR: minimiser of the de-biased loss on RR labels at per-label ε (Chowdhury et al. eq. 6).

    Its normalised form, which has the same minimiser.

    Args:
        x: The features [n, d].
        y_tilde: The RR labels ỹ in {0, 1} [n].
        epsilon: The per-label ε.
        B: The radius of Θ_B, or None.
        sum_zero: Whether Θ_B lies in the hyperplane ⟨1, θ⟩ = 0.

    Returns:
        θ̂_RR [d].

    Raises:
        ValueError: If ``epsilon`` is not a finite number > 0.
        RuntimeError: If the solver does not converge.
    """
    return fit_logistic(x, debiased_labels(y_tilde, epsilon), B=B, sum_zero=sum_zero)


def curvature_gamma(L: float, B: float) -> float:
    """The curvature of the BTL loss on Θ_B.

    Args:
        L: The bound on ‖φ‖.
        B: The radius of Θ_B.

    Returns:
        γ = inf_{|z| ≤ 2LB} σ'(z) = 1/(2 + e^{2LB} + e^{−2LB}).
    """
    return 1.0 / (2 + math.exp(2 * L * B) + math.exp(-2 * L * B))


def sgd_rr(
    x: np.ndarray,
    y_tilde: np.ndarray,
    epsilon: float,
    *,
    L: float,
    B: float,
    kappa: Optional[float] = None,
    sum_zero: bool = True,
) -> np.ndarray:
    """θ̂_SGD-RR (Chowdhury et al. Alg. 1): one pass, projected, last iterate.

    The step is the proof's ``η_t = 1/(γ(2σ(ε) − 1)κ t)`` for the [A]-scaled gradient (docs/mechanisms.md,
    Notes on the papers; the theorem's printed ``1/(γκ)`` drops the 1/t).

    Args:
        x: The features [n, d].
        y_tilde: The RR labels ỹ in {0, 1} [n].
        epsilon: The per-label ε.
        L: The bound on ‖φ‖.
        B: The radius of Θ_B.
        kappa: κ; default λ_min of the sample covariance of x (public).
        sum_zero: Whether Θ_B lies in the hyperplane ⟨1, θ⟩ = 0.

    Returns:
        The last iterate [d].

    Raises:
        ValueError: If ``epsilon`` is not a finite number > 0.
    """
    check_epsilon(epsilon, "epsilon")
    s = 1.0 - flip_rate_from_epsilon(epsilon)
    if kappa is None:
        kappa = float(np.linalg.eigvalsh(x.T @ x / len(x))[0])
    lam = curvature_gamma(L, B) * (2 * s - 1) * kappa
    theta = project_theta(np.zeros(x.shape[1]), B, sum_zero)
    for t, (xt, yt) in enumerate(zip(x, y_tilde), start=1):
        p = _sigmoid(xt @ theta)
        g = ((2 * s - 1) * p - s) * xt if yt == 1 else ((2 * s - 1) * p + (1 - s)) * xt
        theta = project_theta(theta - g / (lam * t), B, sum_zero)
    return theta


def objective_perturbation_sigma(epsilon: float, delta: float, L: float) -> float:
    """Noise std of objective perturbation for (ε, δ)-label-DP (Chowdhury et al. Thm 5.2).

    Args:
        epsilon: The target ε.
        delta: The target δ.
        L: The bound on ‖φ‖.

    Returns:
        σ = L·√(8 log(2/δ) + 4ε)/ε.

    Raises:
        ValueError: If ``epsilon`` is not > 0 or ``delta`` is not in (0, 1).
    """
    check_epsilon(epsilon, "epsilon")
    check_delta(delta, "delta")
    return L * math.sqrt(8 * math.log(2 / delta) + 4 * epsilon) / epsilon


def objective_perturbation(
    x: np.ndarray,
    y: np.ndarray,
    epsilon: float,
    delta: float,
    *,
    L: float,
    B: float,
    beta: Optional[float] = None,
    rng: np.random.Generator,
    sum_zero: bool = True,
) -> np.ndarray:
    """θ̂_obj = argmin_{Θ_B} Σℓ + (β/2)‖θ‖² + wᵀθ with one draw ``w ~ N(0, σ²I)`` (central label DP).

    Chowdhury et al. §5.2; σ from :func:`objective_perturbation_sigma`.

    Args:
        x: The features [n, d].
        y: The labels in {0, 1} [n].
        epsilon: The target ε.
        delta: The target δ.
        L: The bound on ‖φ‖.
        B: The radius of Θ_B.
        beta: The ridge β; default √n/B (their utility proof); any β > 0 is private.
        rng: The generator of w.
        sum_zero: Whether Θ_B lies in the hyperplane ⟨1, θ⟩ = 0.

    Returns:
        θ̂_obj [d].

    Raises:
        ValueError: If ``beta`` is not > 0, ``epsilon`` is not > 0 or ``delta`` is not in (0, 1).
        RuntimeError: If the solver does not converge.
    """
    n, d = x.shape
    beta = math.sqrt(n) / B if beta is None else beta
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    w = rng.normal(0.0, objective_perturbation_sigma(epsilon, delta, L), d)
    return fit_logistic(x, y, B=B, sum_zero=sum_zero, l2=beta / n, linear=w / n)
