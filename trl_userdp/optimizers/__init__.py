"""DP optimizers over users (Opacus ``DPOptimizer`` subclasses)."""

from .aup_optimizer import AUPOptimizer
from .user_optimizer import DistributedUserDPOptimizer, PrivacyBudgetExhausted, UserDPOptimizer

__all__ = ["AUPOptimizer", "DistributedUserDPOptimizer", "PrivacyBudgetExhausted", "UserDPOptimizer"]
