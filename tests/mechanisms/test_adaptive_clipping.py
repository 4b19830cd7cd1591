"""User-wise DP-SGD with private adaptive per-user clipping (docs/mechanisms.md, M1a; Andrew et al. 2021): the accounting
constant against dp-accounting, the clip trajectory and update against an independent per-user computation, the
bound for an adversarial user, the noise of both releases, convergence to the quantile, and checkpoints."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp
from trl_userdp.accountants.analysis import RDP_ORDERS
from trl_userdp.mechanisms import AdaptiveClipUserDPSGD
from trl_userdp.optimizers.adaptive_clip_optimizer import gradient_noise_multiplier

N_USERS, ROWS = 20, 3


def _data(scale=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_USERS * ROWS, 5, generator=g) * torch.linspace(0.2, 3.0, N_USERS).repeat_interleave(ROWS)[:, None]
    if scale is not None:  # user 0's rows scaled (an adversarial user)
        x[:ROWS] *= scale
    y = (torch.randn(N_USERS * ROWS, generator=g) > 0).float()
    return x, y, [i // ROWS for i in range(N_USERS * ROWS)]


def _loss(model, x, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)


def _private(x, y, users, *, lr=0.5, sigma=0.0, sigma_b=1e-12, clip=1.0, quantile=0.5, eta=0.2, in_features=5,
             **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(in_features, 1)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=DataLoader(TensorDataset(x, y)),
        max_grad_norm=clip, noise_multiplier=sigma, max_samples_per_user=ROWS, users_per_batch=float(N_USERS),
        user_ids=users, sampling_seed=0, noise_seed=1,
        mechanism=AdaptiveClipUserDPSGD(quantile, eta, count_noise_multiplier=sigma_b), **kwargs)
    return engine, model, optimizer, loader


def _steps(model, optimizer, loader, steps):
    clips = [optimizer.max_grad_norm]
    for _ in range(steps):
        for x, y in loader:  # q = 1: every user in every step
            optimizer.zero_grad()
            _loss(model, x, y).backward()
            optimizer.step()
            clips.append(optimizer.max_grad_norm)
            break
    return clips


@pytest.mark.parametrize("sigma,sigma_b", [(1.0, 5.0), (3.8, 3.0), (0.7, 0.4)])
def test_gradient_and_count_noise_together_are_one_gaussian_at_the_accounted_sigma(sigma, sigma_b):
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al., Thm 1): the gradient release (sensitivity C, noise σ_Δ C) and the
    centred count (sensitivity ½, noise σ_b, i.e. a Gaussian at 2σ_b) compose to exactly a Gaussian at σ, which
    dp-accounting confirms without subsampling; with subsampling the pair is one vector Gaussian of that multiplier."""
    s_delta = gradient_noise_multiplier(sigma, sigma_b)
    assert s_delta > sigma
    pair = dpa.ComposedDpEvent([dpa.GaussianDpEvent(s_delta), dpa.GaussianDpEvent(2 * sigma_b)])
    for make, rel in ((lambda: rdp.RdpAccountant(orders=RDP_ORDERS), 1e-9), (pld.PLDAccountant, 2e-3)):
        assert make().compose(pair).get_epsilon(1e-5) == pytest.approx(
            make().compose(dpa.GaussianDpEvent(sigma)).get_epsilon(1e-5), rel=rel)
    with pytest.raises(ValueError, match="count_noise_multiplier must exceed noise_multiplier / 2"):
        gradient_noise_multiplier(sigma, sigma / 2)


