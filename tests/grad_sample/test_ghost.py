"""Per-user ghost clipping (issue 13): the per-user norms equal the materialised path's on every supported layer type
(Linear, Embedding, GPT-2's Conv1D, LoRA, tied embeddings by fallback), by both norm routes, and one step's update
equals the materialised path's, also with clipping, noise, adaptive clipping, a NaN user and micro-batches."""

import copy
import warnings

import pytest
import torch

import trl_userdp
from trl_userdp.grad_sample import ghost as ghost_module
from trl_userdp.mechanisms import AdaptiveClipUserDPSGD

from ..helpers import first_batch, make_private, rel_err
from ..tiny_models import MODELS, btl_pair_losses, preference_dataset


def _one_step(name, mode, route=None, *, clip=0.05, weights=None, **kwargs):
    """(flat parameters after one step, the averaged-gradient norm of each user of the step, the engine)."""
    engine, model, optimizer, loader, _ = make_private(MODELS[name](), grad_sample_mode=mode, max_grad_norm=clip,
                                                      **kwargs)
    batch, row_users = first_batch(engine, min_users=3)
    seen = []
    if mode == "ghost":
        if route is not None:
            engine.hooks.norm_route = route
        clip_factors = engine.hooks.clip_factors
        engine.hooks.clip_factors = lambda norms: (seen.append(norms.clone()), clip_factors(norms))[1]
    losses = btl_pair_losses(model, batch)
    (losses if weights is None else losses * weights(row_users)).mean().backward()
    if mode == "hooks":
        grads = optimizer.unit_gradients()
        seen.append(torch.stack([g.flatten(1).norm(dim=1) for g in grads], 1).norm(dim=1))
    optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), torch.cat(seen), engine


