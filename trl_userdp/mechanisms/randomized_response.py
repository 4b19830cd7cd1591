"""User-level randomized response (docs/mechanisms.md, M3; AUP-RLHF §4.1; Chowdhury et al. 2024).

Each user's labels (at most ``m`` after contribution bounding) are each randomized once with
``ε' = ε/m``, so the user's m labels together are ε-DP by basic composition — pure ε, δ = 0, under
the replace-one-user relation. **Labels only**: prompts and responses are released as they are;
this mechanism protects who preferred what, not the texts.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any, Dict, Optional, Tuple

import numpy as np
from accelerate import PartialState
from datasets import load_from_disk

from ..accountants.events import rr_keep_probability, rr_move_probability
from ..accountants.report import PrivacyReport
from ..data import DEFAULT_USER_COLUMN, bound_contributions
from ..seeding import derive_seed
from ..validators import check_epsilon, check_max_samples_per_user
from .base import AccountingSetting, Mechanism, WalkthroughColumn, register_mechanism

#: Column added to a privatized dataset: the per-label ε' it was privatized with. Its presence marks
#: the dataset as privatized (privatizing twice is refused), and trainers read it to set the loss.
PRIVATIZED_COLUMN = "rr_epsilon_per_label"
#: Words that mark a column as derived from the labels (``chosen_input_ids``, ``margin``, ``score_rejected``),
#: matched as whole words so that e.g. a ``labeller`` column is not mistaken for one.
LABEL_WORDS = {"chosen", "rejected", "label", "labels", "score", "scores", "margin"}
#: Folder (inside a run's output directory) holding the privatized dataset, drawn once per directory. The
#: leading underscore keeps it out of ``push_to_hub`` (transformers skips ``_*``): it holds user ids and texts.
OUTPUT_DIR = "_randomized_response"


class UserRandomizedResponse:
    """Privatize the labels of a user-grouped dataset once.

    Binary preference data (``chosen``/``rejected`` columns): a flipped label swaps the two.
    K-wise data (``label_column`` holding an index in ``[0, K)``): the label is kept with probability
    ``e^ε'/(e^ε' + K − 1)`` and moved to each other index with probability ``1/(e^ε' + K − 1)``.

    Args:
        epsilon: the user-level budget ε (> 0).
        max_samples_per_user: m, the contribution bound (rows beyond it are dropped first).
        num_choices: K (2 for pairwise preferences).
        seed: seeds the bounding draw and the flips (None: fresh OS entropy).

    Raises:
        ValueError: a non-positive ε, an m that is not a positive integer, or a K that is not an integer ≥ 2.
    """

    def __init__(self, epsilon: float, max_samples_per_user: int, num_choices: int = 2, seed: Optional[int] = None):
        self.epsilon = check_epsilon(epsilon, "epsilon")
        self.max_samples_per_user = check_max_samples_per_user(max_samples_per_user)
        if isinstance(num_choices, bool) or not isinstance(num_choices, int) or num_choices < 2:
            raise ValueError(f"num_choices must be an integer >= 2, got {num_choices!r}.")
        self.num_choices = num_choices
        self.seed = seed

    @property
    def epsilon_per_label(self) -> float:
        """ε' = ε/m: what each label gets, and what the de-biased losses take as ``epsilon``."""
        return self.epsilon / self.max_samples_per_user

    @property
    def keep_probability(self) -> float:
        """The probability a label is kept, ``e^ε'/(e^ε' + K − 1)``."""
        return rr_keep_probability(self.epsilon_per_label, self.num_choices)

    @property
    def flip_rate(self) -> float:
        """Binary case: probability a label is flipped, ``1 − σ(ε/m)`` (rDPO's ρ).

        Raises:
            ValueError: K > 2 (use :attr:`keep_probability`).
        """
        if self.num_choices != 2:
            raise ValueError("flip_rate is defined for binary labels; use keep_probability for K > 2.")
        return rr_move_probability(self.epsilon_per_label)

    def privatize_labels(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """K-RR on label indices: each kept with probability :attr:`keep_probability`, else moved uniformly to one
        of the K − 1 others.

        Args:
            labels: integer label indices in ``[0, K)``.
            rng: the source of the draws.

        Returns:
            The privatized labels, of the same shape.

        Raises:
            ValueError: labels that are not integers in ``[0, K)``.
        """
        labels = np.asarray(labels)
        if labels.size and (labels.min() < 0 or labels.max() >= self.num_choices or not np.issubdtype(labels.dtype, np.integer)):
            raise ValueError(f"labels must be integers in [0, {self.num_choices}), got values in [{labels.min()}, {labels.max()}].")
        move = rng.random(labels.shape) >= self.keep_probability
        # a moved label goes uniformly to one of the K − 1 other values
        shift = rng.integers(1, self.num_choices, labels.shape)
        return np.where(move, (labels + shift) % self.num_choices, labels)

    def privatize(
        self,
        dataset: Any,
        *,
        user_column: str = DEFAULT_USER_COLUMN,
        label_column: Optional[str] = None,
        chosen_column: str = "chosen",
        rejected_column: str = "rejected",
    ) -> Tuple[Any, PrivacyReport]:
        """Bound each user to m rows, randomize every label once, and report the guarantee.

        Args:
            dataset: a ``datasets.Dataset`` with a user column and either a ``label_column`` or the
                ``chosen``/``rejected`` columns (swapped where the label flips).
            user_column: the column naming each row's user.
            label_column: the column holding the index of the preferred response, in ``[0, K)`` (None: binary
                pairs in ``chosen_column`` and ``rejected_column``).
            chosen_column: the preferred response of a binary pair.
            rejected_column: the other response.

        Returns:
            The privatized dataset (with the :data:`PRIVATIZED_COLUMN` marker) and its :class:`PrivacyReport`.

        Raises:
            ValueError: a dataset privatized already; a missing label column (or none named with K > 2); columns
                derived from the labels; labels that are missing, not integers or outside ``[0, K)``.
        """
        if PRIVATIZED_COLUMN in getattr(dataset, "column_names", ()):
            raise ValueError(
                "This dataset's labels were already privatized by randomized response; privatizing again would "
                "waste budget (and drawing fresh flips for the same labels would leak)."
            )
        if label_column is None:
            if self.num_choices != 2:
                raise ValueError("K-wise randomized response needs `label_column` (the index of the preferred response).")
            missing = [c for c in (chosen_column, rejected_column) if c not in dataset.column_names]
            if missing:
                raise ValueError(f"The dataset has no {missing} column(s); pass `label_column` or the column names.")
        elif label_column not in dataset.column_names:
            raise ValueError(f"The dataset has no label column {label_column!r} (columns: {dataset.column_names}).")
        derived = [c for c in dataset.column_names if c not in (chosen_column, rejected_column, label_column, user_column)
                   and LABEL_WORDS & set(re.split(r"[^a-z0-9]+", c.lower()))]
        if derived:
            raise ValueError(
                f"Columns {derived} depend on the private labels (token ids of chosen/rejected, margins, scores) and "
                "would not be randomized: drop them before privatizing (TRL re-tokenizes the text columns)."
            )
        bounded, bounding = bound_contributions(dataset, self.max_samples_per_user, user_column=user_column, seed=self.seed)
        rng = np.random.default_rng(None if self.seed is None else derive_seed(self.seed, "randomized_response"))
        if label_column is not None:
            labels = np.asarray(bounded[label_column])
            if np.issubdtype(labels.dtype, np.floating) and np.isnan(labels).any():
                raise ValueError(f"Column {label_column!r} has missing (NaN) labels.")
            if np.issubdtype(labels.dtype, np.floating) and (labels != np.round(labels)).any():
                raise ValueError(f"Column {label_column!r} has non-integer labels; K-ary RR needs class indices.")
            new = self.privatize_labels(labels.astype(np.int64) if np.issubdtype(labels.dtype, np.floating) else labels, rng)
            bounded = bounded.remove_columns(label_column).add_column(label_column, new.tolist())
        else:
            flip = self.privatize_labels(np.zeros(len(bounded), dtype=np.int64), rng) == 1
            chosen, rejected = list(bounded[chosen_column]), list(bounded[rejected_column])
            new_chosen = [r if f else c for c, r, f in zip(chosen, rejected, flip)]
            new_rejected = [c if f else r for c, r, f in zip(chosen, rejected, flip)]
            bounded = bounded.remove_columns([chosen_column, rejected_column])
            bounded = bounded.add_column(chosen_column, new_chosen).add_column(rejected_column, new_rejected)
        bounded = bounded.add_column(PRIVATIZED_COLUMN, [self.epsilon_per_label] * len(bounded))
        return bounded, self._report(bounding.n_users)

    def _report(self, n_users: int) -> PrivacyReport:
        return PrivacyReport(
            mechanism="randomized_response",
            n_users=n_users,
            max_samples_per_user=self.max_samples_per_user,
            sample_rate=None,
            noise_multiplier=None,
            steps=None,
            steps_taken=0,
            accountant="basic composition (pure ε)",
            epsilon=self.epsilon,
            delta=0.0,
            neighboring_relation="replace",
            extra={
                "epsilon_per_label": self.epsilon_per_label,
                "num_choices": self.num_choices,
                "keep_probability": self.keep_probability,
                "protects": "labels only",
            },
        )

    def privatize_once(self, dataset: Any, directory: str, **kwargs: Any) -> Tuple[Any, PrivacyReport]:
        """:meth:`privatize`, drawn once per directory: the first call saves the privatized dataset (the
        mechanism's output, safe to publish); later calls (a resumed run) reuse it instead of drawing fresh flips,
        which would be a second, unaccounted release of the same labels. Under several processes the main one
        draws, the others load its output.

        Args:
            dataset: as for :meth:`privatize`.
            directory: the run's output directory; the output is kept in ``directory/{OUTPUT_DIR}``.
            **kwargs: :meth:`privatize`'s column arguments.

        Returns:
            The privatized dataset and its :class:`PrivacyReport`.

        Raises:
            ValueError: a saved output that does not match ``dataset`` (other users, other pairs, other settings),
                or as :meth:`privatize`.
        """
        path = os.path.join(directory, OUTPUT_DIR)
        with PartialState().main_process_first():
            if os.path.isdir(path):
                saved = load_from_disk(path)
                self._check_matches(saved, dataset, path, **kwargs)
                user_column = kwargs.get("user_column", DEFAULT_USER_COLUMN)
                return saved, self._report(len(set(saved[user_column])))
            private, report = self.privatize(dataset, **kwargs)
            if PartialState().is_main_process:
                private.save_to_disk(path)
        return private, report

    def _check_matches(self, saved: Any, dataset: Any, path: str, *, user_column: str = DEFAULT_USER_COLUMN,
                       label_column: Optional[str] = None, chosen_column: str = "chosen",
                       rejected_column: str = "rejected") -> None:
        """``saved`` must be this mechanism's output on ``dataset``: same settings, same users, each user's
        min(rows, m) rows drawn from its own rows (compared without the labels, which the output changed)."""

        def content(row: dict) -> str:
            row = {k: v for k, v in row.items() if k not in (PRIVATIZED_COLUMN, label_column)}
            if label_column is None:  # the pair, unordered: the output may have swapped it
                row["pair"] = sorted(json.dumps(row.pop(c), sort_keys=True) for c in (chosen_column, rejected_column))
            return json.dumps(row, sort_keys=True, default=str)

        refuse = (f"{path} holds labels privatized from other data or settings; reusing them would be wrong and "
                  "drawing new ones would release the labels twice. Use the same data and privacy settings, or "
                  "another output_dir.")
        if PRIVATIZED_COLUMN not in saved.column_names or set(saved[PRIVATIZED_COLUMN]) != {self.epsilon_per_label}:
            raise ValueError(f"{refuse} (privatized at another ε/m than {self.epsilon_per_label:g})")
        have: Dict[Any, Counter] = {}
        for row in dataset:
            have.setdefault(row[user_column], Counter())[content(row)] += 1
        kept: Dict[Any, Counter] = {}
        for row in saved:
            kept.setdefault(row[user_column], Counter())[content(row)] += 1
        if set(have) != set(kept):
            raise ValueError(f"{refuse} (the users differ)")
        for user, rows in kept.items():
            if rows - have[user] or sum(rows.values()) != min(sum(have[user].values()), self.max_samples_per_user):
                raise ValueError(f"{refuse} (a user's rows differ)")


@register_mechanism
class RandomizedResponse(Mechanism):
    """User-level randomized response as a trainer mechanism: labels privatized once (:class:`UserRandomizedResponse`),
    then the trainer's de-biased loss (its ``use_label_privacy``)."""

    name = "randomized_response"
    kind = "labels"
    summary = "labels privatized once by randomized response at ε/m each, then the de-biased loss (labels only)"
    walkthrough_notes = ("RR flip: user-level randomized response flips each label with probability 1 − sigmoid(ε/m).",)

    @staticmethod
    def label_privatizer(args: Any) -> UserRandomizedResponse:
        """The privatizer a trainer's config asks for.

        Args:
            args: the trainer config: its ``target_epsilon`` (ε), ``max_samples_per_user`` (m) and ``privacy_seed``.

        Returns:
            The :class:`UserRandomizedResponse`.
        """
        return UserRandomizedResponse(args.target_epsilon, args.max_samples_per_user, seed=args.privacy_seed)

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """The probability each label is flipped at ε/m."""
        return (WalkthroughColumn("RR flip", "per label", rr_move_probability(epsilon / setting.max_samples_per_user)),)
