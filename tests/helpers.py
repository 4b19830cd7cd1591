"""Shared set-up for engine tests: the linear task and its private Linear(5, 1), and a private reward model on
user-grouped preference pairs."""

import copy

import torch
from torch.utils.data import DataLoader, TensorDataset
from trl.trainer.reward_trainer import DataCollatorForPreference

import trl_userdp

from .tiny_models import btl_pair_losses, preference_dataset


def make_private(model, *, users_per_batch=4, max_samples_per_user=3, lr=1.0, dataset=None, engine_kwargs=None, **kwargs):
    """(engine, model, optimizer, loader, reference copy of the model taken before the hooks)."""
    reference = copy.deepcopy(model)
    # uneven users (1 to 3 pairs, m = 3): "mean of user means" differs from the mean over rows
    dataset = dataset if dataset is not None else preference_dataset(pairs_per_user=(1, 3, 2, 3, 1, 2))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = trl_userdp.PrivacyEngine(**(engine_kwargs or {}))
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("max_grad_norm", 1e6)
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(dataset, collate_fn=DataCollatorForPreference(pad_token_id=0)),
        max_samples_per_user=max_samples_per_user, users_per_batch=users_per_batch, rows_per_example=2,
        sampling_seed=0, noise_generator=torch.Generator().manual_seed(0), **kwargs,
    )
    return engine, model, optimizer, loader, reference


def first_batch(engine, min_users=2):
    """Iterate until a batch with at least ``min_users`` users; the hooks now hold its user map.
    Batches passed over are discarded explicitly (the hooks refuse a second draw otherwise)."""
    loader = engine.data_loader
    for batch in loader:
        if len(set(loader.last_row_users.tolist())) >= min_users:
            return batch, loader.last_row_users.clone()
        engine.hooks.set_row_users(None)
    raise AssertionError("no batch with enough users")


def sub_batch(batch, pairs):
    """The pairs ``pairs`` of a [chosen; rejected] batch."""
    b = batch["input_ids"].shape[0] // 2
    idx = torch.tensor(list(pairs) + [b + i for i in pairs])
    return {k: v[idx] for k, v in batch.items()}


def pairs_by_user(row_users):
    b = len(row_users) // 2
    users = {}
    for i, u in enumerate(row_users[:b].tolist()):
        users.setdefault(u, []).append(i)
    return users


def user_grads(model, batch, pairs, weight=1.0):
    """Autograd gradient of one user's mean pair loss (the reference for per-user gradients)."""
    model.zero_grad()
    (weight * btl_pair_losses(model, sub_batch(batch, pairs)).mean()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel_err(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))


def assert_same_gradient(got: dict, expected: dict, rtol=1e-5):
    """Whole-model relative error below ``rtol``, and every parameter within ``rtol`` of its norm or
    of ``rtol`` times the whole gradient's norm (parameters whose true gradient is ~0 have only
    float noise)."""
    flat_g = torch.cat([got[n].flatten() for n in expected])
    flat_e = torch.cat([expected[n].flatten() for n in expected])
    assert rel_err(flat_g, flat_e) < rtol
    scale = float(torch.linalg.vector_norm(flat_e))
    for n in expected:
        err = float(torch.linalg.vector_norm(got[n] - expected[n]))
        assert err <= rtol * max(float(torch.linalg.vector_norm(expected[n])), scale * 1e-2), (n, err)


def linear_task(n=200, n_users=30, seed=0):
    """The engine tests' task: ``n`` rows of 5 features labelled by the first one's sign, row i written by user
    ``i % n_users``. Returns ``(TensorDataset(x, y), user_ids)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).float()
    return TensorDataset(x, y), [i % n_users for i in range(n)]


def linear_loss(out, target):
    """Binary cross-entropy of a ``[N, 1]`` logit against ``[N]`` labels (the mean over rows)."""
    return torch.nn.functional.binary_cross_entropy_with_logits(out.squeeze(-1), target)


def private_linear(n=200, n_users=30, lr=0.1, accountant="rdp", max_grad_norm=1.0, **kwargs):
    """(engine, model, optimizer, loader): a private Linear(5, 1) on :func:`linear_task`."""
    dataset, user_ids = linear_task(n=n, n_users=n_users)
    model = torch.nn.Linear(5, 1)
    engine = trl_userdp.PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=DataLoader(dataset),
        max_grad_norm=max_grad_norm, user_ids=user_ids, **kwargs,
    )
    return engine, model, optimizer, loader
