"""The number of guesses planned from the claim: a function of the claim alone, the published idealized figures
reproduced by the expected-count bounds behind it, and the power it buys over trying several under a union bound."""

import math

import numpy as np
import pytest

from trl_userdp.audit.bounds import audit_scores, gaussian_epsilon, gaussian_game
from trl_userdp.audit.fdp import TradeOffCurve, audit_curve
from trl_userdp.audit.planning import expected_bounds, plan_guesses


def test_the_plan_depends_on_the_claim_alone_and_guesses_everything_without_one():
    plan = plan_guesses(2.0, 1e-5, 1000)
    assert plan == plan_guesses(2.0, 1e-5, 1000) and all(2 <= k <= 1000 and k % 2 == 0 for k in plan.values())
    assert plan_guesses(math.inf, 1e-5, 100) == {"steinke": 100, "fdp": 100}
    assert plan_guesses(0.01, 1e-5, 100) == {"steinke": 100, "fdp": 100}  # nothing to reject with 100 canaries


@pytest.mark.parametrize("sigma,steinke,fdp", [(2.0, 1.33, 1.59), (1.0, 2.61, 3.61)])
def test_the_expected_bounds_reproduce_mahloujifar_et_al_table_1(sigma, steinke, fdp):
    """One Gaussian mechanism of noise σ, 10⁵ canaries, δ = 1e-5 (their Table 1): Steinke et al.'s column within 5%,
    the f-DP column within 10% from below (their protocol averages 100 simulated runs)."""
    ours = expected_bounds(1 / sigma, 100_000, (200, 500, 800, 1000, 1500, 2000, 3000), 1e-5)
    assert ours["steinke"]["epsilon"] == pytest.approx(steinke, rel=0.05)
    assert 0.9 * fdp <= ours["fdp"]["epsilon"] <= fdp


def test_planned_guesses_keep_the_level_and_give_the_f_dp_audit_its_power_at_epsilon_2():
    """The Gaussian game of a claimed ε = 2 (μ-GDP), 1,000 canaries, 20 seeds: the planned test never rejects the true
    curve and its bound stays below 2; on average it reaches 0.4 × the claim, above the union over the default
    numbers of guesses, and so does Steinke et al.'s bound with its own plan."""
    mu = next(m for m in np.linspace(0.3, 0.7, 4001) if gaussian_epsilon(m, 1e-5) >= 2.0)
    plan = plan_guesses(2.0, 1e-5, 1000)

    def curves(scale):
        return TradeOffCurve.gaussian(mu / scale), gaussian_epsilon(mu / scale, 1e-5)

    planned, union, steinke_planned, steinke_union = [], [], [], []
    for seed in range(20):
        scores, included = gaussian_game(1000, mu, np.random.default_rng(1000 + seed))
        found = audit_curve(scores, included, curves, abstentions=[plan["fdp"]])
        assert not found.claim_rejected and found.epsilon_lower <= 2.0
        planned.append(found.epsilon_lower)
        union.append(audit_curve(scores, included, curves).epsilon_lower)
        steinke_planned.append(audit_scores(scores, included, 1e-5, abstentions=[plan["steinke"]]).epsilon_lower)
        steinke_union.append(audit_scores(scores, included, 1e-5).epsilon_lower)
    assert np.mean(planned) >= 0.8 and np.mean(planned) > np.mean(union)
    assert np.mean(steinke_planned) > np.mean(steinke_union) and max(steinke_planned) <= 2.0
