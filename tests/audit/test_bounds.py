"""The one-run bound (Steinke et al. 2023): its p-value against scipy's binomial tail, its lower bound against games
whose true ε is known, and the guesses behind it."""

import math

import numpy as np
import pytest
from scipy import special, stats

from trl_userdp.audit import audit_scores, epsilon_lower_bound, guess, p_value
from trl_userdp.audit.bounds import gaussian_epsilon, gaussian_game, randomized_response_game


@pytest.mark.parametrize("guesses,correct,epsilon", [(100, 80, 1.0), (50, 50, 3.0), (1000, 520, 0.1), (10, 0, 2.0)])
def test_without_delta_the_p_value_is_the_binomial_tail(guesses, correct, epsilon):
    expected = 1.0 if correct == 0 else stats.binom.sf(correct - 1, guesses, 1 / (1 + math.exp(-epsilon)))
    assert p_value(1000, guesses, correct, epsilon, 0.0) == pytest.approx(expected, rel=1e-12)


def test_the_delta_term_is_prop_5_2_written_out():
    """β + 2mδ·max_i (P[X ≥ v − i] − β)/i, with the maximum taken by an explicit loop over i."""
    m, r, v, eps, delta = 500, 60, 48, 1.5, 1e-4
    q = special.expit(eps)
    tail = lambda k: sum(math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(max(k, 0), r + 1))  # noqa: E731
    beta = tail(v)
    alpha = max((tail(v - i) - beta) / i for i in range(1, v + 1))
    assert p_value(m, r, v, eps, delta) == pytest.approx(beta + 2 * m * delta * alpha, rel=1e-9)
    assert p_value(m, r, v, eps, delta) >= p_value(m, r, v, eps, 0.0)


def test_at_the_bound_the_claim_is_rejected_at_exactly_the_significance():
    bound = epsilon_lower_bound(1000, 200, 170, delta=0.0, confidence=0.95)
    assert stats.binom.sf(169, 200, special.expit(bound)) == pytest.approx(0.05, abs=1e-5)
    assert epsilon_lower_bound(1000, 200, 100, delta=1e-5) == 0.0  # chance-level guesses reject nothing
    assert epsilon_lower_bound(1000, 200, 170, delta=1e-5) < bound  # δ only weakens what can be rejected


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0])
def test_the_bound_stays_below_a_known_epsilon_and_comes_close_with_many_canaries(epsilon):
    """Randomized response per canary is exactly ε-DP: the bound must not exceed ε (at 95%, here in every one of 10
    seeds), and with 10,000 canaries it comes within 15% of ε."""
    small = [audit_scores(*randomized_response_game(1000, epsilon, np.random.default_rng(s)), 1e-5).epsilon_lower
             for s in range(10)]
    assert max(small) <= epsilon and min(small) > 0.5 * epsilon
    large = audit_scores(*randomized_response_game(10_000, epsilon, np.random.default_rng(99)), 1e-5).epsilon_lower
    assert 0.85 * epsilon <= large <= epsilon


def test_the_bound_holds_with_its_confidence_over_many_runs():
    """Over 400 runs of a 1-DP game with 100 canaries, the bound exceeds ε = 1 in at most 5% of them (plus binomial
    slack): the union bound over the abstentions tried keeps the stated confidence."""
    rng = np.random.default_rng(0)
    above = sum(audit_scores(*randomized_response_game(100, 1.0, rng), 0.0).epsilon_lower > 1.0 for _ in range(400))
    assert above <= stats.binom.ppf(0.999, 400, 0.05)


def test_a_mechanism_that_leaks_nothing_audits_to_zero_almost_always():
    rng = np.random.default_rng(1)
    bounds = [audit_scores(rng.standard_normal(1000), rng.random(1000) < 0.5, 1e-5).epsilon_lower for _ in range(40)]
    assert sum(b > 0 for b in bounds) <= 6  # 5% expected: 2 of 40


def test_the_gaussian_game_audits_below_its_epsilon():
    """μ-GDP's ε (Dong et al. Cor. 2.13) is what the engine claims at σ for one full-batch step: the one-run bound of
    the Gaussian game stays below it and, with 1,000 canaries, reaches about a quarter to a half of it."""
    mu = 0.5
    epsilon = gaussian_epsilon(mu, 1e-5)
    assert 1.9 < epsilon < 2.1
    bounds = [audit_scores(*gaussian_game(1000, mu, np.random.default_rng(s)), 1e-5).epsilon_lower for s in range(5)]
    assert max(bounds) <= epsilon and np.mean(bounds) > 0.2 * epsilon


def test_guesses_take_the_most_confident_canaries_and_count_against_the_secret_draw():
    scores = [0.1, 0.9, 0.5, 0.7, 0.2, 0.3]
    included = [False, True, True, False, False, True]
    found = guess(scores, included, k_in=2, k_out=2)  # in: 0.9 (right), 0.7 (wrong); out: 0.1, 0.2 (both right)
    assert (found.guesses, found.correct) == (4, 3)
    assert guess(scores, included, k_in=0, k_out=0).guesses == 0
    with pytest.raises(ValueError, match="add up to at most 6"):
        guess(scores, included, k_in=4, k_out=3)
    with pytest.raises(ValueError, match="finite"):
        guess([math.nan] * 6, included, 1, 1)
    with pytest.raises(ValueError, match="one score per canary"):
        guess(scores[:5], included, 1, 1)
    with pytest.raises(ValueError, match="correct <= guesses <= m"):
        p_value(10, 5, 6, 1.0, 0.0)
