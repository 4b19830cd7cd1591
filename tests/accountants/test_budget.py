"""``PrivacyBudget`` (issue 43): the one place that decides whether another step fits, against an independent
dp-accounting computation of ε."""

import pytest

from trl_userdp.accountants import PrivacyBudget, compute_epsilon, poisson_gaussian_event
from trl_userdp.accountants.accountant import DPRdpAccountant

SIGMA, Q, DELTA = 1.0, 0.05, 1e-5


def _epsilon(steps: int) -> float:
    return compute_epsilon(poisson_gaussian_event(SIGMA, Q, steps), DELTA)


def test_a_fixed_sigma_affords_exactly_the_steps_whose_epsilon_fits():
    budget = PrivacyBudget(epsilon=_epsilon(40) + 1e-9, delta=DELTA)
    accountant = DPRdpAccountant()
    assert budget.affordable_steps(accountant, SIGMA, Q) == 40  # ε(40) fits, ε(41) does not
    for _ in range(40):
        assert budget.allows_step(accountant, SIGMA, Q)
        accountant.step(noise_multiplier=SIGMA, sample_rate=Q)
    assert not budget.allows_step(accountant, SIGMA, Q)
    assert "40 steps are already accounted" in budget.exhausted(accountant.steps_taken)


def test_a_calibrated_plan_affords_its_steps_and_a_changed_step_is_accounted_in_full():
    """σ calibrated to T steps: T steps fit whatever the calibration's rounding. A history at another (σ, q) is
    accounted step by step: one more step fits only if the whole history's ε stays within the budget."""
    budget = PrivacyBudget(epsilon=1.0, delta=DELTA, calibrated_steps=12)
    accountant = DPRdpAccountant()
    assert budget.affordable_steps(accountant, SIGMA, Q) == 12
    accountant.step(noise_multiplier=4.0, sample_rate=Q)  # a quiet step first: the history mixes two (σ, q)
    loose = PrivacyBudget(epsilon=_epsilon(10) + 1e-9, delta=DELTA)
    for _ in range(9):
        accountant.step(noise_multiplier=SIGMA, sample_rate=Q)
    assert loose.allows_step(accountant, SIGMA, Q) is False  # 1 quiet + 10 steps exceed ε(10)
    assert PrivacyBudget(epsilon=_epsilon(11), delta=DELTA).allows_step(accountant, SIGMA, Q)
    with pytest.raises(TypeError):
        PrivacyBudget(1.0, DELTA, None, {})  # the cache is not an argument
