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
    (:class:`~trl_userdp.losses.RRDebiasedRewardLoss` at ε/m per label) on the privatized labels, normalised so that
    its gradient is an unbiased estimate of the clean BTL gradient: the learning rate means what it means without
    privacy, as in the DPO trainer's rDPO loss (unnormalised, the gradient shrinks by 2σ(ε/m) − 1: 0.15 at ε = 3,
    m = 10)."""

    config_class = UserDPRewardConfig
    _rr_loss = None

    def __init__(self, *args, **kwargs):
        """TRL's ``RewardTrainer`` arguments. A tokenizer without an EOS token (BERT, MiniLM) gets its separator as
        one, since TRL's preprocessing ends each text with it.

        Args:
            *args: ``RewardTrainer``'s positional arguments.
            **kwargs: ``RewardTrainer``'s keyword arguments (``processing_class`` is the tokenizer).

        Raises:
            ValueError: The tokenizer has neither an EOS token nor a separator.
        """
        tokenizer = kwargs.get("processing_class")
        if tokenizer is not None and getattr(tokenizer, "eos_token", "") is None:
            # TRL ends each text with the EOS token; encoder tokenizers (BERT, MiniLM) have none but a separator
            if getattr(tokenizer, "sep_token", None) is None:
                raise ValueError("The tokenizer has no EOS token, which TRL's reward preprocessing appends to each "
                                 "text, and no separator to use instead: set `tokenizer.eos_token` first.")
            tokenizer.eos_token = tokenizer.sep_token
            config = getattr(kwargs.get("model", args[0] if args else None), "config", None)
            if config is not None:  # the model's too, as the Trainer would align it (with a notice the user did not cause)
                config.get_text_config().eos_token_id = tokenizer.eos_token_id
        super().__init__(*args, **kwargs)

    def use_label_privacy(self, args, rr) -> None:
        """The de-biased BTL loss at ``rr``'s ε/m per label, normalised."""
        self._rr_loss = RRDebiasedRewardLoss(rr.epsilon_per_label, normalize=True)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss (and its metrics); under randomized response the BTL term is replaced by the de-biased one,
        on the same forward pass."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if self._rr_loss is not None:
            chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
            loss = self._rr_loss(chosen - rejected - inputs.get("margin", 0.0))
            if self.args.center_rewards_coefficient is not None:
                loss = loss + self.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
        return (loss, outputs) if return_outputs else loss
