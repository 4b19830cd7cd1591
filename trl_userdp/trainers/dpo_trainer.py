"""``UserDPDPOTrainer``: TRL's ``DPOTrainer`` with user-level differential privacy."""

from __future__ import annotations

import logging
import types

import torch
from trl import DPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from .dpo_config import UserDPDPOConfig
from .mixin import UserDPTrainerMixin
from .privacy_config import GRADIENT_MECHANISMS

logger = logging.getLogger(__name__)

#: DPO losses that couple the pairs of a batch (sorting across it, or a token mean over it): one
#: user's data would change every other user's gradient, so no per-user sensitivity bound holds.
BATCH_COUPLED_LOSSES = {"aot", "aot_unpaired", "sft"}


def unfuse_lm_head(model: torch.nn.Module) -> None:
    """Replace TRL 1.16's fused LM head (which calls ``lm_head.weight`` outside the module, so per-sample
    gradients of the head are missing, or silently wrong for tied embeddings) by the model's own
    forward: the logits go through ``lm_head`` as a module and the per-token fields are computed from
    them. Same outputs as the fused head at temperature 1, at the memory cost of full logits."""
    own_forward = type(model).forward

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return own_forward(self, *args, **kwargs)
        kwargs["use_cache"] = False
        logits = own_forward(self, *args, **kwargs).logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask = labels != -100
        logp = logits.float().log_softmax(-1)
        log_probs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
            log_sum_sq = torch.logsumexp(2 * logp, dim=-1).masked_fill(~mask, 0.0)
            mean_logits = logits.float().mean(-1).masked_fill(~mask, 0.0)
            is_top1 = (logits.argmax(-1) == labels) & mask
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy,
                                   log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits, is_top1=is_top1,
                                   label_mask=mask)

    model.forward = types.MethodType(forward, model)


class UserDPDPOTrainer(UserDPTrainerMixin, DPOTrainer):
    """Drop-in for ``trl.DPOTrainer`` with a :class:`UserDPDPOConfig` and a user column. The reference
    model handling is TRL's (``ref_model``, PEFT adapters, precomputed log-probabilities). Under
    ``randomized_response`` it trains rDPO (TRL's ``loss_type="robust"`` with ``label_smoothing`` set
    to the RR flip rate, which equals :class:`~trl_userdp.losses.RobustDPOLoss`)."""

    def __init__(self, model, ref_model=None, args: UserDPDPOConfig = None, data_collator=None, train_dataset=None,
                 *rest, **kwargs):
        if not isinstance(args, UserDPDPOConfig):
            raise ValueError("UserDPDPOTrainer needs `args=UserDPDPOConfig(...)` (DPOConfig plus privacy fields).")
        if args.privacy_mechanism in GRADIENT_MECHANISMS and BATCH_COUPLED_LOSSES & set(args.loss_type):
            raise ValueError(
                f"loss_type {sorted(BATCH_COUPLED_LOSSES & set(args.loss_type))} couples the pairs of a batch, which "
                "breaks the per-user bound of DP-SGD; use a per-pair loss such as 'sigmoid' or 'robust'."
            )
        train_dataset = self._prepare_train_dataset(train_dataset, args)
        if self.randomized_response is not None:
            if set(args.loss_type) - {"sigmoid", "robust"}:
                raise ValueError("privacy_mechanism='randomized_response' trains rDPO; leave loss_type at 'sigmoid'.")
            args.loss_type, args.label_smoothing = ["robust"], self.randomized_response.flip_rate
            logger.info("Randomized response: rDPO with label_smoothing = flip rate %.4f.", args.label_smoothing)
        super().__init__(model, ref_model, args, data_collator, train_dataset, *rest, **kwargs)
        if self._dp_active and getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                "The Mixture-of-Experts router auxiliary loss is computed over the whole batch and couples users, "
                "which breaks the per-user bound: set router_aux_loss_coef=0.0 under user-level DP."
            )
        self._init_privacy()
        if self._dp_active:
            policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            unfuse_lm_head(policy)
