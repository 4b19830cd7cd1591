"""trl_userdp: user-level differential privacy for RLHF on Opacus and TRL."""

from .accountants import PrivacyReport

__version__ = "0.1.0.dev0"

__all__ = ["PrivacyReport", "__version__"]
