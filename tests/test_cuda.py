"""What `scripts/gpu-check` runs on a GPU (`-m cuda`): the engine's paths on the device, in fp32 and bf16. Without a
CUDA GPU these are skipped with the reason; `TRL_USERDP_TEST_DEVICE=cpu` runs them on the CPU instead (how they are
checked where no GPU is lent)."""

import os

import pytest
import torch

from benchmarks.audit import quarter_noise
from trl_userdp.audit import audit_gradient_canaries

from .helpers import first_batch, make_private, rel_err
from .tiny_models import MODELS, btl_pair_losses
from .trainers.scripts import SCRIPTS, bf16_updates_by_mode


@pytest.fixture
def device() -> torch.device:
    name = os.environ.get("TRL_USERDP_TEST_DEVICE", "cuda")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu-check); TRL_USERDP_TEST_DEVICE=cpu runs it on the CPU")
    return torch.device(name)


def _one_step(name: str, mode: str, device: torch.device, dtype: torch.dtype):
    """One private step (σ = 0, C = 0.05: every user clipped) of a tiny model on ``device`` in ``dtype``: the flat
    parameters after it."""
    model = MODELS[name]().to(device=device, dtype=dtype)
    engine, model, optimizer, _, _ = make_private(model, grad_sample_mode=mode, max_grad_norm=0.05)
    batch, _ = first_batch(engine, min_users=3)
    batch = {k: v.to(device) for k, v in batch.items()}
    btl_pair_losses(model, batch).mean().backward()
    optimizer.step()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_ghost_clipping_takes_the_materialised_step_on_the_device(device, name, dtype):
    """Per-user ghost clipping and the materialised per-user gradients give the same step on the device (fp32: to
    float rounding; bf16: to bf16's)."""
    hooks, ghost = (_one_step(name, mode, device, dtype) for mode in ("hooks", "ghost"))
    assert rel_err(ghost, hooks) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("mode,dtype,micro_batches", [("hooks", torch.float32, 1), ("ghost", torch.bfloat16, 2)])
def test_the_white_box_audit_passes_an_honest_run_and_catches_a_broken_one_on_the_device(device, mode, dtype,
                                                                                          micro_batches):
    """1,000 gradient canary users through the engine on the device: an honest run at ε = 2 is consistent with its
    claim, one that adds a quarter of its noise is caught (docs/audit.md)."""
    common = dict(steps=10, target_epsilon=2.0, seed=0, grad_sample_mode=mode, dtype=dtype, device=device,
                  micro_batches=micro_batches)
    honest = audit_gradient_canaries(1000, **common)
    assert honest.settings["device"] == device.type and honest.consistent, honest.summary()
    broken = audit_gradient_canaries(1000, before_training=quarter_noise, **common)
    assert not broken.consistent, broken.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("script,trainer_cls,config_cls", SCRIPTS, ids=["reward", "dpo"])
def test_the_trainers_train_privately_in_bf16_on_the_device(device, tmp_path, script, trainer_cls, config_cls):
    """The reward and DPO trainers with ``bf16=True`` (autocast) on the device, σ = 0, every user clipped, gradient
    accumulation 2: per-user hooks and ghost clipping take the same update to bf16's precision (the trainers place the
    model on the device themselves: ``use_cpu`` only where the device is the CPU)."""
    updates = bf16_updates_by_mode(script, trainer_cls, config_cls, str(tmp_path), use_cpu=device.type == "cpu")
    assert all(torch.isfinite(u).all() and u.abs().sum() > 0 for u in updates.values())
    assert rel_err(updates["ghost"], updates["hooks"]) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_sharded_by_fsdp2_takes_the_unsharded_step_on_the_device(device, dtype, tmp_path):
    """FSDP2 over one process on the device (NCCL on a GPU): the sharded path (the layers gathered by FSDP2, the
    clipped sums redistributed to the shards as DTensors on the device, the noise on the shard) takes the unsharded
    ghost step, every user clipped (tests/test_sharded.py runs two processes on the CPU)."""
    import torch.distributed as dist

    from .test_sharded import _train

    setting = dict(device=device, dtype=dtype)  # σ = 0, every user clipped
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp_path}/rendezvous",
                            rank=0, world_size=1)
    try:
        sharded = _train(**setting, sharded=True)[1]
    finally:
        dist.destroy_process_group()
    single = _train(**setting, sharded=False)[1]
    assert single.abs().sum() > 0
    assert rel_err(sharded.float(), single.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
def test_accelerates_fsdp2_plugin_trains_the_reward_model_as_without_it(device, tmp_path):
    """The reward trainer under accelerate's FSDP plugin (FSDP2, its transformer-layer policy; accelerate applies it on
    accelerators only), one process under torchrun: the trainer shards the model itself before the privacy engine is
    set up, and σ = 0 gives the parameters of the run without the plugin."""
    import subprocess
    import sys

    if device.type != "cuda":
        pytest.skip("accelerate's FSDP plugin applies on accelerators only (a CPU run ignores it)")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    script = os.path.join(root, "tests", "fsdp_plugin_run.py")
    runs = {"plugin": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", script],
            "plain": [sys.executable, script]}
    results = {}
    for mode, command in runs.items():
        out = str(tmp_path / mode)
        done = subprocess.run([*command, out, mode], capture_output=True, text=True, timeout=600, env=env, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        results[mode] = torch.load(os.path.join(out, "result.pt"))
    assert results["plugin"]["fsdp"] and results["plugin"]["wrapped"].startswith("FSDP")
    for name, value in results["plain"]["params"].items():
        assert rel_err(results["plugin"]["params"][name], value) < 1e-5, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs instead of refusing")
@pytest.mark.skipif(not os.path.isdir(os.path.join(os.path.dirname(__file__), "..", ".venv")),
                    reason="scripts/gpu-check would build the project's virtualenv first")
def test_without_a_gpu_the_gpu_check_says_why_in_one_line():
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([os.path.join(root, "scripts", "gpu-check")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("scripts/gpu-check: no CUDA GPU")


@pytest.mark.cuda
def test_grpo_on_the_users_prompts_trains_privately_in_bf16_on_the_device(device, tmp_path):
    """``UserDPGRPOTrainer`` with ``bf16=True`` on the device (generation, rewards and the private step), σ = 0, every
    user clipped, gradient accumulation 2: per-user hooks and ghost clipping take the same first update to bf16's
    precision (the same seed gives both the same completions)."""
    from .trainers.test_grpo import HONEST, _params, _prompts, _trainer

    updates = {}
    for mode in ("hooks", "ghost"):
        trainer = _trainer(tmp_path / mode, _prompts(HONEST), bf16=True, use_cpu=device.type == "cpu",
                           noise_multiplier=0.0, target_epsilon=None, per_user_max_grad_norm=0.05,
                           users_per_batch=2.0, gradient_accumulation_steps=2, grad_sample_mode=mode)
        before = _params(trainer.model)
        trainer.train()
        assert trainer.args.bf16 and trainer.model.device.type == device.type
        after = _params(trainer.model)
        updates[mode] = torch.cat([(after[n] - before[n]).float().flatten() for n in before]).cpu()
    assert all(torch.isfinite(u).all() and u.abs().sum() > 0 for u in updates.values())
    assert rel_err(updates["ghost"], updates["hooks"]) < 2e-2
