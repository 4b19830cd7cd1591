"""Who wrote each row: user ids from a ``datasets.Dataset`` column or an aligned sequence."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence

import numpy as np

DEFAULT_USER_COLUMN = "user_id"


@dataclasses.dataclass(frozen=True)
class UserIndex:
    """Rows grouped by user.

    Args:
        codes: ``codes[i]`` is the user of row ``i`` as an integer in ``[0, n_users)``.
        keys: ``keys[c]`` is the original id of code ``c``.
        rows: ``rows[c]`` holds the row indices of user ``c`` in increasing order.
    """

    codes: np.ndarray
    keys: np.ndarray
    rows: List[np.ndarray]

    @property
    def n_users(self) -> int:
        """The number of distinct users."""
        return len(self.keys)

    @property
    def n_rows(self) -> int:
        """The number of rows."""
        return len(self.codes)

    @property
    def counts(self) -> np.ndarray:
        """Rows per user, by user code."""
        return np.bincount(self.codes, minlength=self.n_users)

    @classmethod
    def from_ids(cls, ids: Sequence[Any]) -> "UserIndex":
        """Build the index of one user id per row.

        Args:
            ids: The user id of each row (a sequence, array or tensor).

        Returns:
            The index.

        Raises:
            ValueError: If an id is missing (``None``, NaN or pandas' NA: a row without a user cannot be
                bounded or accounted, and guessing one would silently break the guarantee), or ``ids`` is empty.
        """
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # tensors and arrays -> Python scalars
        for i, u in enumerate(ids):
            if _is_missing(u):
                raise ValueError(f"Row {i} has no user id ({u!r}); every row needs one for user-level DP.")
        if not ids:
            raise ValueError("The dataset is empty: there are no users to train on.")
        keys, codes = np.unique(np.asarray(ids), return_inverse=True)
        codes = codes.astype(np.int64).reshape(-1)
        order = np.argsort(codes, kind="stable")
        bounds = np.cumsum(np.bincount(codes, minlength=len(keys)))[:-1]
        return cls(codes=codes, keys=keys, rows=np.split(order, bounds))


def _is_missing(u: Any) -> bool:
    """None, NaN of any float type (Python, NumPy, a 0-d tensor) or pandas' NA."""
    if u is None or type(u).__name__ in ("NAType", "NaTType"):
        return True
    if hasattr(u, "item") and getattr(u, "ndim", None) == 0:  # NumPy scalar or 0-d tensor
        u = u.item()
    return isinstance(u, float) and math.isnan(u)


def is_hf_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` looks like a ``datasets.Dataset`` (has ``column_names`` and ``select``).

    Args:
        dataset: Any dataset.

    Returns:
        True for a ``datasets.Dataset``-like object.
    """
    return hasattr(dataset, "column_names") and hasattr(dataset, "select")


def resolve_user_ids(
    dataset: Any, *, user_column: str = DEFAULT_USER_COLUMN, user_ids: Optional[Sequence[Any]] = None
) -> UserIndex:
    """The :class:`UserIndex` of ``dataset``.

    Sources, in order: an explicit ``user_ids`` sequence aligned with the dataset; the
    ``user_ids`` attribute of a dataset returned by :func:`~trl_userdp.data.bound_contributions`;
    the ``user_column`` of a ``datasets.Dataset``.

    Args:
        dataset: The dataset.
        user_column: The user-id column of a ``datasets.Dataset``.
        user_ids: One user id per row, if given.

    Returns:
        The index.

    Raises:
        ValueError: If no source of user ids is found, their count differs from the dataset's rows,
            an id is missing, or the dataset is empty.
    """
    if user_ids is None:
        user_ids = getattr(dataset, "user_ids", None)
    if user_ids is None:
        if not is_hf_dataset(dataset):
            raise ValueError(
                f"Cannot find user ids for a {type(dataset).__name__}: pass `user_ids=` (one id per row), "
                f"or use a datasets.Dataset with a {user_column!r} column."
            )
        if user_column not in dataset.column_names:
            raise ValueError(
                f"The dataset has no user column {user_column!r} (columns: {dataset.column_names}). "
                "Add one (one id per row, the person who gave the label) or set `user_column`."
            )
        user_ids = dataset[user_column]
    if len(user_ids) != len(dataset):
        raise ValueError(f"user_ids has {len(user_ids)} entries but the dataset has {len(dataset)} rows.")
    return UserIndex.from_ids(user_ids)
