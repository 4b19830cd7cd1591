"""Our dp-accounting paths against Opacus's accountants, calibration round trips, group privacy."""

import collections
import math

import dp_accounting as dpa
import pytest
from dp_accounting import pld
from opacus.accountants import PRVAccountant, RDPAccountant

from trl_userdp.accountants import (
    GroupPrivacyAccountant,
    calibrate_noise_multiplier,
    compute_delta,
    compute_epsilon,
    group_privacy,
    item_level_target,
    make_accountant,
    poisson_gaussian_event,
)
from trl_userdp.accountants import analysis
from trl_userdp.accountants.analysis import INTEGER_RDP_ORDERS, NEIGHBORING_RELATIONS, RDP_ORDERS
from trl_userdp.accountants.events import els_event, truncated_poisson_gaussian_event

# (σ, q, T): the IMDb setting of AUP-RLHF (q = 50/2500, 5 epochs) and points around it.
POINTS = [(1.0, 0.02, 250), (0.8, 0.01, 1000), (2.0, 0.05, 100), (1.5, 0.001, 5000), (0.7, 0.1, 50), (4.0, 0.02, 250)]
DELTA = 1e-5


def _opacus(cls, sigma, q, steps):
    acc = cls()
    acc.history = [(sigma, q, steps)]
    return acc


@pytest.mark.parametrize("sigma,q,steps", POINTS)
def test_rdp_equals_opacus_rdp_on_integer_orders(sigma, q, steps):
    ours = compute_epsilon(poisson_gaussian_event(sigma, q, steps), DELTA, accountant="rdp", orders=INTEGER_RDP_ORDERS)
    theirs = _opacus(RDPAccountant, sigma, q, steps).get_epsilon(DELTA, alphas=list(INTEGER_RDP_ORDERS))
    assert ours == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("sigma,q,steps", POINTS)
def test_rdp_default_orders_agree_with_opacus_and_never_understate(sigma, q, steps):
    ours = compute_epsilon(poisson_gaussian_event(sigma, q, steps), DELTA, accountant="rdp")
    theirs = _opacus(RDPAccountant, sigma, q, steps).get_epsilon(DELTA, alphas=list(RDP_ORDERS))
    assert ours >= theirs * (1 - 1e-12)
    # dp-accounting's fractional orders are conservative (test_rdp_orders.py): up to ~0.2% here.
    assert ours == pytest.approx(theirs, rel=5e-3)


@pytest.mark.parametrize("sigma,q,steps", POINTS)
def test_pld_within_two_percent_of_opacus_prv(sigma, q, steps):
    ours = compute_epsilon(poisson_gaussian_event(sigma, q, steps), DELTA, accountant="pld")
    # PRV's default eps_error is 0.01 absolute, 5% of the small ε here: ask it for 1e-3.
    theirs = _opacus(PRVAccountant, sigma, q, steps).get_epsilon(DELTA, eps_error=1e-3)
    assert ours == pytest.approx(theirs, rel=0.02)


@pytest.mark.parametrize("accountant,target,options", [
    ("rdp", 1.0, {}), ("rdp", 8.0, {}), ("pld", 1.0, {}),
    # at ε = 8 (σ ≈ 0.6) a PLD evaluation on the default grid takes about a second: the coarse grid ELS uses
    ("pld", 8.0, {"value_discretization_interval": 1e-3}),
])
def test_calibration_round_trip(accountant, target, options):
    make = lambda s: poisson_gaussian_event(s, 0.02, 250)  # noqa: E731
    sigma = calibrate_noise_multiplier(make, target_epsilon=target, target_delta=DELTA, accountant=accountant,
                                       **options)
    eps = compute_epsilon(make(sigma), DELTA, accountant=accountant, **options)
    assert eps <= target
    assert eps >= 0.99 * target  # the smallest σ that fits, not just any σ
    assert compute_epsilon(make(0.98 * sigma), DELTA, accountant=accountant, **options) > target


