"""DP optimizers over users (Opacus ``DPOptimizer`` subclasses)."""

from .adaptive_clip_optimizer import AdaptiveClipUserDPOptimizer
from .aup_optimizer import AUPOptimizer
from .user_optimizer import DistributedUserDPOptimizer, PrivacyBudgetExhausted, UserDPOptimizer

__all__ = ["AUPOptimizer", "AdaptiveClipUserDPOptimizer", "DistributedUserDPOptimizer", "PrivacyBudgetExhausted",
           "UserDPOptimizer"]
