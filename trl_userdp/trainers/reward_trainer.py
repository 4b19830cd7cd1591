"""``UserDPRewardTrainer``: TRL's ``RewardTrainer`` with user-level differential privacy."""

from __future__ import annotations

import torch
from trl import RewardTrainer

from ..losses import RRDebiasedRewardLoss
from .mixin import UserDPTrainerMixin
from .reward_config import UserDPRewardConfig


class UserDPRewardTrainer(UserDPTrainerMixin, RewardTrainer):
    """Drop-in for ``trl.RewardTrainer``: the same arguments, a :class:`UserDPRewardConfig`, and a
    user column in ``train_dataset``. Under ``randomized_response`` the loss is the de-biased one
    (:class:`~trl_userdp.losses.RRDebiasedRewardLoss` at ε/m per label) on the privatized labels."""

    def __init__(self, model, args: UserDPRewardConfig = None, data_collator=None, train_dataset=None, *rest, **kwargs):
        if not isinstance(args, UserDPRewardConfig):
            raise ValueError("UserDPRewardTrainer needs `args=UserDPRewardConfig(...)` (RewardConfig plus privacy fields).")
        train_dataset = self._prepare_train_dataset(train_dataset, args)
        super().__init__(model, args, data_collator, train_dataset, *rest, **kwargs)
        self._init_privacy()
        if self.randomized_response is not None:
            self._rr_loss = RRDebiasedRewardLoss(self.randomized_response.epsilon_per_label)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.privacy_mechanism != "randomized_response":
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs["use_cache"] = False
        outputs = model(**inputs)
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        loss = self._rr_loss(chosen - rejected - inputs.get("margin", 0.0))
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        return (loss, outputs) if return_outputs else loss
