"""Settings of the main job (``trl-userdp pipeline``): :class:`PipelineArguments` and the pipeline's constants."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from ...mechanisms import mechanism_names
from ...validators import check_delta, check_epsilon, check_max_samples_per_user, check_positive, check_users_per_batch

#: beside the SFT policy: the settings it was built with (a later run reuses it only with the same)
SFT_SETTINGS_FILE = "pipeline_sft_settings.json"

#: the mechanisms of the published table (docs/pipeline.md); ``--mechanisms`` takes any registered one
DEFAULT_MECHANISMS = ("none", "randomized_response", "group", "user_dpsgd", "user_dpsgd_adaptive_clip", "aup")


@dataclasses.dataclass
class PipelineArguments:
    """Settings of ``trl-userdp pipeline``. The defaults run in about ten minutes on 2 CPU cores; the
    paper's setting is n = 2500 users, m = 10, ε ∈ {3, 8}, δ = 1e-5 with Gemma-2-2B / Llama-2-7B
    policies (``--policy_model``) on a GPU."""

    n_users: int = dataclasses.field(default=400, metadata={"help": "Simulated users n."})
    max_samples_per_user: int = dataclasses.field(default=10, metadata={"help": "Pairs per user m (the bound)."})
    users_per_batch: float = dataclasses.field(default=40.0, metadata={"help": "Expected users per reward-model step."})
    reward_epochs: float = dataclasses.field(default=5.0, metadata={"help": "Reward-model epochs (1/q steps each)."})
    reward_lr: float = dataclasses.field(default=2.0, metadata={"help": "Reward-head learning rate (SGD)."})
    epsilons: List[float] = dataclasses.field(default_factory=lambda: [1.0, 3.0, 8.0],
                                              metadata={"help": "Target ε values."})
    delta: float = dataclasses.field(default=1e-5, metadata={"help": "Target δ."})
    neighboring_relation: str = dataclasses.field(
        default="replace",
        metadata={"help": "Every mechanism's ε under this relation: 'replace' one user's labels (the papers' Def. 2, "
                          "under which randomized response is defined; the DP-SGD family is calibrated to it by PLD) "
                          "or 'add_or_remove' (without randomized_response).", "choices": ["replace", "add_or_remove"]})
    mechanisms: List[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_MECHANISMS),
                                              metadata={"help": f"Of {mechanism_names()}."})
    max_flip_rate: float = dataclasses.field(default=0.3, metadata={"help": "Users' flip rates are Uniform(0, max_flip_rate)."})
    gold: str = dataclasses.field(default="tfidf", metadata={"help": "Gold reward: 'tfidf' or 'vader'."})
    snippet_words: int = dataclasses.field(default=24, metadata={"help": "Words per review snippet."})
    policy_model: Optional[str] = dataclasses.field(
        default=None, metadata={"help": "A causal LM path or hub id to use instead of the small SFT'd Llama."})
    sft_steps: int = dataclasses.field(default=300, metadata={"help": "SFT steps of the small policy."})
    sft_words: int = dataclasses.field(
        default=12, metadata={"help": "Words per SFT text (each ends with EOS): shorter than completion_tokens, so "
                                      "completions end by themselves."})
    rl_steps: int = dataclasses.field(default=120, metadata={"help": "GRPO steps per reward model."})
    rl_learning_rate: float = dataclasses.field(default=1.5e-3, metadata={"help": "GRPO learning rate."})
    rl_completions_per_step: int = dataclasses.field(
        default=16, metadata={"help": "GRPO completions per step (prompts × num_generations)."})
    num_generations: int = dataclasses.field(default=4, metadata={"help": "GRPO completions per prompt (its group)."})
    eval_every: int = dataclasses.field(default=60, metadata={"help": "Evaluate the policy every this many RL steps."})
    eval_prompts: int = dataclasses.field(default=256, metadata={"help": "Held-out prompts for evaluation."})
    eval_samples: int = dataclasses.field(
        default=4, metadata={"help": "Completions per held-out prompt (the same prompts and sampling seed for every "
                                     "policy: paired)."})
    eval_pairs: int = dataclasses.field(default=500, metadata={"help": "Held-out pairs for reward-model accuracy."})
    kl_beta: float = dataclasses.field(default=0.1, metadata={"help": "GRPO's KL coefficient against the SFT model."})
    completion_tokens: int = dataclasses.field(default=24, metadata={"help": "Most tokens generated per completion."})
    output_dir: str = dataclasses.field(default="runs/pipeline", metadata={"help": "Where models, results and the plot go."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed of data, sampling and training."})
    reward_seed: Optional[int] = dataclasses.field(
        default=None, metadata={"help": "Seed of reward-model training (head init, batch order, user sampling, noise, "
                                        "label flips; default: seed)."})
    rl_seed: Optional[int] = dataclasses.field(default=None, metadata={"help": "Seed of GRPO (default: seed)."})

    @property
    def reward_training_seed(self) -> int:
        """The seed of reward-model training: ``reward_seed``, or ``seed`` if unset."""
        return self.seed if self.reward_seed is None else self.reward_seed

    @property
    def rl_training_seed(self) -> int:
        """The seed of GRPO: ``rl_seed``, or ``seed`` if unset."""
        return self.seed if self.rl_seed is None else self.rl_seed

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Bad settings fail here, before minutes of data building and embedding."""
        unknown = set(self.mechanisms) - set(mechanism_names())
        if unknown:
            raise ValueError(f"Unknown mechanism(s) {sorted(unknown)}; choose from {mechanism_names()}.")
        for eps in self.epsilons:
            check_epsilon(eps, "epsilons")
        check_delta(self.delta, "delta")
        check_max_samples_per_user(self.max_samples_per_user)
        check_positive(self.n_users, "n_users")
        check_users_per_batch(self.users_per_batch, self.n_users)
        check_positive(self.reward_epochs, "reward_epochs")
        if self.neighboring_relation not in ("replace", "add_or_remove"):
            raise ValueError(f"neighboring_relation must be 'replace' or 'add_or_remove', got {self.neighboring_relation!r}.")
        if self.neighboring_relation != "replace" and "randomized_response" in self.mechanisms:
            raise ValueError("randomized_response is defined under 'replace one user's labels'; compare every mechanism "
                             "under one relation: neighboring_relation='replace', or drop randomized_response.")
        if self.gold not in ("tfidf", "vader"):
            raise ValueError(f"gold must be 'tfidf' or 'vader', got {self.gold!r}.")
