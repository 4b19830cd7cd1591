"""Label-privacy losses (docs/mechanisms.md, Losses, issue 4)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trl_userdp.losses import BTLLoss, PlackettLuceLoss, RobustDPOLoss, RRDebiasedRewardLoss, flip_rate_from_epsilon


def _grad(loss_fn, z):
    z = z.clone().requires_grad_(True)
    loss_fn(z).backward()
    return z.grad


@pytest.mark.parametrize("eps", [0.3, 1.0, 3.0])
def test_rr_debiased_gradient_is_unbiased_for_the_clean_btl_gradient(eps):
    """Monte-Carlo over RR draws: E[∇ loss(observed margin)] = ∇ softplus(−z) per pair."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, generator=g) * 2  # clean-orientation margins
    rho = flip_rate_from_epsilon(eps)
    draws = 200_000
    flips = torch.rand(draws, 8, generator=g) < rho
    sign = torch.where(flips, -1.0, 1.0)  # a flip presents the pair the other way round: margin −z
    loss = RRDebiasedRewardLoss(eps, normalize=True, reduction="sum")
    zz = z.expand(draws, 8).clone().requires_grad_(True)
    loss(sign * zz).backward()
    mean, se = zz.grad.mean(0), zz.grad.std(0) / math.sqrt(draws)
    clean = _grad(BTLLoss(reduction="sum"), z)
    assert torch.all((mean - clean).abs() <= 4 * se + 1e-6), (mean, clean, se)


def test_rr_debiased_loss_matches_its_closed_form_gradient_and_can_be_negative():
    eps = 0.5
    s = 1 / (1 + math.exp(-eps))
    z = torch.linspace(-6, 6, 25)
    loss = RRDebiasedRewardLoss(eps, reduction="none")
    labels = torch.randint(0, 2, (25,), generator=torch.Generator().manual_seed(1))
    zz = z.clone().requires_grad_(True)
    loss(zz, labels).sum().backward()
    y_bar = (labels.float() - (1 - s)) / (2 * s - 1)
    assert torch.allclose(zz.grad, (2 * s - 1) * (torch.sigmoid(z) - y_bar), atol=1e-6)
    assert (loss(z) < 0).any()  # not a log-likelihood: large positive margins give negative loss


@pytest.mark.parametrize("eps", [1e-3, 0.1, 1.0, 5.0, 50.0])
def test_rr_debiased_loss_is_convex_in_the_margin(eps):
    z = torch.linspace(-30, 30, 601, dtype=torch.float64).requires_grad_(True)
    loss = RRDebiasedRewardLoss(eps, reduction="sum")
    (g,) = torch.autograd.grad(loss(z), z, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), z)
    assert torch.all(h >= -1e-12)
    s = 1 / (1 + math.exp(-eps))
    assert torch.allclose(h, (2 * s - 1) * torch.sigmoid(z) * torch.sigmoid(-z))  # Hessian (2s−1)σ'(z)


def test_normalize_divides_by_two_s_minus_one():
    z = torch.randn(10)
    s = 1 / (1 + math.exp(-0.7))
    assert torch.allclose(RRDebiasedRewardLoss(0.7, normalize=True)(z), RRDebiasedRewardLoss(0.7)(z) / (2 * s - 1))


def test_robust_dpo_differs_from_sigmoid_when_flips_and_reduces_to_it_without():
    m = torch.randn(100, generator=torch.Generator().manual_seed(0)) * 3
    dpo = -F.logsigmoid(m).mean()
    assert not torch.allclose(RobustDPOLoss(flip_rate=0.1)(m), dpo)
    for eps in (50.0, 1e3, 1e6, float("1e300")):
        out = RobustDPOLoss(epsilon=eps)(m)
        assert torch.isfinite(out) and torch.allclose(out, dpo, atol=1e-6)
    assert torch.allclose(RobustDPOLoss(flip_rate=0.0)(m), dpo)
    assert RobustDPOLoss(epsilon=1.0).flip_rate == pytest.approx(1 / (1 + math.e))


@pytest.mark.parametrize("kwargs,match", [
    (dict(flip_rate=0.5), r"flip_rate must lie in \[0, 1/2\)"), (dict(flip_rate=0.7), r"flip_rate must lie"),
    (dict(flip_rate=-0.1), r"flip_rate must lie"), (dict(epsilon=0.0), "must be a finite number > 0"),
    (dict(epsilon=-1.0), "must be a finite number > 0"), (dict(), "exactly one"),
    (dict(flip_rate=0.1, epsilon=1.0), "exactly one"),
])
def test_robust_dpo_rejects_uninformative_or_ambiguous_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RobustDPOLoss(**kwargs)


def test_plackett_luce_with_two_responses_is_btl_and_its_rr_form_is_the_debiased_loss():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(50, 2, generator=g)
    top = torch.randint(0, 2, (50,), generator=g)
    margin = torch.where(top == 0, scores[:, 0] - scores[:, 1], scores[:, 1] - scores[:, 0])  # observed orientation
    assert torch.allclose(PlackettLuceLoss(reduction="none")(scores, top), BTLLoss(reduction="none")(margin), atol=1e-6)
    assert torch.allclose(
        PlackettLuceLoss(epsilon=0.8, reduction="none")(scores, top),
        RRDebiasedRewardLoss(0.8, reduction="none")(margin), atol=1e-6,
    )


@pytest.mark.parametrize("k,eps", [(3, 1.0), (4, 2.0)])
def test_k_rr_debiased_plackett_luce_gradient_is_unbiased(k, eps):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, k, generator=g, dtype=torch.float64)
    truth = torch.randint(0, k, (6,), generator=g)
    keep = math.exp(eps) / (math.exp(eps) + k - 1)
    draws = 100_000
    move = torch.rand(draws, 6, generator=g) >= keep
    shift = torch.randint(1, k, (draws, 6), generator=g)
    observed = torch.where(move, (truth + shift) % k, truth)
    s = scores.expand(draws, 6, k).reshape(-1, k).clone().requires_grad_(True)
    PlackettLuceLoss(epsilon=eps, normalize=True, reduction="sum")(s, observed.reshape(-1)).backward()
    grads = s.grad.reshape(draws, 6, k)
    mean, se = grads.mean(0), grads.std(0) / math.sqrt(draws)
    sc = scores.clone().requires_grad_(True)
    PlackettLuceLoss(reduction="sum")(sc, truth).backward()
    assert torch.all((mean - sc.grad).abs() <= 4 * se + 1e-9)


def test_losses_reject_bad_arguments():
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0"):
        RRDebiasedRewardLoss(0.0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        RRDebiasedRewardLoss(1.0, reduction="max")
    with pytest.raises(ValueError, match="shape"):
        PlackettLuceLoss()(torch.randn(3), torch.zeros(3))
    assert np.isclose(flip_rate_from_epsilon(1e6), 0.0)
