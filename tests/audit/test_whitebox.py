"""The white-box audit of the engine: gradient canary users through make_private_user_level. An honest run audits
below its claimed ε on every path; a run that adds a quarter of its noise, or clips a user to 8× C, audits above."""

import numpy as np
import pytest
import torch

from benchmarks.audit import quarter_noise
from trl_userdp.audit import AuditReport, CanaryDraw, audit_gradient_canaries
from trl_userdp.audit.bounds import audit_scores, gaussian_game
from trl_userdp.optimizers import UserDPOptimizer


@pytest.mark.parametrize("epsilon", [2.0, 8.0])
def test_an_honest_run_audits_below_its_claim_in_every_seed(epsilon):
    """1,000 canary users, 10 full-batch steps (q = 1, the strongest setting for the sum of updates), 5 seeds: the
    bound never exceeds the claim, and on average reaches the ideal Gaussian game's bound at the same μ and the same
    planned number of guesses and level (the engine leaks what its σ says, no less), and the f-DP audit reaches 0.3 ×
    the claim."""
    reports = [audit_gradient_canaries(1000, steps=10, target_epsilon=epsilon, seed=s) for s in range(5)]
    assert all(r.epsilon_claimed == pytest.approx(epsilon, rel=1e-3) for r in reports)
    assert all(r.consistent for r in reports), [r.summary() for r in reports]
    settings = reports[0].settings
    sigma, planned, level = settings["noise_multiplier"], settings["guesses_planned"]["steinke"], \
        settings["level_of_each_test"]
    ideal = [audit_scores(*gaussian_game(1000, np.sqrt(10) / sigma, np.random.default_rng(s)), 1e-5, level,
                          abstentions=[planned]).epsilon_lower for s in range(5)]
    audited = [r.epsilon_lower for r in reports]
    assert abs(np.mean(audited) - np.mean(ideal)) < 0.5 * np.mean(ideal)
    assert np.mean([r.epsilon_lower_fdp for r in reports]) > 0.3 * epsilon  # the audit has power


def test_a_run_with_a_quarter_of_its_noise_audits_above_its_claim():
    report = audit_gradient_canaries(1000, steps=10, target_epsilon=2.0, seed=0, before_training=quarter_noise)
    assert report.epsilon_claimed == pytest.approx(2.0, rel=1e-3)
    assert not report.consistent and report.epsilon_lower > 2.0, report.summary()


@pytest.mark.parametrize("mode,dtype,micro_batches", [("ghost", torch.float32, 1), ("hooks", torch.bfloat16, 1),
                                                      ("ghost", torch.bfloat16, 2), ("hooks", torch.float32, 2)])
def test_every_path_audits_below_its_claim_and_a_clip_eight_times_too_wide_above(mode, dtype, micro_batches,
                                                                                  monkeypatch):
    honest = audit_gradient_canaries(1000, steps=10, target_epsilon=2.0, seed=3, grad_sample_mode=mode, dtype=dtype,
                                     micro_batches=micro_batches)
    assert honest.consistent and honest.settings["dtype"] == str(dtype).split(".")[-1], honest.summary()
    clip_factors = UserDPOptimizer.clip_factors  # a defect of the kind the fast-path fixes removed: users worth 8× C
    monkeypatch.setattr(UserDPOptimizer, "clip_factors", lambda self, norms: 8 * clip_factors(self, norms))
    broken = audit_gradient_canaries(1000, steps=10, target_epsilon=2.0, seed=3, grad_sample_mode=mode, dtype=dtype,
                                     micro_batches=micro_batches)
    assert not broken.consistent, broken.summary()