#: (event, relation, the dp-accounting function that builds one step's distribution); a mixture of Gaussians is
#: accounted under add/remove only
STEP_DISTRIBUTIONS = [
    ("poisson", "add_or_remove", "from_gaussian_mechanism"), ("poisson", "replace", "from_gaussian_mechanism"),
    ("truncated", "add_or_remove", "from_truncated_subsampled_gaussian_mechanism"),
    ("truncated", "replace", "from_truncated_subsampled_gaussian_mechanism"),
    ("mixture", "add_or_remove", "from_mixture_gaussian_mechanism"),
]


@pytest.mark.parametrize("event,relation,builder", STEP_DISTRIBUTIONS)
def test_the_pld_accountant_builds_a_steps_distribution_once_and_gives_dp_accountings_epsilon(event, relation, builder,
                                                                                            monkeypatch):
    """make_accountant("pld") gives dp-accounting's PLDAccountant's ε bit for bit, for T steps and for a history of two
    settings, while the distribution of one step is built once for every T (ε after each step, the budget's search)."""
    make = {"poisson": lambda t, sigma=1.3: poisson_gaussian_event(sigma, 0.1, t),
            "truncated": lambda t, sigma=1.3: truncated_poisson_gaussian_event(sigma, 0.1, t, 200, 30),
            "mixture": lambda t, sigma=3.0: els_event(sigma, 0.1, t, 2)}[event]
    grid, rel = 1e-2, NEIGHBORING_RELATIONS[relation]
    independent = [pld.PLDAccountant(rel, grid).compose(make(t)).get_epsilon(DELTA) for t in (1, 4, 9)]
    mixed = dpa.ComposedDpEvent([make(4), make(3, sigma=4.0)])
    independent.append(pld.PLDAccountant(rel, grid).compose(mixed).get_epsilon(DELTA))
    monkeypatch.setattr(analysis, "_STEP_PLDS", collections.OrderedDict())  # nothing remembered from other tests
    built = []
    original = getattr(pld.privacy_loss_distribution, builder)
    monkeypatch.setattr(pld.privacy_loss_distribution, builder, lambda *a, **k: built.append(1) or original(*a, **k))
    ours = [make_accountant("pld", relation, value_discretization_interval=grid).compose(make(t)).get_epsilon(DELTA)
            for t in (1, 4, 9)]
    assert len(built) == 1
    ours.append(make_accountant("pld", relation, value_discretization_interval=grid).compose(mixed).get_epsilon(DELTA))
    assert ours == independent
    assert len(built) == 2  # the new setting's step is built, the first one's remembered


def test_the_pld_accountant_leaves_degenerate_steps_to_dp_accounting():
    assert compute_epsilon(poisson_gaussian_event(0.0, 0.1, 3), DELTA, accountant="pld") == math.inf
    assert compute_epsilon(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.0, dpa.GaussianDpEvent(1.0)), 3),
                           DELTA, accountant="pld") == 0.0


def test_replace_one_is_looser_than_add_remove_but_at_most_double():
    event = poisson_gaussian_event(1.0, 0.02, 250)
    add_remove = compute_epsilon(event, DELTA, accountant="pld")
    replace = compute_epsilon(event, DELTA, accountant="pld", relation="replace")
    assert add_remove < replace <= 2 * add_remove


def test_rdp_rejects_replace_one_for_subsampled_gaussian_with_a_hint():
    with pytest.raises(ValueError, match="try accountant='pld'"):
        compute_epsilon(poisson_gaussian_event(1.0, 0.02, 10), DELTA, accountant="rdp", relation="replace")


def test_group_privacy_conversion_and_its_inverse():
    eps0, delta0 = item_level_target(3.0, 1e-5, 10)
    assert eps0 == pytest.approx(0.3)
    assert group_privacy(eps0, delta0, 10) == pytest.approx((3.0, 1e-5))
    assert group_privacy(0.5, 1e-6, 1) == (0.5, 1e-6)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_group_privacy_accountant_matches_the_conversion_of_an_item_level_accountant(kind):
    event = poisson_gaussian_event(5.0, 0.02, 250)
    m = 10
    eps = compute_epsilon(event, DELTA, accountant=kind, group_size=m)
    # Independent check: item-level δ₀ at ε/m from a plain dp-accounting accountant.
    item = make_accountant(kind).compose(event)
    implied_delta = m * math.exp((m - 1) * eps / m) * item.get_delta(eps / m)
    assert implied_delta <= DELTA * (1 + 1e-9)
    slightly_less = 0.999 * eps
    assert m * math.exp((m - 1) * slightly_less / m) * item.get_delta(slightly_less / m) > DELTA
    # m = 1 is the item-level accountant itself
    assert compute_epsilon(event, DELTA, accountant=kind, group_size=1) == pytest.approx(
        compute_epsilon(event, DELTA, accountant=kind)
    )


