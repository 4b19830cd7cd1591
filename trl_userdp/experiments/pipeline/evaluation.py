"""Evaluation of a policy: gold reward, KL to a reference and the share of completions ending with EOS, on the same
held-out prompts and sampling seed for every policy; and the paired test that compares two policies prompt by
prompt."""

from __future__ import annotations

import math
from typing import Dict, Sequence

import numpy as np
import torch

from .arguments import PipelineArguments


def evaluate_policy(policy, reference, tokenizer, prompts: Sequence[str], gold, args: PipelineArguments,
                    seed: int) -> Dict[str, object]:
    """Gold reward, KL(π ‖ π_ref) (Monte-Carlo, summed over tokens) and the share of completions that end with EOS,
    from ``eval_samples`` sampled completions per prompt. ``per_prompt`` holds each prompt's mean gold reward: with the
    same prompts and ``seed`` for every policy, two policies compare prompt by prompt (paired). The evaluation draws
    from its own random stream: run inside GRPO, it leaves the training's stream (its ``rl_seed``) as it was.

    Args:
        policy: the causal LM evaluated (back in train mode afterwards).
        reference: the causal LM of the KL (the SFT policy).
        tokenizer: their tokenizer (its padding side is set to the left).
        prompts: the held-out prompts.
        gold: the gold scorer (texts to rewards).
        args: the pipeline's settings (``eval_samples``, ``completion_tokens``).
        seed: the sampling seed.

    Returns:
        ``gold_reward``, ``kl``, ``ended`` (means), ``gold_reward_se``, ``kl_se`` (standard errors over the prompts) and
        ``per_prompt``.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _evaluate_policy(policy, reference, tokenizer, prompts, gold, args)


@torch.no_grad()
def _evaluate_policy(policy, reference, tokenizer, prompts: Sequence[str], gold,
                     args: PipelineArguments) -> Dict[str, object]:
    policy.eval()
    tokenizer.padding_side = "left"
    repeated = [p for p in prompts for _ in range(args.eval_samples)]
    scores, kls, ended = [], [], []
    for start in range(0, len(repeated), 256):
        batch = repeated[start: start + 256]
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        out = policy.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.completion_tokens,
                              pad_token_id=tokenizer.pad_token_id)
        completions = out[:, enc["input_ids"].shape[1]:]
        texts = [p + c for p, c in zip(batch, tokenizer.batch_decode(completions, skip_special_tokens=True))]
        mask = (completions != tokenizer.pad_token_id).float()
        attention = torch.cat([enc["attention_mask"], mask.long()], dim=1)

        def logps(model):
            logits = model(input_ids=out, attention_mask=attention).logits[:, enc["input_ids"].shape[1] - 1: -1]
            return (logits.log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1) * mask).sum(1)

        kls.append(logps(policy) - logps(reference))
        ended.append((completions == tokenizer.eos_token_id).any(1))
        scores.extend(gold(texts))
    policy.train()
    per_prompt = np.asarray(scores).reshape(len(prompts), args.eval_samples).mean(1)
    kl = torch.cat(kls).double().reshape(len(prompts), args.eval_samples).mean(1).numpy()  # per prompt, as the reward
    return {"gold_reward": float(per_prompt.mean()),
            "gold_reward_se": float(per_prompt.std(ddof=1) / np.sqrt(len(per_prompt))),
            "kl": float(kl.mean()), "kl_se": float(kl.std(ddof=1) / np.sqrt(len(kl))),
            "ended": float(torch.cat(ended).float().mean()), "per_prompt": per_prompt.tolist()}


def paired(a: Sequence[float], b: Sequence[float]) -> Dict[str, float]:
    """Mean of ``a − b`` over the same prompts, its 95% half-width and the two-sided paired t-test's p-value.

    Args:
        a: one policy's value per prompt.
        b: another's, on the same prompts.

    Returns:
        ``mean``, ``half_width`` and ``p``.
    """
    from scipy import stats

    d = np.asarray(a) - np.asarray(b)
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    p = float(stats.ttest_rel(a, b).pvalue)
    if not math.isfinite(p):  # every difference equal (e.g. the same completions): no test statistic
        p = 1.0 if d.mean() == 0 else 0.0
    return {"mean": float(d.mean()), "half_width": half, "p": p}
