"""The disjoint user phases of AUP-RLHF's Alg. 1 (Zhang et al.; docs/mechanisms.md, M4).

Phase ``i`` of ``k`` holds a share ``2^{−(k+1−i)}`` of the users (``phase_users="paper"``: Alg. 1 as
written, which leaves ``2^{−k}`` of them unused — half at ``k = 1``) or that geometric split rescaled
to use every user (``"all"``). Each user's phase is drawn from a generator keyed by its own id, so
adding or removing one user moves no other user between phases: neighbouring datasets differ in one
phase only, and the run is private by parallel composition."""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .bounding import UserSubset, user_rng
from .users import UserIndex, is_hf_dataset

PHASE_USERS = ("all", "paper")


def phase_shares(phases: int, phase_users: str = "all") -> np.ndarray:
    """Share of the users in each phase (smallest first, as in Alg. 1).

    Args:
        phases: The number of phases k ≥ 1.
        phase_users: ``"all"`` (geometric split rescaled to use every user) or ``"paper"`` (Alg. 1 as written).

    Returns:
        The k shares, ``2^{−(k+1−i)}`` for phase i (rescaled to sum to 1 with ``"all"``).

    Raises:
        ValueError: If ``phases`` is not an integer ≥ 1 or ``phase_users`` is unknown.
    """
    if isinstance(phases, bool) or not isinstance(phases, int) or phases < 1:
        raise ValueError(f"phases must be an integer >= 1, got {phases!r}.")
    if phase_users not in PHASE_USERS:
        raise ValueError(f"phase_users must be one of {PHASE_USERS}, got {phase_users!r}.")
    shares = np.array([2.0 ** -(phases + 1 - i) for i in range(1, phases + 1)])
    return shares / shares.sum() if phase_users == "all" else shares


def assign_phases(index: UserIndex, shares: np.ndarray, seed: Optional[int]) -> np.ndarray:
    """Phase of every user, one keyed uniform draw per user.

    Args:
        index: The users.
        shares: The share of the users in each phase (:func:`phase_shares`).
        seed: The run seed (None: OS randomness).

    Returns:
        The phase of each user code, in ``[0, len(shares))``, or ``-1`` for a user in no phase.
    """
    edges = np.cumsum(shares)
    draws = np.array([user_rng(seed, "phases", key).random() for key in index.keys.tolist()])
    phase = np.searchsorted(edges, draws, side="right")
    return np.where(phase < len(shares), phase, -1)


def phase_datasets(dataset: Any, index: UserIndex, phase_of_user: np.ndarray, phases: int) -> List[Any]:
    """The rows of each phase's users, in the original order.

    Args:
        dataset: The (bounded) dataset.
        index: Its users.
        phase_of_user: The phase of each user code (:func:`assign_phases`).
        phases: The number of phases.

    Returns:
        One dataset per phase: a ``datasets.Dataset`` stays one; any other dataset becomes a :class:`UserSubset`.
    """
    keep_hf = is_hf_dataset(dataset) and not hasattr(dataset, "user_ids")
    out = []
    for i in range(phases):
        users = np.flatnonzero(phase_of_user == i)
        rows = np.sort(np.concatenate([index.rows[u] for u in users])) if len(users) else np.zeros(0, dtype=int)
        if keep_hf:
            out.append(dataset.select(rows.tolist()))
        else:
            out.append(UserSubset(dataset, rows.tolist(), index.keys[index.codes[rows]].tolist()))
    return out
