"""``trl-userdp rl``: online RL (GRPO, :class:`~trl_userdp.trainers.PublicPromptGRPOTrainer`) against a private reward
model, as TRL's ``trl/scripts/grpo.py``. Post-processing: the policy carries the reward model's (and a private
policy's) ε, no new one.

```bash
python -m trl_userdp.scripts.rl --dataset_name my_prompts.jsonl --model_name_or_path runs/my_dpo \
    --reward_model runs/my_reward --output_dir runs/my_rl
```
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, ClassVar, Dict, Optional, Tuple

import numpy as np
from trl import ModelConfig, ScriptArguments, get_peft_config

from .utils import check_model_kind, command_parser, finish_run, load_splits, run_script

#: the command's line in ``trl-userdp --help``
HELP = "Online RL (GRPO) on a private reward model: post-processing, no new ε."
#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/rl", "model_name_or_path": "runs/pipeline/sft"}

logger = logging.getLogger("trl_userdp.scripts.rl")  # not __name__: "__main__" under python -m


@dataclasses.dataclass
class RLArguments:
    """Online RL with GRPO on a private reward model saved by ``trl-userdp reward``."""

    #: listed with the privacy options, first in ``--help``
    privacy_options: ClassVar[Tuple[str, ...]] = ("reward_model",)

    reward_model: str = dataclasses.field(default="runs/reward", metadata={
        "help": "Directory with the reward model and privacy_report.json (the ε the policy carries)."})
    n_prompts: int = dataclasses.field(default=64, metadata={"help": "IMDb prompts (first 2-8 words of reviews), without --dataset_name."})


def _with_report(model, path: str):
    """``model`` carrying the privacy report saved in ``path``, if any: a model loaded from LoRA adapters has its
    base's path in its config, where the online trainers would look for the report in vain.

    Args:
        model: the loaded model.
        path: the folder it was loaded from.

    Returns:
        ``model``, with ``privacy_report`` set when ``path`` holds one.
    """
    from ..accountants import REPORT_FILENAME, PrivacyReport  # lazy: Opacus and torch

    if os.path.isfile(os.path.join(path, REPORT_FILENAME)):
        model.privacy_report = PrivacyReport.load(path)
    return model


def _load_policy(path: str, revision: Optional[str] = None):
    """The starting policy of ``rl``.

    Args:
        path: a saved model, or LoRA adapters (a ``dpo --use_peft`` output).
        revision: the model revision.

    Returns:
        ``(policy, its config, the folder of its tokenizer)``. The policy is ``path`` itself for a saved model (GRPO
        loads it), or a trainable :class:`~peft.PeftModel` on the adapters' base (the ``base_model/`` saved beside
        them, else the base they name), carrying the folder's privacy report, which its config's path (the base)
        would not lead to.

    Raises:
        ValueError: adapters that name no base model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path, AutoConfig.from_pretrained(path, revision=revision), path
    from peft import PeftConfig, PeftModel  # lazy: peft, for LoRA policies only

    base = os.path.abspath(os.path.join(path, "base_model"))  # absolute: the new adapters name it (see dpo._saved_base)
    if not os.path.isfile(os.path.join(base, "config.json")):
        base = PeftConfig.from_pretrained(path).base_model_name_or_path
        if base is None:
            raise ValueError(f"the LoRA adapters in {path!r} name no base model (base_model_name_or_path).")
    policy = _with_report(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path,
                                                    is_trainable=True), path)
    tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else base
    return policy, policy.config, tokenizer


def _positions(model_config, tokenizer=None) -> Optional[int]:
    """The longest input a model takes.

    Args:
        model_config: the model's config (its position embeddings).
        tokenizer: its tokenizer (``model_max_length``, e.g. 512 for RoBERTa's 514 positions), if any.

    Returns:
        The smallest limit they state, or None when neither says.
    """
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]  # tokenizers say 1e30: unset
    return min(limits) if limits else None


