"""The step-size rule (issue 42, :mod:`trl_userdp.step_size`): a public-user run at σ_pub = σ·ñ_pub/ñ puts the private
run's noise on its averaged gradient, measured through the engine; the choice takes the best public score."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp
from trl_userdp.step_size import averaged_gradient_noise, choose_learning_rate, public_noise_multiplier


def _update_noise_std(sigma: float, users_per_batch: float, clip: float = 0.5, n_users: int = 64) -> float:
    """The standard deviation of one private step's update on a model whose gradients are all zero (SGD, lr 1): the
    noise on the averaged gradient alone."""
    model = torch.nn.Linear(400, 10, bias=False)
    torch.nn.init.zeros_(model.weight)
    data = TensorDataset(torch.zeros(n_users, 400), torch.arange(n_users))
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(data),
        max_samples_per_user=1, users_per_batch=users_per_batch, max_grad_norm=clip, noise_multiplier=sigma,
        user_ids=list(range(n_users)), sampling_seed=0, noise_seed=1, self_check=False)
    x, _ = next(iter(loader))
    model(x).sum().backward()
    optimizer.step()
    return float(model.weight.detach().std())


def test_a_public_run_at_the_rules_sigma_carries_the_private_runs_noise():
    """Private run: σ = 2 at ñ = 16; public run: ñ_pub = 4 at σ_pub = σ·4/16 = 0.5. Both updates' noise is
    σC/ñ = 0.0625 per coordinate (4,000 coordinates: the estimate is within 5%), and a public run at the private σ
    itself (the naive choice) carries four times as much."""
    sigma, n_tilde, public = 2.0, 16.0, 4.0
    sigma_pub = public_noise_multiplier(sigma, n_tilde, public)
    assert sigma_pub == pytest.approx(0.5)
    expected = averaged_gradient_noise(sigma, 0.5, n_tilde)
    assert expected == pytest.approx(0.0625)
    assert _update_noise_std(sigma, n_tilde) == pytest.approx(expected, rel=0.05)
    assert _update_noise_std(sigma_pub, public) == pytest.approx(expected, rel=0.05)
    assert _update_noise_std(sigma, public) == pytest.approx(4 * expected, rel=0.05)


def test_the_choice_is_the_best_public_score_and_refuses_what_it_cannot_compare():
    trained = []

    def score(lr):
        trained.append(lr)
        return {0.1: 0.6, 0.5: 0.7, 2.0: 0.7}[lr]

    best, scores = choose_learning_rate(score, [2.0, 0.5, 0.1])
    assert best == 0.5 and scores == {0.1: 0.6, 0.5: 0.7, 2.0: 0.7} and sorted(trained) == [0.1, 0.5, 2.0]
    with pytest.raises(ValueError, match="at least one candidate"):
        choose_learning_rate(score, [])
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
        choose_learning_rate(score, [0.0])
    with pytest.raises(ValueError, match="is nan: a run that diverges has no score"):
        choose_learning_rate(lambda lr: math.nan, [0.1])
    with pytest.raises(ValueError, match="public_expected_units must be a finite number > 0"):
        public_noise_multiplier(1.0, 10.0, 0.0)
