"""Why RDP_ORDERS is what it is: the subsampled-Gaussian RDP of both libraries against a
40-digit numerical integral (Mironov et al. 2019, A_α = E_{z~μ0}[(1 − q + q μ1/μ0)^α])."""

import mpmath as mp
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from opacus.accountants.analysis import rdp as opacus_rdp


def _exact_rdp(q: float, sigma: float, alpha: float) -> float:
    mp.mp.dps = 40
    q, sigma, alpha = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
    integrand = lambda z: mp.npdf(z, 0, sigma) * ((1 - q) + q * mp.exp((2 * z - 1) / (2 * sigma**2))) ** alpha  # noqa: E731
    return float(mp.log(mp.quad(integrand, [-mp.inf, -20 * sigma, 0, 1, 20 * sigma, mp.inf])) / (alpha - 1))


@pytest.mark.parametrize("alpha", [2, 3, 8, 32])
def test_integer_orders_are_exact_in_both_libraries(alpha):
    exact = _exact_rdp(0.02, 1.0, alpha)
    assert dpa_rdp._compute_rdp_poisson_subsampled_gaussian(0.02, 1.0, [alpha])[0] == pytest.approx(exact, rel=1e-9)
    assert opacus_rdp.compute_rdp(q=0.02, noise_multiplier=1.0, steps=1, orders=[alpha])[0] == pytest.approx(
        exact, rel=1e-9
    )


@pytest.mark.parametrize("alpha", [1.5, 2.5, 4.8])
def test_fractional_orders_dp_accounting_over_states_opacus_does_not(alpha):
    exact = _exact_rdp(0.02, 1.0, alpha)
    assert opacus_rdp.compute_rdp(q=0.02, noise_multiplier=1.0, steps=1, orders=[alpha])[0] == pytest.approx(
        exact, rel=1e-8
    )
    ours = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(0.02, 1.0, [alpha])[0]
    assert ours > exact  # conservative: ε computed from it can only be larger
