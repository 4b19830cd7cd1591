"""``UserDPKTOTrainer``: TRL's ``KTOTrainer`` with user-level differential privacy."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, List

import torch
from trl import KTOTrainer

from .kto_config import UserDPKTOConfig
from .mixin import UserDPTrainerMixin


class UserDPKTOTrainer(UserDPTrainerMixin, KTOTrainer):
    """Drop-in for ``trl.KTOTrainer`` on unpaired feedback (one completion and a desirable/undesirable label per
    row) with a :class:`UserDPKTOConfig` and a user column. KTO's own loss estimates a KL baseline from completions
    of *other* examples of the batch, which couples users, so under DP it trains KTO's unpaired APO loss
    (``loss_type="apo_zero_unpaired"``, no KL term)."""

    config_class = UserDPKTOConfig
    rows_per_example = 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Under DP, KTO's row losses are averaged with a plain mean: TRL's ``nanmean`` would drop a NaN row from the
        divisor, so one user's NaN data would rescale every other user's gradient (the user itself is then zeroed
        by the optimizer, docs/privacy_model.md, "Faults")."""
        context = _nan_rows_stay_in_the_mean() if self._dp_active else contextlib.nullcontext()
        with context:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's; for a private run's training set without TRL's desirable/undesirable balance warning, which prints
        counts of the private labels (one user's labels decide whether it appears, and its numbers)."""
        if not (self._privacy.private and dataset_name == "train"):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        with _filtered(logging.getLogger("trl.trainer.kto_trainer"), _not_the_balance_warning):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def dp_refusals(self, args) -> List[str]:
        """Refuses every loss but ``apo_zero_unpaired`` (KTO's KL baseline couples users)."""
        if args.loss_type != "apo_zero_unpaired":
            return [f"loss_type={args.loss_type!r} estimates KTO's KL baseline from other examples of the batch (other "
                    "users' completions), which breaks the per-user bound: use loss_type='apo_zero_unpaired'."]
        return []


def _not_the_balance_warning(record: logging.LogRecord) -> bool:
    return "You have different amounts of desirable" not in str(record.msg)


@contextlib.contextmanager
def _filtered(logger: logging.Logger, keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """``logger`` drops the records ``keep`` refuses, for the duration."""
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def _nan_rows_stay_in_the_mean() -> Iterator[None]:
    """``Tensor.nanmean`` as ``Tensor.mean`` for the duration (KTO's loss has no hook for its reduction)."""
    nanmean = torch.Tensor.nanmean
    torch.Tensor.nanmean = torch.Tensor.mean
    try:
        yield
    finally:
        torch.Tensor.nanmean = nanmean
