"""The set-up options both engines take (``**options`` of ``make_private_user_level``), defined and checked once."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from . import distributed
from .data import DEFAULT_USER_COLUMN

GRAD_SAMPLE_MODES = ("hooks", "functorch", "ghost")


@dataclasses.dataclass(frozen=True)
class SetupOptions:
    """Who wrote each row, how rows are laid out, the seeds, and how per-sample gradients are computed.

    Args:
        user_ids: one user per row (else the ``user_column`` of a ``datasets.Dataset``).
        user_column: the column naming each row's user.
        rows_per_example: 2 for collators that emit ``[chosen; rejected]`` rows stacked in two blocks (row i and row
            B + i are one example, as in TRL; an interleaved layout would be mis-assigned and is not detectable).
        bounding_seed: which rows a user keeps when it has more than m (a function of that user's rows only).
        sampling_seed: the user sampling (default: drawn from the OS).
        noise_generator: the noise's generator; or ``noise_seed``: a generator keyed by (seed, step), which a
            resumed run continues instead of replaying (default: seeded from the OS).
        self_check: compare the first step's per-user gradients with autograd's.
        grad_sample_mode: ``"hooks"`` or ``"functorch"`` (per-user gradients from Opacus's per-sample gradients), or
            ``"ghost"``: per-user ghost clipping, which clips without materialising per-user gradients (memory and
            time near non-private training; :class:`~trl_userdp.grad_sample.UserGhostHooks`).
        user_key: put each batch's row -> user map into the (dict) batch under this key; the training loop hands it
            to ``optimizer.hooks.set_row_users`` itself (for loops that prefetch batches, like the Trainer).
        micro_batches: the loader yields each draw of users as this many micro-batches of whole users; run the
            backward pass of each and call ``optimizer.step()`` once after the last. A large logical step in bounded
            activation memory; one draw is one accounted step. Each micro-batch's loss should be the mean of its
            own rows: dividing it by ``micro_batches`` as usual gradient accumulation does scales every user's
            gradient down (still private; the clip then acts as ``micro_batches·C``).
    """

    user_ids: Optional[Sequence[Any]] = None
    user_column: str = DEFAULT_USER_COLUMN
    rows_per_example: int = 1
    bounding_seed: Optional[int] = 0
    sampling_seed: Optional[int] = None
    noise_generator: Optional[torch.Generator] = None
    noise_seed: Optional[int] = None
    self_check: bool = True
    grad_sample_mode: str = "hooks"
    user_key: Optional[str] = None
    micro_batches: int = 1

    def __post_init__(self):
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(
                f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES} (got {self.grad_sample_mode!r})."
            )

    def joined(self, module: nn.Module, *, sharded: bool = False) -> "SetupOptions":
        """These options for a run of several processes: the same bounding and sampling seeds on every rank (a seed
        left to the OS is drawn on rank 0 and shared), and the module's starting parameters made rank 0's. A sharded
        model has no replicas to align: each rank holds its own shard, as ``fully_shard`` made it.

        Args:
            module: the model.
            sharded: the model is sharded by FSDP2.

        Returns:
            The options every rank uses (these, in one process).
        """
        if distributed.world_size() == 1:
            return self
        joined = dataclasses.replace(self, bounding_seed=distributed.shared_seed(self.bounding_seed),
                                     sampling_seed=distributed.shared_seed(self.sampling_seed))
        if not sharded:
            distributed.broadcast_parameters(module)
        return joined

    def loader_options(self, data_loader: Any) -> Dict[str, Any]:
        """What every user-level loader takes from the caller's loader, these options and the processes.

        Args:
            data_loader: the caller's ``DataLoader``.

        Returns:
            Keyword arguments of :class:`~trl_userdp.data.UserDataLoader` (beyond the dataset and the sampling).
        """
        return dict(
            num_replicas=distributed.world_size(),
            rank=distributed.rank(),
            collate_fn=data_loader.collate_fn,
            num_workers=data_loader.num_workers,
            pin_memory=data_loader.pin_memory,
            rows_per_example=self.rows_per_example,
            seed=self.sampling_seed,
            user_column=self.user_column,
            user_key=self.user_key,
            micro_batches=self.micro_batches,
        )
