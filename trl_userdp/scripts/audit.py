"""``trl-userdp audit``: audit a private run in one training run (docs/audit.md). ``--auditor blackbox`` trains a
reward model (:class:`~trl_userdp.trainers.UserDPRewardTrainer`, the reward command's privacy options) or, with
``--trainer dpo``, a DPO policy (:class:`~trl_userdp.trainers.UserDPDPOTrainer`) on the data plus canary users drawn
in by a secret coin, and bounds ε from the model's margins on their pairs; ``--auditor whitebox`` trains gradient
canary users through the engine with the same privacy options. A reward model trained elsewhere is audited in two
steps: ``--plant_into`` writes the data with the canary users drawn in (no training), ``--audited_model`` scores the
model trained on it.

```bash
python -m trl_userdp.scripts.audit --privacy_mechanism user_dpsgd --target_epsilon 8 --output_dir runs/audit
```
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Optional

from ..validators import check_confidence
from .utils import UserDataArguments, command_parser, load_user_data, run_script

#: the command's line in ``trl-userdp --help``
HELP = "Audit a run in one training run: canary users, and a lower bound on its ε (docs/audit.md)."
#: parser defaults (a --config YAML and the command line win over them)
DEFAULTS = {"output_dir": "runs/audit", "n_users": 100, "pairs_per_user": 4, "max_samples_per_user": 4,
            "per_device_train_batch_size": 16, "learning_rate": 3e-2, "max_steps": 150, "logging_steps": 50,
            "save_strategy": "no", "report_to": [], "use_cpu": True}
AUDITORS = ("blackbox", "whitebox")
TRAINERS = ("reward", "dpo")
#: the prompt of the DPO canary pairs (the embedded pairs' prompt)
DPO_CANARY_PROMPT = "Review:"
#: what the output says of the canary draw
SECRET = ("keep it secret from whoever holds the model (who knows which canaries were trained on can fake or "
          "void the audit)")


@dataclasses.dataclass
class AuditArguments:
    """The audit's own options."""

    auditor: str = dataclasses.field(default="blackbox", metadata={
        "help": "blackbox: a reward model trained on the data and the canary users, scored by its margins; "
                "whitebox: gradient canary users through the engine (the path's options: --grad_sample_mode …).",
        "choices": list(AUDITORS)})
    trainer: str = dataclasses.field(default="reward", metadata={
        "help": "blackbox: the model audited, a reward model (UserDPRewardTrainer) or a DPO policy (UserDPDPOTrainer, "
                "scored by its implicit reward margin against its reference).", "choices": list(TRAINERS)})
    beta: float = dataclasses.field(default=0.1, metadata={"help": "--trainer dpo: DPO's β."})
    canaries: int = dataclasses.field(default=200, metadata={"help": "Canary users m (each in with probability ½)."})
    canary_pairs: int = dataclasses.field(default=4, metadata={"help": "blackbox: records of each canary user."})
    canary_tokens: int = dataclasses.field(default=1, metadata={"help": "blackbox: tokens of each canary string."})
    whitebox_steps: int = dataclasses.field(default=10, metadata={"help": "whitebox: private steps."})
    audit_seed: Optional[int] = dataclasses.field(default=None, metadata={
        "help": "Seeds the canary draw (default: the OS; the draw is saved as canary_draw.json, a secret)."})
    plant_into: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "Audit a reward model you train, step 1: write the data (--dataset_name) with the canary users drawn "
                "in to this .jsonl file, to train on, and the canaries with their secret draw to --output_dir; no "
                "training."})
    canary_tokenizer: str = dataclasses.field(default="minilm", metadata={
        "help": "--plant_into: the tokenizer of the model you will train (a folder or hub id; minilm: reward's "
                "default); the canary strings are tokens of its vocabulary."})
    audited_model: Optional[str] = dataclasses.field(default=None, metadata={
        "help": "Step 2: the reward model trained on the --plant_into file (a folder with privacy_report.json): its "
                "canaries (from --output_dir) are scored and its ε bounded; no training."})
    confidence: float = dataclasses.field(default=0.95, metadata={"help": "Confidence of the lower bound, in (0, 1)."})

    def __post_init__(self):
        check_confidence(self.confidence, "--confidence")  # before any training
        if self.plant_into is not None and self.audited_model is not None:
            raise ValueError("--plant_into writes the data to train on, --audited_model audits the trained model: one "
                             "at a time.")
        if (self.plant_into is not None or self.audited_model is not None) and (
                self.auditor != "blackbox" or self.trainer != "reward"):
            raise ValueError("--plant_into and --audited_model audit reward models by their margins (--auditor "
                             "blackbox --trainer reward); a DPO policy's margins need its reference model: audit it "
                             "with --trainer dpo, which trains one.")


