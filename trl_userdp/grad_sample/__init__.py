"""User-level per-sample gradients on top of Opacus's grad samplers."""

from .checks import check_module, supply_position_ids
from .ghost import UserGhostHooks
from .user_hooks import UserGradSampleHooks

__all__ = ["UserGhostHooks", "UserGradSampleHooks", "check_module", "supply_position_ids"]
