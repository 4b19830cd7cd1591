"""The weight guard (issue 40): the first private update that should move a weight must move every trained weight
with a non-zero private gradient, and no frozen weight may change (opacus #820's silent LoRA corruption, and
an unaccounted change)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp

N_USERS, PER_USER, WIDTH = 4, 2, 6


class _Net(nn.Module):
    def __init__(self, writes_frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.memory = nn.Parameter(torch.zeros(WIDTH), requires_grad=False)  # saved with the model, never trained
        self.writes_frozen = writes_frozen

    def forward(self, x):
        if self.writes_frozen and self.training:  # writes the users' data into a frozen weight: never accounted
            with torch.no_grad():
                self.memory.add_(x.sum(0))
        return self.head(torch.tanh(self.body(x))).squeeze(-1)


class _SkipsTheHead(torch.optim.SGD):
    """An optimizer whose update never reaches one of its weights (its group's learning rate is read elsewhere)."""

    def step(self, closure=None):
        head = self.param_groups[1]
        lr, head["lr"] = head["lr"], 0.0
        try:
            return super().step(closure)
        finally:
            head["lr"] = lr


def _train(model, optimizer, steps=1, schedule=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    n = N_USERS * PER_USER
    data = TensorDataset(torch.randn(n, WIDTH, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype))
    model.to(dtype)
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=optimizer, data_loader=DataLoader(data), user_ids=[i // PER_USER for i in range(n)],
        max_samples_per_user=PER_USER, users_per_batch=N_USERS, noise_multiplier=0.0, max_grad_norm=1.0,
        sampling_seed=0)
    scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(optimizer.original_optimizer, schedule)
    for _ in range(steps):
        x, y = next(iter(loader))
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return engine


def _groups(model, lr=0.5):
    return [{"params": model.body.parameters(), "lr": lr}, {"params": model.head.parameters(), "lr": lr}]


def test_a_frozen_weight_written_in_the_forward_pass_stops_training():
    model = _Net(writes_frozen=True)
    with pytest.raises(ValueError, match="frozen weight 'memory' changed"):
        _train(model, torch.optim.SGD(_groups(model)))


def test_an_update_that_does_not_reach_a_trained_weight_stops_training():
    model = _Net()
    with pytest.raises(ValueError, match="trained weight 'head.weight' .* did not move"):
        _train(model, _SkipsTheHead(_groups(model)))


def test_a_warm_up_step_at_learning_rate_zero_is_not_the_one_checked():
    """The first step moves nothing on purpose (lr 0); the guard waits for the first step that should move a weight."""
    model = _Net()
    schedule = lambda step: 0.0 if step == 0 else 1.0  # noqa: E731
    _train(model, torch.optim.SGD(_groups(model)), steps=1, schedule=schedule)  # lr 0: nothing to check
    model = _Net()
    with pytest.raises(ValueError, match="did not move"):
        _train(model, _SkipsTheHead(_groups(model)), steps=2, schedule=schedule)


def test_a_correct_model_and_optimizer_pass_and_the_guard_then_stands_down():
    model = _Net()
    engine = _train(model, torch.optim.SGD(_groups(model)), steps=2)
    assert not engine.optimizer.weight_guard.pending and engine.accountant.steps_taken == 2


def test_an_update_that_rounds_away_is_not_a_false_alarm():
    """An update below the weights' rounding unit leaves them unchanged, correctly (bf16 weights at a tiny learning
    rate; the same in fp32 for a LayerNorm weight of 1 whose clipped gradient is 10⁻⁹)."""
    model = _Net()
    _train(model, torch.optim.SGD(_groups(model, lr=1e-9)), dtype=torch.bfloat16)
    model = _Net()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
    _train(model, torch.optim.SGD(_groups(model, lr=1e-12)))
