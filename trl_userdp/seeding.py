"""Seeds of the privacy randomness, derived one way: a run seed, the stream's purpose and its position.

Every seeded draw of the package comes from here: contribution bounding and AUP-RLHF's phases (per user:
``"bounding"``, ``"phases"``), user sampling (per epoch: ``"sampling"``; per phase: ``"phase"``), randomized
response (``"randomized_response"``), the noise and AUP-RLHF's draws (per step: ``"noise"``, ``"aup"``), and GRPO's
sampling of completions (per step and user: ``"generation"``). docs/privacy_model.md, "The run's randomness", lists
them all.
With a seed (``privacy_seed`` in the trainers, ``noise_seed`` in the engines) the draws of step t come from
``derive_seed(seed, stream, t)``, so a run resumed at step k draws steps k+1, k+2, ... exactly as the
uninterrupted run would, and never replays the draws of steps 1…k (docs/privacy_model.md, "Faults")."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Optional

import numpy as np


def derive_seed(seed: int, stream: str, *position: int) -> int:
    """A seed for one stream at one position of a run, independent across streams and positions.

    Args:
        seed: The run seed.
        stream: The stream's purpose (``"noise"``, ``"aup"``, …).
        *position: The stream's position, e.g. the step (integers).

    Returns:
        A 63-bit non-negative seed (NumPy's ``SeedSequence``).
    """
    key = int.from_bytes(hashlib.sha256(stream.encode()).digest()[:4], "little")
    words = np.random.SeedSequence([int(seed), key, *(int(i) for i in position)]).generate_state(1, np.uint64)
    return int(words[0] >> np.uint64(1))


def user_key(key: Any) -> int:
    """A user's position in per-user streams: a 64-bit integer from the user's original id alone, so that adding or
    removing another user never moves this user's draws.

    Args:
        key: The user's original id (the user column's value).

    Returns:
        A non-negative 64-bit integer.
    """
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def run_secret(privacy_seed: Optional[int]) -> int:
    """The secret a run keys its per-user streams by: the given ``privacy_seed``, or 63 bits from the OS.

    Args:
        privacy_seed: The user's seed, or None (the default, and the only choice for a release).

    Returns:
        The seed of the run's keyed streams.
    """
    return secrets.randbits(63) if privacy_seed is None else int(privacy_seed)

