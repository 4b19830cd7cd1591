"""trl_userdp.PrivacyEngine.make_private_user_level (issue 3): the intended use, accounting,
empty steps, the budget guard, the group baseline and bad input."""

import math

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld, rdp
from torch.utils.data import DataLoader

import trl_userdp
from trl_userdp.accountants.analysis import RDP_ORDERS
from trl_userdp.mechanisms import GroupPrivacy

from .helpers import linear_loss, linear_task, make_private, private_linear
from .tiny_models import MODELS, btl_pair_losses, preference_dataset


def test_the_intended_use_works_as_written():
    dataset, user_ids = linear_task()
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    returned, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=64),
        noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=10, users_per_batch=8, user_ids=user_ids,
    )
    assert returned is model and callable(returned)
    for batch in loader:
        optimizer.zero_grad(); linear_loss(model(batch[0]), batch[1]).backward(); optimizer.step()  # noqa: E702
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < float("inf")
    assert optimizer.expected_batch_size == 8.0 and isinstance(optimizer, trl_userdp.UserDPOptimizer)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_get_epsilon_equals_an_independent_dp_accounting_computation(kind):
    engine, model, optimizer, loader = private_linear(
        accountant=kind, noise_multiplier=0.9, max_samples_per_user=5, users_per_batch=6, sampling_seed=1)
    steps = 0
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad(); linear_loss(model(x), y).backward(); optimizer.step(); steps += 1  # noqa: E702
    q = 6 / 30
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(0.9)), steps)
    independent = (rdp.RdpAccountant(orders=RDP_ORDERS) if kind == "rdp" else pld.PLDAccountant()).compose(event)
    assert steps == 2 * len(loader) == 10
    assert engine.get_epsilon(1e-5) == pytest.approx(independent.get_epsilon(1e-5), rel=1e-9)
    report = engine.privacy_report(1e-5)
    assert report.steps_taken == 10 and report.sample_rate == pytest.approx(q) and report.epsilon == engine.get_epsilon(1e-5)
    assert report.n_users == 30 and report.max_samples_per_user == 5
    assert engine.bounding.rows_dropped == 200 - 150 and "rows_dropped" not in report.to_dict()  # the owner's, not published


def test_empty_steps_add_noise_and_are_counted_with_or_without_backward():
    engine, model, optimizer, loader = private_linear(
        n=40, n_users=20, lr=1.0, noise_multiplier=1.0, max_samples_per_user=2, users_per_batch=0.5, sampling_seed=0,
        noise_generator=torch.Generator().manual_seed(0))
    empty_seen = 0
    for i, (x, y) in enumerate(loader):
        before = model.weight.detach().clone()
        optimizer.zero_grad()
        if len(x) == 0:
            assert x.shape == (0, 5) and y.shape == (0,)
            empty_seen += 1
            if empty_seen % 2:
                linear_loss(model(x), y).backward()  # NaN mean loss, zero-row per-sample gradients
        else:
            linear_loss(model(x), y).backward()
        optimizer.step()
        assert not torch.equal(before, model.weight.detach())  # noise moved the weights
        assert torch.isfinite(model.weight).all()
    assert empty_seen >= 2
    assert engine.accountant.history == [(1.0, 0.5 / 20, len(loader))]


def test_target_epsilon_calibrates_and_the_budget_guard_stops_at_the_plan():
    engine, model, optimizer, loader = private_linear(
        target_epsilon=3.0, target_delta=1e-5, steps=12, max_samples_per_user=5, users_per_batch=6)
    taken = 0
    with pytest.raises(trl_userdp.PrivacyBudgetExhausted):
        for _ in range(5):
            for x, y in loader:
                optimizer.zero_grad(); linear_loss(model(x), y).backward(); optimizer.step(); taken += 1  # noqa: E702
    assert taken == 12
    assert 2.97 <= engine.get_epsilon(1e-5) <= 3.0


