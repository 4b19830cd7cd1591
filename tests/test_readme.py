"""Every code block of the README and docs/ that is meant to run runs as written (issue 25): each Python block with
the small model, tokenizer and data it names (steps capped), the README's command-line chains reward → dpo → rl (full
and LoRA) on its own row format, YAML and model card, and the two-process command of docs/trainers.md (``-m slow``).
A block this file does not know fails the test, so a new snippet gets a runner."""

import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from .helpers import linear_task
ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def blocks(page: str = "README.md"):
    """(language, text) of each fenced block of a page, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / page).read_text())]


def readme_blocks():
    return blocks("README.md")


def _cap_steps(code: str) -> str:
    """The small models learn nothing in 200 steps that 2 do not show: cap the loops, not the API calls."""
    code = re.sub(r"max_steps=\d+", "max_steps=2", code)
    return re.sub(r"epochs=\d+", "epochs=1", code)


def _linear_names():
    """The engine tests' linear task with 100 users (AUP's snippet draws 50 a step): model, optimizer, data, users."""
    dataset, user_ids = linear_task(n_users=100)
    model = torch.nn.Linear(5, 1)
    return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=dataset, user_ids=user_ids)


def _aup():
    import trl_userdp

    names = _linear_names()
    names["loss_fn"] = lambda model, b: torch.nn.functional.binary_cross_entropy_with_logits(
        model(b[0]).squeeze(-1), b[1])
    g = torch.Generator().manual_seed(1)
    public = TensorDataset(torch.randn(60, 5, generator=g), torch.ones(60))
    names["public_user_loader"] = trl_userdp.UserDataLoader(public, users_per_batch=10,
                                                            user_ids=[i // 3 for i in range(60)], seed=0, steps=2)
    return names


def _grpo():
    """A causal LM in ``sft``, a private reward model in ``rm`` (the working directory) and 32 users' prompts."""
    from datasets import Dataset

    from trl_userdp.trainers import UserDPRewardConfig, UserDPRewardTrainer

    from .tiny_models import tiny_llama_lm, tiny_tokenizer
    from .trainers.scripts import reward_script

    tokenizer = tiny_tokenizer()
    tiny_llama_lm(len(tokenizer)).save_pretrained("sft")
    tokenizer.save_pretrained("sft")
    reward_script(UserDPRewardTrainer, UserDPRewardConfig, "rm", steps=1, accountant="rdp")
    prompts = ["the movie was", "i loved the", "the plot", "great and"] * 16
    return dict(prompts_with_user_id=Dataset.from_dict({"prompt": prompts, "user_id": [f"u{i % 32}" for i in range(64)]}))


def _rr():
    from .tiny_models import text_preference_dataset

    return dict(dataset=text_preference_dataset(n_users=8, pairs_per_user=3))


#: a marker of each Python block → the names it expects from the reader
PYTHON = {"UserDPGRPOTrainer(": _grpo, "AdaptiveUserPrivacyEngine()": _aup, "UserRandomizedResponse(": _rr,
          "bound_contributions(": dict, "audit_gradient_canaries(": dict}
#: the README's first two quick starts: they define every name they use, and run as written (no step cap), from a
#: fresh clone, in the default suite (issue 44)
VERBATIM = ("trl_userdp.PrivacyEngine(", "UserDPRewardTrainer(")
#: command blocks that this file does not run, and why
NOT_RUN = {"./scripts/main": "the set-up commands: .ci/run runs ./scripts/test, the main job is its own run",
           "accelerate launch --multi_gpu": "its first line needs GPUs; its second (two CPU processes) runs under -m slow",
           "--shard_model true": "the CPU line runs under -m slow (tests/trainers/test_distributed_trainers.py, the "
                                 "embedded data); the GPU line needs GPUs",
           "pip install torch": "installs into the reader's environment: scripts/_venv.sh runs the same pip install",
           "python -m benchmarks.": "opt-in runs of minutes: tests/benchmarks/ runs each script in a tiny setting",
           "--plant_into": "tests/scripts/test_audit.py runs the same three steps with a tiny reward model"}


def _python_blocks():
    return [(page, code) for page in DOCS for lang, code in blocks(page) if lang == "python"]


def _verbatim(code: str) -> bool:
    return any(marker in code for marker in VERBATIM)


@pytest.mark.parametrize("page,index", [
    # a block that trains through a trainer is a whole run as written (.ci/run's end_to_end set)
    pytest.param(page, i, marks=[pytest.mark.end_to_end] if ".train()" in code else [])
    for i, (page, code) in enumerate(_python_blocks()) if not _verbatim(code)])
