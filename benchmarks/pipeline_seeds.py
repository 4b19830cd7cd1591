"""How much of the main job's verdict is one draw: the gain over the SFT policy across seeds of reward-model training
and of GRPO, against the paired intervals the table prints.

The main job (docs/pipeline.md) trains one reward model per mechanism and ε and one GRPO run against each; its
intervals are over the 256 held-out prompts, for that reward model and that RL run. Here the data, the SFT policy and
the evaluation (prompts and sampling seed) stay fixed, and for each mechanism:

- ``reward seeds``: the reward model is retrained with ``--reward_seed`` s (head initialisation, batch order, user
  sampling, noise, label flips), GRPO at RL seed 0;
- ``RL seeds``: the reward model of reward seed 0, GRPO with ``--rl_seed`` s.

Reported per run: the reward model's held-out pair accuracy and the paired gain over the SFT policy (± its 95%
half-width); per mechanism and kind of seed: the standard deviation of the gains across seeds next to the mean paired
half-width. The control for the seed spread is the same spread for the non-private reward model (``none``).

    python -m benchmarks.pipeline_seeds                      # none and user_dpsgd at ε = 8, 4 seeds each: ~7 min
    python -m benchmarks.pipeline_seeds --mechanisms none randomized_response --epsilon 3 --seeds 6
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, print_table, write_results
from trl_userdp.experiments.pipeline import PipelineArguments
from trl_userdp.experiments.pipeline.data import build_sentiment_data
from trl_userdp.experiments.pipeline.embedding_reward import MiniLMEncoder
from trl_userdp.experiments.pipeline.evaluation import evaluate_policy, paired
from trl_userdp.experiments.pipeline.policy import build_sft_policy, train_policy
from trl_userdp.experiments.pipeline.reward import needs_public_tau, public_tau, train_reward_model


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanisms", nargs="+", default=["none", "user_dpsgd"])
    parser.add_argument("--epsilon", type=float, default=8.0, help="ε of the private mechanisms")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per kind (seed 0 is shared by both kinds)")
    parser.add_argument("--out", default=RESULTS_DIR, help="where the results file goes")
    parser.add_argument("--work_dir", default="runs/pipeline_seeds", help="where the SFT policy and the policies go")
    parser.add_argument("--pipeline", nargs=argparse.REMAINDER, default=[],
                        help="scalar PipelineArguments fields as name=value (e.g. n_users=20 rl_steps=2), for small runs")
    opts = parser.parse_args(argv)
    fields = {f.name: str(f.type) for f in dataclasses.fields(PipelineArguments)}
    overrides = {}
    for item in opts.pipeline:
        name, value = item.split("=", 1)
        if name not in fields or "List" in fields[name]:
            parser.error(f"--pipeline takes scalar PipelineArguments fields, not {name!r}")
        overrides[name] = next(t(value) for t in (int, float, str) if t.__name__ in fields[name] or t is str)
    args = PipelineArguments(output_dir=opts.work_dir, mechanisms=opts.mechanisms, **overrides)

    data = build_sentiment_data(args)
    encoder = MiniLMEncoder()
    emb = encoder(data.pool, progress=True)
    sft_path = build_sft_policy(data, args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    sft_point = evaluate_policy(sft, sft, AutoTokenizer.from_pretrained(sft_path), data.test_prompts, data.gold, args,
                                args.seed + 1)

    runs: List[Dict[str, object]] = []
    plan = [(mech, kind, s) for mech in opts.mechanisms for kind in ("reward", "rl") for s in range(opts.seeds)
            if not (kind == "rl" and s == 0)]  # reward seed 0 with RL seed 0 is one run, listed under reward seeds
    rewards = {}
    for mech, kind, s in tqdm(plan, desc="runs"):
        epsilon = None if mech == "none" else opts.epsilon
        reward_seed, rl_seed = (s, 0) if kind == "reward" else (0, s)
        run_args = dataclasses.replace(args, reward_seed=reward_seed, rl_seed=rl_seed)
        if (mech, reward_seed) not in rewards:  # AUP-RLHF's τ at this seed's initial head, as in the pipeline
            tau = public_tau(encoder, emb, data, run_args) if needs_public_tau(mech) else None
            rewards[mech, reward_seed] = train_reward_model(mech, epsilon, encoder, emb, data, run_args, tau)
        reward = rewards[mech, reward_seed]
        policy = train_policy(sft_path, reward, encoder, data, run_args, sft_point)
        gain = paired(policy["final"]["per_prompt"], sft_point["per_prompt"])
        runs.append({"mechanism": mech, "epsilon": epsilon, "reward_seed": reward_seed, "rl_seed": rl_seed,
                     "reward_model_pair_accuracy": reward.eval_accuracy, "gain_over_sft": gain,
                     "kl": policy["final"]["kl"]})

    print(f"\nGain over the SFT policy (gold log-odds, paired over {args.eval_prompts} prompts × {args.eval_samples} "
          f"samples) per seed; ε = {opts.epsilon:g} for the private mechanisms")
    table = print_table(["mechanism", "reward seed", "RL seed", "RM acc", "gain ± 95% half-width", "p vs SFT"],
                        [[r["mechanism"], r["reward_seed"], r["rl_seed"], f"{r['reward_model_pair_accuracy']:.3f}",
                          f"{r['gain_over_sft']['mean']:.3f} ± {r['gain_over_sft']['half_width']:.3f}",
                          f"{r['gain_over_sft']['p']:.2g}"] for r in runs])
    spread = []
    for mech in opts.mechanisms:
        for kind, key in (("reward seeds", "rl_seed"), ("RL seeds", "reward_seed")):
            chosen = [r for r in runs if r["mechanism"] == mech and r[key] == 0]  # the other seed held at 0
            gains = np.array([r["gain_over_sft"]["mean"] for r in chosen])
            spread.append({"mechanism": mech, "varied": kind, "runs": len(chosen), "gain_mean": float(gains.mean()),
                           "gain_sd": float(gains.std(ddof=1)) if len(gains) > 1 else float("nan"),
                           "gain_min": float(gains.min()), "gain_max": float(gains.max()),
                           "mean_half_width": float(np.mean([r["gain_over_sft"]["half_width"] for r in chosen]))})
    print("\nSpread of the gain across seeds against the paired interval of one run")
    spread_table = print_table(["mechanism", "varied", "runs", "mean gain", "sd across seeds", "min", "max",
                                "mean paired half-width"],
                               [[s["mechanism"], s["varied"], s["runs"], f"{s['gain_mean']:.3f}", f"{s['gain_sd']:.3f}",
                                 f"{s['gain_min']:.3f}", f"{s['gain_max']:.3f}", f"{s['mean_half_width']:.3f}"]
                                for s in spread])
    payload = {"arguments": {**vars(opts), "pipeline": dataclasses.asdict(args)}, "sft_policy_gold_reward":
               sft_point["gold_reward"], "runs": runs, "spread": spread, "table": table, "spread_table": spread_table}
    write_results("pipeline_seeds", payload, opts.out)
    return payload


if __name__ == "__main__":
    main()