def test_clip_trajectory_and_update_equal_an_independent_per_user_computation():
    x, y, users = _data()
    engine, model, optimizer, loader = _private(x, y, users, clip=2.0, quantile=0.3, eta=0.5)
    reference = torch.nn.Linear(5, 1)
    reference.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    clip = 2.0
    for step in range(6):
        grads = []
        for u in range(N_USERS):
            reference.zero_grad()
            rows = slice(u * ROWS, (u + 1) * ROWS)
            _loss(reference, x[rows], y[rows]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
        grads = torch.stack(grads)
        norms = grads.norm(dim=1)
        clipped = grads * (clip / (norms + 1e-6)).clamp(max=1.0)[:, None]
        update = 0.5 * clipped.sum(0) / N_USERS
        with torch.no_grad():
            flat = torch.cat([p.flatten() for p in reference.parameters()]) - update
            reference.weight.copy_(flat[:5].view(1, 5))
            reference.bias.copy_(flat[5:])
        fraction = float((norms <= clip).sum()) / N_USERS
        clip *= math.exp(-0.5 * (fraction - 0.3))
        assert _steps(model, optimizer, loader, 1)[-1] == pytest.approx(clip, rel=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert engine.accountant.history == [(0.0, 1.0, 6)]


def test_an_adversarial_user_moves_the_update_and_the_clip_by_at_most_their_sensitivities():
    """Replacing one user's data by rows scaled 1e6: the update moves by at most 2·lr·C/ñ and log C by at most η/ñ."""
    runs = []
    for scale in (None, 1e6):
        x, y, users = _data(scale)
        engine, model, optimizer, loader = _private(x, y, users, clip=0.5, eta=0.4)
        before = [p.detach().clone() for p in model.parameters()]
        clips = _steps(model, optimizer, loader, 1)
        runs.append((torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]), clips[-1]))
    (update, clip), (update_adv, clip_adv) = runs
    assert 0 < float((update - update_adv).norm()) <= 2 * 0.5 * 0.5 / N_USERS + 1e-7
    assert abs(math.log(clip) - math.log(clip_adv)) <= 0.4 / N_USERS + 1e-9


def test_the_gradient_and_count_noise_have_the_calibrated_variances():
    """Users whose gradients are 0: one step's update is lr·N(0, (σ_Δ C)²)/ñ per coordinate, and each step's clip
    ratio reveals the centred count's noise, N(0, σ_b²) (χ² tests at 99.9%)."""
    d, sigma, sigma_b, eta = 2000, 1.5, 1.0, 0.01  # σ_Δ ≈ 1.5 σ: using σ for the gradient noise would show
    x = torch.zeros(N_USERS * ROWS, d)
    y = torch.full((N_USERS * ROWS,), 0.5)
    users = [i // ROWS for i in range(N_USERS * ROWS)]
    engine, model, optimizer, loader = _private(x, y, users, lr=1.0, sigma=sigma, sigma_b=sigma_b, eta=eta,
                                                in_features=d)
    model.weight.register_hook(lambda g: torch.zeros_like(g))  # the data gives every user a zero weight gradient
    with torch.no_grad():
        model.bias.zero_()  # logit 0, target 0.5: the bias gradient is 0 too
    before = model.weight.detach().clone()
    clips = _steps(model, optimizer, loader, 1)
    noise = (model.weight.detach() - before).flatten() * N_USERS  # lr = 1
    expected = (gradient_noise_multiplier(sigma, sigma_b) * clips[0]) ** 2
    df = noise.numel()
    low, high = stats.chi2.ppf([0.0005, 0.9995], df) / df
    assert low <= float((noise ** 2).mean()) / expected <= high
    clips += _steps(model, optimizer, loader, 399)[1:]
    fractions = 0.5 - np.log(np.array(clips[1:]) / np.array(clips[:-1])) / eta  # = 1 + e_t/ñ, every user unclipped
    count_noise = (fractions - 1.0) * N_USERS
    low, high = stats.chi2.ppf([0.0005, 0.9995], len(count_noise)) / len(count_noise)
    assert low <= float(np.mean(count_noise ** 2)) / sigma_b ** 2 <= high


@pytest.mark.parametrize("count_noise", [1e-12, N_USERS / 20], ids=["noise_off", "noisy_count"])
@pytest.mark.parametrize("quantile", [0.25, 0.8])
def test_the_clip_settles_at_the_target_quantile_of_the_users_norms(quantile, count_noise):
    """Parameters held fixed (lr = 0), the clip starts 100× too large and ends near the γ-quantile of the users' norms."""
    x, y, users = _data()
    engine, model, optimizer, loader = _private(x, y, users, lr=0.0, clip=100.0, quantile=quantile, eta=0.3,
                                                sigma_b=count_noise)
    clips = _steps(model, optimizer, loader, 300)
    norms = []
    plain = torch.nn.Linear(5, 1)  # the users' norms at the (fixed) parameters, from a copy without hooks
    plain.load_state_dict(model.state_dict())
    for u in range(N_USERS):
        plain.zero_grad()
        rows = slice(u * ROWS, (u + 1) * ROWS)
        _loss(plain, x[rows], y[rows]).backward()
        norms.append(float(torch.cat([p.grad.flatten() for p in plain.parameters()]).norm()))
    covered = np.mean([np.mean(np.array(norms) <= c) for c in clips[-100:]])
    assert abs(covered - quantile) <= 0.15


def test_the_clip_is_checkpointed_and_a_tampered_one_is_refused(tmp_path):
    x, y, users = _data()
    engine, model, optimizer, loader = _private(x, y, users, clip=3.0)
    _steps(model, optimizer, loader, 3)
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
    resumed, model2, optimizer2, _ = _private(x, y, users, clip=3.0)
    resumed.load_checkpoint(path=tmp_path / "ckpt.pt", module=model2, optimizer=optimizer2)
    assert optimizer2.max_grad_norm == optimizer.max_grad_norm != 3.0
    assert resumed.steps_accounted() == 3
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    state["trl_userdp_optimizer_state"] = {"max_grad_norm": -1.0}
    torch.save(state, tmp_path / "bad.pt")
    other, model3, optimizer3, _ = _private(x, y, users, clip=3.0)
    with pytest.raises(ValueError, match="no adaptive clip for this run"):
        other.load_checkpoint(path=tmp_path / "bad.pt", module=model3, optimizer=optimizer3)


def test_the_report_states_the_clip_and_the_accounting_is_user_wise_dp_sgds():
    x, y, users = _data()
    engine, model, optimizer, loader = _private(x, y, users, sigma=2.0, sigma_b=3.0, clip=1.0)
    _steps(model, optimizer, loader, 4)
    report = engine.privacy_report(1e-5)
    independent = rdp.RdpAccountant(orders=RDP_ORDERS).compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(1.0, dpa.GaussianDpEvent(2.0)), 4)).get_epsilon(1e-5)
    assert report.mechanism == "user_dpsgd_adaptive_clip" and report.epsilon == pytest.approx(independent, rel=1e-9)
    assert report.per_user_max_grad_norm == optimizer.max_grad_norm and report.extra["initial_per_user_max_grad_norm"] == 1.0
    assert report.extra["gradient_noise_multiplier"] == pytest.approx(gradient_noise_multiplier(2.0, 3.0))