def test_each_python_block_runs_with_the_names_it_expects(page, index, tmp_path, monkeypatch):
    """Every block but the verbatim quick starts (:func:`test_the_quick_starts_run_as_written`)."""
    code = _python_blocks()[index][1]
    monkeypatch.chdir(tmp_path)  # output_dir="rm" and the like land here
    known = [make for marker, make in PYTHON.items() if marker in code]
    assert len(known) == 1, f"{page}: a Python block has no runner in tests/test_readme.py:\n{code}"
    exec(compile(_cap_steps(code), f"{page} python block", "exec"), known[0]())


@pytest.mark.end_to_end
def test_the_quick_starts_run_as_written(tmp_path, monkeypatch):
    """The README's first two quick starts, as written, with no name from the reader (quick start 3 is the chain
    below). Quick start 1 spends ε on its own data; quick start 2 (the packaged MiniLM, its head alone, the embedded IMDb
    users) writes a model and its report at the ε it asked for, and the card names the packaged base by its origin
    (it named a site-packages folder)."""
    from trl_userdp import PrivacyReport

    monkeypatch.chdir(tmp_path)
    verbatim = [(page, code) for page, code in _python_blocks() if _verbatim(code)]
    assert [page for page, _ in verbatim] == ["README.md", "README.md"]
    (_, first), (_, second) = verbatim
    names = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(first, "README quick start 1", "exec"), names)
    assert 0 < names["engine"].get_epsilon(1e-5) < float("inf") and "epsilon" in out.getvalue()
    names = {}
    exec(compile(second, "README quick start 2", "exec"), names)
    report = PrivacyReport.load("rm")
    assert report.steps_taken == 30 and report.epsilon == pytest.approx(8.0, rel=1e-3)
    assert report.n_users == 200 and report.max_samples_per_user == 10
    assert sum(p.requires_grad for p in names["model"].parameters()) == 2  # the head's weight and bias
    card = (tmp_path / "rm" / "README.md").read_text()
    assert "fine-tuned version of [sentence-transformers/all-MiniLM-L6-v2]" in card and "site-packages" not in card


def _chains():
    """The command blocks this file runs, in a working directory holding the README's files: full, then LoRA."""
    return [code for lang, code in readme_blocks() if lang == "bash" and code.startswith("trl-userdp ")]


def test_every_command_block_is_run_or_says_why_not():
    assert len(_chains()) == 2
    for page in DOCS:
        for lang, code in blocks(page):
            if lang in ("bash", "sh", "shell"):
                assert code in _chains() or any(marker in code for marker in NOT_RUN), f"{page}:\n{code}"


def _block(lang: str, needle: str) -> str:
    (found,) = [code for kind, code in readme_blocks() if kind == lang and needle in code]
    return found


def _commands(block: str):
    """Each command of a bash block, continuation lines joined, comments dropped."""
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].strip()
        if line:
            yield line


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The README's command-line section as a reader follows it: its row format for 20 users × 10 pairs, its
    reward.yaml, dpo.yaml as the README describes it, then every command of its block, in order."""
    work = tmp_path_factory.mktemp("readme")
    row = json.loads(_block("text", '"user_id"').strip())
    words = ["warm", "honest", "moving", "sharp", "tender"], ["cold", "hollow", "dull", "flat", "tired"]
    rows = [{**row, "user_id": f"annotator-{u:02d}", "chosen": f" a {words[0][(u + k) % 5]} story",
             "rejected": f" a {words[1][(u * k) % 5]} story"} for u in range(20) for k in range(10)]
    (work / "my_prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "my_prompts.jsonl").write_text("".join(json.dumps({"prompt": "Review:"}) + "\n" for _ in range(8)))
    reward_yaml = _block("yaml", "output_dir: runs/my_reward")
    (work / "reward.yaml").write_text(reward_yaml)
    dpo_yaml = reward_yaml.replace("runs/my_reward", "runs/my_dpo").replace("num_train_epochs: 2", "max_steps: 4")
    (work / "dpo.yaml").write_text(dpo_yaml)
    return work, _run_block(_chains()[0], work)


def _run_block(block: str, work: Path):
    """Each command of the block, as ``trl-userdp`` runs it (``trl_userdp.cli.main`` on the shell's words), in
    ``work``, in this process: the entry point itself runs in a shell in tests/scripts/test_cli.py, and one process
    keeps each setting's calibrated σ, which the LoRA chain asks for again. Returns ``(command, result)`` pairs, the
    result's ``returncode``, ``stdout`` and ``stderr`` (the package's log lines included) as a process's."""
    from trl_userdp.cli import main

    package = logging.getLogger("trl_userdp")
    results = []
    for command in _commands(block):
        words = shlex.split(command)
        assert words[0] == "trl-userdp", command
        out, err = io.StringIO(), io.StringIO()
        handlers, capture = list(package.handlers), logging.StreamHandler(err)
        capture.setFormatter(logging.Formatter("%(levelname)s:%(message)s"))
        package.addHandler(capture)
        try:
            with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                patch.chdir(work)
                code = main(words[1:])
        finally:
            package.handlers = handlers  # what the command added (its console handler) goes with it
        results.append((command, SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())))
    return results


