"""The reference behind ``test_rdp_default_orders_agree_with_opacus_and_never_understate``: Opacus's public
``compute_rdp`` is exact, at integer and fractional orders, against a 40-digit numerical integral (Mironov et al.
2019, A_α = E_{z~μ0}[(1 − q + q μ1/μ0)^α]); our RDP accountant's ε, computed by dp-accounting, is then never below
the exact ε on the same orders (docs/stack_findings.md: dp-accounting over-states RDP at fractional orders)."""

import mpmath as mp
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp

from trl_userdp.accountants import compute_epsilon, poisson_gaussian_event


def _exact_rdp(q: float, sigma: float, alpha: float) -> float:
    mp.mp.dps = 40
    q, sigma, alpha = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
    integrand = lambda z: mp.npdf(z, 0, sigma) * ((1 - q) + q * mp.exp((2 * z - 1) / (2 * sigma**2))) ** alpha  # noqa: E731
    return float(mp.log(mp.quad(integrand, [-mp.inf, -20 * sigma, 0, 1, 20 * sigma, mp.inf])) / (alpha - 1))


@pytest.mark.parametrize("alpha", [1.5, 2, 2.5, 3, 4.8, 8, 32])
def test_opacus_rdp_is_exact_at_integer_and_fractional_orders(alpha):
    exact = _exact_rdp(0.02, 1.0, alpha)
    assert opacus_rdp.compute_rdp(q=0.02, noise_multiplier=1.0, steps=1, orders=[alpha])[0] == pytest.approx(
        exact, rel=1e-8
    )


@pytest.mark.parametrize("alpha", [1.5, 2.5, 4.8])
def test_our_epsilon_at_a_fractional_order_is_never_below_the_exact_one(alpha):
    delta, steps = 1e-5, 100
    exact = opacus_rdp.get_privacy_spent(orders=[alpha], rdp=[steps * _exact_rdp(0.02, 1.0, alpha)], delta=delta)[0]
    ours = compute_epsilon(poisson_gaussian_event(1.0, 0.02, steps), delta, accountant="rdp", orders=[alpha])
    assert ours >= exact * (1 - 1e-9)


def test_the_default_orders_are_opacus_defaults_plus_large_ones():
    from opacus.accountants.rdp import RDPAccountant

    from trl_userdp.accountants.analysis import RDP_ORDERS

    assert RDP_ORDERS == tuple(RDPAccountant.DEFAULT_ALPHAS) + (128, 256, 512, 1024)
