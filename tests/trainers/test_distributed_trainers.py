"""The TRL trainers on two processes (issue 14): transformers' Trainer under accelerate's MULTI_CPU (gloo) state, set
up from the environment variables `accelerate launch` sets, one spawned process per rank. With σ = 0 the update
equals the single-process run on the same users; with noise there is one draw (rank 0's), not one per rank; ε is
the single-process ε; the replicas stay identical; a resumed run continues ε; a failing check on one rank stops both."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from scipy import stats

from trl_userdp import PrivacyReport
from trl_userdp.trainers import UserDPDPOConfig, UserDPDPOTrainer, UserDPRewardConfig, UserDPRewardTrainer

from ..tiny_models import tiny_llama_lm, tiny_tokenizer
from .scripts import dpo_script, reward_script, tiny_reward_model

EXACT = dict(noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=1e6, optim="sgd", learning_rate=0.5)
SCRIPTS = {"reward": (reward_script, UserDPRewardTrainer, UserDPRewardConfig),
           "dpo": (dpo_script, UserDPDPOTrainer, UserDPDPOConfig)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind: str, out: str, **settings):
    script, trainer_cls, config_cls = SCRIPTS[kind]
    trainer = script(trainer_cls, config_cls, out, users_per_batch=4.0, privacy_seed=0, **settings)
    return trainer


def _worker(rank: int, world: int, port: int, out: str, kind: str, settings: dict, fail_on_rank: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if rank == fail_on_rank:
        from trl_userdp.optimizers import UserDPOptimizer

        def failing_check(self):
            raise ValueError("Self-check failed (injected on one rank)")

        UserDPOptimizer._self_check = failing_check
    result = {}
    try:
        trainer = _run(kind, out, **settings)
        engine = trainer.privacy_engine
        result = {"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                  "history": engine.accountant.history, "world_size": torch.distributed.get_world_size(),
                  "ddp": type(trainer.model_wrapped).__name__, "steps": trainer.state.global_step}
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        result = {"error": f"{type(err).__name__}: {err}"}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():  # a rank that tears gloo down while another still saves aborts (SIGABRT)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _two_processes(tmp_path, kind, name="dist", fail_on_rank=-1, **settings):
    out = str(tmp_path / name)
    os.makedirs(out, exist_ok=True)
    settings = {"ddp_timeout": 120, **settings}  # a rank waiting for another fails in two minutes, not CI's 90
    mp.spawn(_worker, args=(2, _free_port(), out, kind, settings, fail_on_rank), nprocs=2, join=True)
    return out, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


#: the DPO variants run with `-m slow` (the default run keeps the reward ones, within CI's 10-minute budget)
REWARD_THEN_SLOW_DPO = ["reward", pytest.param("dpo", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", REWARD_THEN_SLOW_DPO)
def test_two_processes_take_the_single_process_step_and_spend_its_epsilon(tmp_path, kind):
    settings = dict(steps=4, **EXACT)  # 8 users, ñ = 4: some steps leave one process without users
    out, ranks = _two_processes(tmp_path, kind, **settings)
    assert all("error" not in r for r in ranks), ranks
    assert {r["world_size"] for r in ranks} == {2} and ranks[0]["ddp"] == "DistributedDataParallel"
    single = _run(kind, str(tmp_path / "single"), **settings)
    expected = {k: v.detach() for k, v in single.model.state_dict().items()}
    assert ranks[0]["history"] == ranks[1]["history"] == single.privacy_engine.accountant.history
    assert ranks[0]["steps"] == single.state.global_step == 4
    for name, value in expected.items():
        for r in ranks:  # every replica is the single-process model
            torch.testing.assert_close(r["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    tokenizer = tiny_tokenizer()
    if kind == "reward":
        fresh = tiny_reward_model(tokenizer).state_dict()
        assert any(not torch.equal(fresh[k], v) for k, v in expected.items())  # the steps moved it
    noisy = dict(steps=2, target_epsilon=3.0, accountant="rdp")  # RDP calibrates σ in a fraction of PLD's time
    out, ranks = _two_processes(tmp_path, kind, name="dist_eps", **noisy)
    single = _run(kind, str(tmp_path / "single_eps"), **noisy)
    assert PrivacyReport.load(out).epsilon == pytest.approx(single.privacy_report().epsilon, rel=1e-12)
    assert PrivacyReport.load(out).extra["world_size"] == 2
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name


@pytest.mark.parametrize("kind", REWARD_THEN_SLOW_DPO)
def test_one_noise_draw_across_processes(tmp_path, kind):
    """One step, σ = 10: the update is noise of std σC/ñ per coordinate (the clipped users' sum, ≤ 2C in norm, is
    negligible against the noise's norm σC/ñ·√n); a draw per rank would double the variance."""
    sigma, clip, n_tilde = 10.0, 0.1, 4.0
    out, ranks = _two_processes(tmp_path, kind, steps=1, noise_multiplier=sigma, target_epsilon=None,
                                per_user_max_grad_norm=clip, optim="sgd", learning_rate=1.0)
    assert all("error" not in r for r in ranks), ranks
    tokenizer = tiny_tokenizer()
    start = (tiny_reward_model(tokenizer) if kind == "reward" else tiny_llama_lm(len(tokenizer))).state_dict()
    update = torch.cat([(start[k] - v).flatten() for k, v in ranks[0]["params"].items()]).double()
    n = update.numel()
    expected_var = (sigma * clip / n_tilde) ** 2
    stat = (n - 1) * float(update.var()) / expected_var
    lo, hi = stats.chi2.interval(0.999, n - 1)
    assert lo <= stat <= hi, (float(update.var()), expected_var)  # the signal's share of the variance is < 1e-4


@pytest.mark.parametrize("kind", REWARD_THEN_SLOW_DPO)
def test_a_failing_check_on_one_rank_stops_both(tmp_path, kind):
    out, ranks = _two_processes(tmp_path, kind, fail_on_rank=1, steps=2, **EXACT)
    assert "injected on one rank" in ranks[1]["error"]
    assert "Another process failed this step's checks" in ranks[0]["error"]
    assert not os.path.isfile(os.path.join(out, "privacy_report.json"))


@pytest.mark.slow
def test_a_resumed_two_process_run_continues_epsilon(tmp_path):
    noisy = dict(steps=4, target_epsilon=3.0, save_strategy="steps", save_steps=2)
    out, straight = _two_processes(tmp_path, "reward", name="run", **noisy)
    assert all("error" not in r for r in straight), straight
    epsilon = PrivacyReport.load(out).epsilon
    checkpoint = os.path.join(out, "checkpoint-2")
    out, resumed = _two_processes(tmp_path, "reward", name="resumed", resume_from_checkpoint=checkpoint, **noisy)
    assert all("error" not in r for r in resumed), resumed
    assert resumed[0]["history"] == straight[0]["history"] and sum(n for *_, n in resumed[0]["history"]) == 4
    assert PrivacyReport.load(out).epsilon == pytest.approx(epsilon, rel=1e-12)
    for name, value in straight[0]["params"].items():  # the noise continues, keyed by (seed, step)
        torch.testing.assert_close(resumed[0]["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_single_process_mechanisms_refuse_several_processes_before_training(tmp_path):
    out, ranks = _two_processes(tmp_path, "reward", steps=1, privacy_mechanism="user_dpsgd_adaptive")
    for r in ranks:
        assert "'user_dpsgd_adaptive' runs in one process" in r["error"]
    assert not os.path.isfile(os.path.join(out, "privacy_report.json"))