def test_the_epsilon_entry_point_calibrates_as_the_sigma_one_does_with_a_target_alone():
    """make_private_user_level_with_epsilon (as Opacus's make_private_with_epsilon) is the ε-targeted entry; its σ is
    the smallest one within the target over the plan, the same the σ entry calibrates from a target alone."""
    plan = dict(target_epsilon=3.0, target_delta=1e-5, steps=12, max_samples_per_user=5, users_per_batch=6)
    dataset, user_ids = linear_task()
    model = torch.nn.Linear(5, 1)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    _, optimizer, loader = engine.make_private_user_level_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset),
        max_grad_norm=1.0, user_ids=user_ids, **plan)
    reference, _, reference_optimizer, _ = private_linear(**plan)
    sigma = optimizer.noise_multiplier
    assert sigma == reference_optimizer.noise_multiplier and engine.planned_steps == 12
    assert (engine.budget.epsilon, engine.budget.delta, engine.budget.calibrated_steps) == (3.0, 1e-5, 12)
    q = 6 / 30
    eps = lambda s: rdp.RdpAccountant(orders=RDP_ORDERS).compose(  # noqa: E731
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), 12)).get_epsilon(1e-5)
    assert eps(sigma) <= 3.0 < eps(sigma * 0.999)
    with pytest.raises(ValueError, match="calibrates σ; to fix σ use make_private_user_level"):
        trl_userdp.PrivacyEngine().make_private_user_level_with_epsilon(noise_multiplier=1.0, **plan)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("clip", [1e6, 0.05], ids=["unclipped", "clipped"])
def test_micro_batches_of_one_draw_give_the_one_batch_update(clip, mode):
    """micro_batches=k: the loader yields each draw of users as k micro-batches of whole users (some may be empty);
    each micro-batch's loss is the mean of its rows; one optimizer.step() after the k-th. Same seeds: the same
    users, per-user averages and noise as without micro-batches, one accounted step per draw (issue 13)."""
    results = []
    for k in (1, 3):
        torch.manual_seed(0)
        engine, model, optimizer, loader = private_linear(
            noise_multiplier=0.7, max_samples_per_user=5, users_per_batch=6, sampling_seed=3, noise_seed=4,
            micro_batches=k, lr=0.5, max_grad_norm=clip, grad_sample_mode=mode)
        assert len(loader) == k * 5
        for i, (x, y) in enumerate(loader):
            if len(x):
                linear_loss(model(x), y).backward()
            if i % k == k - 1:
                optimizer.step()
                optimizer.zero_grad()
        results.append((model.weight.detach().clone(), engine.accountant.history))
    (w1, h1), (w3, h3) = results
    torch.testing.assert_close(w3, w1, atol=1e-6, rtol=1e-5)
    assert h3 == h1 == [(0.7, 6 / 30, 5)]


def test_a_plan_in_epochs_is_exactly_that_many_passes_over_the_loader():
    """q = 6/26 is not 1/k: a pass is round(1/q) = 4 steps, so 5 epochs are 20 steps, all affordable."""
    engine, model, optimizer, loader = private_linear(
        n_users=26, target_epsilon=3.0, target_delta=1e-5, epochs=5, max_samples_per_user=8, users_per_batch=6)
    for _ in range(5):
        for x, y in loader:
            optimizer.zero_grad(); linear_loss(model(x), y).backward(); optimizer.step()  # noqa: E702
    assert len(loader) == 4 and engine.planned_steps == engine.accountant.steps_taken == 20
    assert not engine.budget_allows_step()


def test_a_fixed_sigma_with_a_target_trains_until_the_budget_is_spent():
    engine, model, optimizer, loader = private_linear(
        noise_multiplier=1.0, target_epsilon=2.0, target_delta=1e-5, max_samples_per_user=5, users_per_batch=6)
    taken = 0
    with pytest.raises(trl_userdp.PrivacyBudgetExhausted):
        for _ in range(100):
            for x, y in loader:
                optimizer.zero_grad(); linear_loss(model(x), y).backward(); optimizer.step(); taken += 1  # noqa: E702
    q = 6 / 30
    independent = rdp.RdpAccountant(orders=RDP_ORDERS)
    assert engine.get_epsilon(1e-5) <= 2.0
    one_more = independent.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)), taken + 1))
    assert one_more.get_epsilon(1e-5) > 2.0  # the last affordable step, not an earlier one
    assert taken == engine.accountant.steps_taken


