"""What the training commands share (:mod:`trl_userdp.scripts.utils`): the private data (any file `datasets` reads,
splits, users, text checks), the reporting and logging options, and the final line."""

import json
import math

import pytest

from trl_userdp import PrivacyReport
from trl_userdp.cli import main

from .helpers import pairs, run_cli, write_jsonl


def test_a_dataset_without_a_user_column_is_a_one_line_error(tmp_path, capsys):
    """In this process (a shell's run of a one-line error: tests/scripts/test_cli.py)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "good", "rejected": "bad"}\n' * 4)
    assert main(["reward", "--dataset", str(path), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("trl-userdp: error:") and "no user column 'user_id'" in last
    assert sum(line.startswith("trl-userdp: error") for line in err.splitlines()) == 1


def test_an_empty_dataset_file_is_a_one_line_error(tmp_path, capsys):
    """It used to end in a bare StopIteration traceback from the json reader (issue 11, item 8)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("")
    assert main(["reward", "--dataset", str(path), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"trl-userdp: error: dataset file {str(path)!r} has no rows: there are no users to train on."


@pytest.mark.end_to_end
def test_a_parquet_folder_with_an_eval_split_trains_and_evaluates(tmp_path, capsys):
    """Local files of any format `datasets` reads, TRL's split flags, and evaluation on the test split (users of its
    own: a test split that shares a user with the train split is refused, its metrics carry no noise)."""
    from datasets import Dataset

    folder = tmp_path / "data"
    folder.mkdir()
    Dataset.from_list(pairs(range(8))).to_parquet(str(folder / "train.parquet"))
    Dataset.from_list(pairs(range(100, 104))).to_parquet(str(folder / "test.parquet"))
    out = tmp_path / "out"
    common = ["dpo", "--dataset_name", str(folder), "--max_steps", "2", "--per_device_train_batch_size", "4",
              "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4", "--save_steps", "2"]
    assert main([*common, "--output_dir", str(out)]) == 0
    history = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_loss" in h and math.isfinite(h["eval_loss"]) for h in history)
    assert PrivacyReport.load(str(out)).steps_taken == 2
    single = tmp_path / "pairs.parquet"  # one file: its rows are the train split
    Dataset.from_list(pairs(range(8))).to_parquet(str(single))
    assert main(["dpo", "--dataset_name", str(single), "--max_steps", "1", "--per_device_train_batch_size", "4",
                 "--output_dir", str(tmp_path / "single")]) == 0
    Dataset.from_list(pairs(range(6, 10))).to_parquet(str(folder / "test.parquet"))
    capsys.readouterr()
    assert main([*common, "--output_dir", str(tmp_path / "shared")]) == 2
    assert "the test split shares 2 user(s) with the train split" in capsys.readouterr().err


@pytest.mark.parametrize("command,fmt", [("reward", "jsonl"), ("dpo", "csv")])
def test_null_or_empty_text_is_one_line_naming_the_row(command, fmt, tmp_path, capsys):
    """Null text in a jsonl or an empty csv cell used to end in a 56-line TRL traceback ('NoneType' object has no
    attribute 'endswith'); an empty chosen trained silently (issue 25, item 4)."""
    from datasets import Dataset

    rows = pairs(range(4))
    rows[5] = {**rows[5], "chosen": None}
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, rows)
    else:
        Dataset.from_list(rows).to_csv(str(path), index=False)
    capsys.readouterr()
    assert main([command, "--dataset_name", str(path), "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # besides progress bars
    assert errors == [errors[0]] and errors[0].startswith("trl-userdp: error: Row 5 has no text (None) in column 'chosen'")


@pytest.mark.end_to_end
def test_a_missing_reporting_package_is_one_line_and_tensorboard_from_the_extra_shows_epsilon(tmp_path, capsys):
    """`--report_to` used to fail with a traceback from inside the Trainer when its package was missing (issue 17);
    with the `tracking` extra, TensorBoard gets the ε and δ curves (issue 16)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(range(8)))
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


@pytest.mark.slow  # a DPO run in a subprocess (about 20 s); the one-line errors and the final line run by default
def test_log_level_info_shows_the_packages_privacy_lines_and_the_run_says_where_it_wrote(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(range(8)))
    proc = run_cli("dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                   "--per_device_train_batch_size", "4", "--log_level", "info", "--max_samples_per_user", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INFO:User-level DP (user_dpsgd): n=8 users" in proc.stderr
    # dropping a large share of the rows is a warning (to the data owner's console only), not a silent loss
    assert "WARNING:Private, for the data owner only" in proc.stderr and "dropped 8 of 16 rows (50%)" in proc.stderr
    assert f"written to {tmp_path / 'out'}" in proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("options,reason", [({"use_peft": True}, "drop --use_peft"),
                                            ({"grad_sample_mode": "hooks"}, "needs --grad_sample_mode ghost"),
                                            ({}, "needs a process group")])
def test_shard_model_refuses_what_cannot_run_sharded_before_training(options, reason):
    """``--shard_model`` (FSDP2, full fine-tuning under torchrun: tests/trainers/test_distributed_trainers.py trains
    it): LoRA's adapters would stay unsharded, materialised per-user gradients fit no process, and one process has
    nothing to shard over; each is a one-line reason."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_userdp.scripts.utils import shard_for_training

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    model_args = SimpleNamespace(use_peft=options.get("use_peft", False))
    training_args = SimpleNamespace(grad_sample_mode=options.get("grad_sample_mode", "ghost"),
                                    device=torch.device("cpu"))
    with pytest.raises(ValueError, match=reason):
        shard_for_training(model, model_args, training_args)
