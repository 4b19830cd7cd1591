"""``UserDataLoader``: the user-level counterpart of Opacus's ``DPDataLoader``."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from ..validators import check_max_samples_per_user
from .collate import UserCollator, UserTaggedDataset
from .sampler import UserPoissonSampler
from .users import DEFAULT_USER_COLUMN, UserIndex, resolve_user_ids


class UserDataLoader(DataLoader):
    """Yields user-level Poisson batches in the batch structure of the wrapped collator.

    Each step's users are drawn by :class:`UserPoissonSampler`; empty steps arrive as zero-row
    batches. The row → user map of a batch is recorded when the batch is *yielded* (so it is right
    with worker processes that run ahead) in :attr:`last_row_users`, and passed to every callback
    registered with :meth:`add_batch_callback` (the engine's hooks register themselves). With
    ``user_key``, dict batches carry the map under that key instead (for loops, like transformers'
    Trainer, that prefetch batches); then no callback runs.

    Args:
        dataset: The (bounded) dataset.
        users_per_batch: Expected users per step ``ñ``; ``q = ñ / n_users``.
        user_ids: One user id per row, overriding ``user_column``.
        user_column: The user-id column of a ``datasets.Dataset`` (removed from the rows the collator sees).
        max_samples_per_user: If given, the contribution bound m the dataset must already meet (bound it first
            with :func:`~trl_userdp.data.bound_contributions`).
        collate_fn: The collator to wrap (see :class:`~trl_userdp.data.UserCollator`).
        rows_per_example: Rows the collator emits per example (2 for TRL's preference collators).
        steps: Steps per pass; default ``round(1/q)``.
        max_users_per_batch: Truncate a step to this many users (AUP-RLHF).
        samples_per_user: Draw this many of a sampled user's rows per step instead of all of them.
        seed: The seed of the user draws (default: OS randomness).
        generator: The generator of the user draws.
        num_replicas: The number of data-parallel ranks.
        rank: This process's rank.
        user_key: If set, dict batches carry the row users under this key and no callback runs.
        micro_batches: Micro-batches of whole users per draw.
        **kwargs: Passed to ``torch.utils.data.DataLoader`` (not the batching arguments).

    Raises:
        ValueError: If ``kwargs`` holds a batching argument (``batch_size``, ``shuffle``, ``sampler``,
            ``batch_sampler``, ``drop_last``), a user has more than ``max_samples_per_user`` rows, the user ids
            cannot be resolved, or a sampler argument is invalid (:class:`~trl_userdp.data.UserPoissonSampler`).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        users_per_batch: float,
        user_ids: Optional[Sequence[Any]] = None,
        user_column: str = DEFAULT_USER_COLUMN,
        max_samples_per_user: Optional[int] = None,
        collate_fn: Optional[Callable] = None,
        rows_per_example: int = 1,
        steps: Optional[int] = None,
        max_users_per_batch: Optional[int] = None,
        samples_per_user: Optional[int] = None,
        seed: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        num_replicas: int = 1,
        rank: int = 0,
        user_key: Optional[str] = None,
        micro_batches: int = 1,
        **kwargs: Any,
    ):
        clash = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & kwargs.keys())
        if clash:
            raise ValueError(f"UserDataLoader draws its own batches over users; do not pass {clash}.")
        self.user_index: UserIndex = resolve_user_ids(dataset, user_column=user_column, user_ids=user_ids)
        if max_samples_per_user is not None:
            max_samples_per_user = check_max_samples_per_user(max_samples_per_user)
            worst = int(self.user_index.counts.max())
            if worst > max_samples_per_user:
                raise ValueError(
                    f"A user has {worst} rows, more than max_samples_per_user={max_samples_per_user}: "
                    "bound contributions first (trl_userdp.data.bound_contributions)."
                )
        self.max_samples_per_user = max_samples_per_user
        self.user_dataset = dataset
        tagged = UserTaggedDataset(dataset, self.user_index.codes, user_column)
        sampler = UserPoissonSampler(
            self.user_index,
            users_per_batch,
            steps=steps,
            max_users_per_batch=max_users_per_batch,
            samples_per_user=samples_per_user,
            seed=seed,
            generator=generator,
            num_replicas=num_replicas,
            rank=rank,
            micro_batches=micro_batches,
        )
        collator = UserCollator(collate_fn, template=tagged[0][0], rows_per_example=rows_per_example, user_key=user_key)
        super().__init__(tagged, batch_sampler=sampler, collate_fn=collator, **kwargs)
        self.user_key = user_key
        self.last_row_users: Optional[torch.Tensor] = None
        self._callbacks: List[Callable[[torch.Tensor], None]] = []
        #: iteration ends early once this returns True (AUP-RLHF's halt)
        self.stop_when: Optional[Callable[[], bool]] = None

    @property
    def user_sampler(self) -> UserPoissonSampler:
        """The batch sampler over users."""
        return self.batch_sampler

    @property
    def sample_rate(self) -> float:
        """User sampling rate ``q = users_per_batch / n_users`` (what the accountant uses)."""
        return self.batch_sampler.sample_rate

    @property
    def users_per_batch(self) -> float:
        """ñ, the expected users per step."""
        return self.batch_sampler.users_per_batch

    @property
    def n_users(self) -> int:
        """n, the users of the (bounded) dataset."""
        return self.user_index.n_users

    @property
    def micro_batches(self) -> int:
        """Micro-batches per draw (one optimizer step after all of them)."""
        return self.batch_sampler.micro_batches

    def add_batch_callback(self, fn: Callable[..., None]) -> None:
        """Register a callback run whenever a batch is yielded.

        Args:
            fn: Called as ``fn(row_users, continuation=...)``, with the batch's row → user map and
                ``continuation`` True for a micro-batch after the first of its draw.
        """
        self._callbacks.append(fn)

    def set_epoch(self, epoch: int) -> None:
        """Continue the user draws at an epoch (:meth:`UserPoissonSampler.set_epoch`).

        Args:
            epoch: The 0-based epoch.
        """
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(super().__iter__()):
            if self.stop_when is not None and self.stop_when():
                return
            if self.user_key is not None:  # the users travel inside the batch (Trainer path)
                yield item
                continue
            batch, row_users = item
            self.last_row_users = row_users
            for fn in self._callbacks:
                fn(row_users, continuation=i % self.micro_batches > 0)
            yield batch


