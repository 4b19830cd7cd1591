"""TRL trainer subclasses with user-level differential privacy (README, TRL trainers)."""

from .dpo_config import UserDPDPOConfig
from .dpo_trainer import UserDPDPOTrainer
from .fused_head import unfuse_lm_head
from .grpo_config import UserDPGRPOConfig
from .grpo_trainer import UserDPGRPOTrainer
from .kto_config import UserDPKTOConfig
from .kto_trainer import UserDPKTOTrainer
from .online import PublicPromptGRPOTrainer, PublicPromptRLOOTrainer, find_privacy_report
from .privacy_config import UserDPArguments
from .reward_config import UserDPRewardConfig
from .reward_trainer import UserDPRewardTrainer

__all__ = [
    "PublicPromptGRPOTrainer",
    "PublicPromptRLOOTrainer",
    "UserDPArguments",
    "UserDPDPOConfig",
    "UserDPDPOTrainer",
    "UserDPGRPOConfig",
    "UserDPGRPOTrainer",
    "UserDPKTOConfig",
    "UserDPKTOTrainer",
    "UserDPRewardConfig",
    "UserDPRewardTrainer",
    "find_privacy_report",
    "unfuse_lm_head",
]
