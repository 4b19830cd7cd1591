import math

import pytest

from trl_userdp.accountants import PrivacyReport


def _report(**kw):
    base = dict(
        mechanism="user_dpsgd", n_users=2500, max_samples_per_user=10, sample_rate=0.02, noise_multiplier=0.85,
        steps=250, steps_taken=250, accountant="dp_pld", epsilon=2.99, delta=1e-5, per_user_max_grad_norm=1.0,
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


def test_the_clip_norm_is_named_as_the_trainers_name_it_and_old_reports_still_load():
    """The report said `max_grad_norm: 1.0` beside a log line saying the Trainer's max_grad_norm=1.0 "would clip the
    raw gradient; set to 0" (issue 44, item 6): the per-user clip C is `per_user_max_grad_norm`, as in the trainers'
    configs. A report saved under the old name (a reward model `rl` reads, a checkpoint) loads into the new one."""
    report = _report()
    saved = report.to_dict()
    assert saved["per_user_max_grad_norm"] == 1.0 and "max_grad_norm" not in saved
    saved["max_grad_norm"] = saved.pop("per_user_max_grad_norm")
    assert PrivacyReport.from_dict(saved) == report


def test_the_summary_is_one_line_with_the_guarantee_and_what_spent_it():
    assert _report().summary() == ("ε = 2.99, δ = 1e-05 per user (add-or-remove-one); user_dpsgd, σ = 0.85, 250 steps; "
                                   "2500 users, at most 10 rows each")
    assert _report(max_samples_per_user=1).summary().endswith("at most 1 row each")
    assert _report(mechanism="none", epsilon=math.inf).summary() == "ε = ∞ (no differential privacy); none"
