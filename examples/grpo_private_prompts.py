"""GRPO on the users' own prompts with user-level DP (`UserDPGRPOTrainer`): the policy's update protects each user's
prompts, not only their preference labels. Simulated users on the embedded IMDb prompts, a small Llama fitted by SFT
(the main job's), LoRA adapters trained by GRPO for the gold sentiment reward, at each ε against non-private GRPO and a
noise-free control (the same clipping and user sampling, σ = 0); gains over the SFT policy with paired 95% intervals
over held-out prompts, as in the main job.

    python examples/grpo_private_prompts.py                    # a few minutes on CPU
    python examples/grpo_private_prompts.py --epsilons 8 --steps 20 --n_users 200   # a quick look

The reward is the gold scorer, declared public here (it stands for a public sentiment classifier), so the table
measures what privacy for the prompts costs; with a private reward model (`UserDPRewardTrainer`) the policy's report
composes both ε (docs/trainers.md).
"""

import dataclasses
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_userdp.experiments.pipeline import PipelineArguments
from trl_userdp.experiments.pipeline.data import SentimentData, build_sentiment_data
from trl_userdp.experiments.pipeline.evaluation import evaluate_policy, paired
from trl_userdp.experiments.pipeline.policy import build_sft_policy
from trl_userdp.trainers import UserDPGRPOConfig, UserDPGRPOTrainer


