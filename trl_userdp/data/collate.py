"""Carry each row's user through any collator, and give empty steps the normal batch structure.

TRL's collators drop unknown keys (a ``user_id`` column would vanish) and crash on an empty list;
Opacus's empty-batch collate rebuilds shapes from ``dataset[0]`` and fails on dict rows. Here the
user travels beside the example (:class:`UserTaggedDataset`), and an empty step is the wrapped
collator's output for one template example, cut to zero rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate


class UserBatch(NamedTuple):
    """A collated batch and the user code of each of its rows (``row_users``, LongTensor [R])."""

    batch: Any
    row_users: torch.Tensor


class UserTaggedDataset(Dataset):
    """``dataset[i]`` paired with the user code of row ``i``.

    Args:
        dataset: The dataset.
        codes: The user code of each row (``UserIndex.codes``).
        user_column: If set, this key is removed from dict rows so the model never sees it.

    Raises:
        ValueError: If ``codes`` and ``dataset`` differ in length.
    """

    def __init__(self, dataset: Any, codes: Sequence[int], user_column: Optional[str] = None):
        if len(codes) != len(dataset):
            raise ValueError(f"{len(codes)} user codes for a dataset of {len(dataset)} rows.")
        self.dataset = dataset
        self.codes = np.asarray(codes, dtype=np.int64)
        self.user_column = user_column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        example = self.dataset[i]
        if self.user_column is not None and isinstance(example, Mapping) and self.user_column in example:
            example = {k: v for k, v in example.items() if k != self.user_column}
        return example, int(self.codes[i])


def empty_like(batch: Any) -> Any:
    """The same structure with zero rows.

    Args:
        batch: A collated batch: tensors, mappings, lists and tuples (named tuples included), nested.

    Returns:
        The batch with tensors cut to ``[:0]`` and per-example lists emptied; other leaves unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({k: empty_like(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if all(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            items = [empty_like(v) for v in batch]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        return type(batch)()
    return batch


class UserCollator:
    """Wraps a collate function for batches of ``(example, user_code)`` pairs.

    Args:
        collate_fn: the collator to wrap (default: PyTorch's ``default_collate``).
        template: one example (without its user column) used to shape empty steps.
        rows_per_example: rows the collator emits per example, stacked as blocks; TRL's preference
            collators emit ``[chosen; rejected]`` (2 rows per pair), so row ``i`` and ``B + i``
            belong to the same user.
        user_key: if set, the batch (a mapping) gets the row users under this key and is returned
            as is (the Trainer path); otherwise a :class:`UserBatch` is returned.

    Raises:
        ValueError: If ``rows_per_example`` < 1.
    """

    def __init__(
        self,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
        *,
        template: Any,
        rows_per_example: int = 1,
        user_key: Optional[str] = None,
    ):
        if rows_per_example < 1:
            raise ValueError(f"rows_per_example must be >= 1, got {rows_per_example}.")
        self.collate_fn = collate_fn or default_collate
        self.template = template
        self.rows_per_example = rows_per_example
        self.user_key = user_key

    def __call__(self, tagged: List[Tuple[Any, int]]) -> Any:
        """Collate ``(example, user_code)`` pairs.

        Args:
            tagged: The pairs of one batch (possibly none: an empty step).

        Returns:
            A :class:`UserBatch`, or with ``user_key`` the collated mapping with the row users added.

        Raises:
            ValueError: If ``user_key`` is set and the collator does not return a mapping.
        """
        examples = [example for example, _ in tagged]
        users = torch.tensor([user for _, user in tagged], dtype=torch.long)
        batch = self.collate_fn(examples) if examples else empty_like(self.collate_fn([self.template]))
        row_users = users.repeat(self.rows_per_example)
        if self.user_key is None:
            return UserBatch(batch, row_users)
        if not isinstance(batch, Mapping):
            raise ValueError(f"user_key={self.user_key!r} needs dict batches, the collator returned {type(batch)}.")
        batch[self.user_key] = row_users
        return batch
