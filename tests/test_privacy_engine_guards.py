"""One draw per step, a row map that cannot go stale, and a budget guard that reads the accountant
(regressions from the first review: /tmp/review findings 1, 2, 4, 5)."""

import itertools
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trl_userdp


def _setup(engine=None, **kw):
    torch.manual_seed(0)
    x = torch.randn(60, 5)
    model = nn.Linear(5, 1)
    engine = engine or trl_userdp.PrivacyEngine(accountant="rdp")
    if "target_epsilon" not in kw:
        kw["noise_multiplier"] = 1.0
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(TensorDataset(x)),
        max_grad_norm=1.0, max_samples_per_user=3, users_per_batch=4.0, user_ids=[i // 3 for i in range(60)],
        sampling_seed=0, **kw,
    )
    return engine, model, optimizer, loader


def _loss(model, batch):
    (x,) = batch
    return model(x).pow(2).mean()


def test_two_draws_cannot_merge_into_one_step():
    engine, model, optimizer, loader = _setup()
    it = iter(loader)
    _loss(model, next(it)).backward()
    with pytest.raises(ValueError, match="drew a new batch before optimizer.step") as err:
        next(it)
    assert "discard it first with `optimizer.hooks.set_row_users(None)`" in str(err.value)
    engine.hooks.set_row_users(None)  # the documented way to skip a drawn batch ...
    next(iter(loader))  # ... after which a new draw is accepted


def test_a_loader_wrapper_that_reads_ahead_is_refused():
    engine, model, optimizer, loader = _setup()

    def prefetch(iterable):  # yields batch t after fetching batch t + 1
        it = iter(iterable)
        current = next(it)
        for upcoming in it:
            yield current
            current = upcoming
        yield current

    with pytest.raises(ValueError, match="read ahead"):
        for batch in prefetch(loader):
            optimizer.zero_grad(); _loss(model, batch).backward(); optimizer.step()  # noqa: E702


def test_a_batch_not_drawn_by_the_loader_has_no_user_map_after_a_step():
    engine, model, optimizer, loader = _setup()
    batch = next(b for b in loader if len(b[0]) > 0)
    _loss(model, batch).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="No row -> user map"):
        _loss(model, batch).backward()  # reusing the old batch (and its map) without a new draw


def test_budget_guard_survives_a_checkpoint_resume(tmp_path):
    target, steps = 2.0, 10

    def run(engine, model, optimizer, loader, n):
        for batch in itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), n):
            optimizer.zero_grad(); _loss(model, batch).backward(); optimizer.step()  # noqa: E702

    engine, model, optimizer, loader = _setup(target_epsilon=target, target_delta=1e-5, steps=steps)
    run(engine, model, optimizer, loader, 6)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, loader2 = _setup(target_epsilon=target, target_delta=1e-5, steps=steps)
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert engine2.accountant.steps_taken == 6
    run(engine2, model2, optimizer2, loader2, 4)
    with pytest.raises(trl_userdp.PrivacyBudgetExhausted):
        run(engine2, model2, optimizer2, loader2, 1)
    assert engine2.accountant.steps_taken == steps and engine2.get_epsilon(1e-5) <= target


def test_guard_and_accountant_agree_when_the_wrapped_step_fails():
    engine, model, optimizer, loader = _setup(target_epsilon=2.0, target_delta=1e-5, steps=5)
    real, calls = optimizer.original_optimizer.step, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("transient")
        return real(*args, **kwargs)

    optimizer.original_optimizer.step = flaky
    with pytest.raises(trl_userdp.PrivacyBudgetExhausted):
        for batch in itertools.chain.from_iterable(itertools.repeat(loader, 10)):
            optimizer.zero_grad()
            _loss(model, batch).backward()
            try:
                optimizer.step()
            except RuntimeError as err:
                if "transient" not in str(err):
                    raise
    assert engine.accountant.steps_taken == 5 and engine.get_epsilon(1e-5) <= 2.0


def test_an_accountant_that_cannot_handle_the_relation_fails_before_training():
    with pytest.raises(ValueError, match="accountant='pld'"):
        _setup(engine=trl_userdp.PrivacyEngine(accountant="rdp", neighboring_relation="replace"))


