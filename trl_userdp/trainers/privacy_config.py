"""Privacy fields shared by the trainer configs (README, TRL trainers), as a dataclass mixed into TRL's configs."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Optional

import torch
from transformers.utils import is_torch_bf16_gpu_available

from ..accountants.accountant import ACCOUNTANTS_BY_NAME, accountant_class
from ..accountants.analysis import NEIGHBORING_RELATIONS
from ..mechanisms import get_mechanism, mechanism_names
from ..mechanisms.group import GROUP_ACCOUNTING
from ..setup_options import GRAD_SAMPLE_MODES
from ..stack_warnings import without_stack_deprecations
from ..validators import check_delta, check_epsilon, check_max_samples_per_user, check_noise_multiplier, check_positive

logger = logging.getLogger(__name__)


def _default(config, name: str):
    """The default of a config's field (TRL's or transformers'), to tell a value the user set from one they did not."""
    field = type(config).__dataclass_fields__.get(name)
    return None if field is None or field.default is dataclasses.MISSING else field.default


#: whether the given-privacy_seed warning was shown in this process (once is enough)
_SEED_WARNED: list = []


@dataclasses.dataclass
class UserDPArguments:
    """User-level DP settings. The privacy unit is the user named in ``user_column``.

    ``privacy_mechanism`` names a registered mechanism (:mod:`trl_userdp.mechanisms`): ``"user_dpsgd"`` (clip
    each user's averaged gradient, Gaussian noise), ``"aup"`` (AUP-RLHF; needs ``concentration_radius``),
    ``"group"`` (item-level DP-SGD with group-privacy accounting), ``"user_dpsgd_adaptive_clip"`` (user-wise DP-SGD whose
    clip, starting at ``per_user_max_grad_norm``, follows a private quantile of the users' norms),
    ``"randomized_response"`` (labels privatized
    once, then the de-biased loss: pure ε, labels only) or ``"none"`` (plain TRL training, for baselines).
    """

    privacy_mechanism: str = dataclasses.field(
        default="user_dpsgd", metadata={"help": "The user-level mechanism (docs/mechanisms.md).",
                                        "choices": list(mechanism_names())}
    )
    target_epsilon: Optional[float] = dataclasses.field(
        default=8.0,
        metadata={"help": "User-level ε for the whole run: σ is calibrated to it, or, with noise_multiplier, it caps "
                          "training (None: no cap)."},
    )
    target_delta: float = dataclasses.field(default=1e-5, metadata={"help": "δ; keep it below 1/n_users."})
    noise_multiplier: Optional[float] = dataclasses.field(
        default=None, metadata={"help": "A fixed σ (user_dpsgd and group); training stops when ε would pass target_epsilon."}
    )
    per_user_max_grad_norm: float = dataclasses.field(
        default=1.0, metadata={"help": "C: bound on each user's averaged gradient (a record's, for group)."}
    )
    max_samples_per_user: int = dataclasses.field(
        default=10, metadata={"help": "m: rows a user may contribute; extra rows are dropped once, seeded."}
    )
    users_per_batch: Optional[float] = dataclasses.field(
        default=None, metadata={"help": "Expected users per optimizer step ñ, over all processes (default: "
                                         "per_device_train_batch_size × gradient_accumulation_steps × processes)."}
    )
    user_column: str = dataclasses.field(default="user_id", metadata={"help": "Column naming each row's user."})
    concentration_radius: Optional[float] = dataclasses.field(
        default=None, metadata={"help": "τ for privacy_mechanism='aup'."}
    )
    max_users_per_batch: Optional[int] = dataclasses.field(
        default=None, metadata={"help": "ñ_max, AUP's truncation (default ñ + 4√ñ)."}
    )
    svt_fraction: float = dataclasses.field(default=0.5, metadata={"help": "Share of ε for AUP's AboveThreshold."})
    target_unclipped_quantile: float = dataclasses.field(
        default=0.5, metadata={"help": "user_dpsgd_adaptive_clip: fraction of users the clip should cover (γ)."})
    clip_learning_rate: float = dataclasses.field(
        default=0.2, metadata={"help": "user_dpsgd_adaptive_clip: step of the clip's geometric update (η)."})
    count_noise_multiplier: Optional[float] = dataclasses.field(
        default=None, metadata={"help": "user_dpsgd_adaptive_clip: noise std σ_b on the count of users within the clip "
                                        "(default: max(users_per_batch / 20, σ))."})
    grad_sample_mode: str = dataclasses.field(
        default="hooks",
        metadata={"help": "How each user's gradient is clipped: 'hooks' (per-user gradients from Opacus's per-sample "
                          "gradients), 'functorch', or 'ghost' (per-user ghost clipping: no per-user gradients, "
                          "memory near non-private training; not for aup).",
                  "choices": list(GRAD_SAMPLE_MODES)})
    accountant: str = dataclasses.field(default="pld", metadata={"help": "dp-accounting accountant.",
                                                                 "choices": sorted(ACCOUNTANTS_BY_NAME)})
    neighboring_relation: str = dataclasses.field(
        default="add_or_remove", metadata={"help": "Neighbouring datasets: add/remove or replace one user.",
                                           "choices": list(NEIGHBORING_RELATIONS)}
    )
    group_accounting: str = dataclasses.field(
        default="conversion", metadata={"help": "For privacy_mechanism='group': group-privacy conversion or ELS.",
                                        "choices": list(GROUP_ACCOUNTING)}
    )
    privacy_seed: Optional[int] = dataclasses.field(
        default=None,
        repr=False,  # and masked in str() and to_dict(): see __str__
        metadata={"help": "Seeds the privacy randomness (label flips, user sampling, noise, AboveThreshold, GRPO's "
                          "sampling); must differ from `seed`. Leave unset in "
                          "deployment: anyone who knows the seed can replay the noise. Never saved: pickles of these "
                          "arguments (training_args.bin) drop it and their JSON masks it. (`seed` seeds the rest.)"},
    )
    log_private_metrics: bool = dataclasses.field(
        default=False,
        metadata={"help": "Also log training loss/accuracy/rewards: statistics of private data without noise."},
    )

    def __post_init__(self):
        if getattr(self, "bf16", False) is None and not getattr(self, "fp16", False):
            # TRL turns an unset bf16 on, which transformers refuses where no accelerator has bf16: unset means bf16
            # on an accelerator that has it (on a CPU, bf16 autocast only when asked for), so a config written as
            # TRL's docs write it runs on a CPU-only machine too
            self.bf16 = not getattr(self, "use_cpu", False) and is_torch_bf16_gpu_available()
        if getattr(self, "dataloader_pin_memory", False) and not torch.accelerator.is_available():
            self.dataloader_pin_memory = False  # pinning needs an accelerator: without one torch only warns
        # TRL's default `gradient_checkpointing=True` (turned off under DP below unless reentrant) is a field that
        # transformers 5 deprecates
        with without_stack_deprecations():
            super().__post_init__()
        self._validate_privacy_fields()

    def _check_privacy_seed(self) -> None:
        """A given ``privacy_seed`` must not be the public ``seed``; it warns once that the release is private only while
        the seed stays secret and is used for one run.

        Raises:
            ValueError: ``privacy_seed`` equals ``seed``.
        """
        if self.privacy_seed is None:
            return
        if self.privacy_seed == getattr(self, "seed", None):
            raise ValueError(f"privacy_seed equals seed ({self.seed}), which is public (saved in training_args.bin): "
                             "anyone could replay the noise. Leave privacy_seed unset (a secret drawn from the OS).")
        if not _SEED_WARNED:
            _SEED_WARNED.append(True)
            logger.warning("privacy_seed is set: the release is private only while that seed stays secret and is used "
                           "for this run alone (another run, or a second resume from one checkpoint, with the same "
                           "seed would share its noise). Leave it unset for a release.")

    def to_dict(self):
        """As transformers hides hub tokens: the ``privacy_seed`` never reaches logs, TensorBoard or model cards."""
        d = super().to_dict()
        if d.get("privacy_seed") is not None:
            d["privacy_seed"] = "<PRIVACY_SEED>"
        return d

    def __str__(self) -> str:
        """transformers' text of the arguments (logged by scripts), with the ``privacy_seed`` masked."""
        text = super().__str__()
        return text if self.privacy_seed is None else text.replace(f"privacy_seed={self.privacy_seed},",
                                                                    "privacy_seed=<PRIVACY_SEED>,")

    def __getstate__(self):
        """Pickles (transformers' ``training_args.bin`` beside every saved model) leave out the ``privacy_seed``,
        which would let anyone replay the noise; a resumed run takes it from its own config."""
        state = dict(self.__dict__)
        state["privacy_seed"] = None
        return state

    def __copy__(self):
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        """Copies in memory keep the seed (only pickles drop it)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _validate_privacy_fields(self) -> None:
        mechanism = get_mechanism(self.privacy_mechanism)
        self.privacy_mechanism = mechanism.name  # a renamed mechanism's name, once
        if mechanism.kind == "none":
            return
        check_max_samples_per_user(self.max_samples_per_user)
        accountant_class(self.accountant)
        if self.noise_multiplier is None or not mechanism.accepts_noise_multiplier:
            check_epsilon(self.target_epsilon, "target_epsilon")
        else:
            check_noise_multiplier(self.noise_multiplier)
            if self.target_epsilon is not None:
                check_epsilon(self.target_epsilon, "target_epsilon")
        check_delta(self.target_delta, "target_delta")
        self._check_privacy_seed()
        mechanism.check_arguments(self)
        if mechanism.kind != "gradient":
            return
        check_positive(self.per_user_max_grad_norm, "per_user_max_grad_norm")
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {self.grad_sample_mode!r}.")
        if self.users_per_batch is not None:
            check_positive(self.users_per_batch, "users_per_batch")
        if getattr(self, "include_num_input_tokens_seen", "no") not in ("no", False):
            logger.warning("include_num_input_tokens_seen counts the tokens of private batches; turned off under DP.")
            self.include_num_input_tokens_seen = "no"
        if hasattr(self, "ddp_broadcast_buffers"):
            # Under DDP a process whose shard has no user in a step runs no forward pass; DDP's buffer broadcast at
            # every forward would then be a collective only the others join. No buffer is trained here (BatchNorm is
            # refused), so the replicas' buffers stay equal without it.
            if self.ddp_broadcast_buffers:
                logger.warning("ddp_broadcast_buffers=True set to False under user-level DP.")
            self.ddp_broadcast_buffers = False
        if getattr(self, "ddp_static_graph", None):
            raise ValueError("ddp_static_graph=True: DDP's static graph reduces gradients itself; under user-level DP "
                             "only the clipped sums are reduced. Leave it unset.")
        if getattr(self, "padding_free", False):
            raise ValueError("padding_free=True packs several users' rows into one: set padding_free=False under DP.")
        if self.max_grad_norm and self.max_grad_norm > 0:
            # the Trainer's default is the user's only if they changed it: then a warning, else a note
            log = logger.info if self.max_grad_norm == _default(self, "max_grad_norm") else logger.warning
            log("transformers' max_grad_norm=%s (clipping the whole batch's gradient) set to 0: DP clips each user's "
                "gradient to per_user_max_grad_norm instead.", self.max_grad_norm)
            self.max_grad_norm = 0.0
        # transformers 5 names it activation_checkpointing; gradient_checkpointing mirrors it
        name = "activation_checkpointing" if hasattr(self, "activation_checkpointing") else "gradient_checkpointing"
        if getattr(self, name):
            kwargs = getattr(self, f"{name}_kwargs") or {}
            if kwargs.get("use_reentrant") is not True:
                log = logger.info if _default(self, "gradient_checkpointing") is True else logger.warning
                log(
                    "gradient_checkpointing=True (TRL's default) in non-reentrant mode loses per-sample gradients; "
                    "turned off. Use gradient_checkpointing_kwargs={'use_reentrant': True} to keep it."
                )
                setattr(self, name, False)
                self.gradient_checkpointing = False
