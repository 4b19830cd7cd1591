"""User-level label-DP estimators of θ* in the linear BTL model (AUP-RLHF §4–5 and its baselines).

Every estimator protects all the labels of one user (n users × m comparisons; features public).
The SGD-type ones run on Poisson-sampled users, project onto Θ_B after each step (post-processing)
and return the average iterate; their noise comes from this package's dp-accounting calibration.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Callable, Optional, Union

import numpy as np
import torch

from ...accountants.events import GroupPrivacyGaussian, PoissonGaussian
from ...data.phases import phase_shares
from ...mechanisms import UserRandomizedResponse, aup
from ...mechanisms.aup import keep_probabilities, pairwise_distances
from ...optimizers.adaptive_clip_optimizer import default_count_noise_multiplier, gradient_noise_multiplier, next_clip
from .btl import BTLData, project_theta
from .estimators import _sigmoid, objective_perturbation, rr_debiased_mle


def _by_user(data: BTLData):
    n = data.n_users
    m = len(data.users) // n
    if not np.array_equal(data.users, np.repeat(np.arange(n), m)):
        raise ValueError("User-level linear estimators expect every user to have the same number of rows, grouped.")
    return data.x.reshape(n, m, -1), data.y.reshape(n, m), m


def user_gradients(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-user averaged BTL gradients ``g_u = (1/m) Σ_j (σ(x_jᵀθ) − y_j) x_j``.

    Args:
        theta: The parameter θ [d].
        x: The users' features [U, m, d].
        y: The users' labels in {0, 1} [U, m].

    Returns:
        The gradients g_u [U, d].
    """
    return ((_sigmoid(x @ theta) - y)[..., None] * x).mean(axis=1)


def user_rr_mle(data: BTLData, epsilon: float, *, rng: np.random.Generator, B: Optional[float] = None) -> np.ndarray:
    """User-level randomized response (each label at ε/m) + the de-biased MLE (AUP-RLHF §4.1).

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε.
        rng: The generator of the randomized response.
        B: The radius of Θ_B, or None.

    Returns:
        θ̂ [d].

    Raises:
        ValueError: If users have different numbers of rows or are not grouped, or ``epsilon`` is invalid.
    """
    _, _, m = _by_user(data)
    rr = UserRandomizedResponse(epsilon, m)
    return rr_debiased_mle(data.x, rr.privatize_labels(data.y, rng), rr.epsilon_per_label, B=B)


def user_objective_perturbation(
    data: BTLData, epsilon: float, delta: float, *, rng: np.random.Generator, B: float
) -> np.ndarray:
    """Central objective perturbation (Chowdhury et al. §5.2) at user level.

    One user's m labels move the gradient by at most m·2L, so L is replaced by m·L in the noise of Thm 5.2.

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε.
        delta: The user-level δ.
        rng: The generator of the noise.
        B: The radius of Θ_B.

    Returns:
        θ̂_obj [d].

    Raises:
        ValueError: If users have different numbers of rows or are not grouped, or ε or δ is invalid.
    """
    _, _, m = _by_user(data)
    return objective_perturbation(data.x, data.y, epsilon, delta, L=m * data.L, B=B, rng=rng)


@lru_cache(maxsize=256)
def _sigma_poisson(epsilon, delta, q, steps, group_size=None, relation="add_or_remove") -> float:
    """The engine's σ for user-wise DP-SGD, or with ``group_size`` for the group-privacy baseline."""
    events = PoissonGaussian() if group_size is None else GroupPrivacyGaussian(group_size)
    return events.calibrate(epsilon, delta, sample_rate=q, steps=steps, accountant="pld", relation=relation, tol=1e-3)


@lru_cache(maxsize=256)
def _sigma_truncated(epsilon, delta, q, steps, n_users, n_max, relation="add_or_remove") -> float:
    return aup.gaussian_noise_multiplier(epsilon, delta, sample_rate=q, steps=steps, n_users=n_users,
                                         max_users_per_batch=n_max, relation=relation, tol=1e-3)


def step_size(lr: Union[float, Callable[[int], float]], t: int) -> float:
    """The step size at a step.

    Args:
        lr: A constant, or a schedule ``lr(t)`` (e.g. ``min(c, 1/(μ(t+1)))``, which converges on a μ-strongly
            convex objective).
        t: The 0-based step.

    Returns:
        The step size.
    """
    return float(lr(t)) if callable(lr) else float(lr)


@dataclasses.dataclass
class SGDResult:
    """The result of an SGD-type estimator.

    Args:
        theta: The estimate θ̂ [d] (the average iterate).
        steps_taken: The steps run.
        halted: Whether AUP-RLHF's AboveThreshold halted the run.
    """

    theta: np.ndarray
    steps_taken: int
    halted: bool = False


