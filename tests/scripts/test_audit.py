"""``trl-userdp audit`` on a model the user trained (plant the canaries, train elsewhere, audit the saved model) and
the config file it is given (issue 44, item 4)."""

import json

import pytest

from trl_userdp.cli import main
from trl_userdp.scripts import audit


@pytest.fixture(scope="module")
def tiny_reward_base(tmp_path_factory):
    """The audit's own `tiny` Llama reward model with its public tokenizer, saved as a base `reward` can start from."""
    base = tmp_path_factory.mktemp("base")
    model, tokenizer = audit._small_reward_model(seed=0)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


@pytest.mark.end_to_end
def test_a_reward_model_trained_elsewhere_is_audited_from_its_folder(tiny_reward_base, tmp_path, capsys):
    """Step 1 writes the data with the canary users drawn in and keeps the draw in the auditor's folder; the user
    trains with `trl-userdp reward` (any trainer would do); step 2 scores the saved model. A non-private model gives
    its canary users away (ε_lower > 0 against ε claimed ∞, read from the model's report); the model's folder never
    holds the draw."""
    from trl_userdp.audit import AuditReport, PreferenceCanaries

    auditor, data = tmp_path / "auditor", tmp_path / "data" / "with_canaries.jsonl"
    assert main(["audit", "--n_users", "20", "--canaries", "60", "--audit_seed", "0", "--plant_into", str(data),
                 "--canary_tokenizer", str(tiny_reward_base), "--output_dir", str(auditor)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "keep it secret from whoever holds the model" in lines[-1] and str(auditor) in lines[-1]
    canaries = PreferenceCanaries.load(str(auditor))
    users = [json.loads(line)["user_id"] for line in data.read_text().splitlines()]
    real, planted = set(users[:80]), set(users[80:])  # the real users' pairs, then 4 per canary drawn in
    assert len(real) == 20 and planted == {max(real) + 1 + c for c in range(60) if canaries.draw.included[c]}
    assert len(users) == 80 + 4 * len(planted)  # the embedded users are integers: the canaries follow them

    model = tmp_path / "runs" / "rm"
    assert main(["reward", "--dataset_name", str(data), "--model_name_or_path", str(tiny_reward_base),
                 "--train_all_layers", "true", "--privacy_mechanism", "none", "--max_steps", "60",
                 "--learning_rate", "3e-2", "--per_device_train_batch_size", "16", "--max_samples_per_user", "4",
                 "--output_dir", str(model), "--save_strategy", "no", "--report_to", "none"]) == 0
    assert not (model / "canary_draw.json").exists()
    capsys.readouterr()
    assert main(["audit", "--audited_model", str(model), "--output_dir", str(auditor)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("ε claimed ∞, audited lower bound") and str(auditor) in lines[-1]
    report = AuditReport.load(str(auditor))
    assert report.epsilon_lower > 0 and report.canaries == 60 and report.settings["model"] == str(model)
    assert report.settings["trainer"] == "reward (trained elsewhere)" and (auditor / "scores.png").exists()


@pytest.mark.parametrize("args,needle", [
    (["--audited_model", "{model}"], "holds no canaries"),
    (["--audited_model", "{empty}"], "holds no privacy_report.json"),
    (["--audited_model", "{model}", "--plant_into", "x.jsonl"], "one at a time"),
    (["--audited_model", "{model}", "--trainer", "dpo"], "a DPO policy's margins need its reference model"),
])
def test_a_wrong_step_of_the_two_step_audit_is_one_line(args, needle, tiny_reward_base, tmp_path, capsys):
    from trl_userdp.accountants import PrivacyReport

    model, empty = tmp_path / "model", tmp_path / "empty"
    empty.mkdir()
    model.mkdir()
    PrivacyReport(mechanism="none", n_users=2, max_samples_per_user=None, sample_rate=None, noise_multiplier=None,
                  steps=None, steps_taken=1, accountant="none", epsilon=float("inf"), delta=0.0).save(str(model))
    for name in ("config.json",):
        (model / name).write_text((tiny_reward_base / name).read_text())
    args = [a.format(model=model, empty=empty) for a in args]
    assert main(["audit", *args, "--output_dir", str(tmp_path / "auditor")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("given,steps,epochs", [
    ({}, 150, 3.0),  # the audit's default step count
    ({"num_train_epochs": 2}, -1, 2.0),  # the YAML's epochs (they were ignored: max_steps=150 won)
    ({"num_train_epochs": 2, "max_steps": 7}, 7, 2.0),  # both given: transformers' rule, max_steps wins
])
def test_the_config_files_epochs_replace_the_default_step_count(given, steps, epochs, tmp_path):
    config = tmp_path / "audit.yaml"
    config.write_text("".join(f"{key}: {value}\n" for key, value in {"learning_rate": 0.01, **given}.items()))
    _, training_args, _ = audit.make_parser().parse_args_and_config(["--config", str(config)])
    assert (training_args.max_steps, training_args.num_train_epochs, training_args.learning_rate) == (steps, epochs, 0.01)
    _, flagged, _ = audit.make_parser().parse_args_and_config(["--num_train_epochs", "4"])
    assert (flagged.max_steps, flagged.num_train_epochs) == (-1, 4.0)
