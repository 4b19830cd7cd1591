"""DP optimizers over users (Opacus ``DPOptimizer`` subclasses)."""

from .aup_optimizer import AUPOptimizer
from .user_optimizer import PrivacyBudgetExhausted, UserDPOptimizer

__all__ = ["AUPOptimizer", "PrivacyBudgetExhausted", "UserDPOptimizer"]
