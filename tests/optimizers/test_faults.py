"""Faults in one user's data never void the guarantee (issue 11, item 1): a user whose averaged gradient is
not finite contributes zero, in user-wise DP-SGD, the group baseline and AUP-RLHF; a huge finite loss stays
bounded by the sensitivity."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp

N_USERS, ROWS, BAD = 6, 18, 2  # rows i belong to user i % 6; user 2 is the faulty one


def _data(bad_label=0.0, bad_x=None, bad_weight=0.0):
    """Linear task rows (x, y, w); the loss is mean(w · BCE). The reference gives the bad user weight 0, so its
    gradient is exactly zero; the faulty variants give it a NaN label, an infinite input or a huge weight."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 5, generator=g)
    y = (x[:, 0] > 0).float()
    w = torch.ones(ROWS)
    users = torch.arange(ROWS) % N_USERS
    bad = users == BAD
    y[bad], w[bad] = bad_label, bad_weight
    if bad_x is not None:
        x[bad] = bad_x
    return TensorDataset(x, y, w), users.tolist()


def _loss(model, batch):
    x, y, w = batch
    return (w * torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y, reduction="none")).mean()


def _run(data, mechanism, steps=3, clip=0.05):
    """Parameters after each of ``steps`` private steps (every user sampled at every step, σ = 0)."""
    dataset, users = data
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    common = dict(module=model, optimizer=optimizer, data_loader=DataLoader(dataset), user_ids=users,
                  max_samples_per_user=3, users_per_batch=float(N_USERS), steps=steps, sampling_seed=0,
                  noise_generator=torch.Generator().manual_seed(1))
    if mechanism == "aup":
        engine = trl_userdp.AdaptiveUserPrivacyEngine()
        model, optimizer, loader = engine.make_private_user_level(
            concentration_radius=10.0, target_epsilon=100.0, target_delta=1e-5, max_users_per_batch=N_USERS, **common)
        optimizer.noise_std = 0.0  # σ = 0: the removal and the mean stay, only the Gaussian noise goes
        # (a large ε keeps AboveThreshold's Laplace noise small, so no seed halts in 3 queries)
    else:
        engine = trl_userdp.PrivacyEngine()
        model, optimizer, loader = engine.make_private_user_level(
            noise_multiplier=0.0, max_grad_norm=clip, mechanism=mechanism, **common)
    after = []
    for _ in range(steps):  # q = 1: one step per pass over the loader
        for batch in loader:
            optimizer.zero_grad()
            _loss(model, batch).backward()
            optimizer.step()
            after.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    assert len(after) == steps
    return after


@pytest.mark.parametrize("mechanism", ["user_dpsgd", "group", "aup"])
@pytest.mark.parametrize("fault", ["nan_label", "inf_input"])
def test_a_non_finite_user_contributes_exactly_zero_at_every_step(mechanism, fault):
    faulty = _data(bad_label=float("nan"), bad_weight=1.0) if fault == "nan_label" else _data(bad_x=float("inf"), bad_weight=1.0)
    with pytest.warns(RuntimeWarning, match="not finite") as caught:
        got = _run(faulty, mechanism)
    assert sum("not finite" in str(w.message) for w in caught) == 1  # once, not per step or per user
    assert not any(str(BAD) in str(w.message) for w in caught)  # the warning names nobody
    expected = _run(_data(), mechanism)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.isfinite(a).all(), f"step {step + 1}: NaN reached the parameters"
        assert torch.allclose(a, b, rtol=0, atol=1e-7), f"step {step + 1}"
    assert not torch.equal(expected[0], expected[-1])  # the other users did train


@pytest.mark.parametrize("mechanism", ["user_dpsgd", "group"])
def test_a_loss_scaled_by_1e38_moves_the_update_by_at_most_the_sensitivity(mechanism):
    clip = 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        huge = _run(_data(bad_weight=1e38), mechanism, steps=1, clip=clip)[0]
    zero = _run(_data(), mechanism, steps=1, clip=clip)[0]
    assert torch.isfinite(huge).all()
    # one user holds 3 rows: C/ñ for a user-level clip, 3·C/ñ for per-record clipping (group privacy)
    bound = clip / N_USERS * (3 if mechanism == "group" else 1)
    assert float(torch.linalg.vector_norm(huge - zero)) <= bound * (1 + 1e-5)


def test_a_clean_run_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _run(_data(), "user_dpsgd")
