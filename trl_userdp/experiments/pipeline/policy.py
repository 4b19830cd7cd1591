"""The policy: a small causal LM fitted with TRL's ``SFTTrainer`` on the snippets, then GRPO against each reward
model through :class:`~trl_userdp.trainers.PublicPromptGRPOTrainer`, which carries the reward model's privacy report."""

from __future__ import annotations

import json
import os
from typing import Dict, List

from datasets import Dataset

from ...data.imdb import snippet
from ...models import small_causal_lm
from .arguments import SFT_SETTINGS_FILE, PipelineArguments
from .data import SentimentData
from .embedding_reward import EmbeddingRewardFunction, MiniLMEncoder
from .evaluation import evaluate_policy
from .reward import RewardResult


def build_sft_policy(data: SentimentData, args: PipelineArguments) -> str:
    """The small Llama fitted on the IMDb snippets with TRL's SFTTrainer (saved; reused if present).

    Args:
        data: the snippet pool (the tokenizer's corpus and, cut to ``sft_words`` words, the SFT texts).
        args: the pipeline's settings (the SFT settings, ``output_dir``, ``policy_model``).

    Returns:
        Its path, or ``args.policy_model`` if one is given.
    """
    if args.policy_model:
        return args.policy_model
    from trl import SFTConfig, SFTTrainer

    path = os.path.join(args.output_dir, "sft")
    # what the SFT policy depends on: reused only when a saved one was built with the same
    settings = {k: getattr(args, k) for k in ("seed", "n_users", "max_samples_per_user", "snippet_words", "eval_pairs",
                                              "eval_prompts", "sft_steps", "sft_words")}
    settings_file = os.path.join(path, SFT_SETTINGS_FILE)
    if os.path.isfile(os.path.join(path, "model.safetensors")) and os.path.isfile(settings_file):
        with open(settings_file) as f:
            if json.load(f) == settings:
                return path
    model, tokenizer = small_causal_lm(data.pool, seed=args.seed)
    config = SFTConfig(output_dir=path, max_steps=args.sft_steps, per_device_train_batch_size=32, learning_rate=2e-3,
                       lr_scheduler_type="cosine", warmup_steps=20, max_length=48, report_to=[], use_cpu=True,
                       bf16=False, gradient_checkpointing=False, save_strategy="no", logging_steps=50, seed=args.seed,
                       disable_tqdm=False)
    # the first sft_words words of each snippet, which TRL ends with EOS: the policy learns to stop
    texts = [snippet(text, args.sft_words) for text in data.pool]
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model(path)
    with open(settings_file, "w") as f:
        json.dump(settings, f)
    return path


def train_policy(sft_path: str, reward: RewardResult, encoder: MiniLMEncoder, data: SentimentData,
                 args: PipelineArguments, start: Dict[str, object]) -> Dict[str, object]:
    """GRPO against one reward model from the SFT policy (evaluated once, ``start``); returns the reward-vs-KL curve,
    the final evaluation (with its per-prompt rewards) and the carried privacy report.

    Args:
        sft_path: the SFT policy (GRPO's start and its KL reference).
        reward: the reward model.
        encoder: the reward model's frozen encoder.
        data: the RL and held-out prompts and the gold scorer.
        args: the pipeline's settings.
        start: the SFT policy's evaluation (step 0 of the curve).

    Returns:
        ``curve`` (each evaluation without ``per_prompt``), ``final`` (the last evaluation) and ``report`` (the carried
        privacy report as a dict).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from ...trainers import PublicPromptGRPOTrainer

    name = f"{reward.mechanism}" + ("" if reward.epsilon is None else f"_eps{reward.epsilon:g}")
    out_dir = os.path.join(args.output_dir, "policies", name)
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    reference = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    reward_fn = EmbeddingRewardFunction(encoder, reward.head, reward.report, f"reward_{name}")
    points: List[Dict[str, object]] = [{"step": 0, **start}]

    def evaluate(model, step: int) -> None:
        points.append({"step": step, **evaluate_policy(model, reference, tokenizer, data.test_prompts, data.gold, args,
                                                       args.seed + 1)})

    class Evaluate(TrainerCallback):
        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % args.eval_every == 0:
                evaluate(model, state.global_step)

    config = GRPOConfig(output_dir=out_dir, max_steps=args.rl_steps, per_device_train_batch_size=args.rl_completions_per_step,
                        num_generations=args.num_generations, max_completion_length=args.completion_tokens,
                        beta=args.kl_beta, learning_rate=args.rl_learning_rate,
                        temperature=1.0, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                        save_strategy="no", logging_strategy="no", seed=args.rl_training_seed, disable_tqdm=True)
    trainer = PublicPromptGRPOTrainer(model=sft_path, reward_funcs=reward_fn, args=config,
                                      train_dataset=Dataset.from_dict({"prompt": data.train_prompts}),
                                      processing_class=tokenizer, allow_non_private_reward=True, callbacks=[Evaluate()])
    trainer.train()
    if points[-1]["step"] != trainer.state.global_step:
        evaluate(trainer.model, trainer.state.global_step)
    trainer.save_model(out_dir)
    curve = [{k: v for k, v in point.items() if k != "per_prompt"} for point in points]
    return {"curve": curve, "final": points[-1], "report": trainer.carried_privacy_report().to_dict()}
