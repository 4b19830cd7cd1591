"""``UserDPKTOConfig``: TRL's ``KTOConfig`` plus the user-level privacy fields."""

from __future__ import annotations

import dataclasses

from trl import KTOConfig

from .privacy_config import UserDPArguments


@dataclasses.dataclass
class UserDPKTOConfig(UserDPArguments, KTOConfig):
    """``KTOConfig`` with the fields of :class:`UserDPArguments` (README, TRL trainers)."""
