"""AUP-RLHF's formulas live in one module (issue 12): the CLI walkthrough, the engine and the optimizer use them,
so they agree exactly."""

import pytest
import torch

from trl_userdp.mechanisms import AUPRLHF, AccountingSetting, aup
from trl_userdp.scripts.account import walkthrough_rows

from ..test_adaptive_engine import _private


def test_the_cli_walkthrough_prints_the_sigma_the_engine_trains_with():
    """``trl-userdp account`` used to calibrate AUP's σ with plain Poisson steps (1.189 at its default setting) while
    the engine truncates them to ñ_max (1.213); both now call :func:`aup.gaussian_noise_multiplier`. (The whole
    table is tested in tests/scripts/test_account.py.)"""
    engine, _, optimizer, loader = _private(eps=4.0, steps=20, upb=60.0, n_users=300)
    setting = AccountingSetting(n_users=300, max_samples_per_user=4, users_per_batch=60.0, steps=20, delta=1e-5)
    ((column,),) = walkthrough_rows(setting, [4.0], mechanisms=[AUPRLHF])[0]
    assert column.header == "AUP σ"
    assert column.value == engine.phase_noise_multipliers[0] == optimizer.noise_multiplier
    assert optimizer.max_users_per_batch == aup.default_max_users_per_batch(60.0)
    assert optimizer.noise_std == pytest.approx(
        aup.noise_std(5.0, optimizer.noise_multiplier, 4.0, 20, 1e-5, 60.0), rel=1e-12)
    assert optimizer.svt.threshold == pytest.approx(0.8 * 60.0)
    assert optimizer.svt.sensitivity == pytest.approx(aup.score_sensitivity(optimizer.max_users_per_batch, 60.0))


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_a_budget_split_outside_the_open_interval_is_refused(fraction):
    with pytest.raises(ValueError, match="svt_fraction must lie in"):
        aup.split_budget(3.0, 1e-5, fraction)


@pytest.mark.parametrize("n_tilde,svt_epsilon,steps", [(20.0, 4.0, 5), (40.0, 1.5, 3)])
def test_survival_probability_matches_the_mechanism_simulated(n_tilde, svt_epsilon, steps):
    """The closed form (threshold noise integrated) against AboveThreshold itself on best-case scores |U|²/ñ with
    truncated Poisson |U|: 4000 simulated runs, within 4 standard errors."""
    import numpy as np

    from trl_userdp.mechanisms.aup import default_max_users_per_batch, score_test, survival_probability

    n_max = default_max_users_per_batch(n_tilde)
    rng, generator = np.random.default_rng(0), torch.Generator().manual_seed(0)
    runs, survived = 4000, 0
    for _ in range(runs):
        test = score_test(n_tilde, n_max, svt_epsilon, generator)
        counts = np.minimum(rng.poisson(n_tilde, steps), n_max)
        survived += all(test.query(float(k) ** 2 / n_tilde) for k in counts)
    p = survival_probability(n_tilde, n_max, svt_epsilon, steps)
    assert 0.02 < p < 0.98  # a regime where both outcomes happen: the comparison can fail
    assert abs(survived / runs - p) <= 4 * (p * (1 - p) / runs) ** 0.5, (survived / runs, p)