@pytest.mark.parametrize("route", ["gram", "direct", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ghost_norms_and_update_equal_the_materialised_path(name, route):
    params, norms, engine = _one_step(name, "hooks")
    ghost_params, ghost_norms, ghost_engine = _one_step(name, "ghost", route)
    assert len(norms) >= 3 and (norms > 0.05).any()  # several users, some of them clipped
    torch.testing.assert_close(ghost_norms, norms, rtol=1e-5, atol=0)
    assert rel_err(ghost_params, params) < 1e-6
    assert ghost_engine.hooks.ghost_modules  # the packable layers did go through ghost norms
    if name == "tied":  # the tied embedding and LM head are ghost layers too: their norms take their cross term
        tied = [m for m in ghost_engine.hooks.ghost_modules if ghost_engine.hooks.param_names[m.weight].endswith(
            "embed_tokens.weight")]
        assert {type(m) for m in tied} == {torch.nn.Embedding, torch.nn.Linear}


def test_with_noise_the_ghost_step_is_the_materialised_step():
    """Same seeds: the same users, clip factors and noise draws, so the same parameters."""
    params, _, _ = _one_step("gpt2", "hooks", noise_multiplier=1.0)
    ghost_params, _, _ = _one_step("gpt2", "ghost", noise_multiplier=1.0)
    assert rel_err(ghost_params, params) < 1e-6


def test_a_nan_user_adds_nothing_in_the_ghost_path_either():
    def nan_for_one_user(row_users):
        return torch.where(row_users[: len(row_users) // 2] == row_users[0], float("nan"), 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        params, norms, _ = _one_step("llama", "hooks", weights=nan_for_one_user)
        with pytest.warns(RuntimeWarning, match="not finite"):
            ghost_params, ghost_norms, engine = _one_step("llama", "ghost", weights=nan_for_one_user)
    assert torch.isfinite(ghost_params).all()
    assert rel_err(ghost_params, params) < 1e-6
    torch.testing.assert_close(ghost_norms, norms, rtol=1e-5, atol=0)  # the NaN user's norm counts as 0 in both


def test_adaptive_clipping_runs_on_ghost_norms():
    """user_dpsgd_adaptive_clip: the clip trajectory and the parameters equal the materialised path's over several steps."""
    runs = []
    for mode in ("hooks", "ghost"):
        engine, model, optimizer, loader, _ = make_private(
            MODELS["llama"](), grad_sample_mode=mode, mechanism=AdaptiveClipUserDPSGD(0.5, 0.5), noise_multiplier=1.0,
            max_grad_norm=0.5, lr=0.1)
        clips = []
        for step, batch in enumerate(loader):
            optimizer.zero_grad()
            btl_pair_losses(model, batch).mean().backward()
            optimizer.step()
            clips.append(optimizer.max_grad_norm)
            if step == 5:
                break
        runs.append((clips, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (clips, params), (ghost_clips, ghost_params) = runs
    assert len(set(clips)) > 1  # the clip moved
    assert ghost_clips == pytest.approx(clips, rel=1e-6)
    assert rel_err(ghost_params, params) < 1e-5


class _TwiceCalled(torch.nn.Module):
    """A Linear applied twice in one pass: a user's norm has cross terms between the two calls, so it is materialised."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.score = torch.nn.Linear(8, 1)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        h = self.shared(torch.tanh(self.shared(h)))
        return type("Out", (), {"logits": self.score(h.mean(1))})()


def test_a_module_called_twice_is_materialised_and_exact():
    results = []
    for mode in ("hooks", "ghost"):
        engine, model, optimizer, loader, _ = make_private(_TwiceCalled(), grad_sample_mode=mode, max_grad_norm=0.05)
        batch, _ = first_batch(engine, min_users=3)
        btl_pair_losses(model, batch).mean().backward()
        optimizer.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert model.shared not in engine.hooks.ghost_modules and model.score in engine.hooks.ghost_modules
    assert rel_err(results[1], results[0]) < 1e-6


def test_a_user_split_across_micro_batches_is_refused():
    engine, model, optimizer, loader, _ = make_private(MODELS["llama"](), grad_sample_mode="ghost")
    batch, row_users = first_batch(engine, min_users=3)
    b = len(row_users) // 2
    pairs = row_users[:b].tolist()
    split = next(i for i in range(b) if pairs.count(pairs[i]) >= 2)  # a user with several pairs in this batch
    halves = [[split], [i for i in range(b) if i != split]]
    for i, half in enumerate(halves):
        idx = torch.tensor(half + [b + j for j in half])
        engine.hooks.set_row_users(row_users[idx], continuation=True)
        sub = {k: v[idx] for k, v in batch.items()}
        if i == 0:
            btl_pair_losses(model, sub).mean().backward()
        else:
            with pytest.raises(ValueError, match="rows in one micro-batch"):
                btl_pair_losses(model, sub).mean().backward()


def test_aup_refuses_ghost_clipping():
    model = MODELS["llama"]()
    from torch.utils.data import DataLoader
    from trl.trainer.reward_trainer import DataCollatorForPreference

    with pytest.raises(ValueError, match="ghost clipping never materialises"):
        trl_userdp.AdaptiveUserPrivacyEngine().make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(preference_dataset(), collate_fn=DataCollatorForPreference(pad_token_id=0)),
            target_epsilon=3.0, target_delta=1e-5, steps=5, concentration_radius=1.0, max_samples_per_user=3,
            users_per_batch=3, rows_per_example=2, grad_sample_mode="ghost")


def test_reading_per_user_gradients_in_ghost_mode_says_why_not():
    engine, model, optimizer, loader, _ = make_private(MODELS["llama"](), grad_sample_mode="ghost")
    batch, _ = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    with pytest.raises(ValueError, match="never materialises per-user gradients"):
        optimizer.unit_gradients()


class _LaterBypass(torch.nn.Module):
    """Uses its head through the module at first, then functionally (as a fused head would): the hooks miss that use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 1)
        self.fused = False

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids).mean(1)
        logits = torch.nn.functional.linear(h, self.head.weight, self.head.bias) if self.fused else self.head(h)
        return type("Out", (), {"logits": logits})()


def test_autograd_gradient_is_dropped_after_the_self_check_and_a_bypass_is_still_caught():
    engine, model, optimizer, loader, _ = make_private(_LaterBypass(), grad_sample_mode="ghost")
    batch, _ = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    assert all(p.grad is not None for p in optimizer.params)  # the self-check compares them
    optimizer.step()
    assert not optimizer.self_check
    optimizer.zero_grad()
    batch, _ = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    assert all(p.grad is None for p in optimizer.params)  # unclipped sums freed as soon as accumulated
    optimizer.step()
    optimizer.zero_grad()
    model.fused = True
    batch, _ = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    with pytest.raises(ValueError, match="bypassed the hooks"):
        optimizer.step()


@pytest.mark.parametrize("route", ["gram", "direct"])
def test_one_row_per_user_uses_the_rows_themselves(route):
    """Every user with one row in the micro-batch (m = 1): the norms come from the rows without packed copies."""
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(1, 64, (24, 7), generator=torch.Generator().manual_seed(0))
    results = []
    for mode in ("hooks", "ghost"):
        model = MODELS["gpt2"]()
        engine = trl_userdp.PrivacyEngine()
        model, optimizer, loader = engine.make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(TensorDataset(ids)),
            noise_multiplier=0.0, max_grad_norm=0.05, max_samples_per_user=1, users_per_batch=8.0,
            user_ids=list(range(24)), sampling_seed=0, grad_sample_mode=mode)
        if mode == "ghost":
            engine.hooks.norm_route = route
        (x,) = next(b for b in loader if len(b[0]) >= 3)
        (model(input_ids=x).logits[:, 0] ** 2).mean().backward()
        optimizer.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert rel_err(results[1], results[0]) < 1e-6


@pytest.mark.parametrize("name", sorted(MODELS))
def test_after_the_self_check_autograd_computes_no_weight_gradient_for_ghost_layers(name):
    """From the second step on, a ghost layer's weights are marked as not needing autograd's gradient while the layer's
    operation is recorded (the clipped sum is book-kept from its activations): no gradient reaches them, and two steps
    still equal the materialised path's."""
    released = {}
    for mode in ("hooks", "ghost"):
        engine, model, optimizer, loader, _ = make_private(MODELS[name](), grad_sample_mode=mode, max_grad_norm=0.05)
        accumulated = []
        for p in optimizer.params:
            p.register_post_accumulate_grad_hook(lambda q: accumulated.append(id(q)))
        for step in range(2):
            optimizer.zero_grad()
            accumulated.clear()
            batch, _ = first_batch(engine, min_users=3)
            btl_pair_losses(model, batch).mean().backward()
            if mode == "ghost":
                ghost = {p for m in engine.hooks.ghost_modules for p in m.parameters() if p.requires_grad}
                assert all(p.requires_grad for p in ghost)  # trainable again after the forward pass
                reached = set(accumulated) & {id(p) for p in ghost}
                # the first step's self-check needs autograd's gradient; afterwards none is computed, also for the
                # layers whose input needs none (the embedding on token ids, LoRA's first adapters)
                assert reached == ({id(p) for p in ghost} if step == 0 else set()) and ghost
            optimizer.step()
        released[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert rel_err(released["ghost"], released["hooks"]) < 1e-6


class _TiedLM(torch.nn.Module):
    """Embedding → tanh → LM head, the head's weight the embedding's (a tied LM head on its own)."""

    def __init__(self, vocab=40, width=8, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=bias)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def _tied_released(ids, users, weights, route, clip, bias=False, mode="ghost"):
    """The released clipped sum of one step (σ = 0, every user drawn), and how many mixed-route cross terms it took."""
    from torch.utils.data import DataLoader, TensorDataset

    model = _TiedLM(bias=bias)
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(ids, weights)), user_ids=users, max_samples_per_user=3,
        users_per_batch=float(len(set(users))), steps=1, sampling_seed=0, noise_multiplier=0.0, max_grad_norm=clip,
        grad_sample_mode=mode)
    if mode == "ghost":
        engine.hooks.norm_route = route
    calls = []
    real = ghost_module.tied_cross_direct
    ghost_module.tied_cross_direct = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        for x, w in loader:
            target = torch.arange(x.shape[1]).expand_as(x) % 40
            losses = torch.nn.functional.cross_entropy(model(x).transpose(1, 2), target, reduction="none").mean(1)
            (losses * w).mean().backward()
            optimizer.step()
            released = torch.cat([p.grad.flatten() for p in model.parameters()]) * optimizer.expected_batch_size
    finally:
        ghost_module.tied_cross_direct = real
    return released, len(calls)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("route", ["gram", "direct", "auto"])
def test_a_tied_lm_head_on_either_route_keeps_each_user_within_the_clip(route, bias):
    """A weight tied between an embedding and an LM head: on the Gram route both layers' Gram matrices give the cross
    term; on the direct route (the head's unit gradient, cheaper once a user's positions outnumber the head's
    ``D·V/(D+V)``: "auto" here) the head's unit gradient does. An adversarial user (loss ×10⁴, its rows repeating
    one token) moves the released sum by at most C; the control, without clipping, moves it far more."""
    g = torch.Generator().manual_seed(1)
    users = [0, 0, 0, 1, 1, 2, 3, 3, 3]
    ids = torch.randint(0, 40, (len(users), 12), generator=g)
    ids[:3] = 7  # the adversary's rows: one token, so its embedding and head gradients add up
    weights = torch.ones(len(users))
    weights[:3] = 1e4
    keep = [i for i, u in enumerate(users) if u != 0]
    for clip, within in ((0.5, True), (1e9, False)):
        with_user, calls = _tied_released(ids, users, weights, route, clip, bias)
        without, _ = _tied_released(ids[keep], [users[i] for i in keep], weights[keep], route, clip, bias)
        influence = float(torch.linalg.vector_norm(with_user - without))
        assert calls == (0 if route == "gram" else 1)  # 12+ positions per user > 8·40/48: "auto" takes the head direct
        assert (influence <= clip * (1 + 1e-4)) if within else influence > 100, (route, clip, influence)
        # every parameter's sum, the head's bias included, as the materialised path releases it
        reference, _ = _tied_released(ids, users, weights, route, clip, bias, mode="hooks")
        assert rel_err(with_user, reference) < 1e-5


@pytest.mark.parametrize("users", [[3, 1, 0, 2], [3, 1, 1, 2]], ids=["one row each", "a user of two rows"])
def test_short_users_on_the_direct_route_take_the_materialised_step(users):
    """Users of one row each: the direct route's unit gradients are the rows' own, a view of them (they were copied
    into the units' order, which is the rows' order: 0.66 s of a SmolLM-135M step); a user of two rows beside users
    of one is packed with a zero row."""
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    steps = {}
    for mode in ("hooks", "ghost"):
        model = copy.deepcopy(base)
        engine = trl_userdp.PrivacyEngine()
        model, optimizer, _ = engine.make_private_user_level(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(list(range(8))),
            user_ids=list(range(8)), noise_multiplier=0.0, max_grad_norm=0.05, max_samples_per_user=2,
            users_per_batch=4.0, grad_sample_mode=mode, sampling_seed=0)
        if mode == "ghost":
            engine.hooks.norm_route = "direct"
        engine.hooks.set_row_users(torch.tensor(users))
        logits = model(input_ids=ids).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1).mean().backward()
        optimizer.step()
        steps[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert rel_err(steps["ghost"], steps["hooks"]) < 1e-6
