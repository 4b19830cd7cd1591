"""AdaptiveUserPrivacyEngine (AUP-RLHF) end to end: accounting, halting, phases, bad input (issue 5)."""

import math

import dp_accounting as dpa
import pytest
from scipy import stats
import torch
from dp_accounting import pld
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp
from trl_userdp.mechanisms.aup import default_max_users_per_batch


def _task(n_users=300, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_users * m, 5, generator=g)
    y = (x @ torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0]) > 0).float()
    return TensorDataset(x, y), [i // m for i in range(n_users * m)]


def _private(tau=5.0, eps=4.0, steps=20, upb=60.0, n_users=300, **kw):
    torch.manual_seed(0)
    dataset, ids = _task(n_users)
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
    for x, y, *_ in loader:
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        opt.step()
        taken += 1
    return taken


def test_epsilon_is_the_gaussian_half_plus_the_above_threshold_half():
    # ñ = 1000 of 2000 users: |U_t| falls below √0.8·ñ (a halt) with probability < 1e-3 per step
    engine, model, opt, loader = _private(upb=1000.0, n_users=2000, steps=10)
    assert _train(model, opt, loader) == len(loader)
    assert not opt.halted and opt.svt_queries == len(loader)
    steps, q, n, n_max = engine.accountant.steps_taken, loader.sample_rate, loader.n_users, opt.max_users_per_batch
    gaussian = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, n_max, opt.noise_multiplier), steps)
    )
    assert engine.get_epsilon(1e-5) == pytest.approx(gaussian.get_epsilon(1e-5) + 2.0, rel=1e-9)
    # σ was calibrated so that the planned T Gaussian steps cost at most (ε/2, δ/2)
    planned = pld.PLDAccountant(value_discretization_interval=1e-3).compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, n_max, opt.noise_multiplier), 10)
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
    lo, hi = stats.binom.interval(0.999, 300, 0.5)
    assert lo <= loader.n_users <= hi and engine.privacy_report(1e-5).extra["phase_users"] == "paper"
    assert loader.sample_rate == pytest.approx(60 / loader.n_users)


def _phased(n_users=9000, phases=2, tau=5.0, eps=4.0, upb=1000.0, **kw):
    """Alg. 1 with k phases on a task whose rows carry their user id (third tensor). With ñ = 1000 a
    Poisson step falls below AboveThreshold's 4ñ/5 bar (|U_t| < √0.8·ñ) with probability ~1e-4, so a
    concentrated run does not halt by chance (with ñ = 60 it halts within a few steps)."""
    torch.manual_seed(0)
    dataset, ids = _task(n_users=n_users)
    dataset = TensorDataset(*dataset.tensors, torch.tensor(ids))
    model = torch.nn.Linear(5, 1)
    engine = trl_userdp.AdaptiveUserPrivacyEngine()
    model, opt, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(dataset),
        concentration_radius=tau, target_epsilon=eps, target_delta=1e-5, max_samples_per_user=4,
        users_per_batch=upb, user_ids=ids, sampling_seed=0, noise_generator=torch.Generator().manual_seed(0),
        phases=phases, **kw,
    )
    return engine, model, opt, loader


def _gaussian_epsilon(n, q, n_max, sigma, steps, delta=1e-5):
    event = dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, n_max, sigma), steps)
    return pld.PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(delta)


