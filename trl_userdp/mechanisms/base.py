"""One object per user-level mechanism, and the registry every entry point takes them from
(docs/architecture.md, "How to add a mechanism").

A mechanism is a descriptor: its name and kind, its checks of the trainer's privacy fields, and, for a gradient
mechanism, the loader it needs, the dp-accounting event of one step, how its budget is split and its ε read, the
optimizer that runs its step (a key of :func:`trl_userdp.optimizers.get_optimizer_class`), its report fields, and its
columns in ``trl-userdp account``. Mechanisms import no engine, optimizer or trainer: the engines
(:class:`~trl_userdp.PrivacyEngine`) and the trainers set them up, and list and dispatch them only through
:func:`get_mechanism` and :func:`mechanism_names`; adding one is one module that calls :func:`register_mechanism`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar, Dict, Optional, Tuple, Type

from ..accountants.events import StepEvent
from ..accountants.report import PrivacyReport
from ..data import UserDataLoader
from ..validators import check_positive
#: kinds: "gradient" (per-user gradients, noise and an accountant), "labels" (labels privatized once before
#: training) and "none" (no privacy, for baselines)
KINDS = ("gradient", "labels", "none")
#: name -> mechanism class, in registration order (filled by :func:`register_mechanism`)
MECHANISM_REGISTRY: Dict[str, Type["Mechanism"]] = {}
#: earlier names still accepted, with a FutureWarning: old name -> registered name
RENAMED_MECHANISMS = {"user_dpsgd_adaptive": "user_dpsgd_adaptive_clip"}


def register_mechanism(cls: Type["Mechanism"]) -> Type["Mechanism"]:
    """Class decorator: make ``cls`` available under ``cls.name`` to the engines, trainers, pipeline and CLI.

    Args:
        cls: the :class:`Mechanism` subclass.

    Returns:
        ``cls``, unchanged.

    Raises:
        ValueError: ``cls.kind`` is not one of :data:`KINDS`, or another class is registered under ``cls.name``.
    """
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.__name__}.kind must be one of {KINDS}, got {cls.kind!r}.")
    if cls.name in MECHANISM_REGISTRY and MECHANISM_REGISTRY[cls.name] is not cls:
        raise ValueError(f"A mechanism named {cls.name!r} is already registered ({MECHANISM_REGISTRY[cls.name].__name__}).")
    MECHANISM_REGISTRY[cls.name] = cls
    return cls


def mechanism_names(kind: Optional[str] = None) -> Tuple[str, ...]:
    """The registered names, in registration order.

    Args:
        kind: one of :data:`KINDS`, to list only that kind's mechanisms (None: all).

    Returns:
        The names.
    """
    return tuple(name for name, cls in MECHANISM_REGISTRY.items() if kind is None or cls.kind == kind)


def get_mechanism(name: str, field: str = "privacy_mechanism") -> Type["Mechanism"]:
    """The mechanism class registered under a name.

    Args:
        name: a registered name (:func:`mechanism_names`).
        field: the argument's name, for the error message.

    Returns:
        The :class:`Mechanism` subclass.

    Raises:
        ValueError: no mechanism is registered under ``name``.
    """
    if name in RENAMED_MECHANISMS:
        warnings.warn(f"{field}={name!r} is now {RENAMED_MECHANISMS[name]!r} (adaptive clipping, not AUP-RLHF's "
                      "AdaptiveUserPrivacyEngine); the old name will be removed.", FutureWarning, stacklevel=2)
        name = RENAMED_MECHANISMS[name]
    if name not in MECHANISM_REGISTRY:
        raise ValueError(f"{field} must be one of {mechanism_names()}, got {name!r}.")
    return MECHANISM_REGISTRY[name]


def gradient_mechanism(mechanism: Any) -> "GradientMechanism":
    """The gradient mechanism object for a registered name (built with its defaults) or an object.

    Args:
        mechanism: a registered name or a :class:`Mechanism` object.

    Returns:
        The :class:`GradientMechanism`.

    Raises:
        ValueError: an unknown name, a mechanism that needs options, or one that is not a gradient mechanism.
    """
    if isinstance(mechanism, str):
        cls = get_mechanism(mechanism, "mechanism")
        try:
            mechanism = cls()
        except TypeError:
            raise ValueError(f"mechanism={mechanism!r} needs its options: pass a {cls.__name__}(...) object "
                             "(docs/engine.md).") from None
    if not isinstance(mechanism, GradientMechanism):
        raise ValueError(f"make_private_user_level sets up gradient mechanisms; {mechanism.name!r} is a "
                         f"{mechanism.kind!r} mechanism.")
    return mechanism


@dataclasses.dataclass(frozen=True)
class AccountingSetting:
    """A user-level setting for the accounting walkthrough (``trl-userdp account``).

    Args:
        n_users: n, the number of users.
        max_samples_per_user: m, the contribution bound.
        users_per_batch: ñ, the expected users per step.
        steps: T, the number of steps.
        delta: the target δ.
    """

    n_users: int
    max_samples_per_user: int
    users_per_batch: float
    steps: int
    delta: float

    @property
    def sample_rate(self) -> float:
        """q = ñ/n."""
        return self.users_per_batch / self.n_users


@dataclasses.dataclass(frozen=True)
class WalkthroughColumn:
    """One column of ``trl-userdp account``.

    Args:
        header: the column's title.
        detail: the line under it (e.g. the accountant, ``"(PLD)"``).
        value: the number shown.
        digits: its decimals.
    """

    header: str
    detail: str
    value: float
    digits: int = 4


class Mechanism:
    """Base class. Subclasses set :attr:`name`, :attr:`kind` and :attr:`summary` and override what applies."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "gradient"
    #: one line for ``--help`` and the docs
    summary: ClassVar[str] = ""
    #: takes a fixed ``noise_multiplier`` (σ) instead of calibrating it to ``target_epsilon``
    accepts_noise_multiplier: ClassVar[bool] = False
    #: what the mechanism's columns of ``trl-userdp account`` mean, one line each
    walkthrough_notes: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        """Check the trainer's privacy fields that only this mechanism needs (the shared ones, ε, δ, m and the
        accountant, are the config's).

        Args:
            args: the trainer config (:class:`~trl_userdp.trainers.UserDPArguments`).

        Raises:
            ValueError: a field this mechanism cannot run with.
        """

    @classmethod
    def from_arguments(cls, args: Any) -> "Mechanism":
        """The mechanism the trainer's privacy fields ask for.

        Args:
            args: the trainer config (:class:`~trl_userdp.trainers.UserDPArguments`).

        Returns:
            The mechanism (by default built without arguments).
        """
        return cls()

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """This mechanism's columns of ``trl-userdp account``.

        Args:
            epsilon: the target ε.
            setting: n, m, ñ, T and δ.

        Returns:
            Its noise at ``epsilon`` in ``setting``, from the accounting it trains with (none by default).
        """
        return ()


