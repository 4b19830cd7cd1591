"""``trl-userdp account``: the table is built from the mechanisms' own walkthrough columns, so a mechanism registered
from outside the package shows up without a change to the command."""

import contextlib
import io
import re

import pytest

from trl_userdp.cli import main
from trl_userdp.mechanisms import MECHANISM_REGISTRY, UserDPSGD, WalkthroughColumn


class OutsideUserDPSGD(UserDPSGD):
    """A mechanism registered from outside the package, with a column of its own in the walkthrough."""

    name = "outside_user_dpsgd"
    walkthrough_notes = ("outside σ: a column added by a test.",)

    @classmethod
    def walkthrough(cls, epsilon, setting):
        return (WalkthroughColumn("outside σ", "(test)", 10.0 * epsilon + setting.max_samples_per_user, digits=2),)


@pytest.fixture(scope="module")
def walkthrough():
    """One run of `account` (n = 200, m = 4, ñ = 10, T = 40, ε = 2, ñ_pub = 5) with the outside mechanism registered:
    its output, and the table as {(header, detail): value} of the ε = 2 row."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(MECHANISM_REGISTRY, OutsideUserDPSGD.name, OutsideUserDPSGD)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["account", "--n_users", "200", "--users_per_batch", "10", "--steps", "40",
                           "--max_samples_per_user", "4", "--epsilons", "2", "--public_users_per_batch", "5"])
    assert status == 0
    out = out.getvalue()
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ε |"))
    return out, _cells(lines[start], lines[start + 1], lines[start + 3])


def _cells(header: str, detail: str, row: str):
    """{(header, detail): value} of a table row: columns are right-aligned, so each value ends where its header and
    detail end, and starts after the previous column's end."""
    cells, previous = {}, row.index("|") + 1
    for start, end in [(m.start(), m.end()) for m in re.finditer(r"[^\s|]+", row)][1:]:
        cells[(header[previous:end].strip(" |"), detail[previous:end].strip(" |"))] = float(row[start:end])
        previous = end
    return cells


@pytest.mark.end_to_end
def test_account_prints_the_calibrated_sigmas(walkthrough):
    from trl_userdp.accountants import compute_epsilon, poisson_gaussian_event

    out, cells = walkthrough
    assert "n = 200 users, m = 4" in out and "T = 40 steps" in out
    user_rdp, user_pld = cells[("user-wise σ", "(RDP)")], cells[("user-wise σ", "(PLD)")]
    group, els = cells[("group σ", "(PLD)")], cells[("ELS σ", "(PLD)")]
    assert compute_epsilon(poisson_gaussian_event(user_rdp, 0.05, 40), 1e-5) == pytest.approx(2.0, abs=0.01)
    assert user_pld < user_rdp  # PLD is tighter than RDP
    assert group > user_pld and els > user_pld  # record-level baselines need more noise
    # every registered mechanism with columns has them, in registration order, and its notes under the table
    assert list(cells) == [("RR flip", "per label"), ("group σ", "(PLD)"), ("ELS σ", "(PLD)"),
                           ("user-wise σ", "(RDP)"), ("user-wise σ", "(PLD)"), ("ε replace", "at PLD σ"),
                           ("adaptive σ_Δ", "(PLD)"), ("AUP σ", "ε/2,δ/2"), ("outside σ", "(test)")]
    for mechanism in MECHANISM_REGISTRY.values():
        assert all(note in out for note in mechanism.walkthrough_notes)


@pytest.mark.end_to_end
def test_a_mechanism_registered_from_outside_gets_its_column_and_notes(walkthrough):
    out, cells = walkthrough
    assert cells[("outside σ", "(test)")] == 24.0  # 10·ε + m, with its 2 digits
    assert " 24.00\n" in out and "\noutside σ: a column added by a test.\n" in out  # the notes, then the step size
    assert out.index("outside σ: a column added") < out.index("Step size (user-wise")
    assert OutsideUserDPSGD.name not in MECHANISM_REGISTRY  # the fixture's registration did not leak


@pytest.mark.end_to_end
def test_account_prints_the_step_size_rules_public_noise_multiplier(walkthrough):
    """Issue 42: with --public_users_per_batch, the noise a step puts on the averaged gradient (σC/ñ) and the fixed σ
    that gives a run on ñ_pub public users per step the same noise (σ·ñ_pub/ñ), from the table's own PLD σ."""
    out, cells = walkthrough
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Step size (user-wise DP-SGD"))
    assert "ñ_pub = 5 per step" in lines[start]
    eps, sigma, noise, public = (float(v) for v in lines[start + 2].split("|"))
    assert eps == 2.0 and sigma == pytest.approx(cells[("user-wise σ", "(PLD)")], abs=1e-4)
    assert noise == pytest.approx(sigma / 10, rel=1e-2) and public == pytest.approx(sigma * 5 / 10, abs=1e-4)
    assert "--noise_multiplier σ_pub" in lines[start + 3]