def _succeeded(results):
    for command, proc in results:
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        assert "written to" in proc.stdout.strip().splitlines()[-1]


@pytest.mark.end_to_end
def test_the_command_line_chain_runs_as_written(chain):
    from trl_userdp import PrivacyReport

    work, results = chain
    assert [c.split()[1] for c, _ in results] == ["reward", "dpo", "rl"]
    _succeeded(results)
    # rl used to generate TRL's default 512 tokens past the tiny policy's 128 positions, whose text the reward model
    # (MiniLM, 512 positions) could not read: `The size of tensor a (545) must match the size of tensor b (512)`
    assert "max_completion_length 512 -> 124: the policy has 128 positions" in results[2][1].stderr
    reports = {name: PrivacyReport.load(str(work / "runs" / name)) for name in ("my_reward", "my_dpo", "my_rl")}
    assert reports["my_reward"].epsilon <= 3.0 and reports["my_dpo"].epsilon <= 3.0
    card = (work / "runs" / "my_dpo" / "README.md").read_text()
    assert _block("text", "## Privacy").strip() in card  # the card the README shows, to the digit
    # the cards name the packaged base models (they said "fine-tuned version of [None](https://huggingface.co/None)")
    assert "fine-tuned version of trl_userdp's `tiny` Llama" in card and 'model="runs/my_dpo"' in card
    reward_card = (work / "runs" / "my_reward" / "README.md").read_text()
    assert "fine-tuned version of [sentence-transformers/all-MiniLM-L6-v2]" in reward_card
    # the comments' figures: ε = 3 each, and the policy's report composes both
    assert reports["my_rl"].epsilon == pytest.approx(reports["my_reward"].epsilon + reports["my_dpo"].epsilon, rel=1e-6)


@pytest.mark.end_to_end
def test_the_lora_chain_runs_as_written_and_its_adapters_reload_from_anywhere(chain, tmp_path, monkeypatch):
    """The LoRA block after the chain (a LoRA reward model used to be refused by `rl`: no report found). Its adapters used to name their base relative to the training run's working
    directory (`runs/my_dpo_lora/base_model`), which PEFT resolves against the reader's: `OSError: Repo id must be in
    the form ...` from anywhere else; and `rl` refused the folder (`Unrecognized model ... model_type`)."""
    from peft import AutoPeftModelForCausalLM

    from trl_userdp import PrivacyReport

    work, _ = chain
    results = _run_block(_chains()[1], work)
    assert [c.split()[1] for c, _ in results] == ["reward", "dpo", "rl"]
    _succeeded(results)
    lora, rl = work / "runs" / "my_dpo_lora", work / "runs" / "my_rl_lora"
    for adapters in (lora, rl):  # rl trains the dpo adapters further, on the same base
        assert json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
            lora / "base_model")
    monkeypatch.chdir(tmp_path)
    assert AutoPeftModelForCausalLM.from_pretrained(str(lora)).peft_config["default"].r == 8
    carried = PrivacyReport.load(str(rl))
    # the LoRA reward model's report is found (it loads on its base, whose folder has none)
    assert carried.epsilon == pytest.approx(PrivacyReport.load(str(work / "runs" / "my_reward_lora")).epsilon
                                            + PrivacyReport.load(str(lora)).epsilon, rel=1e-6)
    (command, _), = [r for r in results if r[0].split()[1] == "rl"]
    refused = _run_block(command + " --use_peft", work)[0][1]  # adapters on adapters: one line with the fix
    assert refused.returncode == 2 and "holds LoRA adapters, which are trained further: drop --use_peft" in refused.stderr


@pytest.mark.slow
def test_the_two_process_command_of_the_trainers_page_runs_as_written(tmp_path):
    """docs/trainers.md's second `accelerate launch` line: two CPU processes (gloo) under torchrun, from the root."""
    from trl_userdp import PrivacyReport

    (block,) = [code for lang, code in blocks("docs/trainers.md") if "accelerate launch --multi_gpu" in code]
    (command,) = [c for c in _commands(block) if c.startswith("torchrun")]
    out = tmp_path / "ddp"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(f"{command} --output_dir {out}", shell=True, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = PrivacyReport.load(str(out))
    # the page's figures: 6 steps, world_size 2, ñ = 32 = 16 per process × 2, ε within the default target 8
    assert report.steps_taken == 6 and report.extra["world_size"] == 2
    assert report.extra["expected_units_per_step"] == 32 and report.epsilon <= 8.0
