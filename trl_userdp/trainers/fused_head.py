"""TRL's fused LM head under user-level DP (docs/stack_findings.md): TRL 1.16 adds it to causal LMs in its DPO,
KTO, GRPO and RLOO trainers; it reads ``lm_head.weight`` outside the module, so per-sample gradients of the head are
missing, or silently wrong for tied embeddings. The DP trainers replace it by the model's own forward."""

from __future__ import annotations

import functools
import inspect
import types

import torch
from trl.trainer.utils import FusedCausalLMOutput


def unfuse_lm_head(model: torch.nn.Module, temperature: float = 1.0) -> None:
    """Replace TRL 1.16's fused LM head (which calls ``lm_head.weight`` outside the module, so per-sample
    gradients of the head are missing, or silently wrong for tied embeddings) by the model's own
    forward: the logits go through ``lm_head`` as a module and the per-token fields are computed from
    them, from the logits divided by ``temperature`` as TRL's head does. Same outputs as the fused head, at the memory
    cost of full logits, except that the positions of a row count its own tokens (from the attention mask, as in
    generation): with left padding (GRPO's prompts) a row's output then does not depend on the other rows' lengths.

    Args:
        model: the causal LM, patched in place.
        temperature: the temperature TRL's fused head was added with (GRPO's sampling temperature).
    """
    own_forward = type(model).forward
    takes_positions = "position_ids" in inspect.signature(own_forward).parameters

    @functools.wraps(own_forward)  # keeps the model's signature, which generate() reads (position_ids, logits_to_keep)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return own_forward(self, *args, **kwargs)
        kwargs["use_cache"] = False
        mask = kwargs.get("attention_mask")
        if takes_positions and mask is not None and kwargs.get("position_ids") is None:
            # each row's positions count its own tokens, as in generation: a row's output must not depend on how
            # much padding other rows (other users) put in front of it (absolute position embeddings)
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = own_forward(self, *args, **kwargs).logits
        if temperature != 1.0:
            logits = logits / temperature
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