@dataclasses.dataclass
class RecipeArguments:
    output_dir: str = dataclasses.field(default="runs/grpo_private_prompts", metadata={"help": "Where to write."})
    n_users: int = dataclasses.field(default=1000, metadata={"help": "Simulated users, each with their own prompts."})
    prompts_per_user: int = dataclasses.field(default=2, metadata={"help": "m: prompts per user (IMDb openings)."})
    users_per_batch: float = dataclasses.field(default=64.0, metadata={"help": "ñ: expected users per step."})
    epsilons: List[float] = dataclasses.field(default_factory=lambda: [3.0, 8.0], metadata={"help": "Target ε."})
    steps: int = dataclasses.field(default=40, metadata={"help": "GRPO steps of every run."})
    learning_rate: float = dataclasses.field(default=2e-2, metadata={"help": "AdamW's step, the same for every run."})
    clip: float = dataclasses.field(default=0.05, metadata={"help": "C: bound on a user's averaged gradient."})
    lora_r: int = dataclasses.field(default=8, metadata={"help": "LoRA rank."})
    lora_targets: List[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "The layers LoRA adapts (fewer parameters: less noise in all, less capacity)."})
    eval_samples: int = dataclasses.field(default=8, metadata={"help": "Completions per held-out prompt."})
    eval_prompts: int = dataclasses.field(default=256, metadata={"help": "Held-out prompts (the main job's)."})
    sft_steps: int = dataclasses.field(default=300, metadata={"help": "SFT steps of the starting policy."})
    num_generations: int = dataclasses.field(default=4, metadata={"help": "Completions per prompt (GRPO's group)."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed of data, SFT and training."})


def user_prompts(prompts: List[str], n_users: int, per_user: int, seed: int) -> Dataset:
    """The first ``n_users × per_user`` prompts, dealt to simulated users at random (``user_id``)."""
    if n_users * per_user > len(prompts):
        raise ValueError(f"{n_users} users × {per_user} prompts needs {n_users * per_user} prompts; "
                         f"there are {len(prompts)}.")
    users = np.random.default_rng(seed).permutation(np.repeat(np.arange(n_users), per_user))
    return Dataset.from_dict({"prompt": prompts[: len(users)], "user_id": [f"user{u}" for u in users]})


def run(name: str, recipe: RecipeArguments, pipeline: PipelineArguments, sft: str, dataset: Dataset,
        data: SentimentData, mechanism: str, epsilon: Optional[float] = None,
        noise_multiplier: Optional[float] = None) -> Dict[str, object]:
    """One GRPO run from the SFT policy: its final policy's evaluation on the main job's held-out prompts (disjoint from
    the users'), the same prompts and sampling seed for every run, and what it spent."""
    gold = data.gold
    prompts_per_step = int(recipe.users_per_batch * recipe.prompts_per_user)
    config = UserDPGRPOConfig(
        output_dir=os.path.join(recipe.output_dir, name), privacy_mechanism=mechanism, target_epsilon=epsilon,
        noise_multiplier=noise_multiplier, users_per_batch=recipe.users_per_batch,
        max_samples_per_user=recipe.prompts_per_user, per_user_max_grad_norm=recipe.clip,
        # the non-private run's batch: the private runs' expected prompts per step, each with its group
        per_device_train_batch_size=prompts_per_step * recipe.num_generations, num_generations=recipe.num_generations,
        max_completion_length=pipeline.completion_tokens, beta=pipeline.kl_beta, learning_rate=recipe.learning_rate,
        max_steps=recipe.steps, seed=recipe.seed, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=max(1, recipe.steps // 4), disable_tqdm=False)
    reward = lambda completions, prompts, **kw: list(gold([p + c for p, c in zip(prompts, completions)]))  # noqa: E731
    reward.__name__ = "gold"
    lora = LoraConfig(r=recipe.lora_r, lora_alpha=2 * recipe.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=list(recipe.lora_targets))
    start = time.time()
    trainer = UserDPGRPOTrainer(model=sft, reward_funcs=reward, args=config, train_dataset=dataset,
                                processing_class=AutoTokenizer.from_pretrained(sft), peft_config=lora,
                                reward_model_is_public=True)
    trainer.train()
    seconds = time.time() - start
    trainer.save_model()
    tokenizer = AutoTokenizer.from_pretrained(sft)
    reference = AutoModelForCausalLM.from_pretrained(sft).eval()
    final = evaluate_policy(trainer.model, reference, tokenizer, data.test_prompts, gold, pipeline, pipeline.seed + 1)
    report = trainer.privacy_report() if mechanism != "none" else None
    return {"name": name, "mechanism": mechanism, "target_epsilon": epsilon,
            "epsilon": None if report is None else report.epsilon,
            "noise_multiplier": None if report is None else report.noise_multiplier,
            "steps": trainer.state.global_step, "seconds": seconds, "final": final}


def main(argv=None) -> Dict[str, object]:
    recipe, = HfArgumentParser(RecipeArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv))
    pipeline = PipelineArguments(output_dir=recipe.output_dir, seed=recipe.seed, eval_samples=recipe.eval_samples,
                                 eval_prompts=recipe.eval_prompts, sft_steps=recipe.sft_steps)
    data = build_sentiment_data(pipeline)
    sft = build_sft_policy(data, pipeline)
    dataset = user_prompts(data.train_prompts, recipe.n_users, recipe.prompts_per_user, recipe.seed)
    tokenizer, reference = AutoTokenizer.from_pretrained(sft), AutoModelForCausalLM.from_pretrained(sft).eval()
    sft_eval = evaluate_policy(AutoModelForCausalLM.from_pretrained(sft), reference, tokenizer, data.test_prompts,
                               data.gold, pipeline, pipeline.seed + 1)
    runs = [run("none", recipe, pipeline, sft, dataset, data, "none"),
            run("sigma0", recipe, pipeline, sft, dataset, data, "user_dpsgd", epsilon=None, noise_multiplier=0.0)]
    runs += [run(f"eps{e:g}", recipe, pipeline, sft, dataset, data, "user_dpsgd", epsilon=e) for e in recipe.epsilons]
    baseline = runs[0]["final"]["per_prompt"]
    print(f"\nGRPO on {recipe.n_users} users' prompts ({recipe.prompts_per_user} each, ñ = {recipe.users_per_batch:g}, "
          f"{recipe.steps} steps, LoRA r = {recipe.lora_r}); SFT gold reward {sft_eval['gold_reward']:.3f}")
    print(f"{'run':<8} {'ε':>6} {'σ':>6} {'gold':>6} {'gain over SFT (95%)':>22} {'vs non-private (95%)':>22} "
          f"{'KL':>6} {'min':>5}")
    for r in runs:
        final = r["final"]
        r["gain_over_sft"] = paired(final["per_prompt"], sft_eval["per_prompt"])
        r["vs_non_private"] = paired(final["per_prompt"], baseline)
        g, v = r["gain_over_sft"], r["vs_non_private"]
        eps = "∞" if r["epsilon"] is None or math.isinf(r["epsilon"]) else f"{r['epsilon']:.2f}"
        sigma = "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.2f}"
        print(f"{r['name']:<8} {eps:>6} {sigma:>6} {final['gold_reward']:>6.3f} "
              f"{g['mean']:>+8.3f} ± {g['half_width']:.3f} p={g['p']:<7.2g} {v['mean']:>+8.3f} ± {v['half_width']:.3f}"
              f"{'':>6} {final['kl']:>6.2f} {r['seconds'] / 60:>5.1f}")
    results = {"recipe": dataclasses.asdict(recipe), "sft": {k: v for k, v in sft_eval.items() if k != "per_prompt"},
               "runs": [{**r, "final": {k: v for k, v in r["final"].items() if k != "per_prompt"}} for r in runs],
               "command": "python examples/grpo_private_prompts.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    os.makedirs(recipe.output_dir, exist_ok=True)
    with open(os.path.join(recipe.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
