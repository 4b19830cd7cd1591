"""The f-DP audit (Mahloujifar et al. 2024): the curve read from the accountant against μ-GDP's closed form, the test
against games whose true curve is known (it keeps its level), and its power where Steinke et al.'s bound saturates."""

import math

import numpy as np
import pytest
from scipy import stats

from trl_userdp.accountants.accountant import DPPldAccountant
from trl_userdp.accountants.events import ELSGaussian, GroupPrivacyGaussian, TruncatedPoissonGaussian
from trl_userdp.audit.bounds import audit_scores, gaussian_epsilon, gaussian_game, guess, randomized_response_game
from trl_userdp.audit.fdp import TradeOffCurve, audit_curve, rejects, run_curves


def full_batch_accountant(epsilon: float, steps: int = 10) -> DPPldAccountant:
    """The accountant of ``steps`` full-batch steps (q = 1) calibrated to ε at δ = 1e-5: μ-GDP with μ = √T/σ."""
    accountant = DPPldAccountant()
    sigma = accountant.calibrate(epsilon, 1e-5, sample_rate=1.0, steps=steps)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    return accountant


def gdp_curve(mu: float):
    """Dong, Roth and Su 2022, Def. 2.7: ``G_μ(α) = Φ(Φ⁻¹(1 − α) − μ)``."""
    return lambda alpha: stats.norm.cdf(stats.norm.ppf(1 - alpha) - mu)


def gdp_rejects(mu: float, m: int, guesses: int, correct: int, significance: float) -> bool:
    """The paper's recursion written with the Gaussian blow-up inverse ``Φ(Φ⁻¹(x) − μ)`` in closed form."""
    r, h = significance * correct / m, significance * (guesses - correct) / m
    for i in range(correct - 1, -1, -1):
        h_new = max(h, stats.norm.cdf(stats.norm.ppf(r) - mu))
        r, h = min(r + i / (guesses - i) * (h_new - h), 1.0), h_new
    return r + h > guesses / m


def test_the_accountants_curve_is_mu_gdp_from_below_for_a_full_batch_run():
    """T full-batch steps at σ are μ-GDP with μ = √T/σ: the curve read from the PLD profile lies on G_μ (within the
    grid's and the discretisation's error) and never above it (a lower trade-off curve is a weaker, sound claim)."""
    accountant = full_batch_accountant(2.0)
    mu = math.sqrt(10) / accountant.history[0][0]
    curve, epsilon = run_curves(accountant, 1e-5)(1.0)
    assert epsilon == pytest.approx(2.0, abs=0.02)
    alphas = np.linspace(0.0, 1.0, 41)
    ours, exact = np.array([curve(a) for a in alphas]), gdp_curve(mu)(alphas)
    assert np.all(ours <= exact + 1e-9) and np.max(exact - ours) < 0.01
    assert TradeOffCurve.epsilon_delta(1.0, 0.1)(0.2) == pytest.approx(max(0.9 - math.e * 0.2, (0.9 - 0.2) / math.e))


@pytest.mark.parametrize("guesses,correct", [(50, 40), (100, 74), (200, 150), (500, 314), (20, 19)])
def test_the_recursion_decides_as_the_closed_form_gaussian_one(guesses, correct):
    """On μ-GDP's closed-form curve the generic recursion (blow-up inverse ``y ↦ f(1 − y)``) decides every claim as the
    recursion written with ``Φ(Φ⁻¹(x) − μ)``."""
    for mu in (0.2, 0.5, 1.0, 2.0):
        alphas = np.linspace(0, 1, 2001)
        exact = gdp_curve(mu)(alphas)
        grid = TradeOffCurve.gaussian(mu)  # G_μ from its closed-form profile (Dong et al. Cor. 2.13)
        assert np.max(np.abs(np.array([grid(a) for a in alphas[::50]]) - exact[::50])) < 2e-3
        assert rejects(grid, 1000, guesses, correct, 0.05) == gdp_rejects(mu, 1000, guesses, correct, 0.05)


