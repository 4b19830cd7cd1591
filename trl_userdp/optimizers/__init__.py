"""DP optimizers over users (Opacus ``DPOptimizer`` subclasses)."""

from .user_optimizer import PrivacyBudgetExhausted, UserDPOptimizer

__all__ = ["PrivacyBudgetExhausted", "UserDPOptimizer"]
