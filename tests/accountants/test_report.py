import math

import pytest

from trl_userdp.accountants import PrivacyReport


def _report(**kw):
    base = dict(
        mechanism="user_dpsgd", n_users=2500, max_samples_per_user=10, sample_rate=0.02, noise_multiplier=0.85,
        steps=250, steps_taken=250, accountant="dp_pld", epsilon=2.99, delta=1e-5, max_grad_norm=1.0,
    )
    base.update(kw)
    return PrivacyReport(**base)


def test_json_round_trip(tmp_path):
    report = _report(extra={"note": "x"})
    assert PrivacyReport.from_json(report.to_json()) == report
    path = report.save(str(tmp_path))
    assert path.endswith("privacy_report.json")
    assert PrivacyReport.load(str(tmp_path)) == report
    assert PrivacyReport.load(path) == report


def test_infinite_epsilon_survives_json():
    report = _report(mechanism="none", epsilon=math.inf)
    assert math.isinf(PrivacyReport.from_json(report.to_json()).epsilon)


def test_unknown_fields_are_rejected():
    d = _report().to_dict()
    d["grad_norm"] = 1.0
    with pytest.raises(ValueError, match="Unknown"):
        PrivacyReport.from_dict(d)


def test_the_published_report_has_no_row_count_from_contribution_bounding():
    """It can reveal one user's exact row count and ε does not cover it (issue 11, item 6)."""
    assert "rows_dropped" not in _report().to_dict()
    d = _report().to_dict()
    d["rows_dropped"] = 3
    with pytest.raises(ValueError, match="Unknown"):
        PrivacyReport.from_dict(d)
