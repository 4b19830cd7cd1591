"""Data-parallel helpers: the world the engine runs in (``torch.distributed``), seeds every rank
must share, and identical starting parameters (what Opacus's ``DPDDP`` does at wrap time)."""

from __future__ import annotations

import secrets
from typing import Optional

import torch
from torch import nn


def world_size() -> int:
    """The number of processes in the default group.

    Returns:
        The world size (1 without an initialized ``torch.distributed``).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def rank() -> int:
    """This process's rank.

    Returns:
        The rank in the default group (0 with a single process).
    """
    return torch.distributed.get_rank() if world_size() > 1 else 0


def shared_seed(seed: Optional[int]) -> Optional[int]:
    """A seed every rank shares.

    Every rank must draw the same users (each keeps its shard), and nobody outside learns the draw.

    Args:
        seed: The user's seed, or None.

    Returns:
        ``seed``, or with several processes and no seed, one drawn from the OS on rank 0 and sent to all
        (None with one process and no seed).
    """
    if seed is not None or world_size() == 1:
        return seed
    box = [secrets.randbits(63) if rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])


def broadcast_parameters(module: nn.Module) -> None:
    """Copy rank 0's parameters to every rank, so that identical updates keep the replicas identical.

    Args:
        module: The model whose parameters are broadcast in place.
    """
    for p in module.parameters():
        torch.distributed.broadcast(p.data, src=0)