@pytest.mark.parametrize("group_accounting", ["conversion", "els"])
def test_group_baseline_accounts_records_through_group_privacy(group_accounting):
    engine, model, optimizer, loader, _ = make_private(
        MODELS["llama"](), mechanism=GroupPrivacy(group_accounting), noise_multiplier=3.0,
        max_grad_norm=1.0, users_per_batch=3, max_samples_per_user=3, dataset=preference_dataset(),  # 3 pairs each
    )
    n_records = len(loader.user_dataset)
    assert loader.sample_rate == pytest.approx(3 / 6) and n_records == 18
    assert optimizer.expected_batch_size == pytest.approx(0.5 * 18)
    for batch in loader:
        optimizer.zero_grad(); btl_pair_losses(model, batch).mean().backward(); optimizer.step()  # noqa: E702
    steps = len(loader)
    item = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(3.0)), steps)
    if group_accounting == "conversion":
        inner = pld.PLDAccountant().compose(item)
        eps = engine.get_epsilon(1e-5)
        assert 3 * math.exp(2 * eps / 3) * inner.get_delta(eps / 3) <= 1e-5 * (1 + 1e-6)
        assert 3 * math.exp(2 * 0.999 * eps / 3) * inner.get_delta(0.999 * eps / 3) > 1e-5
    else:
        mog = dpa.dp_event.MixtureOfGaussiansDpEvent(3.0, [0.0, 1.0, 2.0, 3.0], [0.125, 0.375, 0.375, 0.125])
        independent = pld.PLDAccountant(value_discretization_interval=1e-3).compose(dpa.SelfComposedDpEvent(mog, steps))
        assert engine.get_epsilon(1e-5) == pytest.approx(independent.get_epsilon(1e-5), rel=1e-9)
    assert engine.privacy_report(1e-5).extra["clipping_unit"] == "record"


def test_non_reentrant_gradient_checkpointing_is_rejected_before_training():
    model = MODELS["llama"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        make_private(model)
    model = MODELS["llama"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    make_private(model)  # reentrant checkpointing keeps per-sample gradients


def test_modules_opacus_cannot_sample_are_rejected_with_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    dataset, user_ids = linear_task()
    with pytest.raises(ValueError, match=r"ModuleValidator.fix"):
        trl_userdp.PrivacyEngine().make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset),
            noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=5, users_per_batch=4, user_ids=user_ids,
        )


class _FusedHead(torch.nn.Module):
    """Reads its head weight functionally, as TRL's fused LM head does: no hook sees it."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)


class _FusedTiedHead(torch.nn.Module):
    """A tied embedding whose output use is functional: the per-sample gradient misses that use
    (TRL's fused LM head on a tied model: silently wrong, caught by the self-check)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)

    def forward(self, x):
        h = self.emb((x.abs() * 3).long().clamp(max=6)).mean(1)
        return torch.nn.functional.linear(h, self.emb.weight)[:, :1]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("model,match", [(_FusedHead, "bypassed the hooks"), (_FusedTiedHead, "Self-check failed")])
def test_wrong_per_sample_gradients_refuse_to_train(model, match, mode):
    model, loss = model(), linear_loss
    dataset, user_ids = linear_task()
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset),
        noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=5, users_per_batch=6, user_ids=user_ids,
        sampling_seed=0, grad_sample_mode=mode,
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(b for b in loader if len(b[0]) > 0)
    loss(model(x), y).backward()
    with pytest.raises(ValueError, match=match):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(engine.accountant) == 0  # no step was taken or counted


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=None, target_epsilon=0.0, target_delta=1e-5, epochs=1), "target_epsilon"),
        (dict(noise_multiplier=None, target_epsilon=3.0, target_delta=1.0, epochs=1), "target_delta"),
        (dict(noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5), "epochs"),
        (dict(noise_multiplier=None), "Give `noise_multiplier`, or `target_epsilon`"),
        (dict(target_epsilon=-3.0, target_delta=1e-5), "target_epsilon"),
        (dict(max_samples_per_user=0), "max_samples_per_user"),
        (dict(users_per_batch=31), "exceeds the number of users"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(user_ids=None), "user_ids"),
        (dict(mechanism="item"), "mechanism"),
        (dict(grad_sample_mode="ew"), "grad_sample_mode"),
        (dict(mechanism=GroupPrivacy("els")), "PLD"),
    ],
)
def test_bad_input_raises_before_training(kwargs, match):
    dataset, user_ids = linear_task()
    model = torch.nn.Linear(5, 1)
    args = dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset),
        noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=5, users_per_batch=6, user_ids=user_ids,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        trl_userdp.PrivacyEngine(accountant="rdp").make_private_user_level(**args)
    assert not hasattr(model.weight, "grad_sample")  # nothing was attached


def test_unknown_accountant_is_rejected():
    with pytest.raises(ValueError, match="accountant"):
        trl_userdp.PrivacyEngine(accountant="gdp")
