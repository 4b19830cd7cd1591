"""Each mechanism's dp-accounting event against an independent computation."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import pld
from scipy import stats

from trl_userdp.accountants import (
    compute_delta,
    compute_epsilon,
    els_event,
    poisson_gaussian_event,
    randomized_response_event,
    randomized_response_noise_parameter,
    truncated_poisson_gaussian_event,
)
from trl_userdp.accountants.accountant import DPRdpAccountant
from trl_userdp.accountants.events import (
    ELSGaussian,
    GroupPrivacyGaussian,
    PoissonGaussian,
    StepEvent,
    TruncatedPoissonGaussian,
)

DELTA = 1e-5


def _exact_rr_delta(epsilon: float, eps_label: float, m: int) -> float:
    """δ(ε) of m binary randomized responses at ε' each, replace-one: the privacy loss is
    (2k − m)ε' where k ~ Binomial(m, σ(ε')) labels were kept."""
    keep = 1 / (1 + math.exp(-eps_label))
    k = np.arange(m + 1)
    loss = (2 * k - m) * eps_label
    return float(np.sum(stats.binom.pmf(k, m, keep) * np.maximum(0.0, 1 - np.exp(epsilon - loss))))


@pytest.mark.parametrize("eps,m", [(3.0, 10), (1.0, 5), (8.0, 20)])
def test_user_level_rr_matches_exact_m_fold_composition(eps, m):
    event = randomized_response_event(eps, m)
    for target in (0.0, eps / 2, 0.9 * eps):
        ours = compute_delta(event, target, accountant="pld", relation="replace")
        assert ours == pytest.approx(_exact_rr_delta(target, eps / m, m), abs=2e-3)
    # pure ε-DP for the user: no δ is needed at ε itself
    assert compute_delta(event, eps, accountant="pld", relation="replace") == 0.0


def test_dp_accounting_pld_drops_the_count_of_self_composed_rr():
    """The reason randomized_response_event lists its m events: dp-accounting 0.6 would account one."""
    rr = dpa.RandomizedResponseDpEvent(randomized_response_noise_parameter(0.3), 2)
    self_composed = pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE).compose(dpa.SelfComposedDpEvent(rr, 10))
    assert self_composed.get_epsilon(1e-12) == pytest.approx(0.3, abs=1e-3)  # one label's ε, not 3
    assert compute_epsilon(randomized_response_event(3.0, 10), 1e-12, accountant="pld", relation="replace") > 2.9


@pytest.mark.parametrize("eps,k", [(1.0, 2), (2.0, 4)])
def test_rr_keep_probability(eps, k):
    p = randomized_response_noise_parameter(eps, k)
    keep = 1 - p + p / k
    assert keep == pytest.approx(math.exp(eps) / (math.exp(eps) + k - 1))
    if k == 2:
        assert p / 2 == pytest.approx(1 - 1 / (1 + math.exp(-eps)))  # flip = 1 − σ(ε)


def test_els_with_one_record_per_user_is_the_poisson_gaussian():
    sigma, q, steps = 1.2, 0.02, 200
    els = compute_epsilon(els_event(sigma, q, steps, 1), DELTA, accountant="pld", value_discretization_interval=1e-3)
    plain = compute_epsilon(poisson_gaussian_event(sigma, q, steps), DELTA, accountant="pld", value_discretization_interval=1e-3)
    assert els == pytest.approx(plain, rel=0.01)


def test_els_is_tighter_than_group_privacy_and_grows_with_m():
    sigma, q, steps = 3.0, 0.02, 250
    opts = dict(accountant="pld", value_discretization_interval=1e-2)
    els = [compute_epsilon(els_event(sigma, q, steps, m), DELTA, **opts) for m in (2, 5, 10)]
    assert els[0] < els[1] < els[2]
    group = compute_epsilon(poisson_gaussian_event(sigma, q, steps), DELTA, accountant="pld", group_size=10)
    assert els[2] < group


def test_truncation_at_n_users_is_plain_poisson_sampling():
    n = 400
    trunc = compute_epsilon(truncated_poisson_gaussian_event(1.0, 0.05, 100, n, n), DELTA, accountant="pld")
    plain = compute_epsilon(poisson_gaussian_event(1.0, 0.05, 100), DELTA, accountant="pld")
    assert trunc == pytest.approx(plain, rel=1e-3)


def test_truncated_event_needs_pld():
    with pytest.raises(ValueError, match="try accountant='pld'"):
        compute_epsilon(truncated_poisson_gaussian_event(1.0, 0.05, 10, 100, 10), DELTA, accountant="rdp")


def test_step_events_account_what_dp_accounting_does_independently():
    """Each mechanism's StepEvent gives dp-accounting's own ε for its event, on the grid it declares (a coarser PLD
    grid only over-states ε)."""
    history = [(1.0, 0.02, 250)]
    truncated = TruncatedPoissonGaussian(2500, 80)
    independent = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(2500, 0.02, 80, 1.0), 250)).get_epsilon(DELTA)
    assert truncated.epsilon(history, DELTA) == pytest.approx(independent, rel=1e-9)
    fine = pld.PLDAccountant().compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(2500, 0.02, 80, 1.0), 250)).get_epsilon(DELTA)
    assert fine <= truncated.epsilon(history, DELTA) <= 1.01 * fine
    plain = pld.PLDAccountant().compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.0)), 250)).get_epsilon(DELTA)
    assert PoissonGaussian().epsilon(history, DELTA) == pytest.approx(plain, rel=1e-9)
    assert GroupPrivacyGaussian(10).epsilon(history, DELTA) == pytest.approx(
        compute_epsilon(poisson_gaussian_event(1.0, 0.02, 250), DELTA, accountant="pld", group_size=10), rel=1e-9)


@pytest.mark.parametrize("event", [PoissonGaussian(), GroupPrivacyGaussian(4), ELSGaussian(4),
                                   TruncatedPoissonGaussian(100, 12)])
def test_step_events_round_trip_and_refuse_malformed_state(event):
    assert StepEvent.from_dict(event.to_dict()) == event
    with pytest.raises(ValueError, match="Unknown accounting event"):
        StepEvent.from_dict({**event.to_dict(), "name": "laplace"})
    if event.to_dict().keys() - {"name"}:
        with pytest.raises(ValueError, match="Malformed accounting event"):
            StepEvent.from_dict({"name": event.name, "unexpected": 1})


def test_pld_only_events_refuse_the_rdp_accountant():
    for event in (ELSGaussian(4), TruncatedPoissonGaussian(100, 12)):
        with pytest.raises(ValueError, match="PLD accountant only"):
            DPRdpAccountant(events=event)



@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: poisson_gaussian_event(-0.1, 0.02, 10), "noise_multiplier"),
        (lambda: poisson_gaussian_event(1.0, 0.0, 10), "sample_rate"),
        (lambda: poisson_gaussian_event(1.0, 1.5, 10), "sample_rate"),
        (lambda: els_event(1.0, 0.02, 10, 0), "max_samples_per_user"),
        (lambda: randomized_response_event(0.0, 10), "epsilon must be"),
        (lambda: randomized_response_event(-1.0, 10), "epsilon must be"),
        (lambda: randomized_response_event(1.0, 0), "max_samples_per_user"),
    ],
)
def test_events_reject_bad_parameters(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_calibration_is_computed_once_per_process_and_is_the_same_sigma():
    """StepEvent.calibrate keeps each setting's σ (a PLD calibration takes seconds; a trainer and its resume ask
    twice): the kept σ is the one the calibration computes, and another setting is computed afresh."""
    from trl_userdp.accountants.events import _calibrate

    event = GroupPrivacyGaussian(3)
    first = event.calibrate(4.0, DELTA, sample_rate=0.1, steps=20, accountant="rdp")
    hits = _calibrate.cache_info().hits
    assert GroupPrivacyGaussian(3).calibrate(4.0, DELTA, sample_rate=0.1, steps=20, accountant="rdp") == first
    assert _calibrate.cache_info().hits == hits + 1
    assert first == _calibrate.__wrapped__(event, 4.0, DELTA, 0.1, 20, "rdp", "add_or_remove", 1e-4)
    assert event.calibrate(4.0, DELTA, sample_rate=0.1, steps=40, accountant="rdp") > first


@pytest.mark.slow  # 7-30 s each: ELS's mixture takes about a second an evaluation (the default suite: the RDP start)
@pytest.mark.parametrize("start", [0.3, 1.0, 60.0])
def test_the_calibrated_sigma_does_not_depend_on_where_the_search_starts(start):
    """ELS starts its search at the group-privacy σ (issue 44, item 5: `account` spent most of its time on ELS at
    small σ); any start gives the same σ within the tolerance, and the group-privacy σ is above ELS's."""
    from trl_userdp.accountants.analysis import calibrate_noise_multiplier
    from trl_userdp.accountants.events import COARSE_DISCRETIZATION

    event = ELSGaussian(3)
    sigma = calibrate_noise_multiplier(lambda s: event(s, 0.5, 4), target_epsilon=3.0, target_delta=1e-5,
                                       accountant="pld", tol=1e-3, start=start,
                                       value_discretization_interval=COARSE_DISCRETIZATION)
    default = event.calibrate(3.0, 1e-5, sample_rate=0.5, steps=4, tol=1e-3)
    assert abs(sigma - default) < 3e-3
    assert event.search_plan(3.0, 1e-5, 0.5, 4, "add_or_remove")[0] >= default


