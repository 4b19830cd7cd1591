"""Privacy mechanisms, one descriptor each, in the registry every entry point uses (:mod:`.base`): no privacy,
user-level randomized response (labels, once, before training), the group-privacy baseline, user-wise DP-SGD with a
fixed or an adaptive clip, and AUP-RLHF (its formulas in :mod:`trl_userdp.mechanisms.aup`). Registration order is the
order they are listed in. The package imports no engine, optimizer or trainer: those import it."""

from .base import (
    MECHANISM_REGISTRY,
    AccountingSetting,
    GradientMechanism,
    Mechanism,
    NoPrivacy,
    WalkthroughColumn,
    get_mechanism,
    gradient_mechanism,
    mechanism_names,
    register_mechanism,
)
from .randomized_response import PRIVATIZED_COLUMN, RandomizedResponse, UserRandomizedResponse
from .group import GroupPrivacy
from .user_dpsgd import UserDPSGD
from .adaptive_clipping import AdaptiveClipUserDPSGD
from .aup import AUPRLHF

__all__ = [
    "AUPRLHF",
    "AccountingSetting",
    "AdaptiveClipUserDPSGD",
    "GradientMechanism",
    "MECHANISM_REGISTRY",
    "GroupPrivacy",
    "Mechanism",
    "NoPrivacy",
    "PRIVATIZED_COLUMN",
    "RandomizedResponse",
    "UserDPSGD",
    "UserRandomizedResponse",
    "WalkthroughColumn",
    "get_mechanism",
    "gradient_mechanism",
    "mechanism_names",
    "register_mechanism",
]