def _small_reward_model(seed: int):
    """The ``tiny`` Llama of ``dpo`` as a one-output sequence classifier, with its public tokenizer."""
    from transformers import LlamaForSequenceClassification

    from ..models import small_causal_lm

    policy, tokenizer = small_causal_lm(seed=seed)
    config = policy.config
    config.num_labels = 1
    return LlamaForSequenceClassification(config), tokenizer


def _dpo_config(training_args):
    """The DPO config of an audit: the reward config's options (privacy, optimisation, output) that DPO shares."""
    from ..trainers import UserDPDPOConfig  # lazy: transformers' Trainer and TRL's trainers

    fields = {f.name for f in dataclasses.fields(UserDPDPOConfig) if f.init}
    return UserDPDPOConfig(**{f.name: getattr(training_args, f.name) for f in dataclasses.fields(training_args)
                              if f.init and f.name in fields})


def _blackbox(script_args: UserDataArguments, training_args, audit_args: AuditArguments):
    """Train the reward model or DPO policy on the data and the included canary users, and audit it.

    Returns:
        ``(report, draw)``.
    """
    import copy

    from ..audit import PreferenceCanaries
    from ..audit.fdp import audits_curve

    dpo = audit_args.trainer == "dpo"
    train, _ = load_user_data(script_args, training_args, for_dpo=dpo)
    if dpo and not isinstance(train[0].get("prompt"), str):
        raise ValueError("--trainer dpo audits datasets whose prompts are strings (the canary pairs are written as "
                         "text); this dataset's are not.")
    if dpo:
        from ..models import small_causal_lm
        from ..trainers import UserDPDPOTrainer

        training_args = _dpo_config(training_args)
        training_args.beta = audit_args.beta
        model, tokenizer = small_causal_lm(seed=training_args.seed)
        reference = copy.deepcopy(model).eval()
    else:
        from ..trainers import UserDPRewardTrainer

        model, tokenizer = _small_reward_model(training_args.seed)
        reference = None
    canaries = PreferenceCanaries.make(tokenizer, audit_args.canaries, tokens=audit_args.canary_tokens,
                                       pairs_per_user=audit_args.canary_pairs, seed=audit_args.audit_seed,
                                       prompt=DPO_CANARY_PROMPT if dpo else "")
    data = canaries.add_to(train, training_args.user_column)
    trainer = UserDPDPOTrainer(model=model, ref_model=reference, args=training_args, train_dataset=data,
                               processing_class=tokenizer) if dpo else \
        UserDPRewardTrainer(model=model, args=training_args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    engine = getattr(trainer, "privacy_engine", None)
    report = canaries.audit(trainer.model, tokenizer, delta=training_args.target_delta,
                            epsilon_claimed=trainer.privacy_report().epsilon, reference=reference,
                            confidence=audit_args.confidence,
                            accountant=engine.accountant if engine is not None and audits_curve(engine.mechanism)
                            else None,
                            settings={"mechanism": training_args.privacy_mechanism, "trainer": audit_args.trainer,
                                      "steps": trainer.state.global_step,
                                      "real_users": len(set(train[training_args.user_column]))})
    return report, canaries.draw


def _plant(script_args: UserDataArguments, training_args, audit_args: AuditArguments) -> int:
    """Step 1 of auditing a reward model trained elsewhere: write the data with the canary users drawn in, and the
    canaries with their draw to the auditor's folder.

    Returns:
        0.
    """
    from transformers import AutoTokenizer  # lazy: transformers

    from ..audit import PreferenceCanaries
    from ..models import resolve_model_path

    train, _ = load_user_data(script_args, training_args)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(audit_args.canary_tokenizer))
    canaries = PreferenceCanaries.make(tokenizer, audit_args.canaries, tokens=audit_args.canary_tokens,
                                       pairs_per_user=audit_args.canary_pairs, seed=audit_args.audit_seed)
    data = canaries.add_to(train, training_args.user_column)
    os.makedirs(os.path.dirname(os.path.abspath(audit_args.plant_into)), exist_ok=True)
    data.to_json(audit_args.plant_into)
    canaries.save(training_args.output_dir)
    print(f"trl-userdp: {audit_args.plant_into} holds the data and {int(canaries.draw.included.sum())} of "
          f"{canaries.draw.m} canary users: train your reward model on it (any trainer of this package, or "
          "`trl-userdp reward`), then run `trl-userdp audit --audited_model <its folder> --output_dir "
          f"{training_args.output_dir}`")
    print(f"trl-userdp: the canaries and their draw written to {training_args.output_dir}: {SECRET}")
    return 0


