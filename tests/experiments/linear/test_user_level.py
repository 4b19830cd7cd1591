"""User-level linear estimators (AUP-RLHF's theory world)."""

import math

import numpy as np
import pytest

from trl_userdp.experiments.linear import (
    aup_rlhf,
    generate_btl_data,
    group_dpsgd,
    theorem4_lr,
    theorem4_tau,
    user_dpsgd,
    user_dpsgd_adaptive_clip,
    user_gradients,
)


def test_user_gradients_are_per_user_averages():
    data = generate_btl_data(n_users=4, samples_per_user=3, d=2, seed=0)
    theta = np.array([0.3, -0.3])
    g = user_gradients(theta, data.x.reshape(4, 3, 2), data.y.reshape(4, 3))
    p = 1 / (1 + np.exp(-data.x @ theta))
    expected = [((p - data.y)[:, None] * data.x)[3 * u:3 * u + 3].mean(0) for u in range(4)]
    assert np.allclose(g, expected)


def test_theorem4_defaults():
    assert theorem4_tau(1.0, 100, 5, 4, 1.0, 10, 1e-5) == pytest.approx(4 * math.log(100 * 5 * 4 * math.e * 10 / 1e-5) / 2)
    lr = theorem4_lr(1.0, 1.0, 100, 5, 4, 1.0, 10, 1e-5)
    assert 0 < lr <= 0.25 * 10 ** -0.75


def test_dp_sgd_variants_learn_with_a_generous_budget():
    data = generate_btl_data(n_users=400, samples_per_user=5, d=3, seed=1)
    rng = np.random.default_rng(0)
    for fit in (user_dpsgd, group_dpsgd):
        theta = fit(data, 8.0, 1e-5, users_per_batch=100, steps=100, lr=0.5, max_grad_norm=1.0, rng=rng, B=1.0).theta
        assert np.linalg.norm(theta - data.theta_star) < 0.5 * np.linalg.norm(data.theta_star), fit.__name__


def test_adaptive_clipping_recovers_from_a_loose_initial_clip():
    """A clip 100× the users' norm scale drowns user-wise DP-SGD in noise (σC/ñ); the adaptive clip starts there, moves
    to the median norm within a few steps and learns (docs/mechanisms.md, M1a)."""
    data = generate_btl_data(n_users=400, samples_per_user=5, d=3, seed=1)
    common = dict(users_per_batch=100, steps=100, lr=0.5, B=1.0)
    fixed = user_dpsgd(data, 3.0, 1e-5, max_grad_norm=100.0, rng=np.random.default_rng(0), **common).theta
    adaptive = user_dpsgd_adaptive_clip(data, 3.0, 1e-5, initial_clip=100.0, clip_learning_rate=1.0,
                                   rng=np.random.default_rng(0), **common).theta
    error = lambda theta: np.linalg.norm(theta - data.theta_star)  # noqa: E731
    assert error(adaptive) < 0.5 * np.linalg.norm(data.theta_star) < error(fixed)


def test_aup_full_batch_runs_and_poisson_small_batches_halt():
    data = generate_btl_data(n_users=300, samples_per_user=10, d=3, seed=2)
    rng = np.random.default_rng(0)
    full = aup_rlhf(data, 8.0, 1e-5, users_per_batch=300, steps=30, rng=rng, B=1.0, tau=0.5, lr=0.5)
    assert not full.halted and full.steps_taken == 30
    assert np.linalg.norm(full.theta - data.theta_star) < np.linalg.norm(data.theta_star)
    small = aup_rlhf(data, 8.0, 1e-5, users_per_batch=20, steps=200, rng=rng, B=1.0, tau=0.5, lr=0.5)
    assert small.halted and small.steps_taken < 200  # |U_t| ~ Poisson(20) drops below √0.8·ñ often


def test_aup_phases_split_users_disjointly():
    data = generate_btl_data(n_users=300, samples_per_user=4, d=3, seed=3)
    rng = np.random.default_rng(0)
    out = aup_rlhf(data, 8.0, 1e-5, users_per_batch=1000, steps=10, rng=rng, B=1.0, tau=1.0, lr=0.5, phases=2,
                   phase_users="all")
    assert out.steps_taken == 20
    with pytest.raises(ValueError, match="phase_users"):
        aup_rlhf(data, 8.0, 1e-5, users_per_batch=10, steps=1, rng=rng, B=1.0, phase_users="half")


def test_aup_control_is_the_same_steps_without_noise_or_halting():
    """AUP with ``epsilon=None`` is its control: with a τ nobody exceeds it keeps every user, so with every user at
    every step it is full-batch gradient descent, the same iterates as user-wise DP-SGD's control with a clip no one
    reaches; without τ and lr (Thm 4's depend on ε) it refuses."""
    data = generate_btl_data(n_users=50, samples_per_user=4, d=3, seed=4)
    schedule = lambda t: min(2.0, 1 / (0.1 * (t + 1)))  # noqa: E731
    common = dict(users_per_batch=50.0, steps=40, lr=schedule, B=1.0, tail_average=True)
    aup = aup_rlhf(data, None, 1e-5, tau=100.0, rng=np.random.default_rng(0), **common)
    sgd = user_dpsgd(data, None, 1e-5, max_grad_norm=100.0, rng=np.random.default_rng(1), **common)
    assert not aup.halted and aup.steps_taken == 40
    np.testing.assert_allclose(aup.theta, sgd.theta, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="needs tau and lr"):
        aup_rlhf(data, None, 1e-5, users_per_batch=50.0, steps=1, rng=np.random.default_rng(0), B=1.0, lr=0.5)
