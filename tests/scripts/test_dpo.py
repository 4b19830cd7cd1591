"""``trl-userdp dpo``: the public `tiny` policy, YAML configs and resuming, LoRA, conversational rows, and extending
a finished run."""

import json

import pytest
import torch

from trl_userdp import PrivacyReport
from trl_userdp.cli import main

from .helpers import pairs, write_jsonl

#: the runs' accountant where accounting is not what is tested: RDP calibrates in a second, PLD in about ten
RDP = ["--accountant", "rdp"]


def test_the_tiny_models_tokenizer_is_built_from_public_text_only(tmp_path):
    """Every file saved beside a private model is covered by its report or built from public data: `dpo --model_name_or_path
    tiny` used to train its tokenizer on the private texts and save it, so one user's words showed in the vocabulary
    (issue 17). It is now the public corpus's tokenizer, whatever the users wrote."""
    from trl_userdp import small_causal_lm

    secret = "zqxvjsecretword"
    rows = [{"prompt": "Review:", "chosen": f" good {secret if u == 7 else 'film'} fine", "rejected": " bad movie",
             "user_id": u} for u in range(8) for _ in range(2)]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    assert main(["dpo", "--dataset", str(path), "--model_name_or_path", "tiny", "--output_dir", str(out),
                 "--max_steps", "1", "--per_device_train_batch_size", "4", *RDP]) == 0
    saved = (out / "tokenizer.json").read_text()
    _, public = small_causal_lm()
    public.save_pretrained(tmp_path / "public")
    assert saved == (tmp_path / "public" / "tokenizer.json").read_text()
    assert secret[:6] not in saved and PrivacyReport.load(str(out)).epsilon <= 8.0


@pytest.mark.end_to_end
def test_a_yaml_output_dir_and_resume_from_checkpoint_are_honoured(tmp_path, capsys):
    """Both used to be overridden or ignored (issue 17): the injected --output_dir beat the YAML's, and
    --resume_from_checkpoint never reached trainer.train(). A resumed run continues the checkpoint's steps and ε (the
    same weights as the uninterrupted run: noise and sampling are keyed by step); a checkpoint without its privacy
    state is refused."""
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(range(8)))
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'from_yaml'}\nmax_steps: 4\nsave_steps: 2\n"
                      "per_device_train_batch_size: 4\nprivacy_seed: 11\naccountant: rdp\n")
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


def test_lora_flags_reach_the_adapter_and_the_tiny_base_is_saved_for_reloading(tmp_path):
    """TRL's ModelConfig flags pass through (`--lora_r 8` used to be rejected, LoRA was fixed at r = 16), and the tiny
    model's adapters name a saved base (they used to say `base_model_name_or_path: None`)."""
    from peft import AutoPeftModelForCausalLM

    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(range(8)))
    out = tmp_path / "out"
    assert main(["dpo", "--dataset_name", str(data), "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
                 "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "4", *RDP]) == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16
    assert adapter["base_model_name_or_path"] == str(out / "base_model")
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    assert reloaded.peft_config["default"].r == 8


def test_a_conversational_dpo_dataset_trains(tmp_path, recwarn):
    """Conversational rows (lists of messages) used to end in a traceback; the tiny model gets a public template, any
    other tokenizer without one is asked for --chat_template_path. No Python warning reaches the user (issue 44, item
    6: transformers' FutureWarning for TRL's call of `is_gradient_checkpointing` did)."""
    data = write_jsonl(tmp_path / "chat.jsonl", pairs(range(8), conversational=True))
    out = tmp_path / "out"
    assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "1",
                 "--per_device_train_batch_size", "4", *RDP]) == 0
    assert PrivacyReport.load(str(out)).steps_taken == 1
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "t"), "--max_steps", "1",
                 "--per_device_train_batch_size", "4", "--chat_template_path", str(template), *RDP]) == 0
    saved = "".join(f.read_text() for f in (tmp_path / "t").iterdir() if f.name.startswith(("tokenizer", "chat")))
    assert "<assistant>" in saved  # the template travels with the saved tokenizer
    assert not [str(w.message) for w in recwarn], [str(w.message) for w in recwarn]


@pytest.mark.end_to_end
def test_extending_a_finished_run_is_refused_with_how_to_continue_and_that_works(tmp_path, capsys):
    """A longer plan recalibrates σ, so its resume is refused; the message used to say only that the state "belongs
    to another run or was edited" (issue 25, item 6). Following it (the saved σ, a larger budget) continues the run."""
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(range(8)))
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