class GradientMechanism(Mechanism):
    """A mechanism that trains with per-user gradients, noise and an accountant, set up by
    :meth:`trl_userdp.PrivacyEngine.make_private_user_level`. Its defaults are user-wise DP-SGD's."""

    kind: ClassVar[str] = "gradient"
    accepts_noise_multiplier: ClassVar[bool] = True
    #: what is sampled and clipped: "user" or "record"
    clipping_unit: ClassVar[str] = "user"
    #: what its optimizer does with the per-unit gradients, the key of
    #: :func:`trl_userdp.optimizers.get_optimizer_class`: "flat" (clip to C), "adaptive" (a clip that follows a
    #: private quantile) or "aup" (AUP-RLHF's private mean)
    clipping: ClassVar[str] = "flat"
    #: why the mechanism cannot run data-parallel (None: it can; users sharded by rank, one all-reduce)
    single_process_reason: ClassVar[Optional[str]] = None
    #: why ghost clipping cannot run it (None: it can)
    ghost_reason: ClassVar[Optional[str]] = None

    @property
    def report_name(self) -> str:
        """The ``mechanism`` field of its privacy reports."""
        return self.name

    @classmethod
    def check_world_size(cls, world_size: int) -> None:
        """Refuse several processes for a mechanism that runs in one (:attr:`single_process_reason`).

        Args:
            world_size: the number of processes.

        Raises:
            ValueError: ``world_size > 1`` and the mechanism runs in one process.
        """
        if world_size > 1 and cls.single_process_reason is not None:
            raise ValueError(f"privacy_mechanism={cls.name!r} runs in one process: {cls.single_process_reason}")

    def check_setup(self, *, max_grad_norm: Optional[float], noise_multiplier: Optional[float], world_size: int,
                    grad_sample_mode: str, sharded: bool = False) -> None:
        """Refuse an engine set-up this mechanism cannot run (before anything is built).

        Args:
            max_grad_norm: C, the clip (required by clipping mechanisms).
            noise_multiplier: a fixed σ, or None (calibrated to the target).
            world_size: the number of processes.
            grad_sample_mode: ``"hooks"``, ``"functorch"`` or ``"ghost"``.
            sharded: the model is sharded by FSDP2.

        Raises:
            ValueError: with the reason.
        """
        self.check_world_size(world_size)
        if sharded and grad_sample_mode != "ghost":
            raise ValueError("An FSDP2-sharded model needs grad_sample_mode='ghost': per-user ghost clipping needs no "
                             "per-user gradient, which no process could hold for a sharded model.")
        if sharded and self.clipping != "flat":
            raise ValueError(f"privacy_mechanism={self.name!r} does not run on an FSDP2-sharded model: its "
                             f"{self.clipping!r} clipping is built for one process or data parallelism; use "
                             "'user_dpsgd' or 'group', or data parallelism without sharding.")
        if grad_sample_mode == "ghost" and self.ghost_reason is not None:
            raise ValueError(self.ghost_reason)
        if noise_multiplier is not None and not self.accepts_noise_multiplier:
            raise ValueError(f"mechanism={self.name!r} calibrates its noise to target_epsilon; it takes no "
                             "noise_multiplier.")
        check_positive(max_grad_norm, "max_grad_norm")

    def make_loader(self, dataset: Any, *, n_users: int, users_per_batch: float, max_samples_per_user: int,
                    **loader_options: Any) -> Tuple[UserDataLoader, float]:
        """The loader of the steps.

        Args:
            dataset: the contribution-bounded dataset.
            n_users: n, its users.
            users_per_batch: ñ, the expected users per step.
            max_samples_per_user: m, the contribution bound.
            **loader_options: the rest of :class:`~trl_userdp.data.UserDataLoader`'s arguments.

        Returns:
            The Poisson loader and the expected units (clipped gradients) per step, which the noisy sum is divided
            by. By default users are sampled at ``q = ñ/n``.
        """
        loader = UserDataLoader(dataset, users_per_batch=users_per_batch, max_samples_per_user=max_samples_per_user,
                                **loader_options)
        return loader, loader.users_per_batch

    def step_event(self, *, max_samples_per_user: int, n_users: int, users_per_batch: float) -> StepEvent:
        """How the accountant reads one step (:mod:`trl_userdp.accountants.events`); every subclass defines it.

        Args:
            max_samples_per_user: m, the contribution bound.
            n_users: n, the number of users.
            users_per_batch: ñ, the expected users per step.

        Returns:
            The step's :class:`~trl_userdp.accountants.events.StepEvent`.
        """
        raise NotImplementedError

    def budget(self, target_epsilon: float, target_delta: float) -> Tuple[float, float]:
        """The share of the run's budget that the accountant's steps may spend (σ is calibrated to it, and the budget
        guard stops at it): all of it by default.

        Args:
            target_epsilon: the run's target ε.
            target_delta: the run's target δ.

        Returns:
            ``(ε, δ)`` of the accountant's steps.
        """
        return target_epsilon, target_delta

    def epsilon(self, accounted_epsilon: float, optimizer: Any) -> float:
        """The run's ε: the accountant's ε of the steps taken, plus what the mechanism spends outside the accountant
        (none by default).

        Args:
            accounted_epsilon: the accountant's ε of the steps taken.
            optimizer: the mechanism's optimizer, read for what it spent outside the accountant.

        Returns:
            The run's ε.
        """
        return accounted_epsilon

    def optimizer_options(self, *, max_grad_norm: Optional[float], expected_units: float, steps: Optional[int],
                          target_epsilon: Optional[float], target_delta: Optional[float]) -> Dict[str, Any]:
        """Keyword arguments of its optimizer beyond the shared ones (σ, ñ, hooks, seeds, budget guard).

        Args:
            max_grad_norm: C as given to the engine.
            expected_units: ñ, the expected units per step.
            steps: the planned T (None: no plan).
            target_epsilon: the run's target ε (None: a fixed σ without a cap).
            target_delta: its δ.

        Returns:
            The keyword arguments (by default ``max_grad_norm`` only).
        """
        return {"max_grad_norm": max_grad_norm}

    def report_fields(self, fields: Dict[str, Any], optimizer: Any, *, accounted_epsilon: float) -> Dict[str, Any]:
        """The privacy report's fields (:class:`~trl_userdp.accountants.PrivacyReport`), with what this mechanism adds.

        Args:
            fields: the fields every gradient mechanism reports (``extra`` included).
            optimizer: its optimizer, for the state it reports.
            accounted_epsilon: the accountant's ε at the report's δ.

        Returns:
            ``fields``, updated in place (unchanged by default).
        """
        return fields


@register_mechanism
class NoPrivacy(Mechanism):
    """Plain TRL training, for baselines: ε = ∞."""

    name = "none"
    kind = "none"
    summary = "plain training without privacy (a baseline; ε = ∞)"

    @staticmethod
    def report(steps_taken: int) -> PrivacyReport:
        """The baseline's report: ε = ∞, δ = 0.

        Args:
            steps_taken: the optimizer steps taken.

        Returns:
            The :class:`~trl_userdp.accountants.PrivacyReport`.
        """
        return PrivacyReport(mechanism="none", n_users=0, max_samples_per_user=None, sample_rate=None,
                             noise_multiplier=None, steps=None, steps_taken=steps_taken, accountant="none",
                             epsilon=math.inf, delta=0.0)
