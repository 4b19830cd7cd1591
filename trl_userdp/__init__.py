"""trl_userdp: user-level differential privacy for RLHF on Opacus and TRL."""

from .accountants import PrivacyReport
from .adaptive_engine import AdaptiveUserPrivacyEngine, propose_concentration_radius, propose_concentration_radius_private
from .data import UserDataLoader, bound_contributions
from .grad_sample import UserGradSampleHooks
from .optimizers import AUPOptimizer, PrivacyBudgetExhausted, UserDPOptimizer
from .privacy_engine import PrivacyEngine

__version__ = "0.1.0.dev0"

#: Trainer names, imported on first use (they pull in transformers' Trainer and TRL).
_TRAINERS = (
    "UserDPDPOConfig",
    "UserDPDPOTrainer",
    "UserDPGRPOTrainer",
    "UserDPKTOConfig",
    "UserDPKTOTrainer",
    "UserDPRLOOTrainer",
    "UserDPRewardConfig",
    "UserDPRewardTrainer",
)


def __getattr__(name: str):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    *_TRAINERS,
    "bound_contributions",
    "propose_concentration_radius",
    "propose_concentration_radius_private",
]
