"""The TRL trainers on two processes (issue 14): transformers' Trainer under accelerate's MULTI_CPU (gloo) state, set
up from the environment variables `accelerate launch` sets, one spawned process per rank. With σ = 0 the update
equals the single-process run on the same users; with noise there is one draw (rank 0's), not one per rank; ε is
the single-process ε; the replicas stay identical; a resumed run continues ε; a failing check on one rank stops both."""

import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from scipy import stats

from trl_userdp import PrivacyReport
from trl_userdp.distributed import finish
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
    return script(trainer_cls, config_cls, out, **{"users_per_batch": 4.0, "privacy_seed": 11, **settings})


def _inject_a_failing_check() -> None:
    from trl_userdp.optimizers import UserDPOptimizer

    def failing_check(self, *args):  # not a ValueError: any failure of one rank's checks must reach the other
        raise RuntimeError("Self-check failed (injected on one rank)")

    UserDPOptimizer._self_check = failing_check


def _worker(rank: int, world: int, port: int, jobs: list):
    """Runs ``jobs`` ((output folder, kind, settings, rank to fail on)) one after another in this rank's process,
    saving each result as ``rank<r>.pt`` in its folder."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    for out, kind, settings, fail_on_rank in jobs:
        if rank == fail_on_rank:
            _inject_a_failing_check()
        if "legacy_of" in settings:  # resume from a copy of a checkpoint in the layout written before issue 43
            settings = dict(settings)
            checkpoint, settings["resume_from_checkpoint"] = settings.pop("legacy_of"), os.path.join(out, "legacy")
            if rank == 0:
                shutil.copytree(checkpoint, settings["resume_from_checkpoint"])
                os.rename(os.path.join(settings["resume_from_checkpoint"], "sharded"),
                          os.path.join(settings["resume_from_checkpoint"], "optimizer_sharded"))
            torch.distributed.barrier()
        try:
            trainer = _run(kind, out, **settings)
            # what this process sees when save_model returns: the main process's last file must be written already
            written = os.path.isfile(os.path.join(out, "privacy_report.json"))
            engine = trainer.privacy_engine
            # a sharded model's parameters gathered in full (a collective both ranks run in the same order)
            result = {"params": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                                 for k, v in trainer.model.state_dict().items()},
                      "history": engine.accountant.history, "world_size": torch.distributed.get_world_size(),
                      "ddp": type(trainer.model_wrapped).__name__, "steps": trainer.state.global_step,
                      "written_when_save_returned": written}
        except Exception as err:  # noqa: BLE001 - the test asserts on it
            result = {"error": f"{type(err).__name__}: {err}"}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        if torch.distributed.is_initialized():  # both ranks have saved before the next job (or gloo's teardown)
            torch.distributed.barrier()
    finish()  # the package's teardown: a kept last barrier, then the group torn down (no SIGABRT at exit)


def _two_processes(root, kind, jobs):
    """Each job (name, settings, rank to fail on; that rank's check fails from then on) on the same two processes, in
    order (a process start costs seconds). Returns {name: (output folder, [rank 0's result, rank 1's])}."""
    spec = []
    for name, settings, fail_on_rank in jobs:
        out = os.path.join(str(root), name)
        os.makedirs(out, exist_ok=True)
        # a rank waiting for another fails in two minutes, not CI's 90
        spec.append((out, kind, {"ddp_timeout": 120, **settings}, fail_on_rank))
    mp.spawn(_worker, args=(2, _free_port(), spec), nprocs=2, join=True)
    return {name: (out, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)])
            for (name, _, _), (out, *_) in zip(jobs, spec)}


#: the DPO variants run with `-m slow` (the default run keeps the reward ones, within CI's 10-minute budget)
REWARD_THEN_SLOW_DPO = ["reward", pytest.param("dpo", marks=pytest.mark.slow)]
STEPS_EXACT = dict(steps=4, **EXACT)  # 8 users, ñ = 4: some steps leave one process without users
NOISY = dict(steps=2, target_epsilon=3.0, accountant="rdp")  # RDP calibrates σ in a fraction of PLD's time
SIGMA, CLIP, N_TILDE = 10.0, 0.1, 4.0
ONE_NOISY_STEP = dict(steps=1, noise_multiplier=SIGMA, target_epsilon=None, per_user_max_grad_norm=CLIP, optim="sgd",
                      learning_rate=1.0)
#: FSDP2 (fully_shard on the decoder layers and the root before the trainer), ghost clipping; ñ = 1 of 8 users, so that
#: in most steps one process has no user and runs the placeholder pass
SHARDED = dict(sharded=True, grad_sample_mode="ghost")
SHARDED_EXACT = dict(steps=6, users_per_batch=1.0, **SHARDED, **EXACT)
#: each draw in two micro-batches (gradient accumulation), each clipped and reduce-scattered in turn
SHARDED_GA = dict(steps=3, users_per_batch=2.0, gradient_accumulation_steps=2, **SHARDED, **EXACT)
SHARDED_NOISY = dict(steps=4, target_epsilon=3.0, accountant="rdp", optim="adamw_torch", **SHARDED)


@pytest.fixture(scope="module", params=REWARD_THEN_SLOW_DPO)
def runs(request, tmp_path_factory):
    """The kind, and every two-process run of this file for it, on one pair of processes: the failing check last."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"dist_{kind}")
    sharded_checkpoint = os.path.join(str(root), "sharded_ckpt", "checkpoint-2")
    jobs = [("dist", STEPS_EXACT, -1), ("dist_eps", NOISY, -1), ("noise", ONE_NOISY_STEP, -1),
            ("sharded", SHARDED_EXACT, -1), ("sharded_ga", SHARDED_GA, -1),
            ("sharded_noise", dict(**ONE_NOISY_STEP, **SHARDED), -1),
            ("sharded_ckpt", dict(**SHARDED_NOISY, save_strategy="steps", save_steps=2), -1),
            ("sharded_resumed", dict(**SHARDED_NOISY, resume_from_checkpoint=sharded_checkpoint), -1),
            ("sharded_resumed_legacy", dict(**SHARDED_NOISY, legacy_of=sharded_checkpoint), -1),
            ("refuse", dict(steps=1, privacy_mechanism="user_dpsgd_adaptive_clip"), -1), ("fail", dict(steps=2, **EXACT), 1)]
    return kind, _two_processes(root, kind, jobs)


@pytest.mark.end_to_end
def test_two_processes_take_the_single_process_step_and_spend_its_epsilon(runs, tmp_path):
    kind, runs = runs
    _, ranks = runs["dist"]
    assert all("error" not in r for r in ranks), ranks
    assert {r["world_size"] for r in ranks} == {2} and ranks[0]["ddp"] == "DistributedDataParallel"
    single = _run(kind, str(tmp_path / "single"), **STEPS_EXACT)
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
    # no process leaves save_model before the main process's last file is written (one that tears its process group
    # down while another still writes can abort it: SIGABRT at exit)
    assert all(r["written_when_save_returned"] for r in ranks)
    out, ranks = runs["dist_eps"]
    single = _run(kind, str(tmp_path / "single_eps"), **NOISY)
    assert PrivacyReport.load(out).epsilon == pytest.approx(single.privacy_report().epsilon, rel=1e-12)
    assert PrivacyReport.load(out).extra["world_size"] == 2
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name


@pytest.mark.end_to_end
def test_a_model_sharded_by_fsdp2_takes_the_single_process_steps(runs, tmp_path):
    """Issue 28: the trainer on a model sharded by FSDP2 before it (the Trainer neither wraps nor re-shards it): σ = 0
    and no user clipped, six steps in which a process often has no user (its placeholder pass runs the layers'
    collectives), and three in two micro-batches each: the single-process model, and the saved model is the full one (the sharded engine's ε is the
    single-process ε: tests/test_sharded.py)."""
    kind, runs = runs
    start = _fresh(kind)
    for job, settings in (("sharded_ga", SHARDED_GA), ("sharded", SHARDED_EXACT)):
        out, ranks = runs[job]
        assert all("error" not in r for r in ranks), ranks
        assert ranks[0]["ddp"].startswith("FSDP") and ranks[0]["steps"] == settings["steps"]
        single = _run(kind, str(tmp_path / job), **{**settings, "sharded": False})
        for name, value in single.model.state_dict().items():
            for r in ranks:
                update, expected = r["params"][name] - start[name], value.detach() - start[name]
                torch.testing.assert_close(update, expected, atol=1e-7, rtol=1e-5, msg=f"{job}: {name}")
        assert any(not torch.equal(v.detach(), start[k]) for k, v in single.model.state_dict().items())
    saved = _saved(kind, out)  # save_model gathered the shards into one model on the main process
    for name, value in saved.items():
        torch.testing.assert_close(value, ranks[0]["params"][name], atol=0, rtol=0, msg=name)


def _fresh(kind):
    tokenizer = tiny_tokenizer()
    return (tiny_reward_model(tokenizer) if kind == "reward" else tiny_llama_lm(len(tokenizer))).state_dict()


def _saved(kind, out):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    return auto.from_pretrained(out).state_dict()


@pytest.mark.end_to_end
def test_a_sharded_run_resumes_from_its_checkpoint_exactly(runs):
    """Issue 28: a checkpoint of a sharded run holds the full model (gathered), each process's shards of AdamW's state
    and the privacy state; resumed on two new processes it ends where the run that never stopped ended (the noise
    continues by step and rank), with its ε."""
    _, runs = runs
    straight_out, straight = runs["sharded_ckpt"]
    assert {"sharded", "privacy_state.pt"} <= set(os.listdir(os.path.join(straight_out, "checkpoint-2")))
    for job in ("sharded_resumed", "sharded_resumed_legacy"):  # and from the layout written before issue 43
        resumed_out, resumed = runs[job]
        assert all("error" not in r for r in straight + resumed), (straight, resumed)
        assert resumed[0]["history"] == straight[0]["history"] and sum(n for *_, n in straight[0]["history"]) == 4
        assert PrivacyReport.load(resumed_out).epsilon == PrivacyReport.load(straight_out).epsilon
        for name, value in straight[0]["params"].items():
            torch.testing.assert_close(resumed[0]["params"][name], value, atol=1e-7, rtol=1e-6, msg=f"{job}: {name}")


@pytest.mark.end_to_end
@pytest.mark.parametrize("job", ["noise", "sharded_noise"])
def test_one_noise_draw_across_processes(runs, job):
    """One step, σ = 10: the update is noise of std σC/ñ per coordinate (the clipped users' sum, ≤ 2C in norm, is
    negligible against the noise's norm σC/ñ·√n); a draw per rank would double the variance, none on some elements
    (sharded: each process draws for the elements it owns) would shrink it."""
    kind, runs = runs
    _, ranks = runs[job]
    assert all("error" not in r for r in ranks), ranks
    start = _fresh(kind)
    update = torch.cat([(start[k] - v).flatten() for k, v in ranks[0]["params"].items()]).double()
    n = update.numel()
    expected_var = (SIGMA * CLIP / N_TILDE) ** 2
    stat = (n - 1) * float(update.var()) / expected_var
    lo, hi = stats.chi2.interval(0.999, n - 1)
    assert lo <= stat <= hi, (float(update.var()), expected_var)  # the signal's share of the variance is < 1e-4


@pytest.mark.end_to_end
def test_a_failing_check_on_one_rank_stops_both(runs):
    _, runs = runs
    out, ranks = runs["fail"]
    assert "injected on one rank" in ranks[1]["error"]
    assert "Another process failed this step's checks" in ranks[0]["error"]
    assert not os.path.isfile(os.path.join(out, "privacy_report.json"))


@pytest.mark.end_to_end
def test_single_process_mechanisms_refuse_several_processes_before_training(runs):
    _, runs = runs
    out, ranks = runs["refuse"]
    for r in ranks:
        assert "'user_dpsgd_adaptive_clip' runs in one process" in r["error"]
    assert not os.path.isfile(os.path.join(out, "privacy_report.json"))


@pytest.mark.slow
def test_a_resumed_two_process_run_continues_epsilon(tmp_path):
    noisy = dict(steps=4, target_epsilon=3.0, save_strategy="steps", save_steps=2)
    out, straight = _two_processes(tmp_path, "reward", [("run", noisy, -1)])["run"]
    assert all("error" not in r for r in straight), straight
    epsilon = PrivacyReport.load(out).epsilon
    checkpoint = os.path.join(out, "checkpoint-2")
    out, resumed = _two_processes(tmp_path, "reward", [("resumed", dict(resume_from_checkpoint=checkpoint, **noisy),
                                                            -1)])["resumed"]
    assert all("error" not in r for r in resumed), resumed
    assert resumed[0]["history"] == straight[0]["history"] and sum(n for *_, n in resumed[0]["history"]) == 4
    assert PrivacyReport.load(out).epsilon == pytest.approx(epsilon, rel=1e-12)
    for name, value in straight[0]["params"].items():  # the noise continues, keyed by (seed, step)
        torch.testing.assert_close(resumed[0]["params"][name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_torchrun_save_and_resume_exits_cleanly_every_time(tmp_path):
    """Issue 28: ten `torchrun` launches of `trl-userdp reward` on two gloo processes, five that save checkpoints and
    five that resume from one (about 4 minutes): every launch exits 0, and no rank dies at exit (SIGABRT, "terminate
    called without an active exception")."""
    import subprocess
    import sys

    common = ["--use_cpu", "true", "--n_users", "40", "--pairs_per_user", "4", "--per_device_train_batch_size", "8",
              "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--privacy_seed", "0"]
    failures = []
    for i in range(5):
        out = tmp_path / f"run{i}"
        resume = ["--resume_from_checkpoint", str(out / "checkpoint-4")]
        for extra in (["--max_steps", "6"], ["--max_steps", "6", *resume]):
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                   "--master_port", str(_free_port()), "-m", "trl_userdp.scripts.reward",
                                   "--output_dir", str(out), *common, *extra],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0 or "terminate called" in done.stderr:
                failures.append((i, extra[1], done.returncode, done.stderr[-2000:]))
    assert not failures, failures


@pytest.mark.slow
def test_torchrun_shards_the_packaged_reward_model_and_resumes_exactly(tmp_path):
    """The README's sharded command: `torchrun --nproc_per_node 2 -m trl_userdp.scripts.reward --shard_model true`
    (FSDP2, full fine-tuning of the packaged MiniLM) with checkpoints, then a resume from the first one on two new
    processes: the same final model and ε as the run that never stopped."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    common = ["--use_cpu", "true", "--shard_model", "true", "--grad_sample_mode", "ghost", "--train_all_layers", "true",
              "--n_users", "40", "--pairs_per_user", "4", "--per_device_train_batch_size", "8", "--max_steps", "4",
              "--save_steps", "2", "--report_to", "none", "--privacy_seed", "0"]
    outs = {}
    for name, extra in (("straight", []), ("resumed", ["--resume_from_checkpoint",
                                                       str(tmp_path / "straight" / "checkpoint-2")])):
        outs[name] = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(_free_port()), "-m", "trl_userdp.scripts.reward",
                               "--output_dir", str(outs[name]), *common, *extra],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    straight, resumed = (load_file(outs[n] / "model.safetensors") for n in ("straight", "resumed"))
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=0, rtol=0, msg=name)
    assert PrivacyReport.load(outs["resumed"]).epsilon == PrivacyReport.load(outs["straight"]).epsilon
