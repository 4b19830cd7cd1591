"""Opacus accountants whose ε comes from dp-accounting.

They keep Opacus's ``(noise_multiplier, sample_rate, steps)`` history, so Opacus's optimizer
hook, ``get_noise_multiplier`` and ``PrivacyEngine.save_checkpoint`` work unchanged, and they are
registered with Opacus under ``"dp_rdp"`` and ``"dp_pld"``::

    opacus.PrivacyEngine(accountant="dp_pld")

What one step is comes from its mechanism as a :class:`~trl_userdp.accountants.events.StepEvent`
(default: Poisson-subsampled Gaussian, user-wise DP-SGD); the accountant composes the events of its history
and knows no mechanism (docs/mechanisms.md, Accounting).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import dp_accounting as dpa
from opacus.accountants import IAccountant, RDPAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from ..validators import check_delta, check_noise_multiplier, check_sample_rate
from .analysis import make_accountant, neighboring_relation
from .events import PoissonGaussian, StepEvent


class DPAccountingAccountant(IAccountant):
    """Base class: the steps of one mechanism (its :class:`StepEvent`) composed in a dp-accounting accountant.

    Args:
        relation: The neighbouring relation, ``"add_or_remove"`` or ``"replace"`` (one user).
        events: What one step is; default :class:`PoissonGaussian` (user-wise DP-SGD).

    Raises:
        ValueError: If ``relation`` is unknown, or if ``events`` is PLD-only and this accountant is not PLD.
    """

    kind = "rdp"

    def __init__(self, *, relation: str = "add_or_remove", events: Optional[StepEvent] = None):
        neighboring_relation(relation)  # validates the name
        events = PoissonGaussian() if events is None else events
        if events.pld_only and self.kind != "pld":
            raise ValueError(f"The {events.name} event is accounted by dp-accounting's PLD accountant only: "
                             "use accountant='pld'.")
        self.history = []
        self.relation = relation
        self.events = events

    def spawn(self) -> "DPAccountingAccountant":
        """An empty accountant with the same configuration.

        Returns:
            A new accountant of this class, relation and events, with no history.
        """
        return type(self)(relation=self.relation, events=self.events)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step at (σ, q); consecutive equal steps merge, as in Opacus's accountants.

        Args:
            noise_multiplier: The step's noise multiplier σ.
            sample_rate: The step's sampling rate q.

        Raises:
            ValueError: If ``noise_multiplier`` is not a finite number ≥ 0 or ``sample_rate`` is not in (0, 1].
        """
        check_noise_multiplier(noise_multiplier)
        check_sample_rate(sample_rate)
        RDPAccountant.step(self, noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def event(self) -> dpa.DpEvent:
        """The composed dp-accounting event of every step taken so far.

        Returns:
            A ``dp_accounting.DpEvent`` composing the history.
        """
        return self.events.composed(self.history)

    def get_epsilon(self, delta: float, **kwargs) -> float:
        """ε of the steps taken so far (cached per history).

        Args:
            delta: The target δ.
            **kwargs: Ignored (Opacus's accountant interface).

        Returns:
            ε at ``delta``; 0.0 before any step.

        Raises:
            ValueError: If ``delta`` is not in (0, 1), or if dp-accounting cannot account the events.
        """
        check_delta(delta, "delta")
        if not self.history:
            return 0.0
        return _cached_epsilon(tuple(map(tuple, self.history)), delta, self.kind, self.relation, self.events)

    def calibrate(self, target_epsilon: float, target_delta: float, *, sample_rate: float, steps: int) -> float:
        """The smallest σ for which ``steps`` of this accountant's steps at ``sample_rate`` meet the target.

        Args:
            target_epsilon: The target ε.
            target_delta: The target δ.
            sample_rate: The sampling rate q of every step.
            steps: The number of steps T.

        Returns:
            The noise multiplier σ (see :func:`~trl_userdp.accountants.analysis.calibrate_noise_multiplier`).

        Raises:
            ValueError: If a target is invalid or no σ in the search range meets it.
        """
        return self.events.calibrate(target_epsilon, target_delta, sample_rate=sample_rate, steps=steps,
                                     accountant=self.kind, relation=self.relation)

    def __len__(self) -> int:
        return len(self.history)

    @property
    def steps_taken(self) -> int:
        """Steps accounted so far (empty steps included)."""
        return sum(n for _, _, n in self.history)

    def supports_relation(self, sample_rate: float) -> bool:
        """Whether dp-accounting can account this accountant's steps under its relation.

        Args:
            sample_rate: The sampling rate q of the probe step.

        Returns:
            True if the accountant supports the event of one step at ``sample_rate``.
        """
        probe = make_accountant(self.kind, self.relation, self.events.group_size, **self.events.accountant_options)
        return probe.supports(self.events(1.0, sample_rate, 1))

    @classmethod
    def mechanism(cls) -> str:
        """The name registered with Opacus.

        Returns:
            ``"dp_rdp"`` or ``"dp_pld"``.
        """
        return f"dp_{cls.kind}"

    def state_dict(self, destination=None):
        """Opacus's accountant state, plus the relation and the accounting event."""
        destination = super().state_dict(destination)
        destination["relation"] = self.relation
        destination["events"] = self.events.to_dict()
        return destination

    def load_state_dict(self, state_dict) -> None:
        """Restore the history saved by :meth:`state_dict`.

        A state saved under another configuration (accountant, relation, accounting event) is refused:
        loading it would account this run's steps as another mechanism's.

        Args:
            state_dict: The state saved by :meth:`state_dict`.

        Raises:
            ValueError: If the saved configuration differs from this accountant's, or the history is malformed
                (not ``(σ, q, count)`` triples with valid σ, q and integer count ≥ 1).
        """
        saved = (state_dict.get("mechanism"), state_dict.get("relation"), state_dict.get("events"))
        own = (self.mechanism(), self.relation, self.events.to_dict())
        if saved != own:
            raise ValueError(
                f"The saved accountant (accountant, relation, event) = {saved} is not this run's {own}: it belongs "
                "to another run or was edited; refusing to load it."
            )
        history = state_dict.get("history")
        if not isinstance(history, list) or not all(isinstance(h, (tuple, list)) and len(h) == 3 for h in history):
            raise ValueError(f"The saved accountant history is malformed: {history!r}.")
        for sigma, q, n in history:
            check_noise_multiplier(sigma)
            check_sample_rate(q)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"The saved accountant history has a step count {n!r}; counts are integers >= 1.")
        self.history = [(float(sigma), float(q), int(n)) for sigma, q, n in history]