@pytest.mark.slow
def test_poisson_sampled_runs_score_each_step_at_least_as_well_as_their_sum():
    """q = 0.2: the likelihood ratio over every iterate sees more than the sum; both stay below the claim."""
    common = dict(steps=30, users_per_batch=100.0, target_epsilon=8.0, seed=5)
    by_sum = audit_gradient_canaries(1000, score="sum", **common)
    by_steps = audit_gradient_canaries(1000, score="steps", **common)
    assert by_sum.consistent and by_steps.consistent
    assert by_steps.epsilon_lower >= by_sum.epsilon_lower > 0
    assert by_sum.settings["sample_rate"] == pytest.approx(100 / by_sum.canaries_in)


def test_the_report_and_the_draw_save_load_and_plot(tmp_path):
    """The report saves, loads and plots; the draw saves and loads, and an edited draw is refused; bad options are
    refused before training."""
    report = audit_gradient_canaries(200, steps=3, users_per_batch=50.0, target_epsilon=4.0, seed=5, score="steps",
                                     accountant="rdp")
    report.save(str(tmp_path))
    assert AuditReport.load(str(tmp_path)) == report
    assert report.plot(str(tmp_path / "scores.png")) and (tmp_path / "scores.png").stat().st_size > 0
    draw = CanaryDraw.draw(50, seed=1)
    draw.save(str(tmp_path))
    assert np.array_equal(CanaryDraw.load(str(tmp_path)).included, draw.included)
    saved = (tmp_path / "canary_draw.json").read_text()
    (tmp_path / "canary_draw.json").write_text(saved.replace("0, 1", "1, 1", 1))
    with pytest.raises(ValueError, match="does not match its seed"):
        CanaryDraw.load(str(tmp_path))
    with pytest.raises(ValueError, match="score must be one of"):
        audit_gradient_canaries(10, score="max")
    with pytest.raises(ValueError, match="at σ = 0"):
        audit_gradient_canaries(10, noise_multiplier=0.0, score="steps")


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_near_cancelling_users_in_bf16_ghost_clipping_stay_below_the_claim(micro_batches):
    """Canary users of two rows at ±10⁴·C (average 100·C), ghost clipping's Gram route in bf16: on the code before the
    fast-path fixes (c51be16) this audit gives ε_lower = 4.57 against a claimed 2 (500 of 500 guesses right: the norms,
    computed in bf16 from the rows, lost the users and let them through unclipped); the fixed code must stay below."""
    def gram(engine, optimizer):
        engine.hooks.norm_route = "gram"

    report = audit_gradient_canaries(1000, steps=10, target_epsilon=2.0, seed=0, rows_per_user=2, near_cancelling=True,
                                     grad_sample_mode="ghost", dtype=torch.bfloat16, micro_batches=micro_batches,
                                     before_training=gram)
    assert report.settings["near_cancelling"] and report.consistent, report.summary()
    with pytest.raises(ValueError, match="rows_per_user=2"):
        audit_gradient_canaries(10, near_cancelling=True)


@pytest.mark.parametrize("noise", ["honest", "quarter"])
def test_group_privacy_runs_are_audited_against_their_own_curve(noise):
    """The group baseline (item-level DP-SGD, ε by group privacy over 2 records): its curve is read from a profile
    that is not monotone in ε, and is tested all the same: an honest run passes, a quarter of its noise is caught."""
    report = audit_gradient_canaries(1000, steps=10, target_epsilon=4.0, seed=1, rows_per_user=2, mechanism="group",
                                     before_training=quarter_noise if noise == "quarter" else None)
    assert report.epsilon_lower_fdp is not None and report.settings["level_of_each_test"] == pytest.approx(0.975)
    assert report.consistent is (noise == "honest"), report.summary()
    if noise == "quarter":
        assert report.fdp_claim_rejected


def test_a_mechanism_that_spends_outside_its_accountant_is_not_held_to_the_accountants_curve():
    from trl_userdp.audit.fdp import audits_curve
    from trl_userdp.mechanisms import get_mechanism

    assert audits_curve(get_mechanism("user_dpsgd")()) and audits_curve(get_mechanism("group")())
    assert not audits_curve(get_mechanism("aup")(concentration_radius=1.0))
