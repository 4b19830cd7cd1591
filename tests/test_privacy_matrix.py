"""The privacy test matrix (issue 24): property-based tests over every path a step can take —
{hooks, ghost} × {fp32, bf16 weights, bf16 autocast} × {one batch, ``micro_batches``, ``UserBatchMemoryManager``} ×
{user_dpsgd, user_dpsgd_adaptive_clip, group} × {one, two backward passes} × {one process, two gloo processes} — with
generated adversarial users (rows that nearly cancel, ×1e6 rows, NaN and inf rows, users with 1 and with m rows) and
draws of any subset of the users, the empty draw included, checking

(a) each user's influence on the released sum ≤ its sensitivity · (1 + the dtype's tolerance), plus the rounding of
    the released sum itself in the parameters' dtype (docs/privacy_model.md, "Precision and paths");
(b) at σ = 0 and a huge clip, the released sum equals an independent per-user autograd loop over the drawn users;
(c) the step is accounted once, at the run's (σ, q), and adaptive clipping's count covers every user of the draw.

Two processes run what the engine allows there (one batch or ``micro_batches``; user_dpsgd and group); the rest must be
refused before training with a one-line reason. The trainers' ``gradient_accumulation_steps`` axis is in
tests/trainers/test_privacy_matrix_trainers.py. The default profile runs a bounded number of examples;
``HYPOTHESIS_PROFILE=slow`` (with ``-m slow``) many more. The last test re-introduces a known defect and checks that
the matrix finds it."""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_userdp.grad_sample import ghost

from .influence import D, T, Rows, TwoRanks, clipped_sum, user_autograd_sum

settings.register_profile("default", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=400, deadline=None, derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")

M = 3  # max_samples_per_user
WIDTH = 16
#: a user's influence may exceed its sensitivity by this share (the ghost norms' trusted rounding, factor rounding)
TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2, "bf16-autocast": 1e-3}
#: plus this share of the released sums' norms: rounding in the dtype the step computes in (bf16 under autocast), where
#: the other users' clipped gradients come out of batch-size-dependent kernels and may differ by a rounding when a
#: user leaves the batch (docs/privacy_model.md, "Precision and paths")
SUM_ROUNDING = {"fp32": 1e-6, "bf16": 2.0 ** -7, "bf16-autocast": 2.0 ** -7}
KINDS = ["normal", "one_row", "m_rows", "cancelling", "huge", "tiny", "nan", "inf"]
#: what the engine runs in one process only (refused across processes before training)
ONE_PROCESS_ONLY = {"batching": "physical", "mechanism": "user_dpsgd_adaptive_clip"}
_RANKS: list = []  # the two processes, started by the first example that needs them


@pytest.fixture(scope="module", autouse=True)
def _stop_the_ranks():
    yield
    while _RANKS:
        _RANKS.pop().close()


def released(rows: Rows, processes: int, **kwargs):
    """The released sum of one step and the accountant's history, in one process or two."""
    if processes == 1:
        engines: list = []
        out = clipped_sum(rows, engine_out=engines, **kwargs)
        return out, engines[0].accountant.history
    if not _RANKS:
        _RANKS.append(TwoRanks())
    return _RANKS[0].clipped_sum(rows, **kwargs)


def _refused_across_processes(s) -> bool:
    """A two-process path the engine does not run: check that it says so, before training, in one line."""
    if s["processes"] == 1 or not any(s[k] == v for k, v in ONE_PROCESS_ONLY.items()):
        return False
    with pytest.raises(RuntimeError, match="ValueError: .* runs in one process") as refusal:
        released(s["rows"], 2, clip=1.0, m=M, **_path(s))
    assert "\n" not in str(refusal.value)
    return True


