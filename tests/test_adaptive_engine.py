"""AdaptiveUserPrivacyEngine (AUP-RLHF) end to end: accounting, halting, phases, bad input (issue 5)."""

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp


def _task(n_users=300, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_users * m, 5, generator=g)
    y = (x @ torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0]) > 0).float()
    return TensorDataset(x, y), [i // m for i in range(n_users * m)]


def _private(tau=5.0, eps=4.0, steps=20, upb=60.0, **kw):
    torch.manual_seed(0)
    dataset, ids = _task()
    model = torch.nn.Linear(5, 1)
    engine = trl_userdp.AdaptiveUserPrivacyEngine()
    model, opt, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(dataset),
        concentration_radius=tau, target_epsilon=eps, target_delta=1e-5, steps=steps, max_samples_per_user=4,
        users_per_batch=upb, user_ids=ids, sampling_seed=0, noise_generator=torch.Generator().manual_seed(0), **kw,
    )
    return engine, model, opt, loader


def _train(model, opt, loader):
    taken = 0
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        opt.step()
        taken += 1
    return taken


def test_epsilon_is_the_gaussian_half_plus_the_above_threshold_half():
    engine, model, opt, loader = _private()
    assert _train(model, opt, loader) == len(loader)
    assert not opt.halted and opt.svt_queries == len(loader)
    steps, q, n, n_max = engine.accountant.steps_taken, loader.sample_rate, loader.n_users, opt.max_users_per_batch
    gaussian = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, n_max, opt.noise_multiplier), steps)
    )
    assert engine.get_epsilon(1e-5) == pytest.approx(gaussian.get_epsilon(1e-5) + 2.0, rel=1e-9)
    # σ was calibrated so that the planned T Gaussian steps cost at most (ε/2, δ/2)
    planned = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, n_max, opt.noise_multiplier), 20)
    )
    assert 1.98 <= planned.get_epsilon(0.5e-5) <= 2.0
    report = engine.privacy_report(1e-5)
    assert report.mechanism == "aup" and report.concentration_radius == 5.0 and report.extra["svt_epsilon"] == 2.0


def test_a_halted_run_stops_cleanly_and_reports_where():
    engine, model, opt, loader = _private(tau=1e-4)  # nobody is concentrated: the first query fails
    before = model.weight.detach().clone()
    taken = _train(model, opt, loader)
    assert taken == 1 and opt.halted and opt.halted_at_query == 1
    assert torch.equal(before, model.weight.detach())
    assert engine.accountant.steps_taken == 0
    report = engine.privacy_report(1e-5)
    assert report.extra["halted"] and report.extra["halted_at_query"] == 1
    assert report.epsilon == pytest.approx(2.0)  # AboveThreshold was queried: its half is spent
    opt.step()  # further steps do nothing
    assert torch.equal(before, model.weight.detach()) and opt.svt_queries == 1


def test_paper_phase_uses_half_of_the_users():
    engine, model, opt, loader = _private(phase_users="paper")
    assert loader.n_users == 150 and engine.privacy_report(1e-5).extra["phase_users"] == "paper"


def test_truncation_bounds_every_step():
    engine, model, opt, loader = _private(upb=60.0, max_users_per_batch=62)
    for x, y in loader:
        assert len(set(loader.last_row_users.tolist())) <= 62
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        opt.step()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tau=0.0), "concentration_radius"),
        (dict(svt_fraction=1.0), "svt_fraction"),
        (dict(phase_users="half"), "phase_users"),
        (dict(eps=0.0), "target_epsilon"),
    ],
)
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _private(**kwargs)


def test_tau_from_public_users_makes_the_private_run_pass():
    public, public_ids = _task(n_users=200, seed=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    loss = lambda mdl, b: torch.nn.functional.binary_cross_entropy_with_logits(mdl(b[0]).squeeze(-1), b[1])  # noqa: E731
    loader = trl_userdp.UserDataLoader(public, users_per_batch=60, user_ids=public_ids, seed=0, steps=5)
    tau = trl_userdp.propose_concentration_radius(model, loss, loader, coverage=0.95)
    assert tau > 0 and not hasattr(model.weight, "grad_sample")  # the hooks are gone again
    too_small = trl_userdp.propose_concentration_radius(model, loss, loader, coverage=0.05)
    assert too_small < tau
    engine, model2, opt, private_loader = _private(tau=tau)
    _train(model2, opt, private_loader)
    assert not opt.halted
