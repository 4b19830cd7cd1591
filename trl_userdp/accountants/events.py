"""dp-accounting events for the user-level mechanisms of docs/mechanisms.md.

Every privacy figure in this package comes from composing one of these events in a
dp-accounting ``PrivacyAccountant`` (RDP or PLD); nothing here computes ε itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple

import dp_accounting as dpa
from scipy import stats

from ..validators import (
    check_epsilon,
    check_max_samples_per_user,
    check_noise_multiplier,
    check_sample_rate,
    check_step_count,
)
from .analysis import calibrate_noise_multiplier, compute_epsilon, make_accountant


def poisson_gaussian_event(noise_multiplier: float, sample_rate: float, steps: int) -> dpa.DpEvent:
    """``T`` Poisson-subsampled Gaussian steps.

    M1 user-wise DP-SGD with q over users (AUP-RLHF Alg. 4), or item-level DP-SGD with q over records (M2).

    Args:
        noise_multiplier: The noise multiplier σ.
        sample_rate: The Poisson sampling rate q.
        steps: The number of steps T ≥ 0.

    Returns:
        A ``SelfComposedDpEvent`` of T ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``.

    Raises:
        ValueError: If σ, q or T is invalid.
    """
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(sample_rate)
    return dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier)), check_step_count(steps, minimum=0)
    )


def truncated_poisson_gaussian_event(
    noise_multiplier: float, sample_rate: float, steps: int, n_users: int, max_users_per_batch: int
) -> dpa.DpEvent:
    """``T`` steps of truncated Poisson sampling + Gaussian (docs/mechanisms.md, M4).

    AUP caps a step at ``ñ_max`` users. Only dp-accounting's PLD accountant supports this event.

    Args:
        noise_multiplier: The noise multiplier σ.
        sample_rate: The user sampling rate q.
        steps: The number of steps T ≥ 0.
        n_users: The number of users n.
        max_users_per_batch: The truncation ``ñ_max``: at most this many users per step.

    Returns:
        A ``SelfComposedDpEvent`` of T ``TruncatedSubsampledGaussianDpEvent``.

    Raises:
        ValueError: If σ, q or T is invalid, or ``n_users`` or ``max_users_per_batch`` is < 1.
    """
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(sample_rate)
    if max_users_per_batch < 1 or n_users < 1:
        raise ValueError("n_users and max_users_per_batch must be >= 1.")
    return dpa.SelfComposedDpEvent(
        dpa.TruncatedSubsampledGaussianDpEvent(
            dataset_size=int(n_users),
            sampling_probability=sample_rate,
            truncated_batch_size=int(max_users_per_batch),
            noise_multiplier=noise_multiplier,
        ),
        check_step_count(steps, minimum=0),
    )


def els_event(
    noise_multiplier: float, record_sample_rate: float, steps: int, max_samples_per_user: int
) -> dpa.DpEvent:
    """User-level view of item-level DP-SGD with Poisson record sampling (ELS, Charles et al. 2024).

    A user with ``m`` records has ``k ~ Binomial(m, q)`` of them in a step, each clipped to ``C``,
    so removing the user shifts the noisy sum by at most ``k·C``: a mixture of Gaussians with
    sensitivities ``k`` (in units of ``C``) and weights ``Binomial(m, q).pmf(k)``. Only the PLD
    accountant supports it, under add/remove-one-user.

    Args:
        noise_multiplier: The noise multiplier σ.
        record_sample_rate: The Poisson sampling rate q of records.
        steps: The number of steps T ≥ 0.
        max_samples_per_user: The contribution bound m (records per user).

    Returns:
        A ``SelfComposedDpEvent`` of T ``MixtureOfGaussiansDpEvent``.

    Raises:
        ValueError: If σ, q, T or m is invalid.
    """
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(record_sample_rate)
    m = check_max_samples_per_user(max_samples_per_user)
    pmf = stats.binom.pmf(range(m + 1), m, record_sample_rate)
    keep = [k for k in range(m + 1) if pmf[k] > 0]
    probs = [float(pmf[k]) for k in keep]
    total = sum(probs)
    return dpa.SelfComposedDpEvent(
        dpa.dp_event.MixtureOfGaussiansDpEvent(
            standard_deviation=noise_multiplier,
            sensitivities=[float(k) for k in keep],
            sampling_probs=[p / total for p in probs],
        ),
        check_step_count(steps, minimum=0),
    )


def randomized_response_noise_parameter(epsilon_per_label: float, num_choices: int = 2) -> float:
    """The probability that K-ary randomized response at ε' replaces a label by a uniform draw.

    RR replaces a label by a uniform draw over the K values with probability ``p = K/(e^ε' + K − 1)``
    (dp-accounting's noise parameter): it keeps the label with probability ``1 − p + p/K = e^ε'/(e^ε' + K − 1)``
    and moves it to each other value with ``p/K`` (docs/mechanisms.md, M3). The one definition of RR's law:
    the mechanism, its losses, the linear estimators and the accountant all derive from it.

    Args:
        epsilon_per_label: The per-label budget ε'.
        num_choices: The number of label values K ≥ 2.

    Returns:
        The noise parameter ``p``.

    Raises:
        ValueError: If ``epsilon_per_label`` is not a finite number > 0, or ``num_choices`` is not an
            integer ≥ 2.
    """
    check_epsilon(epsilon_per_label, "epsilon_per_label")
    if isinstance(num_choices, bool) or not isinstance(num_choices, int) or num_choices < 2:
        raise ValueError(f"num_choices must be an integer >= 2, got {num_choices!r}.")
    return num_choices / (math.exp(min(epsilon_per_label, 700.0)) + num_choices - 1)


def rr_move_probability(epsilon_per_label: float, num_choices: int = 2) -> float:
    """The probability that randomized response moves a label to one given other value.

    Args:
        epsilon_per_label: The per-label budget ε'.
        num_choices: The number of label values K ≥ 2.

    Returns:
        ``1/(e^ε' + K − 1)`` (the binary flip rate ``σ(−ε')`` at K = 2).

    Raises:
        ValueError: As :func:`randomized_response_noise_parameter`.
    """
    return randomized_response_noise_parameter(epsilon_per_label, num_choices) / num_choices


def rr_keep_probability(epsilon_per_label: float, num_choices: int = 2) -> float:
    """The probability that randomized response keeps a label.

    Args:
        epsilon_per_label: The per-label budget ε'.
        num_choices: The number of label values K ≥ 2.

    Returns:
        ``e^ε'/(e^ε' + K − 1)``.

    Raises:
        ValueError: As :func:`randomized_response_noise_parameter`.
    """
    return 1 - (num_choices - 1) * rr_move_probability(epsilon_per_label, num_choices)


def randomized_response_event(epsilon: float, max_samples_per_user: int, num_choices: int = 2) -> dpa.DpEvent:
    """User-level randomized response: each of a user's ``m`` labels gets RR at ``ε' = ε/m``.

    Basic composition over the user's labels (AUP-RLHF §4.1); labels only; replace-one relation.
    The m applications are listed in a ``ComposedDpEvent``, not a ``SelfComposedDpEvent``:
    dp-accounting 0.6's PLD accountant ignores the count of a self-composed randomized response
    and would report the ε of a single label (tests/accountants/test_events.py shows it).

    Args:
        epsilon: The user-level budget ε.
        max_samples_per_user: The contribution bound m (labels per user).
        num_choices: The number of label values K ≥ 2.

    Returns:
        A ``ComposedDpEvent`` of m ``RandomizedResponseDpEvent``.

    Raises:
        ValueError: If ``epsilon`` is not > 0, m is not an integer ≥ 1, or K is not an integer ≥ 2.
    """
    check_epsilon(epsilon, "epsilon")
    m = check_max_samples_per_user(max_samples_per_user)
    rr = dpa.RandomizedResponseDpEvent(
        noise_parameter=randomized_response_noise_parameter(epsilon / m, num_choices), num_buckets=num_choices
    )
    return dpa.ComposedDpEvent([rr] * m)


# ---------------------------------------------------------------------------------------------------
# What one step of a mechanism is, for the accountant: the accountant composes these and knows no mechanism.

#: PLD discretisation for ELS and truncated sampling: their PLDs are 10-70x slower at dp-accounting's
#: default 1e-4; the coarser grid is still an upper bound (pessimistic rounding).
COARSE_DISCRETIZATION = 1e-3


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """The dp-accounting event of ``T`` steps at ``(σ, q)`` of one mechanism, and how ε is read from it.

    Subclasses are small frozen dataclasses whose fields are the mechanism's public constants (m, n, ñ_max);
    :meth:`to_dict` is what a checkpoint stores, so a resumed run is accounted as the same mechanism.
    Calling an event with ``(noise_multiplier, sample_rate, steps)`` returns the ``dp_accounting.DpEvent``
    of ``steps`` steps at (σ, q).
    """

    #: registry name (the ``"name"`` of :meth:`to_dict`)
    name: ClassVar[str] = ""
    #: only dp-accounting's PLD accountant supports the event
    pld_only: ClassVar[bool] = False

    def __call__(self, noise_multiplier: float, sample_rate: float, steps: int) -> dpa.DpEvent:
        """The event of ``steps`` steps at ``(σ, q)``.

        Args:
            noise_multiplier: The noise multiplier σ.
            sample_rate: The sampling rate q.
            steps: The number of steps T.

        Returns:
            A ``dp_accounting.DpEvent``.

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError

    @property
    def group_size(self) -> Optional[int]:
        """Records per user for the group-privacy conversion of an item-level ε (None: ε is the user's)."""
        return None

    @property
    def accountant_options(self) -> Dict[str, Any]:
        """Options of the dp-accounting accountant (e.g. a coarser PLD grid)."""
        return {}

    def search_plan(self, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                    relation: str) -> Tuple[float, float]:
        """Where :meth:`calibrate`'s bracket search starts, and the factor it multiplies or divides σ by until ε crosses
        the target: any start is correct, one near the answer saves evaluations. The base class starts at the σ that
        RDP calibrates (milliseconds, to 1%), for events RDP accounts: RDP's conversion to (ε, δ) is looser than
        PLD's, so PLD's σ is at most about that, within a few percent, and a PLD search steps by 1.25 and brackets in
        two evaluations of its own instead of six or more from σ = 1 by 2 (`trl-userdp account`, issue 44).

        Args:
            target_epsilon: The target ε.
            target_delta: The target δ.
            sample_rate: The sampling rate q.
            steps: The number of steps T.
            relation: The neighbouring relation.

        Returns:
            ``(RDP's σ, 1.25)``; ``(1, 2)`` for an event RDP cannot account under ``relation``, or a target RDP cannot
            meet within the searched range (PLD's search then says whether it can).
        """
        if self.pld_only or not make_accountant("rdp", relation).supports(self(1.0, sample_rate, steps)):
            return 1.0, 2.0
        try:
            return calibrate_noise_multiplier(lambda s: self(s, sample_rate, steps), target_epsilon=target_epsilon,
                                              target_delta=target_delta, accountant="rdp", relation=relation,
                                              group_size=self.group_size, tol=1e-2), 1.25
        except ValueError:
            return 1.0, 2.0

    def composed(self, history: Sequence[Tuple[float, float, int]]) -> dpa.DpEvent:
        """The event of an accountant's history.

        Args:
            history: ``(σ, q, steps)`` triples, as Opacus's accountants keep them.

        Returns:
            A ``ComposedDpEvent`` of the triples' events.
        """
        return dpa.ComposedDpEvent([self(s, q, n) for s, q, n in history])

    def epsilon(self, history: Sequence[Tuple[float, float, int]], delta: float, *, accountant: str = "pld",
                relation: str = "add_or_remove") -> float:
        """ε at ``delta`` of the steps in ``history``.

        Args:
            history: ``(σ, q, steps)`` triples.
            delta: The target δ.
            accountant: ``"rdp"`` or ``"pld"``.
            relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.

        Returns:
            ε (group-privacy ε where :attr:`group_size` is set).

        Raises:
            ValueError: As :func:`~trl_userdp.accountants.analysis.compute_epsilon`.
        """
        return compute_epsilon(self.composed(history), delta, accountant=accountant, relation=relation,
                               group_size=self.group_size, **self.accountant_options)

    def calibrate(self, target_epsilon: float, target_delta: float, *, sample_rate: float, steps: int,
                  accountant: str = "pld", relation: str = "add_or_remove", tol: float = 1e-4) -> float:
        """The smallest σ for which ``steps`` steps at ``sample_rate`` meet ``(target_epsilon, target_delta)``.

        Args:
            target_epsilon: The target ε.
            target_delta: The target δ.
            sample_rate: The sampling rate q of every step.
            steps: The number of steps T.
            accountant: ``"rdp"`` or ``"pld"``.
            relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
            tol: The tolerance on σ.

        Returns:
            The noise multiplier σ.

        Raises:
            ValueError: As :func:`~trl_userdp.accountants.analysis.calibrate_noise_multiplier`.
        """
        setting = (float(target_epsilon), float(target_delta), float(sample_rate), steps, accountant, relation,
                   float(tol))
        try:
            hash(self)
        except TypeError:  # an event with an unhashable field (one of a user's own): no memo
            return _calibrate.__wrapped__(self, *setting)
        return _calibrate(self, *setting)

    def to_dict(self) -> Dict[str, Any]:
        """The event's registry name and fields, as a checkpoint stores them.

        Returns:
            ``{"name": ..., **fields}``.
        """
        return {"name": self.name, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(state: Dict[str, Any]) -> "StepEvent":
        """The event saved by :meth:`to_dict`.

        Args:
            state: The dictionary saved by :meth:`to_dict`.

        Returns:
            The :class:`StepEvent` subclass instance.

        Raises:
            ValueError: If the name is unknown, or the fields do not fit the event or fail its checks.
        """
        if not isinstance(state, dict) or state.get("name") not in STEP_EVENTS:
            raise ValueError(f"Unknown accounting event {state!r}; known: {sorted(STEP_EVENTS)}.")
        fields = {k: v for k, v in state.items() if k != "name"}
        try:
            return STEP_EVENTS[state["name"]](**fields)
        except TypeError as e:
            raise ValueError(f"Malformed accounting event {state!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PoissonGaussian(StepEvent):
    """User-wise DP-SGD (M1): users Poisson-sampled at q, each clipped, Gaussian noise."""

    name: ClassVar[str] = "poisson_gaussian"

    def __call__(self, noise_multiplier, sample_rate, steps):
        return poisson_gaussian_event(noise_multiplier, sample_rate, steps)


@dataclasses.dataclass(frozen=True)
class RecordLevelEvent(StepEvent):
    """Item-level DP-SGD over the records of users with at most ``max_samples_per_user`` each (M2).

    Args:
        max_samples_per_user: The contribution bound m (records per user).

    Raises:
        ValueError: If ``max_samples_per_user`` is not an integer ≥ 1.
    """

    max_samples_per_user: int

    def __post_init__(self):
        check_max_samples_per_user(self.max_samples_per_user)


@dataclasses.dataclass(frozen=True)
class GroupPrivacyGaussian(RecordLevelEvent):
    """Item-level DP-SGD whose user-level ε is group privacy over ``max_samples_per_user`` records (M2).

    Args:
        max_samples_per_user: The contribution bound m, the group size.
    """

    name: ClassVar[str] = "group_privacy_gaussian"

    @property
    def group_size(self) -> int:
        """k = m: ε of one record is converted to k records by group privacy."""
        return self.max_samples_per_user

    def __call__(self, noise_multiplier, sample_rate, steps):
        return poisson_gaussian_event(noise_multiplier, sample_rate, steps)


@dataclasses.dataclass(frozen=True)
class ELSGaussian(RecordLevelEvent):
    """Item-level DP-SGD accounted at user level by ELS (:func:`els_event`, M2).

    Args:
        max_samples_per_user: The contribution bound m (records per user).
    """

    name: ClassVar[str] = "els_gaussian"
    pld_only: ClassVar[bool] = True

    @property
    def accountant_options(self) -> Dict[str, Any]:
        """The PLD grid: the coarse discretization, which ELS's many-fold compositions need to stay fast."""
        return {"value_discretization_interval": COARSE_DISCRETIZATION}

    def search_plan(self, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                    relation: str) -> Tuple[float, float]:
        """From the group-privacy σ of the same records by 1.25 (:class:`GroupPrivacyGaussian`, seconds): ELS's tighter accounting
        needs at most about that much, and its mixture's privacy-loss distribution takes seconds to build at a small
        σ (5.9 s at σ = 1 against 0.4 s at σ = 32, m = 6, q = 0.5, T = 10), so the search stays near the answer. To
        1e-3, the tolerance of ``trl-userdp account``'s group column, which then costs nothing here."""
        return GroupPrivacyGaussian(self.max_samples_per_user).calibrate(
            target_epsilon, target_delta, sample_rate=sample_rate, steps=steps, accountant="pld", relation=relation,
            tol=1e-3), 1.25

    def __call__(self, noise_multiplier, sample_rate, steps):
        return els_event(noise_multiplier, sample_rate, steps, self.max_samples_per_user)


@dataclasses.dataclass(frozen=True)
class TruncatedPoissonGaussian(StepEvent):
    """AUP-RLHF's Gaussian steps (M4): Poisson sampling of ``n_users`` truncated to ``max_users_per_batch``.

    Args:
        n_users: The number of users n.
        max_users_per_batch: The truncation ``ñ_max``: at most this many users per step.

    Raises:
        ValueError: If either is not an integer ≥ 1.
    """

    n_users: int
    max_users_per_batch: int
    name: ClassVar[str] = "truncated_poisson_gaussian"
    pld_only: ClassVar[bool] = True

    def __post_init__(self):
        for field in ("n_users", "max_users_per_batch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}.")

    @property
    def accountant_options(self) -> Dict[str, Any]:
        """The PLD grid: the coarse discretization (the truncated mixture has one component per user count)."""
        return {"value_discretization_interval": COARSE_DISCRETIZATION}

    def __call__(self, noise_multiplier, sample_rate, steps):
        return truncated_poisson_gaussian_event(noise_multiplier, sample_rate, steps, self.n_users,
                                                self.max_users_per_batch)


STEP_EVENTS = {cls.name: cls for cls in (PoissonGaussian, GroupPrivacyGaussian, ELSGaussian, TruncatedPoissonGaussian)}


@functools.lru_cache(maxsize=64)
def _calibrate(event: StepEvent, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
               accountant: str, relation: str, tol: float) -> float:
    """:meth:`StepEvent.calibrate`, once per process for each setting: a PLD calibration takes seconds, and a trainer,
    its resume, the engines and the CLI ask for the same one again (the event is a frozen dataclass, so it is a key)."""
    start, factor = event.search_plan(target_epsilon, target_delta, sample_rate, steps, relation)
    return calibrate_noise_multiplier(
        lambda s: event(s, sample_rate, steps), target_epsilon=target_epsilon, target_delta=target_delta,
        accountant=accountant, relation=relation, group_size=event.group_size, tol=tol, start=start, factor=factor,
        **event.accountant_options)
