"""Utilities mirroring ``opacus.utils`` at the user level."""

from .batch_memory_manager import UserBatchMemoryManager

__all__ = ["UserBatchMemoryManager"]
