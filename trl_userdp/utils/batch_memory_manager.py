"""``UserBatchMemoryManager``: Opacus's ``BatchMemoryManager`` for a :class:`~trl_userdp.data.UserDataLoader`.

Opacus splits each logical batch into physical batches by rows. At the user level that would cut a user's rows apart
(their clipped average needs all of them in one step), so this manager splits each draw of users into physical
batches of *whole* users, at most ``max_physical_batch_size`` rows each, and tells the optimizer, through Opacus's
``signal_skip_step``, which physical batch ends the draw. The loop is Opacus's: backward each physical batch (its
loss the mean of its own rows), call ``optimizer.step()`` and ``optimizer.zero_grad()`` after every one; only the
last of a draw clips, noises and takes (and accounts) the step. Same seeds give the same update as the whole draw in
one batch, with memory bounded by the physical batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, List

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch.utils.data import DataLoader

from ..data.loader import UserDataLoader


def take_rows(batch: Any, rows: torch.Tensor) -> Any:
    """Select rows (dim 0) of every tensor in a batch.

    Args:
        batch: A batch of tensors, in (nested) tuples, lists and mappings.
        rows: The row indices (LongTensor).

    Returns:
        The batch with every tensor indexed by ``rows``, in the same structure.

    Raises:
        TypeError: If the batch holds anything else (a named tuple, a string, ...).
    """
    if isinstance(batch, torch.Tensor):
        return batch[rows.to(batch.device)]
    if isinstance(batch, Mapping):
        return type(batch)({k: take_rows(v, rows) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(take_rows(v, rows) for v in batch)
    raise TypeError(f"UserBatchMemoryManager splits batches of tensors (in tuples, lists or dicts), got "
                    f"{type(batch).__name__}.")


def whole_user_chunks(row_users: torch.Tensor, max_rows: int) -> List[torch.Tensor]:
    """Split a draw into consecutive physical batches of whole users.

    Args:
        row_users: The user of each row ``[R]``; a user's rows are consecutive (the loader yields them together).
        max_rows: The most rows of one physical batch.

    Returns:
        The row indices of each physical batch (one empty batch for an empty draw).

    Raises:
        ValueError: If a user has more than ``max_rows`` rows.
    """
    if len(row_users) == 0:
        return [torch.zeros(0, dtype=torch.long)]
    starts = torch.cat([torch.tensor([0]), torch.nonzero(row_users[1:] != row_users[:-1]).flatten() + 1,
                        torch.tensor([len(row_users)])]).tolist()
    chunks, first = [], 0
    for begin, end in zip(starts[:-1], starts[1:]):
        if end - begin > max_rows:
            raise ValueError(f"A user has {end - begin} rows in this step, more than max_physical_batch_size="
                             f"{max_rows}: a user's rows cannot be split across physical batches; raise it to at "
                             "least max_samples_per_user.")
        if end - first > max_rows:
            chunks.append(torch.arange(first, begin))
            first = begin
    chunks.append(torch.arange(first, starts[-1]))
    return chunks


class UserSplittingLoader:
    """What :class:`UserBatchMemoryManager` hands to the loop.

    It yields the draws of ``loader`` in physical batches of whole users, with the hooks told which physical
    batches continue a draw and the optimizer which ones end it.

    Args:
        loader: The user-level loader.
        max_rows: The most rows of one physical batch.
        optimizer: The optimizer of ``make_private_user_level``.
    """

    def __init__(self, loader: UserDataLoader, max_rows: int, optimizer):
        self.loader, self.max_rows, self.optimizer = loader, max_rows, optimizer

    def __len__(self) -> int:
        return len(self.loader)  # draws; each yields one or more physical batches

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        for batch, row_users in DataLoader.__iter__(loader):  # one collated draw, split below
            if loader.stop_when is not None and loader.stop_when():
                return
            chunks = whole_user_chunks(row_users, self.max_rows)
            for j, rows in enumerate(chunks):
                loader.last_row_users = row_users[rows]
                for fn in loader._callbacks:
                    fn(loader.last_row_users, continuation=j > 0)
                self.optimizer.signal_skip_step_whole_users(do_skip=j < len(chunks) - 1)
                yield take_rows(batch, rows) if len(chunks) > 1 else batch


class UserBatchMemoryManager(BatchMemoryManager):
    """Opacus's ``BatchMemoryManager`` over the loader that ``make_private_user_level`` returned (module docstring).

    Args:
        data_loader: The :class:`~trl_userdp.data.UserDataLoader` of ``make_private_user_level``, in one process,
            without ``micro_batches``, ``user_key`` or ``rows_per_example > 1``.
        max_physical_batch_size: The most rows of one physical batch; at least the largest number of rows a user
            has in a step (``max_samples_per_user``).
        optimizer: The optimizer of ``make_private_user_level``.

    Raises:
        ValueError: If ``data_loader`` or ``optimizer`` is not of ``make_private_user_level`` or is configured as
            above, or ``max_physical_batch_size`` is not an integer ≥ 1 or is below ``max_samples_per_user``.
    """

    def __init__(self, *, data_loader: UserDataLoader, max_physical_batch_size: int, optimizer):
        if not isinstance(data_loader, UserDataLoader):
            raise ValueError(f"UserBatchMemoryManager needs the UserDataLoader of make_private_user_level, got "
                             f"{type(data_loader).__name__}; for item-level DP use Opacus's BatchMemoryManager.")
        if data_loader.micro_batches != 1 or data_loader.user_key is not None:
            raise ValueError("UserBatchMemoryManager splits whole draws: use it instead of micro_batches, and not on "
                             "the trainers' loader (they accumulate with gradient_accumulation_steps).")
        if data_loader.user_sampler.num_replicas > 1:  # ranks would split their shards into different numbers
            raise ValueError("UserBatchMemoryManager runs in one process: across processes each rank's shard splits "
                             "into its own number of physical batches, and the ranks' steps would not line up; use "
                             "micro_batches= (the same count on every rank).")
        if getattr(data_loader.collate_fn, "rows_per_example", 1) != 1:
            raise ValueError("UserBatchMemoryManager splits batches with one row per example; with "
                             "rows_per_example > 1 use micro_batches instead.")
        if not hasattr(optimizer, "signal_skip_step_whole_users"):
            raise ValueError("UserBatchMemoryManager needs the optimizer of make_private_user_level.")
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int) \
                or max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be an integer >= 1, got {max_physical_batch_size!r}.")
        cap = data_loader.max_samples_per_user
        if cap is not None and max_physical_batch_size < cap:
            raise ValueError(f"max_physical_batch_size={max_physical_batch_size} is below max_samples_per_user={cap}:"
                             " a user's rows cannot be split across physical batches.")
        super().__init__(data_loader=data_loader, max_physical_batch_size=max_physical_batch_size, optimizer=optimizer)

    def __enter__(self) -> UserSplittingLoader:
        return UserSplittingLoader(self.data_loader, self.max_physical_batch_size, self.optimizer)
