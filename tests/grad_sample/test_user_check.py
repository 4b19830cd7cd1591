"""The first step's per-user self-check (issue 40): a user's gradient from the hooks against its recomputation on its
own rows, so a layer that mixes users fails on any architecture, while the users' sum still agrees with autograd's."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp
from trl_userdp.grad_sample import UserGradSampleHooks
from trl_userdp.grad_sample.ghost import UserGhostHooks

N_USERS, PER_USER, WIDTH = 4, 2, 8


class _MixesRows(nn.Module):
    """Adds the batch's mean to every row between two linear layers: each row's gradient holds the other rows' data,
    yet the rows' gradients still add up to autograd's (so the sum check passes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inner(x)
        return self.head(torch.tanh(h + h.mean(0, keepdim=True))).squeeze(-1)


class _RowWise(_MixesRows):
    def forward(self, x):
        return self.head(torch.tanh(self.inner(x))).squeeze(-1)


class _OwnLoss(_RowWise):
    """Computes a loss over the whole batch itself, as a Hugging Face model does from ``labels``."""

    def forward(self, x, labels):
        score = super().forward(x)
        return {"loss": ((score - labels) ** 2).mean(), "logits": score}


def _one_step(model, mode, *, labels=False):
    g = torch.Generator().manual_seed(1)
    n = N_USERS * PER_USER
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, generator=g))
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(data),
        user_ids=[i // PER_USER for i in range(n)], max_samples_per_user=PER_USER, users_per_batch=N_USERS,
        noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode=mode, sampling_seed=0)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    loss = model(x, labels=y)["loss"] if labels else ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return engine


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_model_that_mixes_users_fails_the_per_user_check(mode):
    with pytest.raises(ValueError, match="recomputed on that user's rows alone"):
        _one_step(_MixesRows(), mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_sum_check_alone_would_let_that_model_train(mode, monkeypatch):
    """The control: without its per-user half, the self-check passes the same model (the users' sum is right)."""
    hooks = UserGhostHooks if mode == "ghost" else UserGradSampleHooks
    monkeypatch.setattr(hooks, "check_users", lambda *args, **kwargs: None)
    _one_step(_MixesRows(), mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_row_wise_model_passes_and_every_checked_user_was_recomputed(mode, monkeypatch):
    compared = []
    from trl_userdp.grad_sample import user_check

    real = user_check.UserCheck.check

    def spy(self, params, quiet, compare):
        return real(self, params, quiet, lambda user, reference: (compared.append(user), compare(user, reference)))

    monkeypatch.setattr(user_check.UserCheck, "check", spy)
    _one_step(_RowWise(), mode)
    assert sorted(compared) == [0, 1]  # the first step's first two users, once


def test_a_loss_the_model_computes_over_the_batch_is_not_split_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_userdp"):
        engine = _one_step(_OwnLoss(), "hooks", labels=True)
    assert any("per-user half of the self-check" in r.getMessage() for r in caplog.records)
    assert engine.accountant.steps_taken == 1  # the sum check still ran and passed


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_deberta_leak_is_caught_by_the_per_user_check_alone(mode, monkeypatch):
    """Issue 40's DeBERTa-v3 leak (its shared relative-position projections put every user's gradient on one row),
    with both of the defences that now prevent it switched off: the per-row relative positions and the forward pass's
    shared-input guard. The per-user check still stops it; its control (below) shows the sum check alone would not."""
    from trl_userdp.grad_sample import relative_positions

    from .test_architectures import private_step_error

    monkeypatch.setattr(relative_positions.RowRelativePositions, "__init__", lambda self, module: setattr(
        self, "swapped", []))
    monkeypatch.setattr(UserGradSampleHooks, "_shared_input", lambda self, module, first: None)
    with pytest.raises(ValueError, match="recomputed on that user's rows alone"):
        private_step_error("DeBERTa-v3", "reward", "lora", mode, "right", torch.float32, 1e6)
    hooks = UserGhostHooks if mode == "ghost" else UserGradSampleHooks
    monkeypatch.setattr(hooks, "check_users", lambda *args, **kwargs: None)
    assert private_step_error("DeBERTa-v3", "reward", "lora", mode, "right", torch.float32, 1e6) > 1e-3