def _cap_completion_length(config, model_config, tokenizer, prompts) -> None:
    """Cap ``config.max_completion_length`` so that the longest prompt and its completion fit the policy's positions
    (generating past them crashes a model with learnt positions, and makes noise of rotary ones), with a warning.

    Args:
        config: the GRPO config, changed in place.
        model_config: the policy's config.
        tokenizer: the policy's tokenizer.
        prompts: the prompt dataset.

    Raises:
        ValueError: the longest prompt leaves no room for a completion.
    """
    from trl.data_utils import is_conversational  # lazy: loads transformers

    limit = _positions(model_config)
    if limit is None or config.max_completion_length is None or len(prompts) == 0:
        return
    texts = prompts["prompt"]
    if is_conversational({"prompt": texts[0]}):
        ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for p in texts]
    else:
        ids = tokenizer(text=list(texts))["input_ids"]  # as GRPOTrainer tokenizes them
    longest = max(len(i) for i in ids)
    room = limit - longest
    if room < 1:
        raise ValueError(f"the longest prompt has {longest} tokens, which leaves no room for a completion in the "
                         f"policy's {limit} positions: shorten the prompts.")
    if config.max_completion_length > room:
        logger.warning(
            f"max_completion_length {config.max_completion_length} -> {room}: the policy has {limit} positions and "
            f"the longest prompt {longest} tokens.")
        config.max_completion_length = room


def _truncate_reward_inputs(model, limit: int) -> None:
    """Make the reward model score the first ``limit`` tokens of a prompt and its completion: GRPO re-tokenizes the
    decoded text with the reward model's tokenizer, untruncated, which can exceed its positions whatever the policy
    generated (one policy token can be many reward tokens). Warns once when it truncates.

    Args:
        model: the reward model (a forward pre-hook is registered on it).
        limit: its positions.
    """
    said = []

    def truncate(module, args, kwargs):
        for key in ("input_ids", "attention_mask", "token_type_ids", "position_ids"):
            value = kwargs.get(key)
            if value is not None and value.shape[-1] > limit:
                kwargs[key] = value[..., :limit]
                if not said:
                    said.append(True)
                    logger.warning(
                        f"reward inputs truncated to the reward model's {limit} positions (prompt and completion "
                        f"had {value.shape[-1]} tokens).")
        return args, kwargs

    model.register_forward_pre_hook(truncate, with_kwargs=True)