def _audit_saved(training_args, audit_args: AuditArguments):
    """Step 2: score the planted canaries on the reward model saved in ``--audited_model`` and bound its ε.

    Returns:
        The :class:`~trl_userdp.audit.AuditReport`.

    Raises:
        ValueError: the folder is not a reward model with its privacy report, or the auditor's folder holds no
            canaries.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer  # lazy: transformers

    from ..accountants import REPORT_FILENAME, PrivacyReport
    from ..audit import PreferenceCanaries
    from .utils import check_model_kind

    path = audit_args.audited_model
    if not os.path.isfile(os.path.join(path, REPORT_FILENAME)):
        raise ValueError(f"--audited_model {path!r} holds no {REPORT_FILENAME}: pass the folder a trainer of this "
                         "package saved the reward model to.")
    check_model_kind(path, None, "reward", "--audited_model")
    canaries = PreferenceCanaries.load(training_args.output_dir)
    claimed = PrivacyReport.load(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return canaries.audit(model, AutoTokenizer.from_pretrained(path), delta=claimed.delta,
                          epsilon_claimed=claimed.epsilon, confidence=audit_args.confidence,
                          settings={"mechanism": claimed.mechanism, "trainer": "reward (trained elsewhere)",
                                    "model": os.path.abspath(path), "steps": claimed.steps_taken,
                                    "users": claimed.n_users})


def main(script_args: UserDataArguments, training_args, audit_args: AuditArguments) -> int:
    """Run the audit, write ``audit_report.json``, ``canary_draw.json`` and ``scores.png``, print what it found and
    where the secret draw is; or, with ``--plant_into``, write the data to train on and the canaries.

    Args:
        script_args: the real users' data (:class:`~trl_userdp.scripts.utils.UserDataArguments`; the embedded IMDb
            pairs by default).
        training_args: a :class:`~trl_userdp.trainers.UserDPRewardConfig` (the run under audit; its shared options
            make the :class:`~trl_userdp.trainers.UserDPDPOConfig` of ``--trainer dpo``).
        audit_args: the audit's options.

    Returns:
        0.

    Raises:
        ValueError: bad options or data.
    """
    from ..audit import audit_gradient_canaries  # lazy: the engines and transformers
    from ..mechanisms import get_mechanism

    out = training_args.output_dir
    delta = training_args.target_delta
    if audit_args.plant_into is not None:
        return _plant(script_args, training_args, audit_args)
    draw = None
    if audit_args.audited_model is not None:
        report = _audit_saved(training_args, audit_args)
    elif audit_args.auditor == "whitebox":
        if audit_args.trainer != "reward":
            raise ValueError("--trainer chooses the model of --auditor blackbox; --auditor whitebox audits the engine.")
        mechanism = get_mechanism(training_args.privacy_mechanism)
        if mechanism.kind != "gradient":
            raise ValueError(f"--auditor whitebox audits gradient mechanisms; {training_args.privacy_mechanism!r} is "
                             "not one: use --auditor blackbox.")
        report = audit_gradient_canaries(
            audit_args.canaries, steps=audit_args.whitebox_steps, target_epsilon=training_args.target_epsilon,
            noise_multiplier=training_args.noise_multiplier, delta=delta,
            max_grad_norm=training_args.per_user_max_grad_norm, mechanism=mechanism.from_arguments(training_args),
            grad_sample_mode=training_args.grad_sample_mode, confidence=audit_args.confidence,
            seed=audit_args.audit_seed, accountant=training_args.accountant, progress=True)
    else:
        report, draw = _blackbox(script_args, training_args, audit_args)
    os.makedirs(out, exist_ok=True)
    report.save(out)
    report.plot(os.path.join(out, "scores.png"))
    claimed = "∞" if math.isinf(report.epsilon_claimed) else f"{report.epsilon_claimed:.3g}"
    fdp = "" if report.epsilon_lower_fdp is None else (
        f"; f-DP audit of the claimed curve: {'REJECTED' if report.fdp_claim_rejected else 'not rejected'}")
    print(f"ε claimed {claimed}, audited lower bound {report.epsilon_lower:.3g} at {report.confidence:.0%} "
          f"({report.correct} of {report.guesses} guesses right on {report.canaries} canary users{fdp})")
    if draw is not None:  # the auditor's secret: this folder holds no model
        print(f"trl-userdp: the canary draw is {draw.save(out)}: {SECRET}")
    print(f"trl-userdp: audit_report.json and scores.png written to {out}")
    return 0


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``audit``: the data, :class:`~trl_userdp.trainers.UserDPRewardConfig` and
    :class:`AuditArguments`.

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser, with :data:`DEFAULTS`.
    """
    from ..trainers import UserDPRewardConfig  # lazy: transformers' Trainer and TRL's trainers

    return command_parser("audit", [UserDataArguments, UserDPRewardConfig, AuditArguments], help=HELP,
                          subparsers=subparsers, prog=prog, defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(run_script("audit", make_parser, main, prog="python -m trl_userdp.scripts.audit"))
