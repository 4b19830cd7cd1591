"""AUPOptimizer: concentration score, AboveThreshold, outlier removal and noise (issue 5)."""

import math

import pytest
import torch
from scipy import stats

from trl_userdp.grad_sample import UserGradSampleHooks
from trl_userdp.mechanisms.aup import keep_probabilities, pairwise_distances
from trl_userdp.optimizers.aup_optimizer import AUPOptimizer


def _make(sigma=0.0, tau=1.0, n_tilde=10.0, n_max=20, svt_epsilon=1e6, seed=0):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    hooks = UserGradSampleHooks(model)
    opt = AUPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma, concentration_radius=tau,
        expected_batch_size=n_tilde, max_users_per_batch=n_max, epsilon=2.0, delta=1e-5, steps=100,
        svt_epsilon=svt_epsilon, hooks=hooks, generator=torch.Generator().manual_seed(seed), self_check=False,
    )
    return model, hooks, opt


def _step(model, hooks, opt, x, y, users):
    """One step on rows (x, y) of the given users; returns the update p_before − p_after."""
    before = model.weight.detach().clone()
    opt.zero_grad()
    hooks.set_row_users(torch.tensor(users))
    ((model(x).squeeze(-1) - y) ** 2).mean().backward()
    opt.step()
    return before - model.weight.detach()


def _identical_users(n_users, rows=2):
    x = torch.tensor([[1.0, 2.0, -1.0]]).repeat(n_users * rows, 1)
    y = torch.ones(n_users * rows)
    return x, y, [u for u in range(n_users) for _ in range(rows)]


def test_distances_from_the_gram_matrix_are_euclidean():
    g = [torch.randn(6, 3, 2), torch.randn(6, 4)]
    flat = torch.cat([t.reshape(6, -1) for t in g], dim=1).double()
    assert torch.allclose(pairwise_distances(g), torch.cdist(flat, flat), atol=1e-9)


def test_identical_users_pass_and_nobody_is_removed():
    model, hooks, opt = _make()
    x, y, users = _identical_users(12)
    with torch.no_grad():
        expected_grad = 2 * (model(x[:1]).squeeze() - y[0]) * x[0]  # every user's average gradient
    update = _step(model, hooks, opt, x, y, users)
    assert not opt.halted and opt.svt_queries == 1
    assert torch.allclose(update.flatten(), expected_grad, atol=1e-6)  # σ = 0: the mean of all 12 users


def test_a_far_away_adversary_is_always_removed():
    for seed in range(50):
        model, hooks, opt = _make(seed=seed)
        x, y, users = _identical_users(12)
        x = torch.cat([x, torch.tensor([[300.0, -200.0, 100.0]])])
        y = torch.cat([y, torch.tensor([-50.0])])
        with torch.no_grad():
            honest = 2 * (model(x[:1]).squeeze() - y[0]) * x[0]
        update = _step(model, hooks, opt, x, y, users + [99])
        assert torch.allclose(update.flatten(), honest, atol=1e-5), seed  # kept, it would pull the mean far away


def test_widely_spread_gradients_make_above_threshold_halt():
    model, hooks, opt = _make(tau=0.1)
    x = torch.eye(3).repeat(4, 1) * torch.arange(1, 13).unsqueeze(1).float()  # 12 users far apart
    update = _step(model, hooks, opt, x, torch.zeros(12), list(range(12)))
    assert opt.halted and opt.halted_at_query == 1
    assert torch.count_nonzero(update) == 0  # no update on ⊥
    x2, y2, users2 = _identical_users(12)
    assert torch.count_nonzero(_step(model, hooks, opt, x2, y2, users2)) == 0  # and none afterwards
    assert opt.svt_queries == 1


def test_keep_probabilities_follow_the_schedule():
    n_tilde = 12.0
    # user i has f_i users (itself included) within 2τ: f = 5 (< ñ/2), 7 (between), 8 (≥ 2ñ/3)
    d = torch.full((20, 20), 10.0, dtype=torch.float64)
    d.fill_diagonal_(0.0)
    for i, f in ((0, 5), (1, 7), (2, 8)):
        d[i, list(range(3, 3 + f - 1))] = 0.0
    p = keep_probabilities(d, 1.0, n_tilde)
    assert p[0] == 0.0 and p[1] == pytest.approx((7 - 6) / 2) and p[2] == 1.0


def test_noise_std_matches_the_formula():
    sigma, tau, n_tilde = 1.3, 0.4, 10.0
    expected = tau * sigma * math.sqrt(8 * math.log(math.exp(2.0) * 100 / 1e-5)) / n_tilde
    model, hooks, opt = _make(sigma=sigma, tau=tau, n_tilde=n_tilde)
    assert opt.noise_std == pytest.approx(expected)
    x, y, users = _identical_users(12)
    draws = []
    for _ in range(400):
        with torch.no_grad():
            model.weight.zero_()
            mean_grad = 2 * (model(x[:1]).squeeze() - y[0]) * x[0]
        draws.append(_step(model, hooks, opt, x, y, users).flatten() - mean_grad)
    noise = torch.cat(draws).double()
    n = noise.numel()
    lo, hi = stats.chi2.interval(0.999, n - 1)
    assert lo <= (n - 1) * float(noise.var()) / expected**2 <= hi


def test_more_users_than_the_truncation_is_refused():
    model, hooks, opt = _make(n_max=11)
    x, y, users = _identical_users(12)
    with pytest.raises(ValueError, match="max_users_per_batch=11"):
        _step(model, hooks, opt, x, y, users)


def test_a_training_forward_without_backward_is_refused():
    model, hooks, opt = _make()
    x, y, users = _identical_users(12)
    model(x[:1])  # e.g. a metric computed in training mode with gradients on
    with pytest.raises(ValueError, match="had no backward pass"):
        _step(model, hooks, opt, x, y, users)