class PhasedUserDataLoader:
    """AUP-RLHF's Alg. 1 phases run one after another.

    Phase ``i``'s :class:`UserDataLoader` (its own users, rate and step count) yields all its steps, then phase
    ``i + 1``'s. Before the first batch of a new phase every phase callback runs with the phase index (the engine
    switches the optimizer's σ, AboveThreshold and accountant there), so each batch must be stepped before the
    next is fetched.

    Args:
        loaders: One loader per phase, in order.
        steps_per_iteration: Steps one pass yields: the next ones of the schedule (an epoch's worth when the run
            was given in epochs), so ``for epoch in range(epochs): for batch in loader`` runs it all.

    Raises:
        ValueError: If ``loaders`` is empty.
    """

    def __init__(self, loaders: Sequence[UserDataLoader], steps_per_iteration: int):
        if not loaders:
            raise ValueError("A phased loader needs at least one phase.")
        self.loaders = list(loaders)
        self.steps_per_iteration = int(steps_per_iteration)
        self.phase = 0
        self.user_key: Optional[str] = None
        #: iteration ends early once this returns True (AUP-RLHF's halt)
        self.stop_when: Optional[Callable[[], bool]] = None
        self._phase_callbacks: List[Callable[[int], None]] = []
        self._iterator: Optional[Iterator[Any]] = None
        self._done = False

    def __len__(self) -> int:
        return self.steps_per_iteration

    @property
    def current(self) -> UserDataLoader:
        """The current phase's loader."""
        return self.loaders[self.phase]

    @property
    def sample_rate(self) -> float:
        """The current phase's user sampling rate."""
        return self.current.sample_rate

    @property
    def users_per_batch(self) -> float:
        """The current phase's ñ."""
        return self.current.users_per_batch

    @property
    def n_users(self) -> int:
        """Users over all phases."""
        return sum(loader.n_users for loader in self.loaders)

    @property
    def last_row_users(self) -> Optional[torch.Tensor]:
        """The row -> user map of the current phase's last batch."""
        return self.current.last_row_users

    def add_batch_callback(self, fn: Callable[[torch.Tensor], None]) -> None:
        """Register a batch callback with every phase's loader (:meth:`UserDataLoader.add_batch_callback`).

        Args:
            fn: Called as ``fn(row_users, continuation=...)`` whenever a batch is yielded.
        """
        for loader in self.loaders:
            loader.add_batch_callback(fn)

    def add_phase_callback(self, fn: Callable[[int], None]) -> None:
        """Register a callback run before the first batch of every phase after the first.

        Args:
            fn: Called as ``fn(phase)`` with the new phase's 0-based index.
        """
        self._phase_callbacks.append(fn)

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.steps_per_iteration):
            if self._done or (self.stop_when is not None and self.stop_when()):
                return
            batch = self._next_batch()
            if self._done:
                return
            yield batch

    def _next_batch(self) -> Any:
        while True:
            if self._iterator is None:
                self._iterator = iter(self.current)
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
                if self.phase + 1 == len(self.loaders):
                    self._done = True
                    return None
                self.phase += 1
                for fn in self._phase_callbacks:
                    fn(self.phase)
