"""User-level per-sample gradients on top of Opacus's grad samplers."""

from .checks import check_module
from .ghost import UserGhostHooks
from .positions import RowPositions
from .relative_positions import RowRelativePositions
from .user_hooks import UserGradSampleHooks

__all__ = ["UserGhostHooks", "UserGradSampleHooks", "RowPositions", "RowRelativePositions", "check_module"]