def test_the_default_count_noise_keeps_the_gradient_noise_within_sixteen_percent():
    """Default σ_b = max(ñ/20, σ): valid at any ñ (2σ_b > σ), and σ_Δ ≤ σ/√(1 − ¼) ≈ 1.155σ."""
    x, y, users = _data()
    engine = trl_userdp.PrivacyEngine(accountant="pld")
    model = torch.nn.Linear(5, 1)
    _, optimizer, _ = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(TensorDataset(x, y)),
        max_grad_norm=1.0, noise_multiplier=2.0, max_samples_per_user=ROWS, users_per_batch=4.0, user_ids=users,
        mechanism="user_dpsgd_adaptive_clip")
    assert optimizer.count_noise_multiplier == 2.0 == max(4.0 / 20, 2.0)
    assert optimizer.gradient_noise_multiplier == pytest.approx(2.0 / math.sqrt(0.75))


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_quantile=0.0), "target_unclipped_quantile must lie in"),
    (dict(target_quantile=1.0), "target_unclipped_quantile must lie in"),
    (dict(clip_learning_rate=0.0), "clip_learning_rate must be a finite number > 0"),
    (dict(count_noise_multiplier=0.0), "count_noise_multiplier must be a finite number > 0"),
    (dict(count_noise_multiplier=-1.0), "count_noise_multiplier must be a finite number > 0"),
])
def test_bad_settings_are_refused_before_training(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveClipUserDPSGD(**kwargs)


def test_empty_draws_are_noise_only_steps_that_still_move_the_clip():
    """Poisson draws with no user (ñ = 0.3 of 20): the step adds noise, is accounted, and the clip follows the noisy
    count, as every other step (the reshape of an empty step used to crash, a data-dependent failure)."""
    x, y, users = _data()
    torch.manual_seed(0)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    model = torch.nn.Linear(5, 1)
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(TensorDataset(x, y)),
        max_grad_norm=1.0, noise_multiplier=1.0, max_samples_per_user=ROWS, users_per_batch=0.3, user_ids=users,
        sampling_seed=0, noise_seed=1, mechanism=AdaptiveClipUserDPSGD(count_noise_multiplier=1.0))
    empty, clips = 0, [optimizer.max_grad_norm]
    for x_batch, y_batch in loader:
        optimizer.zero_grad()
        if len(x_batch):
            _loss(model, x_batch, y_batch).backward()
        else:
            empty += 1
        optimizer.step()
        clips.append(optimizer.max_grad_norm)
    assert empty >= 50 and engine.steps_accounted() == len(loader)
    assert len(set(clips)) == len(clips)  # the clip moved at every step, empty ones included
