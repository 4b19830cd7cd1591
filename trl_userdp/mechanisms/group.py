"""The item-level baseline made user-level (docs/mechanisms.md, M2): records Poisson-sampled at the users' rate q,
each record's gradient clipped, and the user-level ε from group privacy over a user's m records
(``accounting="conversion"``) or from ELS accounting (``"els"``, Charles et al. 2024, PLD only)."""

from __future__ import annotations

from typing import Any

from ..accountants.events import ELSGaussian, GroupPrivacyGaussian, StepEvent
from ..validators import steps_per_epoch
from .base import GradientMechanism, register_mechanism

GROUP_ACCOUNTING = ("conversion", "els")


@register_mechanism
class GroupPrivacy(GradientMechanism):
    name = "group"
    summary = "item-level DP-SGD with group-privacy (or ELS) accounting over a user's m records"
    clipping_unit = "record"

    def __init__(self, accounting: str = "conversion"):
        if accounting not in GROUP_ACCOUNTING:
            raise ValueError(f"group_accounting must be one of {GROUP_ACCOUNTING}, got {accounting!r}.")
        self.accounting = accounting

    @classmethod
    def from_options(cls, *, group_accounting: str = "conversion", **options: Any) -> "GroupPrivacy":
        return cls(group_accounting)

    @classmethod
    def from_arguments(cls, args: Any) -> "GroupPrivacy":
        return cls(args.group_accounting)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        cls(args.group_accounting)
        if args.group_accounting == "els" and args.accountant not in ("pld", "dp_pld", "prv"):
            raise ValueError("group_accounting='els' needs accountant='pld'.")

    @property
    def report_name(self) -> str:
        return "group_els" if self.accounting == "els" else "group"

    def make_loader(self, dataset, *, n_users, users_per_batch, max_samples_per_user, **loader_options):
        """Every record is its own sampling and clipping unit, sampled at the users' rate q."""
        from ..data import UserDataLoader

        q = users_per_batch / n_users
        loader = UserDataLoader(dataset, users_per_batch=q * len(dataset), user_ids=range(len(dataset)),
                                steps=steps_per_epoch(q), **loader_options)
        return loader, q * len(dataset)

    def step_event(self, *, max_samples_per_user: int, n_users: int) -> StepEvent:
        if self.accounting == "els":
            return ELSGaussian(max_samples_per_user)
        return GroupPrivacyGaussian(max_samples_per_user)