def test_phases_run_in_order_on_disjoint_users_with_their_own_sigma_and_threshold():
    engine, model, opt, loader = _phased(epochs=1.0)
    assert isinstance(loader, trl_userdp.data.PhasedUserDataLoader) and len(loader.loaders) == 2
    sizes = [ld.n_users for ld in loader.loaders]
    lo, hi = stats.binom.interval(0.999, 9000, 1 / 3)
    assert lo <= sizes[0] <= hi and sum(sizes) == 9000  # geometric split (1/3, 2/3), every user used
    assert engine.phase_steps == [round(ld.n_users / 1000) for ld in loader.loaders]  # one pass each
    members = [set(ld.user_index.keys.tolist()) for ld in loader.loaders]
    assert not members[0] & members[1]
    phase_of_step, thresholds = [], []
    for x, y, users in loader:
        phase_of_step.append(loader.phase)
        assert set(users.tolist()) <= members[loader.phase]  # a step only holds its phase's users
        assert opt.noise_multiplier == engine.phase_noise_multipliers[loader.phase]
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        opt.step()
        thresholds.append(opt.svt.noisy_threshold)
    assert phase_of_step == sorted(phase_of_step) and len(phase_of_step) == sum(engine.phase_steps)
    assert thresholds[0] != thresholds[-1] and len(set(thresholds)) == 2  # one threshold per phase
    assert opt.svt_queries_by_phase == engine.phase_steps and not opt.halted
    # σ differs by phase (q = ñ/n_i, T_i) and each phase was calibrated to (ε/2, δ/2)
    for ld, sigma, t, acc in zip(loader.loaders, engine.phase_noise_multipliers, engine.phase_steps,
                                 engine.phase_accountants):
        assert acc.steps_taken == t
        assert 1.98 <= _gaussian_epsilon(ld.n_users, ld.sample_rate, opt.max_users_per_batch, sigma, t, 0.5e-5) <= 2.0
    # parallel composition: the run's ε is the largest phase's, each checked against dp-accounting
    phase_eps = [
        _gaussian_epsilon(ld.n_users, ld.sample_rate, opt.max_users_per_batch, sigma, t) + 2.0
        for ld, sigma, t in zip(loader.loaders, engine.phase_noise_multipliers, engine.phase_steps)
    ]
    assert engine.get_epsilon(1e-5) == pytest.approx(max(phase_eps), rel=1e-9)
    report = engine.privacy_report(1e-5)
    assert [p["epsilon"] for p in report.extra["phases"]] == pytest.approx(phase_eps, rel=1e-9)
    assert report.steps == report.steps_taken == sum(engine.phase_steps)
    assert trl_userdp.PrivacyReport.from_json(report.to_json()) == report


def test_epochs_split_the_phased_schedule_into_passes():
    engine, model, opt, loader = _phased(epochs=2.0)
    total = sum(engine.phase_steps)
    assert len(loader) == math.ceil(total / 2)
    taken = [_train(model, opt, loader) for _ in range(3)]
    assert taken == [len(loader), total - len(loader), 0]  # two passes run it all; a third has nothing


def test_a_halt_in_a_phase_ends_the_whole_run():
    engine, model, opt, loader = _phased(tau=1e-4, steps=30)
    assert _train(model, opt, loader) == 1 and opt.halted and loader.phase == 0
    assert _train(model, opt, loader) == 0  # no further phase starts
    assert engine.get_epsilon(1e-5) == pytest.approx(2.0)  # only phase 1's AboveThreshold was spent
    assert engine.privacy_report(1e-5).extra["halted_at_query"] == 1


def test_phases_refuse_a_prefetching_loop_and_too_small_phases():
    with pytest.raises(ValueError, match="user_key"):
        _phased(steps=10, user_key="user_index")
    with pytest.raises(ValueError, match="Phase sizes"):
        _phased(n_users=3000, phases=3, phase_users="paper", steps=10)  # phase 1 holds ~375 < 1000 users


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
        (dict(phases=0), "phases"),
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
    # ñ = 1000: Poisson fluctuations alone do not halt it (test_epsilon_is_the_gaussian_half…), so a halt would be τ's
    engine, model2, opt, private_loader = _private(tau=tau, upb=1000.0, n_users=2000, steps=10)
    for _ in range(5):  # 5 passes of round(1/q) = 2 steps: the planned 10
        _train(model2, opt, private_loader)
    assert not opt.halted and opt.svt_queries == engine.accountant.steps_taken == 10


def _private_radius_loader(n_users=300, upb=60.0, seed=0):
    dataset, ids = _task(n_users)
    return trl_userdp.UserDataLoader(dataset, users_per_batch=upb, user_ids=ids, seed=seed, steps=1,
                                     max_users_per_batch=default_max_users_per_batch(upb))


