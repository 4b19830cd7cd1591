"""The privacy test matrix (issue 24): property-based tests over every path a step can take —
{hooks, ghost} × {fp32, bf16 weights, bf16 autocast} × {one batch, ``micro_batches``, ``UserBatchMemoryManager``} ×
{user_dpsgd, user_dpsgd_adaptive, group} × {one, two backward passes} — with generated adversarial users (rows that
nearly cancel, ×1e6 rows, NaN and inf rows, users with 1 and with m rows), checking

(a) each user's influence on the released sum ≤ its sensitivity · (1 + the dtype's tolerance), plus the rounding of
    the released sum itself in the parameters' dtype (docs/privacy_model.md, "Precision and paths");
(b) at σ = 0 and a huge clip, the released sum equals an independent per-user autograd loop;
(c) the step is accounted once, at the run's (σ, q), and adaptive clipping's count covers every user of the draw.

The default profile runs a bounded number of examples; ``HYPOTHESIS_PROFILE=slow`` (with ``-m slow``) many more. The
last test re-introduces a known defect and checks that the matrix finds it."""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_userdp.grad_sample import ghost

from .influence import T, Rows, clipped_sum, user_autograd_sum

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


@st.composite
def scenarios(draw):
    """A step's path and its users; user 0 is the one whose influence is measured, of an adversarial ``kind``."""
    kind = draw(st.sampled_from(KINDS))
    n_users = draw(st.integers(2, 4))
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
                mechanism=draw(st.sampled_from(["user_dpsgd", "user_dpsgd_adaptive", "group"])),
                passes=draw(st.sampled_from([1, 2])),
                clip=draw(st.sampled_from([1e-3, 1.0])))


def _path(s):
    return {k: s[k] for k in ("mode", "dtype", "batching", "mechanism", "passes")}


@settings(settings.get_profile(PROFILE))
@given(scenarios())
def test_no_user_moves_the_released_sum_beyond_its_sensitivity(s):
    rows, clip = s["rows"], s["clip"]
    engines = []
    with_user = clipped_sum(rows, clip=clip, m=M, engine_out=engines, **_path(s))
    without = clipped_sum(rows.without(0), clip=clip, m=M, **_path(s))
    # the group baseline's unit is a record: a user of k records is worth k clipped records
    sensitivity = clip * (rows.users.count(0) if s["mechanism"] == "group" else 1)
    dtype = s["dtype"]
    allowed = sensitivity * (1 + TOLERANCE[dtype]) + SUM_ROUNDING[dtype] * float(
        torch.linalg.vector_norm(torch.nan_to_num(with_user)) + torch.linalg.vector_norm(torch.nan_to_num(without)))
    assert torch.isfinite(with_user).all() and torch.isfinite(without).all()
    got = float(torch.linalg.vector_norm(with_user - without))
    assert got <= allowed, f"user 0 ({s['kind']}) moved the sum by {got / sensitivity:.4f}× its sensitivity"
    # (c) one accounted step at this run's σ and q
    engine = engines[0]
    assert engine.accountant.history == [(0.0, 1.0, 1)]


@settings(settings.get_profile(PROFILE))
@given(scenarios())
def test_without_clipping_the_released_sum_is_the_per_user_autograd_sum(s):
    rows = s["rows"]
    if s["kind"] in ("nan", "inf", "huge"):  # non-finite users add zero; ×1e6 users swamp the comparison
        rows = rows.without(0)
    got = clipped_sum(rows, clip=1e9, m=M, **_path(s))
    if s["mechanism"] == "group":  # units are records
        reference = user_autograd_sum(Rows(rows.x, rows.w, list(range(len(rows.users)))), range(len(rows.users)))
    else:
        reference = user_autograd_sum(rows, sorted(set(rows.users)))
    per_row = Rows(rows.x, rows.w, list(range(len(rows.users))))  # rounding is relative to what was summed: rows
    scale = float(torch.linalg.vector_norm(reference)) + sum(
        float(torch.linalg.vector_norm(user_autograd_sum(per_row, [r]))) for r in range(len(rows.users)))
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
            clipped_sum(rows, mode=mode, batching=batching, mechanism="user_dpsgd_adaptive", clip=0.5, m=M,
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
    with pytest.raises(AssertionError, match="moved the sum"):
        test_no_user_moves_the_released_sum_beyond_its_sensitivity()


@pytest.mark.slow
def test_the_slow_profile_runs_many_examples():
    """``-m slow``: the influence and exactness properties with the slow profile's examples."""
    for test in (test_no_user_moves_the_released_sum_beyond_its_sensitivity,
                 test_without_clipping_the_released_sum_is_the_per_user_autograd_sum):
        settings(settings.get_profile("slow"))(given(scenarios())(test.hypothesis.inner_test))()
