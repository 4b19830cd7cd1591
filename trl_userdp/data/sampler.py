"""User-level Poisson sampling (docs/privacy_model.md): each user joins a step independently with probability
``q = users_per_batch / n_users`` and brings all its rows (or ``k`` of them, AUP-RLHF Alg. 4).
Empty steps are yielded, not skipped: the accountant counts them and the optimizer adds noise."""

from __future__ import annotations

import secrets
from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler

from ..seeding import derive_seed
from ..validators import check_max_samples_per_user, check_users_per_batch, steps_per_epoch
from .users import UserIndex


class UserPoissonSampler(Sampler[List[int]]):
    """Batch sampler over users, usable as ``DataLoader(..., batch_sampler=...)``.

    Args:
        users: the :class:`UserIndex` of the (bounded) dataset.
        users_per_batch: expected users per step ``ñ`` (a float is fine); ``q = ñ / n_users``.
        steps: steps per pass over the loader; default ``round(1/q)`` (one epoch in expectation,
            as Opacus's ``DPDataLoader``).
        max_users_per_batch: truncated Poisson sampling: if more users are drawn, keep a uniform
            subset of this size (AUP-RLHF needs a bounded step; docs/mechanisms.md, M4).
        samples_per_user: draw ``k`` of a sampled user's rows per step instead of all of them.
        seed / generator: source of randomness; by default seeded from the OS, so nobody can replay
            the draws (a seed makes experiments reproducible, and is required with ``num_replicas > 1``
            so every rank draws the same users — keep it secret in deployment).
        num_replicas, rank: data-parallel sharding. Every rank draws the same users and keeps those
            with ``user % num_replicas == rank``, so the ranks' batches together form one Poisson step.
        micro_batches: yield each step's draw as this many consecutive micro-batches of whole users (as even
            as the users allow; some may be empty), for a large logical step in bounded memory: one draw, one
            optimizer step, one accounted step.

    Raises:
        ValueError: If ``users_per_batch`` is not in (0, n_users], ``steps`` or ``micro_batches`` is < 1,
            ``max_users_per_batch`` < ``users_per_batch``, ``samples_per_user`` is not an integer ≥ 1,
            ``rank`` is not in ``[0, num_replicas)``, or ``num_replicas > 1`` without a seed or generator.
    """

    def __init__(
        self,
        users: UserIndex,
        users_per_batch: float,
        *,
        steps: Optional[int] = None,
        max_users_per_batch: Optional[int] = None,
        samples_per_user: Optional[int] = None,
        seed: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        num_replicas: int = 1,
        rank: int = 0,
        micro_batches: int = 1,
    ):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}.")
        self.micro_batches = micro_batches
        self.users = users
        self.users_per_batch = check_users_per_batch(users_per_batch, users.n_users)
        self.sample_rate = self.users_per_batch / users.n_users
        self.steps = steps_per_epoch(self.sample_rate) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps!r}.")
        if max_users_per_batch is not None and max_users_per_batch < self.users_per_batch:
            raise ValueError(
                f"max_users_per_batch ({max_users_per_batch}) must be >= users_per_batch ({users_per_batch})."
            )
        self.max_users_per_batch = max_users_per_batch
        self.samples_per_user = (
            None if samples_per_user is None else check_max_samples_per_user(samples_per_user, "samples_per_user")
        )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must lie in [0, num_replicas), got rank={rank}, num_replicas={num_replicas}.")
        if num_replicas > 1 and seed is None and generator is None:
            raise ValueError("With num_replicas > 1 pass a `seed` shared by all ranks, so they draw the same users.")
        self.seed = seed
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(secrets.randbits(63))  # unpredictable; with a seed, re-keyed at every step
        self.generator = generator
        #: steps drawn so far (0-based index of the next one). With a seed, step t's draws come from
        #: ``derive_seed(seed, "sampling", t)``, so setting it (the engine does on resume, to the accounted steps)
        #: continues the run's stream instead of replaying it. Without a seed every draw is fresh OS randomness.
        self.position = 0
        #: draws a resumed run takes in its first epoch without replaying them (transformers' ``ignore_data_skip``:
        #: the Trainer starts the epoch at its first draw instead of skipping the ones already taken); every later
        #: epoch starts that many draws later too, so no position is ever drawn twice
        self.resume_offset = 0
        self.num_replicas = num_replicas
        self.rank = rank

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def set_epoch(self, epoch: int) -> None:
        """Continue at the first step of an epoch, shifted by :attr:`resume_offset`: see :attr:`position`.

        Transformers' Trainer calls this, then skips the steps a resumed run already took.

        Args:
            epoch: The 0-based epoch.
        """
        self.position = int(epoch) * self.steps + self.resume_offset

    def sample_users(self) -> torch.Tensor:
        """One step's users (all ranks): Poisson with rate q, truncated to ``max_users_per_batch``.

        Returns:
            The sampled user codes, a sorted LongTensor (possibly empty).
        """
        n = self.users.n_users
        users = torch.nonzero(torch.rand(n, generator=self.generator) < self.sample_rate).flatten()
        cap = self.max_users_per_batch
        if cap is not None and len(users) > cap:
            users = users[torch.randperm(len(users), generator=self.generator)[:cap]].sort().values
        return users

    def _rows(self, user: int) -> List[int]:
        rows = self.users.rows[user]
        k = self.samples_per_user
        if k is not None and len(rows) > k:
            rows = rows[torch.randperm(len(rows), generator=self.generator)[:k].sort().values.numpy()]
        return rows.tolist()

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            if self.seed is not None:  # step t's users from (seed, t): a resumed run continues, never replays
                self.generator.manual_seed(derive_seed(self.seed, "sampling", self.position))
            self.position += 1
            users = self.sample_users()
            mine: List[List[int]] = []
            for u in users.tolist():
                rows = self._rows(u)  # drawn on every rank, so generators stay in step
                if u % self.num_replicas == self.rank:
                    mine.append(rows)
            k = self.micro_batches
            for i in range(k):
                yield [r for rows in mine[i * len(mine) // k: (i + 1) * len(mine) // k] for r in rows]
