"""``UserDPRewardConfig``: TRL's ``RewardConfig`` plus the user-level privacy fields."""

from __future__ import annotations

import dataclasses

from trl import RewardConfig

from .privacy_config import UserDPArguments


@dataclasses.dataclass
class UserDPRewardConfig(UserDPArguments, RewardConfig):
    """``RewardConfig`` with the fields of :class:`UserDPArguments` (README, TRL trainers)."""
