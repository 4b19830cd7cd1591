"""Opacus accountants whose ε comes from dp-accounting.

They keep Opacus's ``(noise_multiplier, sample_rate, steps)`` history, so Opacus's optimizer
hook, ``get_noise_multiplier`` and ``PrivacyEngine.save_checkpoint`` work unchanged, and they are
registered with Opacus under ``"dp_rdp"`` and ``"dp_pld"``::

    opacus.PrivacyEngine(accountant="dp_pld")

With ``group_size=m`` the history is read as item-level DP-SGD steps (records sampled at rate q,
each clipped) and the reported ε is the user-level guarantee for users of at most ``m`` records:
through group privacy, or with ``els=True`` through ELS accounting (docs/mechanisms.md, M2). With
``truncation=(n_users, max_users)`` steps are truncated-Poisson-sampled (AUP-RLHF, docs/mechanisms.md, M4).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import dp_accounting as dpa
from opacus.accountants import IAccountant, RDPAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from ..validators import check_delta, check_noise_multiplier, check_sample_rate
from .analysis import compute_epsilon, neighboring_relation
from .events import els_event, poisson_gaussian_event, truncated_poisson_gaussian_event

#: PLD discretisation for ELS and truncated sampling: their PLDs are 10-70x slower at dp-accounting's
#: default 1e-4; the coarser grid is still an upper bound (pessimistic rounding).
COARSE_DISCRETIZATION = 1e-3


class DPAccountingAccountant(IAccountant):
    """Base class: Poisson-subsampled Gaussian steps composed in a dp-accounting accountant."""

    kind = "rdp"

    def __init__(
        self,
        *,
        relation: str = "add_or_remove",
        group_size: Optional[int] = None,
        els: bool = False,
        truncation: Optional[Tuple[int, int]] = None,
    ):
        neighboring_relation(relation)  # validates the name
        if els and (self.kind != "pld" or group_size is None):
            raise ValueError("ELS accounting needs the PLD accountant and a group_size (records per user).")
        if truncation is not None and self.kind != "pld":
            raise ValueError("Truncated Poisson sampling is accounted by dp-accounting's PLD accountant only.")
        self.history = []
        self.relation = relation
        self.group_size = group_size
        self.els = els
        self.truncation = None if truncation is None else tuple(truncation)

    def _config(self) -> tuple:
        return (self.kind, self.relation, self.group_size, self.els, self.truncation)

    def spawn(self) -> "DPAccountingAccountant":
        """An empty accountant with the same configuration."""
        return type(self)(relation=self.relation, group_size=self.group_size, els=self.els, truncation=self.truncation)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step at (σ, q); consecutive equal steps merge, as in Opacus's accountants."""
        check_noise_multiplier(noise_multiplier)
        check_sample_rate(sample_rate)
        RDPAccountant.step(self, noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    @property
    def conversion_group_size(self) -> Optional[int]:
        """The group size for the group-privacy conversion (None for user-level and ELS)."""
        return None if self.els else self.group_size

    @property
    def options(self) -> dict:
        """Extra dp-accounting accountant options for this accountant's events."""
        coarse = self.els or self.truncation is not None
        return {"value_discretization_interval": COARSE_DISCRETIZATION} if coarse else {}

    def step_event(self, noise_multiplier: float, sample_rate: float, steps: int) -> dpa.DpEvent:
        """The event of ``steps`` steps at (σ, q)."""
        if self.els:
            return els_event(noise_multiplier, sample_rate, steps, self.group_size)
        if self.truncation is not None:
            return truncated_poisson_gaussian_event(noise_multiplier, sample_rate, steps, *self.truncation)
        return poisson_gaussian_event(noise_multiplier, sample_rate, steps)

    def event(self) -> dpa.DpEvent:
        """The composed dp-accounting event of every step taken so far."""
        return dpa.ComposedDpEvent([self.step_event(s, q, n) for s, q, n in self.history])

    def get_epsilon(self, delta: float, **kwargs) -> float:
        check_delta(delta, "delta")
        if not self.history:
            return 0.0
        return _cached_epsilon(tuple(map(tuple, self.history)), delta, self._config())

    def __len__(self) -> int:
        return len(self.history)

    @property
    def steps_taken(self) -> int:
        """Steps accounted so far (empty steps included)."""
        return sum(n for _, _, n in self.history)

    def supports_relation(self, sample_rate: float) -> bool:
        """Whether dp-accounting can account this accountant's steps under its relation."""
        from .analysis import make_accountant

        probe = make_accountant(self.kind, self.relation, self.conversion_group_size, **self.options)
        return probe.supports(self.step_event(1.0, sample_rate, 1))

    @classmethod
    def mechanism(cls) -> str:
        return f"dp_{cls.kind}"

    def state_dict(self, destination=None):
        destination = super().state_dict(destination)
        destination["relation"] = self.relation
        destination["group_size"] = self.group_size
        destination["els"] = self.els
        destination["truncation"] = self.truncation
        return destination

    def load_state_dict(self, state_dict) -> None:
        """Restore the history saved by :meth:`state_dict`. A state saved under another configuration
        (accountant, relation, group size, ELS, truncation) or with a malformed history is refused: loading it
        would account this run's steps as another mechanism's."""
        truncation = state_dict.get("truncation")
        saved = (state_dict.get("mechanism"), state_dict.get("relation"), state_dict.get("group_size"),
                 state_dict.get("els"), None if truncation is None else tuple(truncation))
        own = (self.mechanism(), self.relation, self.group_size, self.els, self.truncation)
        if saved != own:
            raise ValueError(
                "The saved accountant (mechanism, relation, group_size, els, truncation) = "
                f"{saved} is not this run's {own}: it belongs to another run or was edited; refusing to load it."
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
def _cached_epsilon(history, delta: float, config: tuple) -> float:
    kind, relation, group_size, els, truncation = config
    acc = _BY_KIND[kind](relation=relation, group_size=group_size, els=els, truncation=truncation)
    acc.history = list(history)
    return compute_epsilon(
        acc.event(), delta, accountant=kind, relation=relation, group_size=acc.conversion_group_size, **acc.options
    )


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
    """The accountant class registered under ``name`` (``"rdp"``, ``"pld"``, ``"prv"``, ``"dp_rdp"``, ``"dp_pld"``)."""
    if name not in ACCOUNTANTS_BY_NAME:
        raise ValueError(f"accountant must be one of {sorted(ACCOUNTANTS_BY_NAME)}, got {name!r}.")
    return ACCOUNTANTS_BY_NAME[name]
