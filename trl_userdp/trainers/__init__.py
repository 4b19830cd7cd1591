"""TRL trainer subclasses with user-level differential privacy (SPEC §5)."""

from .dpo_config import UserDPDPOConfig
from .dpo_trainer import UserDPDPOTrainer, unfuse_lm_head
from .privacy_config import GRADIENT_MECHANISMS, PRIVACY_MECHANISMS, UserDPArguments
from .reward_config import UserDPRewardConfig
from .reward_trainer import UserDPRewardTrainer

__all__ = [
    "GRADIENT_MECHANISMS",
    "PRIVACY_MECHANISMS",
    "UserDPArguments",
    "UserDPDPOConfig",
    "UserDPDPOTrainer",
    "UserDPRewardConfig",
    "UserDPRewardTrainer",
    "unfuse_lm_head",
]
