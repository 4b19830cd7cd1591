"""Loading saved privacy state safely: a checkpoint is data, never code (docs/privacy_model.md, "Faults")."""

from __future__ import annotations

import pickle
from typing import Any

import torch


def load_plain(path: Any, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only.

    A file that needs anything else (a pickled object, a planted payload) is refused before any of it runs.

    Args:
        path: The file to load (anything ``torch.load`` accepts).
        **kwargs: Passed to ``torch.load``; ``weights_only`` may only be True.

    Returns:
        The loaded object.

    Raises:
        ValueError: If ``weights_only`` is not True, if the file holds more than plain data, or if it is
            truncated or not a torch file.
    """
    if kwargs.pop("weights_only", True) is not True:
        raise ValueError("Privacy state is loaded with weights_only=True only.")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds more than plain data (tensors, numbers, strings, containers), so it is not "
                         f"loaded: a checkpoint must never run code ({_first_line(err)}).") from None
    except (RuntimeError, EOFError) as err:  # truncated or not a torch file at all
        raise ValueError(f"{path} is not a readable checkpoint ({_first_line(err)}).") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