@pytest.mark.parametrize("event", [PoissonGaussian(), GroupPrivacyGaussian(10)], ids=["user-wise", "group"])
def test_a_pld_calibration_starts_at_the_rdp_sigma_and_brackets_in_few_evaluations(event, monkeypatch):
    """`trl-userdp account` for n = 30 spent most of its time in PLD evaluations far from the answer (22 for the group
    column from σ = 1, issue 44 item 5). From the RDP σ (an upper bound computed in milliseconds) it takes at most 9,
    and gives the σ of a search from σ = 1 within the tolerance."""
    from trl_userdp.accountants.analysis import calibrate_noise_multiplier

    evaluations = []
    get_epsilon = pld.PLDAccountant.get_epsilon
    monkeypatch.setattr(pld.PLDAccountant, "get_epsilon",
                        lambda self, delta: evaluations.append(delta) or get_epsilon(self, delta))
    plan = dict(sample_rate=8 / 30, steps=20, relation="add_or_remove")
    start, factor = event.search_plan(3.0, DELTA, **plan)
    assert evaluations == []  # the start is RDP's
    rdp = event.calibrate(3.0, DELTA, accountant="rdp", tol=1e-3, **{k: v for k, v in plan.items() if k != "relation"})
    assert start == pytest.approx(rdp, abs=2e-2)
    grid = dict(value_discretization_interval=1e-3)  # the count, not the grid, is the subject here
    sigma = calibrate_noise_multiplier(lambda s: event(s, plan["sample_rate"], plan["steps"]), target_epsilon=3.0,
                                       target_delta=DELTA, accountant="pld", group_size=event.group_size, tol=1e-3,
                                       start=start, factor=factor, **grid)
    near = len(evaluations)
    assert 0 < near <= 9
    from_one = calibrate_noise_multiplier(lambda s: event(s, plan["sample_rate"], plan["steps"]), target_epsilon=3.0,
                                          target_delta=DELTA, accountant="pld", group_size=event.group_size, tol=1e-3,
                                          **grid)
    assert len(evaluations) - near > near  # the search from σ = 1 took more
    assert sigma == pytest.approx(from_one, abs=2e-3) and sigma <= start * 1.01


def test_the_search_starts_at_one_where_rdp_gives_no_sigma():
    """A target RDP cannot calibrate in range (met at its smallest σ), or an event RDP does not account, leaves the
    start at σ = 1 and the step at 2 for PLD's own search, which decides: the start never decides an outcome."""
    assert PoissonGaussian().search_plan(1e4, DELTA, 0.01, 1, "add_or_remove") == (1.0, 2.0)
    assert PoissonGaussian().search_plan(3.0, DELTA, 0.01, 10, "replace") == (1.0, 2.0)  # RDP: no Poisson replace-one
