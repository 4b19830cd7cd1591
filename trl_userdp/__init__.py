"""trl_userdp: user-level differential privacy for RLHF on Opacus and TRL.

The names below are imported on first use, so that importing a lower layer (``trl_userdp.mechanisms``,
``trl_userdp.accountants``, ``trl_userdp.data``) does not pull in the engines, the optimizers or the trainers.
"""

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

#: public name -> the module that defines it
_EXPORTS = {
    "AUPOptimizer": ".optimizers",
    "AdaptiveUserPrivacyEngine": ".adaptive_engine",
    "PrivacyBudgetExhausted": ".optimizers",
    "PrivacyEngine": ".privacy_engine",
    "PrivacyReport": ".accountants",
    "UserDPOptimizer": ".optimizers",
    "UserDataLoader": ".data",
    "UserGradSampleHooks": ".grad_sample",
    "bound_contributions": ".data",
    "load_reward_model": ".models",
    "small_causal_lm": ".models",
    "propose_concentration_radius": ".adaptive_engine",
    "propose_concentration_radius_private": ".adaptive_engine",
    # the trainers pull in transformers' Trainer and TRL
    "UserDPDPOConfig": ".trainers",
    "UserDPDPOTrainer": ".trainers",
    "UserDPGRPOConfig": ".trainers",
    "UserDPGRPOTrainer": ".trainers",
    "UserDPKTOConfig": ".trainers",
    "UserDPKTOTrainer": ".trainers",
    "PublicPromptGRPOTrainer": ".trainers",
    "PublicPromptRLOOTrainer": ".trainers",
    "UserDPRewardConfig": ".trainers",
    "UserDPRewardTrainer": ".trainers",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *sorted(_EXPORTS)]
