"""``trl-userdp reward``: a user-level private reward model (:class:`~trl_userdp.trainers.UserDPRewardTrainer`), as
TRL's ``trl/scripts/reward.py`` with the privacy options.

```bash
python -m trl_userdp.scripts.reward --dataset_name my_prefs.jsonl --target_epsilon 3 --output_dir runs/my_reward
```
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from trl import ModelConfig, get_peft_config

from .utils import (SHARD_HELP, UserDataArguments, command_parser, finish_run, load_user_data, run_script,
                    shard_for_training)

#: the command's line in ``trl-userdp --help``
HELP = "Train a user-level private reward model (UserDPRewardTrainer)."

#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/reward", "model_name_or_path": "minilm", "lora_task_type": "SEQ_CLS"}


@dataclasses.dataclass
class RewardModelConfig(ModelConfig):
    """TRL's ``ModelConfig`` (``--use_peft``, ``--lora_r``, …) for the reward model (``minilm``: the packaged
    MiniLM-L6)."""

    train_all_layers: bool = dataclasses.field(
        default=False, metadata={"help": "Train the whole model, not only the last layer (the paper's choice)."})
    shard_model: bool = dataclasses.field(default=False, metadata={"help": SHARD_HELP})


def main(script_args: UserDataArguments, training_args, model_args: RewardModelConfig) -> int:
    """Train a user-level private reward model, save it with its privacy report and model card, print the report.

    Args:
        script_args: the private data (:class:`~trl_userdp.scripts.utils.UserDataArguments`).
        training_args: a :class:`~trl_userdp.trainers.UserDPRewardConfig`.
        model_args: the base model and LoRA options.

    Returns:
        0.

    Raises:
        ValueError: bad data or settings, or a model whose last layer cannot be found.
        ImportError: ``minilm`` without the ``examples`` extra.
    """
    from ..models import load_reward_model  # lazy: transformers and the trainers are heavy
    from ..trainers import UserDPRewardTrainer

    train, eval_dataset = load_user_data(script_args, training_args)
    model, tokenizer = load_reward_model(model_args.model_name_or_path, revision=model_args.model_revision,
                                         train_all_layers=model_args.train_all_layers or model_args.use_peft)
    if model_args.shard_model:
        model = shard_for_training(model, model_args, training_args)
    trainer = UserDPRewardTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=eval_dataset,
                                  processing_class=tokenizer, peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return finish_run(trainer, trainer.privacy_report())


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``reward``: the data, :class:`~trl_userdp.trainers.UserDPRewardConfig` and the model options.

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser, with :data:`DEFAULTS`.
    """
    from ..trainers import UserDPRewardConfig  # lazy: transformers' Trainer and TRL's trainers

    return command_parser("reward", [UserDataArguments, UserDPRewardConfig, RewardModelConfig], help=HELP,
                          subparsers=subparsers, prog=prog, defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(run_script("reward", make_parser, main, prog="python -m trl_userdp.scripts.reward"))