def test_a_true_claim_is_rejected_at_most_at_the_tests_level():
    """Randomized response per canary is exactly ε-DP, i.e. f_{ε,0}-DP, and nearly tight for this test: 100 canaries,
    10 guesses ("in" and "out"), 2,000 runs; the true claim is rejected in at most 5% of them (plus binomial slack:
    a test twice as permissive would reject in about 8%). The Gaussian game with mean shift μ is exactly G_μ-DP:
    rejected at most as often, over 300 runs with the guesses split between four abstentions."""
    rng = np.random.default_rng(0)
    curve = TradeOffCurve.epsilon_delta(1.0, 0.0)
    rejected = 0
    for _ in range(2000):
        found = guess(*randomized_response_game(100, 1.0, rng), 5, 5)
        rejected += rejects(curve, 100, found.guesses, found.correct, 0.05)
    assert 0 < rejected <= stats.binom.ppf(0.999, 2000, 0.05)
    gauss, rejected = TradeOffCurve.gaussian(1.0), 0
    for _ in range(300):
        scores, included = gaussian_game(100, 1.0, rng)
        found = [guess(scores, included, k // 2, k - k // 2) for k in (10, 26, 50, 100)]
        rejected += any(rejects(gauss, 100, g.guesses, g.correct, 0.05 / 4) for g in found)
    assert rejected <= stats.binom.ppf(0.999, 300, 0.05)


@pytest.mark.parametrize("events", [GroupPrivacyGaussian(2), GroupPrivacyGaussian(4), ELSGaussian(2),
                                    TruncatedPoissonGaussian(n_users=200, max_users_per_batch=40)])
def test_every_mechanisms_curve_is_finite_and_the_family_monotone(events):
    """The curves of the mechanisms' events (group privacy's profile is not monotone in ε), at three noise scales:
    finite, not empty (f > 0 somewhere), and pointwise weaker as the noise shrinks."""
    accountant = DPPldAccountant(events=events)
    for _ in range(20):
        accountant.step(noise_multiplier=1.5, sample_rate=0.1)
    curves = run_curves(accountant, 1e-5)
    alphas = np.linspace(0.0, 1.0, 21)
    values = [np.array([curves(scale)[0](a) for a in alphas]) for scale in (0.7, 1.0, 1.4)]
    assert all(np.isfinite(v).all() and v[1] > 0 for v in values)
    assert np.all(values[0] <= values[1] + 1e-9) and np.all(values[1] <= values[2] + 1e-9)


@pytest.mark.parametrize("epsilon", [2.0, 8.0])
def test_an_honest_full_batch_run_is_not_rejected_and_its_bound_stays_below(epsilon):
    """The Gaussian game of the run's μ, 1,000 canaries, 6 seeds: the claimed curve survives, and the bound in the
    family stays below the claim; at ε = 8, where Steinke et al.'s bound saturates (it cannot pass ~log of the
    guesses' odds), the f-DP bound is higher on average."""
    accountant = full_batch_accountant(epsilon)
    mu = math.sqrt(10) / accountant.history[0][0]
    curves = run_curves(accountant, 1e-5)
    audits, steinke = [], []
    for seed in range(6):
        scores, included = gaussian_game(1000, mu, np.random.default_rng(seed))
        audits.append(audit_curve(scores, included, curves))
        steinke.append(audit_scores(scores, included, 1e-5).epsilon_lower)
    assert not any(a.claim_rejected for a in audits)
    assert all(0 <= a.epsilon_lower <= epsilon for a in audits) and gaussian_epsilon(mu, 1e-5) == pytest.approx(
        epsilon, abs=0.05)
    if epsilon == 8.0:
        assert np.mean([a.epsilon_lower for a in audits]) > np.mean(steinke)


def test_a_run_with_a_quarter_of_its_noise_is_rejected():
    accountant = full_batch_accountant(2.0)
    mu = math.sqrt(10) / accountant.history[0][0]
    scores, included = gaussian_game(1000, 4 * mu, np.random.default_rng(0))
    audit = audit_curve(scores, included, run_curves(accountant, 1e-5))
    assert audit.claim_rejected and audit.epsilon_lower > 2.0 and audit.scale < 1.0


def test_a_run_without_noise_has_no_curve_to_scale():
    accountant = DPPldAccountant()
    accountant.step(noise_multiplier=0.0, sample_rate=1.0)
    with pytest.raises(ValueError, match="σ > 0"):
        run_curves(accountant, 1e-5)
    with pytest.raises(ValueError, match="correct <= guesses"):
        rejects(TradeOffCurve.epsilon_delta(1.0, 0.0), 10, 5, 6, 0.05)