def test_group_privacy_is_weaker_than_user_level_accounting_at_the_same_sigma():
    event = poisson_gaussian_event(5.0, 0.02, 250)
    assert compute_epsilon(event, DELTA, accountant="pld", group_size=10) > compute_epsilon(
        event, DELTA, accountant="pld"
    )


def test_compute_delta_inverts_compute_epsilon():
    event = poisson_gaussian_event(1.0, 0.02, 250)
    eps = compute_epsilon(event, DELTA, accountant="pld")
    assert compute_delta(event, eps, accountant="pld") == pytest.approx(DELTA, rel=0.05)


def test_group_accountant_wraps_any_inner_accountant():
    acc = GroupPrivacyAccountant(make_accountant("pld"), 4).compose(poisson_gaussian_event(3.0, 0.05, 100))
    assert acc.get_delta(acc.get_epsilon(DELTA)) <= DELTA


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_epsilon=0.0, target_delta=1e-5), "target_epsilon"),
        (dict(target_epsilon=-1.0, target_delta=1e-5), "target_epsilon"),
        (dict(target_epsilon=float("nan"), target_delta=1e-5), "target_epsilon"),
        (dict(target_epsilon=1.0, target_delta=0.0), "target_delta"),
        (dict(target_epsilon=1.0, target_delta=1.0), "target_delta"),
        (dict(target_epsilon=1.0, target_delta=1e-5, accountant="gdp"), "accountant"),
    ],
)
def test_calibration_rejects_bad_budgets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibrate_noise_multiplier(lambda s: poisson_gaussian_event(s, 0.02, 250), **kwargs)


def test_calibration_says_when_the_budget_is_too_small():
    with pytest.raises(ValueError, match="too small"):
        calibrate_noise_multiplier(
            lambda s: poisson_gaussian_event(s, 1.0, 10**6), target_epsilon=0.01, target_delta=1e-10, max_sigma=50
        )


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_compute_epsilon_rejects_bad_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        compute_epsilon(poisson_gaussian_event(1.0, 0.02, 10), delta)


def test_a_calibration_computes_each_epsilon_once_and_finds_dp_accountings_sigma():
    """dp-accounting's Brent search asks again for the ε of the bracket's ends: the calibration computes each once
    (a PLD ε takes about a second), and finds the σ that dp-accounting's search on plain accountants finds."""
    import dp_accounting as dpa

    from trl_userdp.accountants import analysis

    def make_event(sigma):
        return dpa.SelfComposedDpEvent(poisson_gaussian_event(sigma, 1.0, 1), 20)

    computed = []

    class Counting(dpa.rdp.RdpAccountant):
        def get_epsilon(self, target_delta):
            computed.append(repr(self.ledger))
            return super().get_epsilon(target_delta)

    original = analysis.make_accountant
    try:
        analysis.make_accountant = lambda *a, **k: Counting(orders=RDP_ORDERS)
        sigma = calibrate_noise_multiplier(make_event, target_epsilon=4.0, target_delta=1e-5, accountant="rdp")
    finally:
        analysis.make_accountant = original
    assert len(computed) == len(set(computed)) > 3  # no ε twice
    lo = 2.0 ** math.floor(math.log2(sigma))  # the bracket found by doubling from σ = 1
    plain = dpa.calibrate_dp_mechanism(lambda: dpa.rdp.RdpAccountant(orders=RDP_ORDERS), make_event, 4.0, 1e-5,
                                       bracket_interval=dpa.ExplicitBracketInterval(lo, 2 * lo), tol=1e-4)
    assert sigma == plain
