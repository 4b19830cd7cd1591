"""Online RL on a user-level private reward model (the PPO stage of AUP-RLHF; TRL ≥ 1.13 ships GRPO
and RLOO): `PublicPromptGRPOTrainer` accepts the reward model only with its privacy report, never sees the
preference labels, and saves the carried-over report with the policy (post-processing: no new ε).

    python examples/reward_modeling.py            # first: a private reward model in runs/reward
    python examples/online_rl.py                  # ~1 min on CPU
    python examples/online_rl.py --policy_model meta-llama/Llama-2-7b-hf --use_peft   # GPU
"""

import dataclasses
import os
import sys

import numpy as np
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOConfig, TrlParser

from trl_userdp import small_causal_lm
from trl_userdp.data.imdb import load_imdb_reviews
from trl_userdp.trainers import PublicPromptGRPOTrainer

DEFAULTS = ["--output_dir", "runs/online_rl", "--max_steps", "10", "--per_device_train_batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "16", "--learning_rate", "1e-4", "--beta", "0.0",
            "--logging_steps", "5", "--report_to", "none", "--bf16", "false", "--save_strategy", "no"]


@dataclasses.dataclass
class ScriptArguments:
    reward_model: str = dataclasses.field(default="runs/reward", metadata={"help": "Saved by reward_modeling.py."})
    policy_model: str = dataclasses.field(default="small", metadata={"help": "'small' or a causal LM hub id/path."})
    n_prompts: int = dataclasses.field(default=64, metadata={"help": "IMDb prompts: the first 2-8 words of reviews."})
    use_peft: bool = dataclasses.field(default=False, metadata={"help": "Train LoRA adapters."})


def main(argv=None):
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)
    script_args, training_args = TrlParser((ScriptArguments, GRPOConfig)).parse_args_and_config(args=argv)
    texts, _ = load_imdb_reviews()
    rng = np.random.default_rng(training_args.seed)
    prompts = [" ".join(texts[i].split()[: rng.integers(2, 9)]) for i in rng.permutation(len(texts))[: script_args.n_prompts]]
    policy = script_args.policy_model
    if policy == "small":  # a small Llama saved to disk, so GRPO can also load its reference copy
        model, tokenizer = small_causal_lm(seed=training_args.seed)
        policy = os.path.join(training_args.output_dir, "initial_policy")
        model.save_pretrained(policy)
        tokenizer.save_pretrained(policy)

    reward_model = AutoModelForSequenceClassification.from_pretrained(script_args.reward_model, num_labels=1)
    trainer = PublicPromptGRPOTrainer(
        model=policy, reward_funcs=reward_model, args=training_args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(policy),
        reward_processing_classes=AutoTokenizer.from_pretrained(script_args.reward_model),
        peft_config=LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM") if script_args.use_peft else None,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    report = trainer.carried_privacy_report()
    print(f"policy saved to {training_args.output_dir}; it inherits ε = {report.epsilon:.3f} at δ = {report.delta:g} "
          "per user from its reward model (post-processing)")
    return trainer


if __name__ == "__main__":
    main()