def test_a_noise_seed_keys_the_noise_by_step_so_a_resume_continues_it(tmp_path):
    """With ``noise_seed`` the noise of step t comes from (seed, t): a run restored from a checkpoint at step 3
    draws exactly the noise of steps 4-6 of the uninterrupted run, never that of steps 1-3 (issue 11, item 3)."""

    def noise(engine, model, optimizer, loader, n):
        out, users = [], []
        for batch in itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), n):
            optimizer.zero_grad()
            (0.0 * _loss(model, batch)).backward()  # σ > 0, zero gradient: the update is the noise
            users.append(sorted(set(loader.last_row_users.tolist())))
            before = model.weight.detach().clone()
            optimizer.step()
            out.append(before - model.weight.detach())
        return out, users

    straight, straight_users = noise(*_setup(noise_seed=5), 6)
    engine, model, optimizer, loader = _setup(noise_seed=5)
    first, first_users = noise(engine, model, optimizer, loader, 3)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, loader2 = _setup(noise_seed=5)
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    resumed, resumed_users = noise(engine2, model2, optimizer2, loader2, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, straight[:3]))
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[3:]))
    assert not any(torch.equal(a, b) for a in resumed for b in first)
    # the seeded sampling continues too: the users of steps 4-6, not a replay of steps 1-3
    assert first_users == straight_users[:3] and resumed_users == straight_users[3:] != first_users
    with pytest.raises(ValueError, match="noise_seed"):
        _setup(noise_seed=5, noise_generator=torch.Generator())


def test_a_checkpoint_is_checked_before_anything_is_loaded(tmp_path):
    engine, model, optimizer, loader = _setup(noise_seed=1)
    batch = next(b for b in loader if len(b[0]) > 0)
    optimizer.zero_grad(); _loss(model, batch).backward(); optimizer.step()  # noqa: E702
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    with pytest.raises(ValueError, match="Call make_private_user_level first"):
        trl_userdp.PrivacyEngine(accountant="rdp").load_checkpoint(path=path, module=nn.Linear(5, 1))
    other, model2, optimizer2, _ = _setup(engine=trl_userdp.PrivacyEngine(accountant="pld"))  # another run's
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="is not this run's"):
        other.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))  # the weights were not touched
    assert other.accountant.steps_taken == 0


def test_an_aup_engine_checkpoint_keeps_above_threshold_state(tmp_path):
    from .test_adaptive_engine import _private, _train

    aup = dict(upb=1000.0, n_users=2000, steps=4)  # ñ = 1000: no halt in a few queries (test_adaptive_engine.py)
    engine, model, optimizer, loader = _private(**aup)
    _train(model, optimizer, loader)
    assert not optimizer.halted and optimizer.svt_queries == engine.accountant.steps_taken > 0
    path = os.path.join(tmp_path, "aup.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, _ = _private(**aup)
    engine2.load_checkpoint(path=path, module=model2)
    assert optimizer2.svt.noisy_threshold == optimizer.svt.noisy_threshold  # the run's threshold, not a new draw
    assert optimizer2.svt_queries == optimizer.svt_queries and engine2.accountant.steps_taken == engine.accountant.steps_taken
    state = torch.load(path, weights_only=True)
    state["trl_userdp_optimizer_state"]["queries"] = 0
    torch.save(state, path)
    engine3, model3, _, _ = _private(**aup)
    with pytest.raises(ValueError, match="0 AboveThreshold queries for"):
        engine3.load_checkpoint(path=path, module=model3)


def test_opacus_secure_rng_advice_is_replaced_by_one_info_line(caplog):
    """Opacus warned on every run to "retrain with secure_mode", which this stack cannot (issue 25, item 6); the
    engine says what the randomness is instead, at INFO (docs/privacy_model.md, "The run's randomness")."""
    import logging
    import warnings

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="trl_userdp"):
        warnings.simplefilter("always")
        trl_userdp.PrivacyEngine()
    assert not [w for w in caught if "Secure RNG" in str(w.message)]
    assert any("not a cryptographic RNG" in r.message for r in caplog.records)


def test_a_privacy_state_without_its_accountant_is_refused_in_one_line(tmp_path):
    """A checkpoint folder whose privacy_state.pt (or the earlier privacy.pt) lost its accountant is refused with the
    reason, in either layout, instead of a KeyError (issue 43)."""
    from trl_userdp import checkpoints

    torch.save({"optimizer": {}}, tmp_path / "privacy_state.pt")
    with pytest.raises(ValueError, match="holds no accountant state: resuming would reset the accountant"):
        checkpoints.read_privacy_state(str(tmp_path))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"trl_userdp_optimizer_state": {}, "epoch": 3}, legacy / "privacy.pt")
    with pytest.raises(ValueError, match="privacy.pt holds no accountant state"):
        checkpoints.read_privacy_state(str(legacy))
    torch.save({"privacy_accountant_state_dict": {"history": []}, "epoch": 3}, legacy / "privacy.pt")
    assert checkpoints.read_privacy_state(str(legacy)) == {"accountant": {"history": []}, "optimizer": {},
                                                           "entries": {"epoch": 3}}
