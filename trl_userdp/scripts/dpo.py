"""``trl-userdp dpo``: a policy trained with user-level private DPO (:class:`~trl_userdp.trainers.UserDPDPOTrainer`),
as TRL's ``trl/scripts/dpo.py`` with the privacy options.

```bash
python -m trl_userdp.scripts.dpo --dataset_name my_prefs.jsonl --target_epsilon 3 --output_dir runs/my_dpo
```
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from typing import Optional

from trl import ModelConfig, get_peft_config

from .utils import (SHARD_HELP, UserDataArguments, check_model_kind, command_parser, finish_run, load_user_data,
                    run_script, shard_for_training)

#: the command's line in ``trl-userdp --help``
HELP = "Train a policy with user-level private DPO (UserDPDPOTrainer)."
#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/dpo", "model_name_or_path": "tiny"}
#: how the model card names the ``tiny`` base model (TRL's card links hub ids only)
TINY_CARD = ("trl_userdp's `tiny` Llama (`trl_userdp.small_causal_lm`), initialised at "
             "random, with a tokenizer trained on public text only")
#: a minimal chat template for the ``tiny`` model (public; its tokenizer has none)
TINY_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


@dataclasses.dataclass
class PolicyModelConfig(ModelConfig):
    """TRL's ``ModelConfig`` for the DPO policy (``tiny``: a small Llama with a tokenizer trained on public text)."""

    chat_template_path: Optional[str] = dataclasses.field(
        default=None, metadata={"help": "A Jinja chat template file (.jinja/.j2), or a tokenizer whose template to "
                                        "copy, for conversational data."})
    shard_model: bool = dataclasses.field(default=False, metadata={"help": SHARD_HELP})


def _saved_base(model, tokenizer, output_dir: str):
    """A model built in memory (``tiny``), saved and reloaded, so that its LoRA adapters name a base they can be
    reloaded on (``base_model_name_or_path``). Public: random weights and a tokenizer trained on public text.

    Args:
        model: the base model.
        tokenizer: its tokenizer.
        output_dir: the run's output directory; the base goes to ``output_dir/base_model``.

    Returns:
        The base model, loaded from its absolute path.
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers

    # absolute: PEFT stores the base's path as given (``base_model_name_or_path``) and loads it relative to the
    # reader's working directory, so a path relative to the training run's would not reload from anywhere else
    path = os.path.abspath(os.path.join(output_dir, "base_model"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


def main(script_args: UserDataArguments, training_args, model_args: PolicyModelConfig) -> int:
    """Train a policy with user-level private DPO, save it with its privacy report and model card, print the report.

    Args:
        script_args: the private data (:class:`~trl_userdp.scripts.utils.UserDataArguments`).
        training_args: a :class:`~trl_userdp.trainers.UserDPDPOConfig`.
        model_args: the policy (``tiny`` or a path), LoRA and chat-template options.

    Returns:
        0.

    Raises:
        ValueError: bad data or settings, or conversational data for a tokenizer without a chat template.
    """
    # lazy: transformers and the trainers are heavy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.data_utils import is_conversational

    from ..trainers import UserDPDPOTrainer

    tiny = model_args.model_name_or_path in ("tiny", "minilm")
    if not tiny:  # before any data or weights load
        check_model_kind(model_args.model_name_or_path, model_args.model_revision, "causal-lm", "--model_name_or_path")
    train, eval_dataset = load_user_data(script_args, training_args, for_dpo=True)
    if tiny:
        from ..models import small_causal_lm

        # the tokenizer is saved beside the model and no report covers it: trained on public text, not the users'
        model, tokenizer = small_causal_lm(seed=training_args.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    template = model_args.chat_template_path
    if template is not None:
        if os.path.isfile(template) and template.endswith((".jinja", ".j2")):
            with open(template, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        else:
            from trl import clone_chat_template  # lazy: loads transformers

            model, tokenizer, _ = clone_chat_template(model, tokenizer, template)
    elif is_conversational(train[0]) and tokenizer.chat_template is None:
        if not tiny:
            raise ValueError(f"the dataset is conversational but {model_args.model_name_or_path}'s tokenizer has no "
                             "chat template: pass --chat_template_path.")
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    peft_config = get_peft_config(model_args)
    if tiny and peft_config is not None:
        model = _saved_base(model, tokenizer, training_args.output_dir)
    reference = None if peft_config is not None else copy.deepcopy(model)
    if model_args.shard_model:  # the reference stays whole on each process (it is not trained)
        model = shard_for_training(model, model_args, training_args)
    trainer = UserDPDPOTrainer(model=model, ref_model=reference, args=training_args, train_dataset=train,
                               eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config)
    if tiny:
        trainer.base_model_description = TINY_CARD
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return finish_run(trainer, trainer.privacy_report())


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``dpo``: the data, :class:`~trl_userdp.trainers.UserDPDPOConfig` and the policy options.

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser, with :data:`DEFAULTS`.
    """
    from ..trainers import UserDPDPOConfig  # lazy: transformers' Trainer and TRL's trainers

    return command_parser("dpo", [UserDataArguments, UserDPDPOConfig, PolicyModelConfig], help=HELP,
                          subparsers=subparsers, prog=prog, defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(run_script("dpo", make_parser, main, prog="python -m trl_userdp.scripts.dpo"))
