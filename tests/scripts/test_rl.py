"""``trl-userdp rl`` (public prompts) and ``grpo`` (the users' own prompts): any prompts file and policy path, and
reward inputs within the reward model's positions."""

import json

import pytest
import torch

from trl_userdp import PrivacyReport
from trl_userdp.cli import main
from trl_userdp.scripts.rl import _positions, _truncate_reward_inputs

from ..tiny_models import tiny_gpt2_rm, tiny_llama_lm, tiny_llama_rm, tiny_tokenizer


@pytest.mark.end_to_end
def test_rl_runs_on_the_users_own_prompts_with_a_policy_by_path(tmp_path, capsys, recwarn):
    """`rl` used to work only after the pipeline ran in the same folder, on IMDb prompts: now any dataset with a
    `prompt` column and any policy path; the policy carries the reward model's ε (post-processing)."""
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
    # issue 44, item 3: a prompts file with a user column (the users' own prompts) was refused with a pointer to
    # `public_columns`, a trainer argument the command line does not have: one line naming the trainer that trains on them
    own = tmp_path / "own_prompts.jsonl"
    own.write_text("\n".join(json.dumps({"prompt": "the movie was", "user_id": f"u{i}"}) for i in range(4)) + "\n")
    capsys.readouterr()
    assert main(["rl", "--dataset_name", str(own), "--model_name_or_path", str(policy), "--reward_model",
                 str(tmp_path / "reward"), "--output_dir", str(tmp_path / "own")]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # datasets' bar aside
    assert err.startswith("trl-userdp: error: ") and "columns ['user_id'] besides 'prompt'" in err
    assert "use `trl-userdp grpo`" in err
    # ... which trains the policy on them with user-level DP: the prompts' ε composed with the reward model's
    assert main(["grpo", "--dataset_name", str(own), "--model_name_or_path", str(policy), "--reward_model",
                 str(tmp_path / "reward"), "--output_dir", str(tmp_path / "own"), "--max_steps", "2",
                 "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
                 "--max_samples_per_user", "1", "--users_per_batch", "2", "--target_epsilon", "3"]) == 0
    composed = PrivacyReport.load(str(tmp_path / "own"))
    prompts_report = PrivacyReport.from_dict(composed.extra["prompts_report"])
    assert prompts_report.n_users == 4 and prompts_report.steps_taken == 2 and prompts_report.epsilon <= 3.0
    assert composed.epsilon == pytest.approx(prompts_report.epsilon + original.epsilon, rel=1e-9)
    assert composed.noise_multiplier > 0
    assert main(["grpo", "--dataset_name", str(prompts), "--model_name_or_path", str(policy), "--reward_model",
                 str(tmp_path / "reward"), "--output_dir", str(tmp_path / "none")]) == 2  # no user column: one line
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "has no 'user_id' column" in err
    # issue 44, item 6: rl printed pin_memory's warning on a CPU and eight FutureWarnings of TRL's calls to
    # transformers' renamed gradient-checkpointing API (grpo two): nothing the user wrote
    assert not [str(w.message) for w in recwarn], [str(w.message) for w in recwarn]


def test_reward_inputs_beyond_the_reward_models_positions_are_truncated():
    """GRPO re-tokenizes prompt + completion with the reward model's tokenizer, untruncated: past a reward model's
    learnt positions that was a size-mismatch RuntimeError. The reward is now that of the first positions."""
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
