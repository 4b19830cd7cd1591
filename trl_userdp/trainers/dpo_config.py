"""``UserDPDPOConfig``: TRL's ``DPOConfig`` plus the user-level privacy fields."""

from __future__ import annotations

import dataclasses

from trl import DPOConfig

from .privacy_config import UserDPArguments


@dataclasses.dataclass
class UserDPDPOConfig(UserDPArguments, DPOConfig):
    """``DPOConfig`` with the fields of :class:`UserDPArguments` (README, TRL trainers)."""