def online_setup(script_args: ScriptArguments, training_args, model_args: ModelConfig, rl_args: RLArguments, *,
                 user_column: Optional[str] = None) -> Dict[str, Any]:
    """What ``rl`` and ``grpo`` hand their GRPO trainer: the prompts, the policy, the reward model with its report,
    their tokenizers and LoRA options, each model checked to be of its kind before any weight loads.

    Args:
        script_args: the prompts (a dataset with a ``prompt`` column; unset, IMDb review openings for ``rl``).
        training_args: the GRPO config (``max_completion_length`` is capped to the policy's positions).
        model_args: the policy (a saved model or LoRA adapters) and LoRA options.
        rl_args: the reward model's folder and the number of IMDb prompts.
        user_column: None: public prompts, a dataset with any other column is refused (``rl``); else the users'
            own prompts, which must carry this column (``grpo``).

    Returns:
        The trainer's keyword arguments.

    Raises:
        ValueError: a dataset without the split, a ``prompt`` column or the user column, or with a column the
            command does not take; prompts too long for the policy; ``--use_peft`` on a LoRA policy.
        OSError: a missing model folder.
    """
    # lazy: datasets, torch and transformers are heavy
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_model_kind(rl_args.reward_model, None, "reward", "--reward_model")  # before any data or weights load
    check_model_kind(model_args.model_name_or_path, model_args.model_revision, "causal-lm", "--model_name_or_path")
    if script_args.dataset_name is None:
        if user_column is not None:
            raise ValueError("grpo trains on the users' own prompts: pass --dataset_name, a file with a 'prompt' and "
                             f"a {user_column!r} column.")
        from ..data.imdb import load_imdb_reviews, snippet  # lazy: the packaged reviews load datasets

        texts, _ = load_imdb_reviews()
        rng = np.random.default_rng(training_args.seed)
        prompts = Dataset.from_dict({"prompt": [snippet(texts[i], int(rng.integers(2, 9)))
                                                for i in rng.permutation(len(texts))[: rl_args.n_prompts]]})
    else:
        prompts = load_splits(script_args)
        if script_args.dataset_train_split not in prompts:
            raise ValueError(f"dataset {script_args.dataset_name!r} has no split {script_args.dataset_train_split!r} "
                             f"(it has {sorted(prompts)}).")
        prompts = prompts[script_args.dataset_train_split]
        wanted = ["prompt"] if user_column is None else ["prompt", user_column]
        missing = [c for c in wanted if c not in prompts.column_names]
        if missing:
            raise ValueError(f"dataset {script_args.dataset_name!r} has no {missing[0]!r} column (it has "
                             f"{prompts.column_names}).")
        others = sorted(set(prompts.column_names) - set(wanted))
        if others and user_column is None:  # a user column: the users' own prompts, which `rl` does not privatise
            raise ValueError(f"dataset {script_args.dataset_name!r} has columns {others} besides 'prompt': `rl` trains "
                             "on public prompts (the policy carries the reward model's ε). On the users' own prompts "
                             "use `trl-userdp grpo` (user-level DP on them); or drop the columns if the prompts are "
                             "public.")
        if others:
            raise ValueError(f"dataset {script_args.dataset_name!r} has columns {others} besides {wanted}: GRPO hands "
                             "every column to the reward functions. Drop them.")
    # LoRA adapters (`reward --use_peft`) load on the base they name, with the report of their folder
    reward_model = _with_report(
        AutoModelForSequenceClassification.from_pretrained(rl_args.reward_model, num_labels=1), rl_args.reward_model)
    reward_tokenizer = AutoTokenizer.from_pretrained(rl_args.reward_model)
    reward_limit = _positions(reward_model.config, reward_tokenizer)
    if reward_limit is not None:
        _truncate_reward_inputs(reward_model, reward_limit)
    policy, policy_config, tokenizer_path = _load_policy(model_args.model_name_or_path, model_args.model_revision)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and not isinstance(policy, str):
        raise ValueError(f"{model_args.model_name_or_path!r} holds LoRA adapters, which are trained further: drop "
                         "--use_peft.")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    _cap_completion_length(training_args, policy_config, tokenizer, prompts)
    if training_args.dataloader_pin_memory and not torch.accelerator.is_available():
        training_args.dataloader_pin_memory = False  # pinning needs an accelerator: without one torch only warns
    return dict(model=policy, reward_funcs=reward_model, args=training_args, train_dataset=prompts,
                processing_class=tokenizer, reward_processing_classes=reward_tokenizer, peft_config=peft_config)


def main(script_args: ScriptArguments, training_args, model_args: ModelConfig, rl_args: RLArguments) -> int:
    """Run GRPO on public prompts against a private reward model, save the policy with the report it carries, print
    the report.

    Args:
        script_args: the prompts (a dataset with a ``prompt`` column only; unset, IMDb review openings).
        training_args: a :class:`~trl.GRPOConfig`.
        model_args: the policy (a saved model or LoRA adapters) and LoRA options.
        rl_args: the reward model's folder and the number of IMDb prompts.

    Returns:
        0.

    Raises:
        ValueError, OSError: as :func:`online_setup`.
    """
    from ..trainers import PublicPromptGRPOTrainer  # lazy: the trainers are heavy

    trainer = PublicPromptGRPOTrainer(**online_setup(script_args, training_args, model_args, rl_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return finish_run(trainer, trainer.carried_privacy_report())


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``rl``: TRL's ``ScriptArguments``, ``GRPOConfig`` and ``ModelConfig``, and :class:`RLArguments`.

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser, with :data:`DEFAULTS`.
    """
    from trl import GRPOConfig  # lazy: loads transformers

    return command_parser("rl", [ScriptArguments, GRPOConfig, ModelConfig, RLArguments], help=HELP,
                          subparsers=subparsers, prog=prog, defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(run_script("rl", make_parser, main, prog="python -m trl_userdp.scripts.rl"))
