"""UserDPOptimizer: exactness, the per-user bound, the noise level (docs/mechanisms.md, M1, issue 3)."""

import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp

from ..helpers import assert_same_gradient, first_batch, make_private, pairs_by_user, sub_batch
from ..tiny_models import MODELS, btl_pair_losses, preference_dataset


MODES = ["hooks", "ghost"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_noiseless_unclipped_step_equals_plain_training_on_the_mean_of_user_means(name, mode):
    ñ = 4.0
    engine, model, optimizer, loader, reference = make_private(MODELS[name](), users_per_batch=ñ, grad_sample_mode=mode)
    batch, row_users = first_batch(engine)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    btl_pair_losses(model, batch).mean().backward()
    optimizer.step()  # SGD, lr = 1
    # plain training: loss = (1/ñ) Σ_u mean over u's pairs, with ñ the expected users per step
    reference.zero_grad()
    loss = sum(btl_pair_losses(reference, sub_batch(batch, pairs)).mean() for pairs in pairs_by_user(row_users).values())
    (loss / ñ).backward()
    after = dict(model.named_parameters())
    updates = {n: before[n] - after[n].detach() for n in before}
    assert_same_gradient(updates, {n: p.grad for n, p in reference.named_parameters() if p.requires_grad})


def _pre_noise_update(engine, optimizer, model, batch, row_users, weights):
    """p.grad after clipping and scaling, σ = 0 (the update before noise), as one flat vector."""
    optimizer.zero_grad()
    engine.hooks.set_row_users(None)  # replace whatever batch is pending by this one
    engine.hooks.set_row_users(row_users)
    (btl_pair_losses(model, batch) * weights).mean().backward()
    optimizer.pre_step()
    flat = torch.cat([p.grad.flatten() for p in optimizer.params])
    optimizer.zero_grad()
    return flat


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mechanism", ["user_dpsgd", "group"])
def test_an_adversarial_user_moves_the_update_by_at_most_its_sensitivity(mechanism, mode):
    """User-wise DP-SGD: one user shifts the pre-noise update by ≤ C/ñ however many records it has.
    Group baseline: by ≤ k·C/ñ for the k ≤ m records it has in the step (per-record clipping)."""
    C = 0.01
    engine, model, optimizer, loader, _ = make_private(
        MODELS["llama"](), max_grad_norm=C, mechanism=mechanism, users_per_batch=5, dataset=preference_dataset(),
        grad_sample_mode=mode)
    if mechanism == "user_dpsgd":
        user_of = lambda code: code  # noqa: E731 - units are users
    else:  # units are records of the bounded dataset
        owners = loader.user_dataset["user_id"]
        user_of = lambda code: owners[code]  # noqa: E731
    for batch in loader:  # a step where the adversary has several units (records) if it can
        units = loader.last_row_users[: batch["input_ids"].shape[0] // 2]
        users = [user_of(int(c)) for c in units]
        if len(set(users)) >= 2 and users.count(users[0]) >= 2:
            break
        engine.hooks.set_row_users(None)
    row_users = loader.last_row_users.clone()
    adversary = users[0]
    mask = torch.tensor([u == adversary for u in users])
    with_adversary = _pre_noise_update(engine, optimizer, model, batch, row_users, torch.where(mask, 1e4, 1.0))
    keep = [i for i in range(len(users)) if not mask[i]]
    without = _pre_noise_update(engine, optimizer, model, sub_batch(batch, keep), units[keep].repeat(2), torch.ones(len(keep)))
    ñ = optimizer.expected_batch_size
    assert int(mask.sum()) >= 2  # the adversary has several records in this step
    k = int(mask.sum()) if mechanism == "group" else 1  # user-wise: one bound for all of them
    shift = float(torch.linalg.vector_norm(with_adversary - without))
    assert shift <= k * C / ñ * (1 + 1e-4)
    assert shift >= 0.5 * C / ñ  # clipped, not dropped: the test can fail both ways


@pytest.mark.parametrize("mode", MODES)
def test_noise_variance_matches_sigma_c_over_n_tilde(mode):
    sigma, C, ñ = 2.0, 0.5, 2.5  # a float ñ: Opacus's integer expected batch size would give (σC/2)² or (σC/3)²
    model = torch.nn.Linear(40, 50)
    ds = TensorDataset(torch.randn(60, 40))
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(ds),
        noise_multiplier=sigma, max_grad_norm=C, max_samples_per_user=3, users_per_batch=ñ, user_ids=list(range(20)) * 3,
        sampling_seed=0, noise_generator=torch.Generator().manual_seed(1), grad_sample_mode=mode,
    )
    draws = []
    for (x,) in loader:
        optimizer.zero_grad()
        (0.0 * model(x)).mean().backward()  # zero gradients: the update is pure noise
        before = model.weight.detach().clone()
        optimizer.step()
        draws.append((before - model.weight.detach()).flatten())
    noise = torch.cat(draws).double()
    n = noise.numel()
    expected_var = (sigma * C / ñ) ** 2
    lo, hi = stats.chi2.interval(0.999, n - 1)
    stat = (n - 1) * float(noise.var()) / expected_var
    assert lo <= stat <= hi, (float(noise.var()), expected_var)
    assert abs(float(noise.mean())) < 4 * (expected_var / n) ** 0.5


@pytest.mark.parametrize("mode", MODES)
def test_steps_clear_stale_grad_samples_without_zero_grad(mode):
    engine, model, optimizer, loader, _ = make_private(MODELS["llama"](), lr=0.1, grad_sample_mode=mode)
    for step, batch in enumerate(loader):
        model.zero_grad()  # what transformers' Trainer calls: it keeps grad_sample
        btl_pair_losses(model, batch).mean().backward()
        optimizer.step()
        assert all(getattr(p, "grad_sample", None) is None for p in optimizer.params)
        if step == 3:
            break


@pytest.mark.parametrize("secure_mode", [False, True])
@pytest.mark.parametrize("std", [0.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_noise_is_opacus_draw_added_into_the_sum_in_place(dtype, std, secure_mode):
    """add_gaussian_noise_ gives exactly Opacus's summed_grad + _generate_noise(...) for the same generator state, in
    the sum's own memory (no parameter-sized tensor beside it)."""
    from opacus.optimizers.optimizer import _generate_noise

    from trl_userdp.optimizers.noise import add_gaussian_noise_

    summed = torch.randn(37, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    theirs = summed + _generate_noise(std=std, reference=summed, generator=torch.Generator().manual_seed(3),
                                      secure_mode=secure_mode)
    own = summed.clone()
    ours = add_gaussian_noise_(own, std, torch.Generator().manual_seed(3), secure_mode)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)
    assert ours.data_ptr() == own.data_ptr()
    if std:  # the control: another generator state draws other noise
        assert not torch.equal(ours, add_gaussian_noise_(summed.clone(), std, torch.Generator().manual_seed(4),
                                                         secure_mode))


def test_the_ghost_optimizer_step_holds_the_clipped_sums_once():
    """The noise is added into the step's clipped sums, which become ``p.grad`` (Opacus's ``add_noise`` keeps a new
    ``p.grad`` beside them), and each layer's stored inputs and output gradients are let go as its book-kept sum is
    taken: the live memory of ``optimizer.step()`` rises by the sums and one layer's transients above what it starts
    with, under 1.5× the trainable parameters' bytes (2× before: the sums and their noisy copies at once). Layers of
    equal size, so that no one parameter's transient is the whole model."""
    from torch.profiler import ProfilerActivity, profile

    from ..helpers import linear_loss, linear_task

    torch.manual_seed(0)
    width = 256
    model = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.ReLU(), *[
        layer for _ in range(4) for layer in (torch.nn.Linear(width, width), torch.nn.ReLU())], torch.nn.Linear(width, 1))
    dataset, user_ids = linear_task(n=200, n_users=50)
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset),
        noise_multiplier=1.0, max_grad_norm=1.0, user_ids=user_ids, max_samples_per_user=4, users_per_batch=8.0,
        grad_sample_mode="ghost", sampling_seed=0)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for step, (x, y) in enumerate(loader):
        linear_loss(model(x), y).backward()
        if step < 2:  # the first step's self-check keeps autograd's gradients
            optimizer.step()
            optimizer.zero_grad()
            continue
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            optimizer.step()
        break
    live = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    assert trainable * 0.9 < peak < 1.5 * trainable, (peak, trainable)
