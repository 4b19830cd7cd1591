"""Linear BTL estimators: solver exactness, projection, consistency, objective-perturbation noise."""

import math

import numpy as np
import pytest

from trl_userdp.experiments.linear import (
    debiased_labels,
    fit_logistic,
    generate_btl_data,
    mle,
    objective_perturbation_sigma,
    project_theta,
    rr_debiased_mle,
    sgd_rr,
)
from trl_userdp.mechanisms import UserRandomizedResponse


def test_generator_respects_the_model_bounds():
    data = generate_btl_data(n_users=200, samples_per_user=5, d=6, B=1.5, L=0.8, seed=0)
    assert data.x.shape == (1000, 6) and set(np.unique(data.y)) == {0, 1}
    assert abs(data.theta_star.sum()) < 1e-12 and np.linalg.norm(data.theta_star) == pytest.approx(1.5)
    assert np.linalg.norm(data.x, axis=1).max() <= 2 * 0.8 + 1e-12
    assert data.n_users == 200 and np.bincount(data.users).max() == 5


def test_projection_is_the_euclidean_projection_onto_theta_b():
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.standard_normal(4) * 3
        p = project_theta(v, 1.0)
        assert abs(p.sum()) < 1e-12 and p @ p <= 1 + 1e-12  # feasible
        # no feasible point is closer: sum-zero points in the unit ball, near p and anywhere
        q = p + 0.05 * rng.standard_normal((5000, 4))
        q = np.vstack([q, rng.standard_normal((5000, 4))])
        q -= q.mean(1, keepdims=True)
        q /= np.maximum(1.0, np.linalg.norm(q, axis=1, keepdims=True))
        assert np.min(np.sum((q - v) ** 2, axis=1)) >= np.sum((p - v) ** 2) - 1e-12


def test_solver_reaches_the_optimum_of_the_debiased_objective():
    data = generate_btl_data(n_users=500, samples_per_user=2, d=4, seed=1)
    rng = np.random.default_rng(0)
    targets = debiased_labels(UserRandomizedResponse(0.5, 1).privatize_labels(data.y, rng), 0.5)
    theta = fit_logistic(data.x, targets, sum_zero=False, l2=0.01)
    grad = data.x.T @ (1 / (1 + np.exp(-data.x @ theta)) - targets) / len(targets) + 0.01 * theta
    assert np.linalg.norm(grad) < 1e-8


def test_estimators_are_consistent():
    errs = {"mle": [], "rr": [], "sgd": []}
    for n in (2000, 32000):
        data = generate_btl_data(n_users=n, samples_per_user=1, d=5, B=1.0, L=1.0, seed=2)
        y_tilde = UserRandomizedResponse(1.0, 1).privatize_labels(data.y, np.random.default_rng(1))
        errs["mle"].append(np.linalg.norm(mle(data.x, data.y, B=2.0) - data.theta_star))
        errs["rr"].append(np.linalg.norm(rr_debiased_mle(data.x, y_tilde, 1.0, B=2.0) - data.theta_star))
        errs["sgd"].append(np.linalg.norm(sgd_rr(data.x, y_tilde, 1.0, L=1.0, B=2.0) - data.theta_star))
    for name, (small, large) in errs.items():
        assert large < small, name
    assert errs["mle"][1] < errs["rr"][1]  # privacy costs accuracy


@pytest.mark.parametrize("eps,delta,L", [(0.1, 1e-3, 1.0), (1.0, 1e-5, 2.0), (5.0, 1e-6, 0.5)])
def test_objective_perturbation_noise_meets_the_theorem_condition(eps, delta, L):
    sigma = objective_perturbation_sigma(eps, delta, L)
    # Chowdhury et al. L1205: (2Lσ·sqrt(8 log(2/δ)) + 4L²) / (2σ²) ≤ ε
    assert (2 * L * sigma * math.sqrt(8 * math.log(2 / delta)) + 4 * L * L) / (2 * sigma**2) <= eps * (1 + 1e-12)
