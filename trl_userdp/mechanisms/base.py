"""One object per user-level mechanism, and the registry every entry point takes them from
(docs/architecture.md, "How to add a mechanism").

A mechanism declares its name and kind, its checks of the trainer's privacy fields, and — for a gradient
mechanism — the loader it needs, the optimizer that runs its step, the dp-accounting event of one step, the name
its report carries, and how the trainers set it up from their config. The engines, the trainer configs and
trainers, the pipeline and the CLI list and dispatch mechanisms only through :func:`get_mechanism` and
:func:`mechanism_names`; adding one is one module that calls :func:`register_mechanism`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, Optional, Tuple, Type

from ..accountants import PrivacyReport
from ..accountants.events import StepEvent

#: kinds: "gradient" (per-user gradients, noise and an accountant), "labels" (labels privatized once before
#: training) and "none" (no privacy, for baselines)
KINDS = ("gradient", "labels", "none")
#: name -> mechanism class, in registration order (filled by :func:`register_mechanism`)
MECHANISM_REGISTRY: Dict[str, Type["Mechanism"]] = {}


def register_mechanism(cls: Type["Mechanism"]) -> Type["Mechanism"]:
    """Class decorator: make ``cls`` available under ``cls.name`` to the engines, trainers, pipeline and CLI."""
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}.")
    if cls.name in MECHANISM_REGISTRY and MECHANISM_REGISTRY[cls.name] is not cls:
        raise ValueError(f"A mechanism named {cls.name!r} is already registered ({MECHANISM_REGISTRY[cls.name].__name__}).")
    MECHANISM_REGISTRY[cls.name] = cls
    return cls


def mechanism_names(kind: Optional[str] = None) -> Tuple[str, ...]:
    """The registered names (of one ``kind``), in registration order."""
    return tuple(name for name, cls in MECHANISM_REGISTRY.items() if kind is None or cls.kind == kind)


def get_mechanism(name: str, field: str = "privacy_mechanism") -> Type["Mechanism"]:
    """The mechanism class registered under ``name`` (``field`` names the argument in the error)."""
    if name not in MECHANISM_REGISTRY:
        raise ValueError(f"{field} must be one of {mechanism_names()}, got {name!r}.")
    return MECHANISM_REGISTRY[name]


class Mechanism:
    """Base class. Subclasses set :attr:`name`, :attr:`kind` and :attr:`summary` and override what applies."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "gradient"
    #: one line for ``--help`` and the docs
    summary: ClassVar[str] = ""
    #: takes a fixed ``noise_multiplier`` (σ) instead of calibrating it to ``target_epsilon``
    accepts_noise_multiplier: ClassVar[bool] = False

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        """Checks of the trainer's privacy fields (:class:`~trl_userdp.trainers.UserDPArguments`) that only this
        mechanism needs; the shared ones (ε, δ, m, accountant) are the config's."""

    @classmethod
    def from_options(cls, **options: Any) -> "Mechanism":
        """An instance from engine keyword options (each mechanism takes the ones it knows)."""
        return cls()

    @classmethod
    def from_arguments(cls, args: Any) -> "Mechanism":
        """An instance from the trainer's privacy fields."""
        return cls()


class GradientMechanism(Mechanism):
    """A mechanism that trains with per-user gradients, noise and an accountant."""

    kind: ClassVar[str] = "gradient"
    accepts_noise_multiplier: ClassVar[bool] = True
    #: what is sampled and clipped: "user" or "record"
    clipping_unit: ClassVar[str] = "user"
    #: set up by :class:`~trl_userdp.AdaptiveUserPrivacyEngine` instead of :class:`~trl_userdp.PrivacyEngine`
    adaptive: ClassVar[bool] = False
    #: why the mechanism cannot run data-parallel (None: it can; users sharded by rank, one all-reduce)
    single_process_reason: ClassVar[Optional[str]] = None

    @property
    def report_name(self) -> str:
        """The ``mechanism`` field of its privacy reports."""
        return self.name

    def optimizer_class(self, world_size: int) -> type:
        """The Opacus-style optimizer that runs one step of this mechanism."""
        self.check_world_size(world_size)
        from ..optimizers import DistributedUserDPOptimizer, UserDPOptimizer

        return DistributedUserDPOptimizer if world_size > 1 else UserDPOptimizer

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        """Refuse several processes for a mechanism that runs in one (:attr:`single_process_reason`)."""
        if world_size > 1 and cls.single_process_reason is not None:
            raise ValueError(f"privacy_mechanism={cls.name!r} runs in one process: {cls.single_process_reason}")

    def make_loader(self, dataset: Any, *, n_users: int, users_per_batch: float, max_samples_per_user: int,
                    **loader_options: Any) -> Tuple[Any, float]:
        """The Poisson loader over the contribution-bounded ``dataset`` and the expected units (clipped
        gradients) per step, which the noisy sum is divided by."""
        raise NotImplementedError

    def step_event(self, *, max_samples_per_user: int, n_users: int) -> StepEvent:
        """How the accountant reads one step (:mod:`trl_userdp.accountants.events`)."""
        raise NotImplementedError

    def optimizer_options(self, expected_units: float) -> Dict[str, Any]:
        """Keyword arguments of its optimizer beyond the shared ones (σ, C, ñ, hooks, seeds)."""
        return {}

    def report_extra(self, optimizer: Any) -> Dict[str, Any]:
        """What its privacy report adds under ``extra``."""
        return {}

    @classmethod
    def make_private(cls, args: Any, **engine_arguments: Any) -> Tuple[Any, Any, Any]:
        """``(engine, optimizer, loader)`` for a trainer: the engine call this mechanism's trainer fields
        (``args``) ask for, with the arguments every mechanism shares (model, data, budget, seeds). By default
        :meth:`~trl_userdp.PrivacyEngine.make_private_user_level` with C, and σ fixed or calibrated."""
        from ..privacy_engine import PrivacyEngine

        if args.noise_multiplier is not None:  # a fixed σ; target_epsilon (if any) caps the run
            engine_arguments.update(noise_multiplier=args.noise_multiplier)
            if args.target_epsilon is None:
                engine_arguments.update(target_epsilon=None, target_delta=None)
        engine = PrivacyEngine(accountant=args.accountant, neighboring_relation=args.neighboring_relation)
        _, optimizer, loader = engine.make_private_user_level(
            max_grad_norm=args.per_user_max_grad_norm, mechanism=cls.from_arguments(args), **engine_arguments)
        return engine, optimizer, loader


@register_mechanism
class NoPrivacy(Mechanism):
    """Plain TRL training, for baselines: ε = ∞."""

    name = "none"
    kind = "none"
    summary = "plain training without privacy (a baseline; ε = ∞)"

    @staticmethod
    def report(steps_taken: int) -> PrivacyReport:
        return PrivacyReport(mechanism="none", n_users=0, max_samples_per_user=None, sample_rate=None,
                             noise_multiplier=None, steps=None, steps_taken=steps_taken, accountant="none",
                             epsilon=math.inf, delta=0.0)
