"""Opacus accountants whose ε comes from dp-accounting.

They keep Opacus's ``(noise_multiplier, sample_rate, steps)`` history, so Opacus's optimizer
hook, ``get_noise_multiplier`` and ``PrivacyEngine.save_checkpoint`` work unchanged, and they are
registered with Opacus under ``"dp_rdp"`` and ``"dp_pld"``::

    opacus.PrivacyEngine(accountant="dp_pld")

With ``group_size=m`` the history is read as item-level DP-SGD steps and the reported ε is the
user-level guarantee through group privacy (SPEC §2 M2).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import dp_accounting as dpa
from opacus.accountants import IAccountant, RDPAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from ..validators import check_delta
from .analysis import compute_epsilon, neighboring_relation
from .events import poisson_gaussian_event


class DPAccountingAccountant(IAccountant):
    """Base class: Poisson-subsampled Gaussian steps composed in a dp-accounting accountant."""

    kind = "rdp"

    def __init__(self, *, relation: str = "add_or_remove", group_size: Optional[int] = None):
        neighboring_relation(relation)  # validates the name
        self.history = []
        self.relation = relation
        self.group_size = group_size

    #: Same history bookkeeping as Opacus: consecutive steps with equal (σ, q) are merged.
    step = RDPAccountant.step

    def event(self) -> dpa.DpEvent:
        """The composed dp-accounting event of every step taken so far."""
        return history_event(self.history)

    def get_epsilon(self, delta: float, **kwargs) -> float:
        check_delta(delta, "delta")
        if not self.history:
            return 0.0
        return _cached_epsilon(tuple(map(tuple, self.history)), delta, self.kind, self.relation, self.group_size)

    def __len__(self) -> int:
        return len(self.history)

    @classmethod
    def mechanism(cls) -> str:
        return f"dp_{cls.kind}"

    def state_dict(self, destination=None):
        destination = super().state_dict(destination)
        destination["relation"] = self.relation
        destination["group_size"] = self.group_size
        return destination

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.relation = state_dict.get("relation", self.relation)
        self.group_size = state_dict.get("group_size", self.group_size)


def history_event(history) -> dpa.DpEvent:
    """Opacus history ``[(σ, q, steps), ...]`` as one dp-accounting event."""
    return dpa.ComposedDpEvent([poisson_gaussian_event(s, q, n) for s, q, n in history])


@lru_cache(maxsize=64)
def _cached_epsilon(
    history: Tuple[Tuple[float, float, int], ...], delta: float, kind: str, relation: str, group_size
) -> float:
    return compute_epsilon(history_event(history), delta, accountant=kind, relation=relation, group_size=group_size)


class DPRdpAccountant(DPAccountingAccountant):
    """dp-accounting RDP on Opacus's orders (agrees with Opacus ``rdp``)."""

    kind = "rdp"


class DPPldAccountant(DPAccountingAccountant):
    """dp-accounting privacy-loss distributions (tight; supports the replace-one relation)."""

    kind = "pld"


for _cls in (DPRdpAccountant, DPPldAccountant):
    if _cls.mechanism() not in _ACCOUNTANTS:
        register_accountant(_cls.mechanism(), _cls)
