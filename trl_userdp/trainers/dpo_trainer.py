"""``UserDPDPOTrainer``: TRL's ``DPOTrainer`` with user-level differential privacy."""

from __future__ import annotations

import logging
from typing import List

from trl import DPOTrainer

from .dpo_config import UserDPDPOConfig
from .mixin import UserDPTrainerMixin

logger = logging.getLogger(__name__)

#: DPO losses that couple the pairs of a batch (sorting across it, or a token mean over it): one
#: user's data would change every other user's gradient, so no per-user sensitivity bound holds.
BATCH_COUPLED_LOSSES = {"aot", "aot_unpaired", "sft"}


class UserDPDPOTrainer(UserDPTrainerMixin, DPOTrainer):
    """Drop-in for ``trl.DPOTrainer`` with a :class:`UserDPDPOConfig` and a user column. The reference
    model handling is TRL's (``ref_model``, PEFT adapters, precomputed log-probabilities). Under
    ``randomized_response`` it trains rDPO (TRL's ``loss_type="robust"`` with ``label_smoothing`` set
    to the RR flip rate, which equals :class:`~trl_userdp.losses.RobustDPOLoss`)."""

    config_class = UserDPDPOConfig

    def dp_refusals(self, args) -> List[str]:
        """Refuses the losses of :data:`BATCH_COUPLED_LOSSES`."""
        coupled = sorted(BATCH_COUPLED_LOSSES & set(args.loss_type))
        return [f"loss_type {coupled} couples the pairs of a batch, which breaks the per-user bound of DP-SGD; use a "
                "per-pair loss such as 'sigmoid' or 'robust'."] if coupled else []

    def use_label_privacy(self, args, rr) -> None:
        """rDPO: ``loss_type="robust"`` with ``label_smoothing`` at ``rr``'s flip rate, set in ``args``.

        Raises:
            ValueError: a ``loss_type`` other than ``"sigmoid"`` or ``"robust"``.
        """
        if set(args.loss_type) - {"sigmoid", "robust"}:
            raise ValueError("privacy_mechanism='randomized_response' trains rDPO; leave loss_type at 'sigmoid'.")
        args.loss_type, args.label_smoothing = ["robust"], rr.flip_rate
        logger.info("Randomized response: rDPO with label_smoothing = flip rate %.4f.", args.label_smoothing)