@lru_cache(maxsize=64)
def _cached_epsilon(history, delta: float, kind: str, relation: str, events: StepEvent) -> float:
    return events.epsilon(history, delta, accountant=kind, relation=relation)


class DPRdpAccountant(DPAccountingAccountant):
    """dp-accounting RDP on Opacus's orders (agrees with Opacus ``rdp``)."""

    kind = "rdp"


class DPPldAccountant(DPAccountingAccountant):
    """dp-accounting privacy-loss distributions (tight; supports the replace-one relation)."""

    kind = "pld"


_BY_KIND = {"rdp": DPRdpAccountant, "pld": DPPldAccountant}
#: Names accepted by :class:`trl_userdp.PrivacyEngine` (Opacus's "prv" is served by PLD).
ACCOUNTANTS_BY_NAME = {
    "rdp": DPRdpAccountant, "dp_rdp": DPRdpAccountant, "pld": DPPldAccountant, "dp_pld": DPPldAccountant,
    "prv": DPPldAccountant,
}

for _cls in (DPRdpAccountant, DPPldAccountant):
    if _cls.mechanism() not in _ACCOUNTANTS:
        register_accountant(_cls.mechanism(), _cls)


def accountant_class(name: str) -> type:
    """The accountant class registered under a name.

    Args:
        name: ``"rdp"``, ``"pld"``, ``"prv"``, ``"dp_rdp"`` or ``"dp_pld"`` (``"prv"`` is served by PLD).

    Returns:
        :class:`DPRdpAccountant` or :class:`DPPldAccountant`.

    Raises:
        ValueError: If ``name`` is not one of these.
    """
    if name not in ACCOUNTANTS_BY_NAME:
        raise ValueError(f"accountant must be one of {sorted(ACCOUNTANTS_BY_NAME)}, got {name!r}.")
    return ACCOUNTANTS_BY_NAME[name]
