"""User-level per-sample gradients on top of Opacus's grad samplers."""

from .checks import check_module, supply_position_ids
from .user_hooks import UserGradSampleHooks

__all__ = ["UserGradSampleHooks", "check_module", "supply_position_ids"]
