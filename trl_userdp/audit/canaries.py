"""Canary users and their secret inclusion draw (docs/audit.md).

A canary is a whole user: each of ``m`` canary users is put into the training data with probability ½, by a draw the
model never sees. The draw is the auditor's secret: it is saved apart from the model (``canary_draw.json``) and read
back only to count the right guesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from typing import Optional

import numpy as np

DRAW_FILENAME = "canary_draw.json"


@dataclasses.dataclass(frozen=True)
class CanaryDraw:
    """Which of ``m`` canary users are in the training data.

    Args:
        included: ``[m]`` bools, True for a canary user that is trained on.
        seed: the seed of the draw (a secret of the auditor, like the draw itself).
    """

    included: np.ndarray
    seed: int

    @classmethod
    def draw(cls, m: int, seed: Optional[int] = None) -> "CanaryDraw":
        """Each of ``m`` canaries in with probability ½, independently.

        Args:
            m: the number of canary users (at least 2).
            seed: the draw's seed (None: drawn from the OS).

        Returns:
            The draw.

        Raises:
            ValueError: ``m < 2``.
        """
        if m < 2:
            raise ValueError(f"An audit needs at least 2 canary users, got {m}.")
        seed = secrets.randbits(63) if seed is None else int(seed)
        return cls(np.random.default_rng(seed).random(m) < 0.5, seed)

    @property
    def m(self) -> int:
        """The number of canary users."""
        return len(self.included)

    def save(self, directory: str) -> str:
        """Write the draw to ``directory/canary_draw.json`` (keep it away from whoever holds the model).

        Args:
            directory: the auditor's folder.

        Returns:
            The file's path.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, DRAW_FILENAME)
        with open(path, "w") as f:
            json.dump({"seed": self.seed, "included": self.included.astype(int).tolist()}, f)
        return path

    @classmethod
    def load(cls, directory: str) -> "CanaryDraw":
        """Read a draw written by :meth:`save`.

        Args:
            directory: the auditor's folder.

        Returns:
            The draw.

        Raises:
            ValueError: the file does not hold a draw of 0/1 entries that its seed reproduces.
        """
        with open(os.path.join(directory, DRAW_FILENAME)) as f:
            state = json.load(f)
        included = np.asarray(state["included"])
        if not np.isin(included, (0, 1)).all():
            raise ValueError(f"{directory}: the canary draw must hold 0/1 entries.")
        draw = cls.draw(len(included), state["seed"])
        if not np.array_equal(draw.included, included.astype(bool)):
            raise ValueError(f"{directory}: the canary draw does not match its seed (edited?).")
        return draw