@st.composite
def scenarios(draw):
    """A step's path and its users; user 0 is the one whose influence is measured, of an adversarial ``kind``."""
    kind = draw(st.sampled_from(KINDS))
    n_users = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, M)) for _ in range(n_users)]
    sizes[0] = {"one_row": 1, "m_rows": M, "cancelling": max(2, sizes[0])}.get(kind, sizes[0])
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), T, WIDTH, generator=g)
    w = torch.ones(sum(sizes))
    users = [u for u, k in enumerate(sizes) for _ in range(k)]
    if kind == "cancelling":  # the same rows with opposite, nearly equal weights, large or not
        x[1] = x[0] * draw(st.sampled_from([1.0, 100.0]))
        x[0] = x[1]
        w[1] = -(1 - 10.0 ** -draw(st.integers(1, 4)))
    elif kind in ("huge", "tiny"):
        x[: sizes[0]] *= 1e6 if kind == "huge" else 1e-6
    elif kind in ("nan", "inf"):
        x[0, 0, 0] = float(kind)
    return dict(rows=Rows(x, w, users), kind=kind,
                mode=draw(st.sampled_from(["hooks", "ghost"])),
                dtype=draw(st.sampled_from(["fp32", "bf16", "bf16-autocast"])),
                batching=draw(st.sampled_from(["one", "micro", "physical"])),
                mechanism=draw(st.sampled_from(["user_dpsgd", "user_dpsgd_adaptive_clip", "group"])),
                passes=draw(st.sampled_from([1, 2])),
                processes=draw(st.sampled_from([1, 2])),
                # the other users of the draw (user 0 is drawn or not): none makes the draw without user 0 empty
                others=draw(st.sets(st.integers(1, n_users - 1))) if n_users > 1 else set(),
                clip=draw(st.sampled_from([1e-3, 1.0])))


def _path(s):
    return {k: s[k] for k in ("mode", "dtype", "batching", "mechanism", "passes")}


def _drawn(s, with_user: bool) -> set:
    return s["others"] | {0} if with_user else s["others"]


@settings(settings.get_profile(PROFILE))
@given(scenarios())
def test_no_user_moves_the_released_sum_beyond_its_sensitivity(s):
    if _refused_across_processes(s):
        return
    rows, clip, processes = s["rows"], s["clip"], s["processes"]
    with_user, history = released(rows, processes, clip=clip, m=M, drawn=_drawn(s, True), **_path(s))
    without, _ = released(rows, processes, clip=clip, m=M, drawn=_drawn(s, False), **_path(s))
    # the group baseline's unit is a record: a user of k records is worth k clipped records
    sensitivity = clip * (rows.users.count(0) if s["mechanism"] == "group" else 1)
    dtype = s["dtype"]
    allowed = sensitivity * (1 + TOLERANCE[dtype]) + SUM_ROUNDING[dtype] * float(
        torch.linalg.vector_norm(torch.nan_to_num(with_user)) + torch.linalg.vector_norm(torch.nan_to_num(without)))
    assert torch.isfinite(with_user).all() and torch.isfinite(without).all()
    got = float(torch.linalg.vector_norm(with_user - without))
    assert got <= allowed, f"user 0 ({s['kind']}) moved the sum by {got / sensitivity:.4f}× its sensitivity"
    if not s["others"]:  # the empty draw releases nothing but noise (none here)
        assert not without.any()
    # (c) one accounted step at this run's σ and q
    assert history == [(0.0, 1.0, 1)]


@settings(settings.get_profile(PROFILE))
@given(scenarios())
def test_without_clipping_the_released_sum_is_the_per_user_autograd_sum(s):
    if _refused_across_processes(s):
        return
    rows = s["rows"]
    # non-finite users add zero; ×1e6 users swamp the comparison: they stay in the data but are not drawn
    drawn = _drawn(s, with_user=s["kind"] not in ("nan", "inf", "huge"))
    got, _ = released(rows, s["processes"], clip=1e9, m=M, drawn=drawn, **_path(s))
    if s["mechanism"] == "group":  # units are records
        reference = user_autograd_sum(Rows(rows.x, rows.w, list(range(len(rows.users)))),
                                      [r for r, u in enumerate(rows.users) if u in drawn])
    else:
        reference = user_autograd_sum(rows, sorted(drawn))
    per_row = Rows(rows.x, rows.w, list(range(len(rows.users))))  # rounding is relative to what was summed: rows
    scale = float(torch.linalg.vector_norm(reference)) + sum(
        float(torch.linalg.vector_norm(user_autograd_sum(per_row, [r])))
        for r, u in enumerate(rows.users) if u in drawn)
    rtol = 1e-5 if s["dtype"] == "fp32" else 3e-2
    assert float(torch.linalg.vector_norm(got - reference)) <= rtol * scale


