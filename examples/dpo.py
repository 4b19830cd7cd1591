"""User-level private DPO: the TRL DPO script with `UserDPDPOTrainer`, full fine-tuning or LoRA.

The policy is a small Llama (built from a config, BPE tokenizer trained on the IMDb snippets) unless
`--model_name_or_path` names a real causal LM; the pairs are the embedded IMDb pairs after the prompt
"Review:". TRL 1.16's fused LM head is replaced under DP (it would drop the head's per-sample gradient).

    python examples/dpo.py                       # full fine-tuning, ~1 min on CPU
    python examples/dpo.py --use_peft            # LoRA (r = 16, α = 32)
    python examples/dpo.py --model_name_or_path google/gemma-2-2b --use_peft --per_device_train_batch_size 4  # GPU
"""

import copy
import dataclasses
import sys

from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

from trl_userdp import UserDPDPOConfig, UserDPDPOTrainer
from trl_userdp import small_causal_lm
from trl_userdp.experiments.pipeline import imdb_preference_dataset

DEFAULTS = ["--output_dir", "runs/dpo", "--max_steps", "20", "--per_device_train_batch_size", "8",
            "--learning_rate", "1e-3", "--logging_steps", "5", "--report_to", "none", "--bf16", "false",
            "--max_length", "64", "--save_strategy", "no", "--beta", "0.1"]


@dataclasses.dataclass
class ScriptArguments:
    model_name_or_path: str = dataclasses.field(default="small", metadata={"help": "'small' or a causal LM hub id/path."})
    n_users: int = dataclasses.field(default=100, metadata={"help": "Simulated IMDb users."})
    pairs_per_user: int = dataclasses.field(default=10, metadata={"help": "Pairs each user labels."})
    use_peft: bool = dataclasses.field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})


def main(argv=None):
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)
    script_args, training_args = TrlParser((ScriptArguments, UserDPDPOConfig)).parse_args_and_config(args=argv)
    dataset = imdb_preference_dataset(script_args.n_users, script_args.pairs_per_user, prompt="Review:",
                                      user_column=training_args.user_column, seed=training_args.seed)
    if script_args.model_name_or_path == "small":
        # its tokenizer is saved beside the model and no report covers it: trained on public text, not the users'
        model, tokenizer = small_causal_lm(seed=training_args.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    peft_config = (LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
                   if script_args.use_peft else None)
    ref_model = None if peft_config else copy.deepcopy(model)  # with LoRA the reference is the base model

    trainer = UserDPDPOTrainer(model=model, ref_model=ref_model, args=training_args, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    report = trainer.privacy_report()
    print(f"saved to {training_args.output_dir}: ε = {report.epsilon:.3f} at δ = {report.delta:g} per user "
          f"({'LoRA' if peft_config else 'full fine-tuning'}, {report.steps_taken} steps)")
    return trainer


if __name__ == "__main__":
    main()
