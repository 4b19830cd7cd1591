"""The white-box audit across two data-parallel processes (gloo on CPU): the canary users are sharded by id as any
users, every process gets the same report, and it is the single-process report; a run with a quarter of its noise on
both processes is caught there as in one process."""

import datetime
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.audit import quarter_noise
from trl_userdp.audit import AuditReport, audit_gradient_canaries

CASES = {"hooks": {}, "ghost_bf16": {"grad_sample_mode": "ghost", "dtype": torch.bfloat16},
         "quarter_noise": {"before_training": quarter_noise}}
COMMON = dict(steps=10, target_epsilon=2.0, seed=0, rows_per_user=2)


def _worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case, options in CASES.items():
            audit_gradient_canaries(1000, **COMMON, **options).save(os.path.join(tmp, f"{case}{rank}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports():
    """{case: [rank 0's report, rank 1's]}."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, d), nprocs=2, join=True)
        yield {case: [AuditReport.load(str(Path(d) / f"{case}{r}")) for r in range(2)] for case in CASES}


@pytest.mark.end_to_end
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_audit_the_run_one_process_audits(reports, case):
    ranks = reports[case]
    single = audit_gradient_canaries(1000, **COMMON, **CASES[case])
    bf16 = CASES[case].get("dtype") == torch.bfloat16
    for report in ranks:
        assert report.settings["world_size"] == 2 and report.consistent is single.consistent
        if bf16:  # rounding can swap two canaries' ranks: the bounds may move by a guess
            assert abs(report.epsilon_lower - single.epsilon_lower) < 0.1
            assert abs(report.epsilon_lower_fdp - single.epsilon_lower_fdp) < 0.1
        else:
            assert (report.epsilon_lower, report.correct, report.guesses, report.epsilon_lower_fdp) == \
                (single.epsilon_lower, single.correct, single.guesses, single.epsilon_lower_fdp)
        # the same updates up to the order of sums (per process, then all-reduced), rounded to the parameters'
        # precision (bf16: an ulp of the weights, a quarter of C/ñ, against noise of std σ√T ≈ 20 C/ñ)
        torch.testing.assert_close(torch.tensor(report.scores_in), torch.tensor(single.scores_in),
                                   rtol=2 ** -7 if bf16 else 1e-4, atol=0.5 if bf16 else 1e-3)
    assert ranks[0].scores_in == ranks[1].scores_in  # one noise draw, the same on both
    # the users are sharded, not copied: each process trained on part of the rows, together on all of them
    shares = [r.settings["rows_on_this_process"] for r in ranks]
    assert min(shares) > 0 and sum(shares) == single.settings["rows_on_this_process"]
    assert ranks[0].consistent is (case != "quarter_noise"), ranks[0].summary()


def rows_split_across_processes(engine, optimizer):
    """A defect of data parallelism: every process takes every drawn user but only its share of the user's rows, so
    each process clips its part to C and a user of two rows moves the update by 2C."""
    sampler = engine.data_loader.user_sampler
    rank, world, rows = sampler.rank, sampler.num_replicas, sampler._rows
    sampler._rows = lambda user: rows(user)[rank::world]
    sampler.num_replicas, sampler.rank = 1, 0


def _split_worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        audit_gradient_canaries(10_000, **COMMON, before_training=rows_split_across_processes).save(
            os.path.join(tmp, f"split{rank}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_users_split_across_processes_are_caught_with_ten_thousand_canaries(tmp_path):
    """Rows sharded instead of users doubles a two-row user's sensitivity: at 1,000 canaries the audit is at the edge
    of its power (the f-DP audit rejects the claimed curve in 4 of 6 seeds, Steinke et al.'s bound is above the
    claimed 2 in 1 of 6), at 10,000 both are above the claim (2.21 and 2.83, 20 s)."""
    mp.spawn(_split_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    report = AuditReport.load(str(tmp_path / "split0"))
    assert report.settings["world_size"] == 2 and report.canaries == 10_000
    assert not report.consistent and report.epsilon_lower > 2.0 and report.fdp_claim_rejected, report.summary()