def test_tau_from_a_small_private_budget_is_the_first_radius_whose_score_clears_the_threshold():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    loss = lambda mdl, b: torch.nn.functional.binary_cross_entropy_with_logits(mdl(b[0]).squeeze(-1), b[1])  # noqa: E731
    radii = [0.01 * 1.5**k for k in range(20)]
    # the exact score of the batch the loader will draw (same seed), from a per-user autograd loop
    twin = _private_radius_loader()
    x, y = next(iter(twin))
    row_users = twin.last_row_users
    grads = []
    for u in row_users.unique():
        model.zero_grad()
        loss(model, (x[row_users == u], y[row_users == u])).backward()
        grads.append(torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]))
    dist = torch.cdist(torch.stack(grads), torch.stack(grads))
    exact = next(r for r in radii if float((dist <= r).sum()) / 60.0 >= 0.9 * 60.0)
    # noiseless limit (ε huge): the walk returns exactly that radius
    tau = trl_userdp.propose_concentration_radius_private(
        model, loss, _private_radius_loader(), epsilon=1e9, radii=radii, generator=torch.Generator().manual_seed(0))
    assert tau == exact and not hasattr(model.weight, "grad_sample")
    # a small budget on many users (the noise is O(ñ_max/(ñ ε)) against a score of order ñ): a radius near
    # the noiseless one, and the AUP run on the same users pays for it
    big = dict(n_users=2000, upb=1000.0)
    noiseless = trl_userdp.propose_concentration_radius_private(
        model, loss, _private_radius_loader(**big), epsilon=1e9, radii=radii, generator=torch.Generator().manual_seed(0))
    tau = trl_userdp.propose_concentration_radius_private(model, loss, _private_radius_loader(**big), epsilon=0.5,
                                                          radii=radii, generator=torch.Generator().manual_seed(1))
    assert noiseless / 1.5 <= tau <= noiseless * 1.5
    engine, model2, opt, private_loader = _private(tau=tau, radius_epsilon=0.5, steps=10, **big)
    _train(model2, opt, private_loader)
    assert not opt.halted
    report = engine.privacy_report(1e-5)
    assert report.extra["radius_epsilon"] == 0.5 and report.extra["svt_epsilon"] == pytest.approx(1.75)
    gaussian = pld.PLDAccountant(value_discretization_interval=1e-3).compose(dpa.SelfComposedDpEvent(
        dpa.TruncatedSubsampledGaussianDpEvent(2000, private_loader.sample_rate, opt.max_users_per_batch,
                                               opt.noise_multiplier), engine.accountant.steps_taken))
    assert engine.get_epsilon(1e-5) == pytest.approx(0.5 + 1.75 + gaussian.get_epsilon(1e-5), rel=1e-9)
    planned = pld.PLDAccountant(value_discretization_interval=1e-3).compose(dpa.SelfComposedDpEvent(
        dpa.TruncatedSubsampledGaussianDpEvent(2000, private_loader.sample_rate, opt.max_users_per_batch,
                                               opt.noise_multiplier), 10))
    assert 1.72 <= planned.get_epsilon(0.5e-5) <= 1.75  # the Gaussian half of what is left: (4 − 0.5)/2


def test_the_private_radius_walk_refuses_unbounded_sensitivity_and_says_when_nothing_passed():
    model = torch.nn.Linear(5, 1)
    loss = lambda mdl, b: torch.nn.functional.binary_cross_entropy_with_logits(mdl(b[0]).squeeze(-1), b[1])  # noqa: E731
    dataset, ids = _task()
    untruncated = trl_userdp.UserDataLoader(dataset, users_per_batch=60, user_ids=ids, seed=0, steps=1)
    with pytest.raises(ValueError, match="max_users_per_batch"):
        trl_userdp.propose_concentration_radius_private(model, loss, untruncated, epsilon=1.0, radii=[1.0])
    with pytest.raises(ValueError, match="No radius up to 1e-09 passed"):
        trl_userdp.propose_concentration_radius_private(model, loss, _private_radius_loader(), epsilon=1e9,
                                                        radii=[1e-9], generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="radius_epsilon"):
        _private(radius_epsilon=4.0)


def test_the_averaged_iterate_is_the_mean_of_the_steps_parameters_and_replaces_them_on_request():
    """AUP-RLHF's output for convex models is the average of its iterates (`average_iterates=True`): the optimizer
    keeps the running mean of the parameters after each step it takes, and `load_iterate_average()` writes it into
    the model (post-processing: no privacy cost)."""
    engine, model, opt, loader = _private(upb=1000.0, n_users=2000, steps=6, average_iterates=True)
    iterates = []
    for x, y, *_ in loader:
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        opt.step()
        if not opt.halted:
            iterates.append([p.detach().clone() for p in model.parameters()])
    assert len(iterates) >= 2 and not torch.equal(iterates[0][0], iterates[-1][0])
    epsilon = engine.get_epsilon(1e-5)
    opt.load_iterate_average()
    for p, *steps in zip(model.parameters(), *iterates):
        torch.testing.assert_close(p.detach(), torch.stack(steps).mean(0))
    assert engine.get_epsilon(1e-5) == epsilon
    _, _, plain_opt, _ = _private(upb=1000.0, n_users=2000, steps=6)
    with pytest.raises(ValueError, match="No iterate average"):
        plain_opt.load_iterate_average()
