"""The item-level baseline made user-level (docs/mechanisms.md, M2): records Poisson-sampled at the users' rate q,
each record's gradient clipped, and the user-level ε from group privacy over a user's m records
(``accounting="conversion"``) or from ELS accounting (``"els"``, Charles et al. 2024, PLD only)."""

from __future__ import annotations

from typing import Any, Tuple

from ..accountants.events import ELSGaussian, GroupPrivacyGaussian, StepEvent
from ..data import UserDataLoader
from ..validators import steps_per_epoch
from .base import AccountingSetting, GradientMechanism, WalkthroughColumn, register_mechanism

GROUP_ACCOUNTING = ("conversion", "els")


@register_mechanism
class GroupPrivacy(GradientMechanism):
    """Item-level DP-SGD accounted per user.

    Args:
        accounting: ``"conversion"`` (group privacy over m records) or ``"els"`` (Charles et al. 2024; PLD only).

    Raises:
        ValueError: an unknown ``accounting``.
    """

    name = "group"
    summary = "item-level DP-SGD with group-privacy (or ELS) accounting over a user's m records"
    clipping_unit = "record"
    walkthrough_notes = (
        "group σ: item-level DP-SGD whose (ε/m, δ/(m·e^{(m-1)ε/m})) guarantee gives (ε, δ) per user by group privacy.",
        "ELS σ: the same item-level DP-SGD accounted per user directly (Charles et al. 2024, mixture of Gaussians).")

    def __init__(self, accounting: str = "conversion"):
        if accounting not in GROUP_ACCOUNTING:
            raise ValueError(f"group_accounting must be one of {GROUP_ACCOUNTING}, got {accounting!r}.")
        self.accounting = accounting

    @classmethod
    def from_arguments(cls, args: Any) -> "GroupPrivacy":
        """The accounting of ``args.group_accounting``."""
        return cls(args.group_accounting)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        """Checks ``group_accounting``, and that ELS accounting runs on the PLD accountant."""
        cls(args.group_accounting)
        if args.group_accounting == "els" and args.accountant not in ("pld", "dp_pld", "prv"):
            raise ValueError("group_accounting='els' needs accountant='pld'.")

    @property
    def report_name(self) -> str:
        """``group_els`` under ELS accounting, else ``group``."""
        return "group_els" if self.accounting == "els" else "group"

    def make_loader(self, dataset, *, n_users, users_per_batch, max_samples_per_user, **loader_options):
        """Every record is its own sampling and clipping unit, sampled at the users' rate q."""
        q = users_per_batch / n_users
        loader = UserDataLoader(dataset, users_per_batch=q * len(dataset), user_ids=range(len(dataset)),
                                steps=steps_per_epoch(q), **loader_options)
        return loader, q * len(dataset)

    def step_event(self, *, max_samples_per_user: int, n_users: int, users_per_batch: float) -> StepEvent:
        """Group privacy over a user's m records, or ELS's accounting of them (Charles et al. 2024)."""
        if self.accounting == "els":
            return ELSGaussian(max_samples_per_user)
        return GroupPrivacyGaussian(max_samples_per_user)

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """σ under group-privacy and under ELS accounting, both PLD."""
        plan = dict(sample_rate=setting.sample_rate, steps=setting.steps, accountant="pld", tol=1e-3)
        m = setting.max_samples_per_user  # records are sampled at the users' rate q
        return (WalkthroughColumn("group σ", "(PLD)", GroupPrivacyGaussian(m).calibrate(epsilon, setting.delta, **plan),
                                  digits=3),
                WalkthroughColumn("ELS σ", "(PLD)", ELSGaussian(m).calibrate(epsilon, setting.delta, **plan), digits=3))
