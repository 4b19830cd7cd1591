"""``trl-userdp grpo``: GRPO on the users' own prompts (:class:`~trl_userdp.trainers.UserDPGRPOTrainer`), as TRL's
``trl/scripts/grpo.py`` with the privacy options: user-level DP for the prompts, the privacy unit the user of the
prompt file's user column; the policy's report composes that ε with the reward model's (and a private starting
policy's). On public prompts, ``trl-userdp rl`` spends no new ε.

```bash
python -m trl_userdp.scripts.grpo --dataset_name users_prompts.jsonl --model_name_or_path runs/my_dpo \
    --reward_model runs/my_reward --target_epsilon 3 --output_dir runs/my_grpo
```
"""

from __future__ import annotations

import argparse
from typing import Optional

from trl import ModelConfig, ScriptArguments

from .rl import RLArguments, online_setup
from .utils import command_parser, finish_run, run_script

#: the command's line in ``trl-userdp --help``
HELP = "GRPO on the users' own prompts with user-level DP (UserDPGRPOTrainer); composes the reward model's ε."
#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/grpo", "model_name_or_path": "runs/pipeline/sft"}


def main(script_args: ScriptArguments, training_args, model_args: ModelConfig, rl_args: RLArguments) -> int:
    """Run user-level private GRPO on the users' prompts, save the policy with its report and card, print the report.

    Args:
        script_args: the users' prompts (a dataset with a ``prompt`` and the user column).
        training_args: a :class:`~trl_userdp.trainers.UserDPGRPOConfig`.
        model_args: the policy (a saved model or LoRA adapters) and LoRA options.
        rl_args: the reward model's folder.

    Returns:
        0.

    Raises:
        ValueError, OSError: as :func:`~trl_userdp.scripts.rl.online_setup`, and the trainer's refusals.
    """
    from ..trainers import UserDPGRPOTrainer  # lazy: the trainers are heavy

    trainer = UserDPGRPOTrainer(**online_setup(script_args, training_args, model_args, rl_args,
                                               user_column=training_args.user_column))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return finish_run(trainer, trainer.privacy_report())


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``grpo``: TRL's ``ScriptArguments`` and ``ModelConfig``,
    :class:`~trl_userdp.trainers.UserDPGRPOConfig` and :class:`~trl_userdp.scripts.rl.RLArguments`.

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser, with :data:`DEFAULTS`.
    """
    from ..trainers import UserDPGRPOConfig  # lazy: transformers' Trainer and TRL's trainers

    return command_parser("grpo", [ScriptArguments, UserDPGRPOConfig, ModelConfig, RLArguments], help=HELP,
                          subparsers=subparsers, prog=prog, defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(run_script("grpo", make_parser, main, prog="python -m trl_userdp.scripts.grpo"))