def test_adaptive_count_is_the_same_on_every_path():
    """(c) for adaptive clipping: the clip's next value (a function of the released count) does not depend on the
    path, for a draw where some users are within the clip and some are not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, T, WIDTH, generator=g) * torch.linspace(0.1, 3, 12).view(-1, 1, 1)
    rows = Rows(x, torch.ones(12), [i // 2 for i in range(12)])
    moves = set()
    for mode in ("hooks", "ghost"):
        for batching in ("one", "micro", "physical"):
            engines = []
            clipped_sum(rows, mode=mode, batching=batching, mechanism="user_dpsgd_adaptive_clip", clip=0.5, m=M,
                        engine_out=engines)
            moves.add(round(math.log(engines[0].optimizer.max_grad_norm / 0.5), 6))
    assert len(moves) == 1, moves


def test_the_matrix_finds_a_reintroduced_defect(monkeypatch):
    """Put back finding 1 (each backward pass's Gram norm added in squares) and finding 4 (no rounding bound on a
    Gram norm): the influence property must fail."""
    original = ghost.UserGhostHooks._gram_norms2

    def per_pass_norms(self, module, passes, slots):
        parts = [original(self, module, [one], slots) for one in passes]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), parts[0][2]

    monkeypatch.setattr(ghost.UserGhostHooks, "_gram_norms2", per_pass_norms)
    monkeypatch.setattr(ghost, "TRUSTED_SHARE", math.inf)
    # the first step's per-user self-check sees the wrong norms (issue 40) ...
    rows = Rows(torch.randn(4, T, D, generator=torch.Generator().manual_seed(0)), torch.ones(4), [0, 0, 1, 1])
    with pytest.raises(ValueError, match="recomputed on that user's rows alone"):
        clipped_sum(rows, mode="ghost", passes=2, clip=1e-3)
    # ... and without it, the influence property
    monkeypatch.setattr(ghost.UserGhostHooks, "check_users", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="moved the sum"):
        test_no_user_moves_the_released_sum_beyond_its_sensitivity()


@pytest.mark.slow
def test_the_slow_profile_runs_many_examples():
    """``-m slow``: the influence and exactness properties with the slow profile's examples."""
    for test in (test_no_user_moves_the_released_sum_beyond_its_sensitivity,
                 test_without_clipping_the_released_sum_is_the_per_user_autograd_sum):
        settings(settings.get_profile("slow"))(given(scenarios())(test.hypothesis.inner_test))()


@pytest.mark.parametrize("mode,route", [("hooks", None), ("ghost", "direct"), ("ghost", "gram")])
def test_a_bf16_user_at_the_clip_is_released_within_it_exactly(mode, route):
    """Issue 39, finding 4: bf16 parameters, one user with one row whose gradient is 7 in each of 64 coordinates
    (norm 56), C = 32.375. The clip factor rounded down is not enough: the bf16 product c·g rounds to nearest, which let
    the released gradient reach 1.0039·C. Every route now releases at most C, with no tolerance."""
    from torch.utils.data import DataLoader, TensorDataset

    import trl_userdp

    clip, positions = 32.375, 2
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    # two positions of 3.5 per row: the weight's gradient is 2 · 3.5 = 7 in every coordinate
    x = torch.full((1, positions, 8), 3.5, dtype=torch.bfloat16)
    engine = trl_userdp.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x), batch_size=1), user_ids=[0], max_samples_per_user=1,
        users_per_batch=1.0, noise_multiplier=0.0, max_grad_norm=clip, steps=1, grad_sample_mode=mode)
    if route is not None:
        engine.hooks.norm_route = route
    (batch,) = next(iter(loader))
    optimizer.zero_grad()
    model(batch).float().sum().backward()
    optimizer.step()
    released = float(torch.linalg.vector_norm(model.weight.grad.float()))
    assert clip * 0.98 < released <= clip, released
