"""What a trainer does for each kind of mechanism (:data:`~trl_userdp.mechanisms.base.KINDS`), chosen once from the
config's mechanism by :func:`trainer_privacy`: no privacy (a baseline), labels privatized once before training
(randomized response), or private optimizer steps (per-user gradients, the engine and its accountant). The mixin
asks these objects instead of branching on the kind."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, ClassVar, Optional

import datasets
from torch.utils.data import IterableDataset

from ..accountants import PrivacyReport
from ..mechanisms import NoPrivacy, UserRandomizedResponse, get_mechanism
from ..mechanisms.randomized_response import OUTPUT_DIR as RR_OUTPUT_DIR

logger = logging.getLogger(__name__)


class TrainerPrivacy:
    """The no-privacy baseline: plain TRL training, reported as ε = ∞."""

    #: the run releases something private: ε in the logs, no statistics of private batches, privacy_report.json
    private: ClassVar[bool] = False
    #: the optimizer steps are private (per-user gradients through the engine)
    gradient: ClassVar[bool] = False

    def prepare_dataset(self, trainer: Any, dataset: Any, args: Any) -> Any:
        """The training dataset as the TRL trainer's ``__init__`` should see it (before its tokenization).

        Args:
            trainer: the trainer, before TRL's ``__init__``.
            dataset: its ``train_dataset``.
            args: its config.

        Returns:
            The dataset (unchanged for the baseline).
        """
        return dataset

    def report(self, trainer: Any) -> Optional[PrivacyReport]:
        """What the run has spent so far.

        Args:
            trainer: the trainer.

        Returns:
            Its :class:`PrivacyReport` (ε = ∞ for the baseline), or None: nothing to report yet.
        """
        return NoPrivacy.report(trainer.state.global_step)

    def epsilon(self, trainer: Any) -> float:
        """ε spent so far.

        Args:
            trainer: the trainer.

        Returns:
            ε (∞ for the baseline).
        """
        return math.inf

    def delta(self, trainer: Any) -> float:
        """The δ of :meth:`epsilon`.

        Args:
            trainer: the trainer.

        Returns:
            δ (0 for the baseline).
        """
        return 0.0


class _UserLevelPrivacy(TrainerPrivacy):
    """What every private kind needs of the training dataset: users are drawn from all of it."""

    private = True

    def prepare_dataset(self, trainer: Any, dataset: Any, args: Any) -> Any:
        """Refuses a dataset users cannot be sampled from.

        Raises:
            ValueError: no dataset, a streamed (iterable) one, or an empty one.
        """
        if dataset is None or isinstance(dataset, (IterableDataset, datasets.IterableDataset)):
            raise ValueError(
                f"User-level DP needs a map-style train_dataset (a datasets.Dataset with a {args.user_column!r} "
                f"column), got {type(dataset).__name__}: users are sampled from the whole dataset, and a "
                "streamed one has no length. Load it without streaming=True."
            )
        if len(dataset) == 0:
            raise ValueError("train_dataset is empty: there are no users to train on.")
        return dataset


class LabelPrivacy(_UserLevelPrivacy):
    """Labels privatized once by randomized response, before TRL's preprocessing; the trainer's loss becomes the
    de-biased one (its ``use_label_privacy``). The report is the privatization's: pure ε, δ = 0."""

    def __init__(self) -> None:
        self.randomized_response: Optional[UserRandomizedResponse] = None
        self.rr_report: Optional[PrivacyReport] = None

    def prepare_dataset(self, trainer: Any, dataset: Any, args: Any) -> Any:
        """Adapt the loss and flip the labels, once per output directory (a resumed run reuses the saved output
        instead of a second, unaccounted draw)."""
        dataset = super().prepare_dataset(trainer, dataset, args)
        self.randomized_response = get_mechanism(args.privacy_mechanism).label_privatizer(args)
        trainer.use_label_privacy(args, self.randomized_response)
        dataset, self.rr_report = self.randomized_response.privatize_once(dataset, args.output_dir,
                                                                          user_column=args.user_column)
        logger.info("Randomized response: %d labels privatized once (ε = %g per user, ε/m = %g per label), kept in %s.",
                    len(dataset), args.target_epsilon, self.randomized_response.epsilon_per_label,
                    os.path.join(args.output_dir, RR_OUTPUT_DIR))
        return dataset

    def report(self, trainer: Any) -> Optional[PrivacyReport]:
        """The privatization's report (pure ε, δ = 0)."""
        return self.rr_report

    def epsilon(self, trainer: Any) -> float:
        """The target ε, all spent by the privatization."""
        return float(trainer.args.target_epsilon)


class GradientPrivacy(_UserLevelPrivacy):
    """Private optimizer steps: the trainer's engine (:class:`~trl_userdp.PrivacyEngine`, set up on the first
    ``get_train_dataloader``) accounts them."""

    gradient = True

    def report(self, trainer: Any) -> Optional[PrivacyReport]:
        """The engine's report at the target δ (None before the engine is set up)."""
        engine = trainer.privacy_engine
        return None if engine is None else engine.privacy_report(trainer.args.target_delta)

    def epsilon(self, trainer: Any) -> float:
        """The engine's ε at the target δ (0 before the engine is set up)."""
        engine = trainer.privacy_engine
        return 0.0 if engine is None else float(engine.get_epsilon(trainer.args.target_delta))

    def delta(self, trainer: Any) -> float:
        """The target δ."""
        return trainer.args.target_delta


#: mechanism kind -> what the trainer does for it
TRAINER_PRIVACY = {"none": TrainerPrivacy, "labels": LabelPrivacy, "gradient": GradientPrivacy}


def trainer_privacy(args: Any) -> TrainerPrivacy:
    """What a trainer does for its ``privacy_mechanism``'s kind.

    Args:
        args: the trainer config.

    Returns:
        A fresh :class:`TrainerPrivacy` of the mechanism's kind.

    Raises:
        ValueError: an unknown ``privacy_mechanism``.
    """
    return TRAINER_PRIVACY[get_mechanism(args.privacy_mechanism).kind]()
