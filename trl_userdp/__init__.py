"""trl_userdp: user-level differential privacy for RLHF on Opacus and TRL."""

from .accountants import PrivacyReport
from .adaptive_engine import AdaptiveUserPrivacyEngine, propose_concentration_radius
from .data import UserDataLoader, bound_contributions
from .grad_sample import UserGradSampleHooks
from .optimizers import AUPOptimizer, PrivacyBudgetExhausted, UserDPOptimizer
from .privacy_engine import PrivacyEngine

__version__ = "0.1.0.dev0"

__all__ = [
    "AUPOptimizer",
    "AdaptiveUserPrivacyEngine",
    "PrivacyBudgetExhausted",
    "PrivacyEngine",
    "PrivacyReport",
    "UserDPOptimizer",
    "UserDataLoader",
    "UserGradSampleHooks",
    "__version__",
    "bound_contributions",
    "propose_concentration_radius",
]
