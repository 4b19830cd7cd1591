"""Contribution bounding (docs/privacy_model.md): each user keeps at most ``m`` rows, chosen once, before training,
by a seeded uniform draw. Without this bound no user-level guarantee holds."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Subset

from ..seeding import derive_seed, user_key
from ..validators import check_max_samples_per_user
from .users import DEFAULT_USER_COLUMN, UserIndex, is_hf_dataset, resolve_user_ids


@dataclasses.dataclass(frozen=True)
class BoundingReport:
    """What contribution bounding did: users, rows in, rows kept and rows dropped.

    Args:
        n_users: The number of users.
        max_samples_per_user: The contribution bound m.
        rows_in: Rows before bounding.
        rows_kept: Rows after bounding.
        rows_dropped: ``rows_in − rows_kept``.
        users_truncated: Users who had more than m rows.
        seed: The seed of the draw (None: OS randomness).
    """

    n_users: int
    max_samples_per_user: int
    rows_in: int
    rows_kept: int
    rows_dropped: int
    users_truncated: int
    seed: Optional[int]


class UserSubset(Subset):
    """A ``torch.utils.data.Subset`` that remembers the user id of each kept row.

    Args:
        dataset: The full dataset.
        indices: The kept rows' indices into ``dataset``.
        user_ids: The user id of each kept row, aligned with ``indices``.
    """

    def __init__(self, dataset: Any, indices: Sequence[int], user_ids: Sequence[Any]):
        super().__init__(dataset, list(indices))
        self.user_ids = list(user_ids)


def bound_contributions(
    dataset: Any,
    max_samples_per_user: int,
    *,
    user_column: str = DEFAULT_USER_COLUMN,
    user_ids: Optional[Sequence[Any]] = None,
    seed: Optional[int] = 0,
) -> Tuple[Any, BoundingReport]:
    """Keep at most ``max_samples_per_user`` rows per user (uniformly at random, seeded per user).

    Bounding a bounded dataset again drops nothing.

    Args:
        dataset: The dataset (a ``datasets.Dataset`` or any sized, indexable dataset).
        max_samples_per_user: The contribution bound m.
        user_column: The user-id column of a ``datasets.Dataset``.
        user_ids: One user id per row, overriding ``user_column``.
        seed: The seed of the per-user draws (None: OS randomness).

    Returns:
        The bounded dataset, in the original row order, and a :class:`BoundingReport`. A ``datasets.Dataset``
        comes back as a ``datasets.Dataset`` (its user column rides along); any other dataset as a
        :class:`UserSubset` carrying the kept rows' ``user_ids``.

    Raises:
        ValueError: If ``max_samples_per_user`` is not an integer ≥ 1, or the user ids cannot be resolved
            (see :func:`~trl_userdp.data.resolve_user_ids`).
    """
    m = check_max_samples_per_user(max_samples_per_user)
    index = resolve_user_ids(dataset, user_column=user_column, user_ids=user_ids)
    kept = _draw_rows(index, m, seed)
    report = BoundingReport(
        n_users=index.n_users,
        max_samples_per_user=m,
        rows_in=index.n_rows,
        rows_kept=len(kept),
        rows_dropped=index.n_rows - len(kept),
        users_truncated=int((index.counts > m).sum()),
        seed=seed,
    )
    if is_hf_dataset(dataset) and user_ids is None and not hasattr(dataset, "user_ids"):
        return dataset.select(kept.tolist()), report
    return UserSubset(dataset, kept.tolist(), index.keys[index.codes[kept]].tolist()), report


def user_rng(seed: Optional[int], stream: str, key: Any) -> np.random.Generator:
    """A generator for one user, keyed by the user's id.

    Adding or removing another user leaves this user's draw unchanged, so bounded neighbouring datasets still
    differ in one user only.

    Args:
        seed: The run seed (None: OS randomness).
        stream: The use (``"bounding"``, ``"phases"``; :func:`~trl_userdp.seeding.derive_seed`).
        key: The user's original id.

    Returns:
        A ``numpy.random.Generator``.
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(derive_seed(seed, stream, user_key(key)))


def _draw_rows(index: UserIndex, m: int, seed: Optional[int]) -> np.ndarray:
    kept = [
        rows if len(rows) <= m else np.sort(user_rng(seed, "bounding", key).choice(rows, size=m, replace=False))
        for key, rows in zip(index.keys.tolist(), index.rows)
    ]
    return np.sort(np.concatenate(kept))