def _average(iterates, tail: bool = False) -> np.ndarray:
    """The average iterate (``tail``: of the last half, which forgets the transient of a decaying schedule)."""
    iterates = np.asarray(iterates)
    return np.mean(iterates[len(iterates) // 2:] if tail else iterates, axis=0)


def user_dpsgd(
    data: BTLData, epsilon: Optional[float], delta: float, *, users_per_batch: float, steps: int,
    lr: Union[float, Callable[[int], float]], max_grad_norm: float, rng: np.random.Generator, B: float,
    relation: str = "add_or_remove", tail_average: bool = False,
) -> SGDResult:
    """User-wise DP-SGD (AUP-RLHF Alg. 4; Chua et al. 2024).

    Clip each sampled user's averaged gradient to C, add N(0, σ²C²), divide by ñ; σ for T Poisson-subsampled
    steps at (ε, δ).

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε, or None for the same steps without noise (the control that isolates the
            optimiser from the privacy).
        delta: The user-level δ.
        users_per_batch: The expected users per step ñ.
        steps: The number of steps T.
        lr: A constant or a schedule (:func:`step_size`).
        max_grad_norm: The clipping norm C.
        rng: The generator of the sampling and the noise.
        B: The radius of Θ_B.
        relation: The neighbouring relation (``"replace"``: the papers' change-one-user neighbours).
        tail_average: Average the last half of the iterates.

    Returns:
        The :class:`SGDResult`.

    Raises:
        ValueError: If users have different numbers of rows or are not grouped, or the privacy parameters are
            invalid or cannot be met.
    """
    return _user_wise_dpsgd(data, epsilon, delta, users_per_batch=users_per_batch, steps=steps, lr=lr,
                            clip=max_grad_norm, rng=rng, B=B, relation=relation, tail_average=tail_average)


def user_dpsgd_adaptive_clip(
    data: BTLData, epsilon: Optional[float], delta: float, *, users_per_batch: float, steps: int,
    lr: Union[float, Callable[[int], float]], initial_clip: float, rng: np.random.Generator, B: float,
    target_quantile: float = 0.5, clip_learning_rate: float = 0.2, count_noise_multiplier: Optional[float] = None,
    relation: str = "add_or_remove", tail_average: bool = False,
) -> SGDResult:
    """User-wise DP-SGD with adaptive per-user clipping (docs/mechanisms.md, M1a).

    The mechanism of :class:`~trl_userdp.optimizers.AdaptiveClipUserDPOptimizer` with its formulas: σ as
    :func:`user_dpsgd`, the clip follows the private ``target_quantile`` of the sampled users' norms.

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε, or None for exact counts and no noise.
        delta: The user-level δ.
        users_per_batch: The expected users per step ñ.
        steps: The number of steps T.
        lr: A constant or a schedule (:func:`step_size`).
        initial_clip: The clipping norm of the first step.
        rng: The generator of the sampling and the noise.
        B: The radius of Θ_B.
        target_quantile: The quantile of the users' norms the clip tracks.
        clip_learning_rate: The clip's geometric learning rate.
        count_noise_multiplier: The noise multiplier of the private count; default the optimizer's.
        relation: The neighbouring relation.
        tail_average: Average the last half of the iterates.

    Returns:
        The :class:`SGDResult`.

    Raises:
        ValueError: If users have different numbers of rows or are not grouped, or the privacy parameters are
            invalid or cannot be met.
    """
    return _user_wise_dpsgd(data, epsilon, delta, users_per_batch=users_per_batch, steps=steps, lr=lr,
                            clip=initial_clip, rng=rng, B=B, relation=relation, tail_average=tail_average,
                            adaptive=(target_quantile, clip_learning_rate, count_noise_multiplier))


def _user_wise_dpsgd(data, epsilon, delta, *, users_per_batch, steps, lr, clip, rng, B, relation, tail_average,
                     adaptive=None) -> SGDResult:
    x, y, _ = _by_user(data)
    n = len(x)
    q = users_per_batch / n
    sigma = 0.0 if epsilon is None else _sigma_poisson(epsilon, delta, q, steps, relation=relation)
    if adaptive is not None:
        target_quantile, clip_learning_rate, sigma_b = adaptive
        if epsilon is None:
            sigma_b = 0.0
        elif sigma_b is None:
            sigma_b = default_count_noise_multiplier(users_per_batch, sigma)
        sigma = gradient_noise_multiplier(sigma, sigma_b)
    theta = project_theta(np.zeros(x.shape[-1]), B)
    clip, iterates = float(clip), []
    for t in range(steps):
        users = np.flatnonzero(rng.random(n) < q)
        g = user_gradients(theta, x[users], y[users])
        norms = np.linalg.norm(g, axis=1, keepdims=True)
        g *= np.minimum(1.0, clip / np.maximum(norms, 1e-12))
        noisy = (g.sum(0) + rng.normal(0, sigma * clip, theta.shape)) / users_per_batch
        theta = project_theta(theta - step_size(lr, t) * noisy, B)
        iterates.append(theta)
        if adaptive is not None:
            centred = float((norms <= clip).sum()) - len(users) / 2 + rng.normal(0, sigma_b)
            clip = next_clip(clip, centred, users_per_batch, target_quantile, clip_learning_rate)
    return SGDResult(_average(iterates, tail_average), steps)


def group_dpsgd(
    data: BTLData, epsilon: Optional[float], delta: float, *, users_per_batch: float, steps: int,
    lr: Union[float, Callable[[int], float]], max_grad_norm: float, rng: np.random.Generator, B: float,
    relation: str = "add_or_remove", tail_average: bool = False,
) -> SGDResult:
    """Item-level DP-SGD made user-level by group privacy over a user's m records (Chua et al. 2024 baseline).

    Records are Poisson-sampled at the users' rate q, each clipped to C, noise σC with σ calibrated so that the
    group conversion gives (ε, δ) per user.

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε, or None for the same steps without noise (the control).
        delta: The user-level δ.
        users_per_batch: The expected users per step ñ (q = ñ/n).
        steps: The number of steps T.
        lr: A constant or a schedule (:func:`step_size`).
        max_grad_norm: The per-record clipping norm C.
        rng: The generator of the sampling and the noise.
        B: The radius of Θ_B.
        relation: The neighbouring relation.
        tail_average: Average the last half of the iterates.

    Returns:
        The :class:`SGDResult`.

    Raises:
        ValueError: If users have different numbers of rows or are not grouped, or the privacy parameters are
            invalid or cannot be met.
    """
    x, y, m = _by_user(data)
    xs, ys = data.x, data.y
    q = users_per_batch / len(x)
    sigma = 0.0 if epsilon is None else _sigma_poisson(epsilon, delta, q, steps, group_size=m, relation=relation)
    theta = project_theta(np.zeros(xs.shape[-1]), B)
    iterates = []
    expected = q * len(xs)
    for t in range(steps):
        rows = np.flatnonzero(rng.random(len(xs)) < q)
        g = (_sigmoid(xs[rows] @ theta) - ys[rows])[:, None] * xs[rows]
        g *= np.minimum(1.0, max_grad_norm / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12))
        noisy = (g.sum(0) + rng.normal(0, sigma * max_grad_norm, theta.shape)) / expected
        theta = project_theta(theta - step_size(lr, t) * noisy, B)
        iterates.append(theta)
    return SGDResult(_average(iterates, tail_average), steps)


def theorem4_tau(L: float, n: int, d: int, m: int, epsilon: float, steps: int, delta: float) -> float:
    """AUP-RLHF Thm 4: ``τ = 4L·log(n d m e^ε T/δ)/√m``.

    Args:
        L: The bound on ‖φ‖.
        n: The number of users.
        d: The dimension.
        m: Comparisons per user.
        epsilon: The user-level ε.
        steps: The number of steps T.
        delta: The user-level δ.

    Returns:
        The concentration radius τ.
    """
    return 4 * L * (math.log(n * d * m * steps / delta) + epsilon) / math.sqrt(m)


def theorem4_lr(L: float, B: float, n: int, d: int, m: int, epsilon: float, steps: int, delta: float) -> float:
    """AUP-RLHF Thm 4: ``η = (B/4L)·min{√m·n·ε/(T·√(d·log²(mnd/δ))), T^{-3/4}, √(nm)/T}``.

    Args:
        L: The bound on ‖φ‖.
        B: The radius of Θ_B.
        n: The number of users.
        d: The dimension.
        m: Comparisons per user.
        epsilon: The user-level ε.
        steps: The number of steps T.
        delta: The user-level δ.

    Returns:
        The step size η.
    """
    return (B / (4 * L)) * min(
        math.sqrt(m) * n * epsilon / (steps * math.sqrt(d) * math.log(m * n * d / delta)),
        steps ** -0.75,
        math.sqrt(n * m) / steps,
    )


def aup_rlhf(
    data: BTLData, epsilon: Optional[float], delta: float, *, users_per_batch: float, steps: int,
    rng: np.random.Generator, B: float, tau: Optional[float] = None,
    lr: Union[None, float, Callable[[int], float]] = None, max_users_per_batch: Optional[int] = None,
    svt_fraction: float = 0.5, phases: int = 1, phase_users: str = "all", relation: str = "add_or_remove",
    tail_average: bool = False,
) -> SGDResult:
    """AUP-RLHF (Alg. 1 with k = ``phases`` over disjoint user sets; Alg. 2 in each).

    The same mechanism as :class:`~trl_userdp.optimizers.AUPOptimizer` (the sensitivity correction of
    docs/mechanisms.md, M4, truncated Poisson sampling). The phases are exact-size slices of a random permutation;
    their users are disjoint, so the run is (ε, δ) by parallel composition; each phase starts from the last.

    Args:
        data: The comparisons, m per user, grouped.
        epsilon: The user-level ε, or None for the control: the same steps and outlier removal without
            AboveThreshold and without noise (``tau`` and ``lr`` must then be given).
        delta: The user-level δ.
        users_per_batch: The expected users per step ñ (capped at a phase's users).
        steps: The number of steps T of each phase.
        rng: The generator of the permutation, the sampling and the noise.
        B: The radius of Θ_B.
        tau: The concentration radius τ; default :func:`theorem4_tau`.
        lr: A constant or a schedule (:func:`step_size`); default :func:`theorem4_lr`.
        max_users_per_batch: The truncation ñ_max; default the optimizer's.
        svt_fraction: The share of ε spent on AboveThreshold.
        phases: The number of phases k.
        phase_users: As in :func:`trl_userdp.data.phases.phase_shares` (``"paper"``: phase i has n/2^{k+1−i}
            users, half of them unused at k = 1; ``"all"``: rescaled to use every user).
        relation: The Gaussian half's neighbouring relation (AboveThreshold's sensitivity covers both).
        tail_average: Average the last half of the iterates.

    Returns:
        The :class:`SGDResult` (``halted`` if AboveThreshold stopped the run).

    Raises:
        ValueError: If ``epsilon`` is None without ``tau`` and ``lr``, ``phases`` or ``phase_users`` is invalid,
            users have different numbers of rows or are not grouped, or the privacy parameters are invalid.
    """
    if epsilon is None and (tau is None or lr is None):
        raise ValueError("aup_rlhf without privacy (epsilon=None) needs tau and lr: Thm 4's choices depend on ε.")
    x_all, y_all, m = _by_user(data)
    n_all, d = len(x_all), x_all.shape[-1]
    weights = phase_shares(phases, phase_users)
    order = rng.permutation(n_all)
    bounds = np.concatenate([[0], np.cumsum(np.floor(weights * n_all).astype(int))])
    theta = project_theta(np.zeros(d), B)
    total_steps = 0
    for i in range(phases):
        users = order[bounds[i] : bounds[i + 1]]
        result = _aup_phase(
            theta, x_all[users], y_all[users], epsilon, delta, users_per_batch=min(users_per_batch, len(users)),
            steps=steps, rng=rng, B=B, L=data.L, m=m, tau=tau, lr=lr, max_users_per_batch=max_users_per_batch,
            svt_fraction=svt_fraction, relation=relation, tail_average=tail_average,
        )
        theta, total_steps = result.theta, total_steps + result.steps_taken
        if result.halted:
            return SGDResult(theta, total_steps, halted=True)
    return SGDResult(theta, total_steps)


def _aup_phase(theta, x, y, epsilon, delta, *, users_per_batch, steps, rng, B, L, m, tau, lr, max_users_per_batch,
               svt_fraction, relation, tail_average) -> SGDResult:
    n, d = len(x), x.shape[-1]
    tau = theorem4_tau(L, n, d, m, epsilon, steps, delta) if tau is None else tau
    lr = theorem4_lr(L, B, n, d, m, epsilon, steps, delta) if lr is None else lr
    n_tilde = users_per_batch
    n_max = min(max_users_per_batch or aup.default_max_users_per_batch(n_tilde), n)
    q = n_tilde / n
    svt, noise_std = None, 0.0
    if epsilon is not None:
        eps_svt, eps_gauss, delta_gauss = aup.split_budget(epsilon, delta, svt_fraction)
        sigma = _sigma_truncated(eps_gauss, delta_gauss, q, steps, n, n_max, relation)
        noise_std = aup.noise_std(tau, sigma, epsilon, steps, delta, n_tilde)
        svt = aup.score_test(n_tilde, n_max, eps_svt, torch.Generator().manual_seed(int(rng.integers(2**62))))
    iterates = []
    for t in range(steps):
        users = np.flatnonzero(rng.random(n) < q)
        if len(users) > n_max:
            users = np.sort(rng.choice(users, n_max, replace=False))
        g = user_gradients(theta, x[users], y[users])
        dist = pairwise_distances([torch.from_numpy(g)])
        if svt is not None and not svt.query(float((dist <= tau).sum()) / n_tilde):
            return SGDResult(_average(iterates, tail_average) if iterates else theta, t, halted=True)
        keep = rng.random(len(users)) < keep_probabilities(dist, tau, n_tilde).numpy()
        mean = g[keep].mean(0) if keep.any() else np.zeros(d)
        theta = project_theta(theta - step_size(lr, t) * (mean + rng.normal(0, noise_std, d)), B)
        iterates.append(theta)
    return SGDResult(_average(iterates, tail_average), steps)
