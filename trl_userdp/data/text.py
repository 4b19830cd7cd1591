"""Text columns of a preference dataset, checked before TRL tokenizes them: a null, NaN or non-text value would
otherwise end in a traceback deep inside TRL's preprocessing, and an empty completion would train silently."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .users import _is_missing, is_hf_dataset

#: the text columns of TRL's preference, unpaired and prompt-only formats
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion")
#: columns that may hold an empty string (a prompt-free pair has an empty or absent prompt)
MAY_BE_EMPTY = ("prompt",)


def _problem(value: Any, column: str) -> Optional[str]:
    """What is wrong with one value of a text column, or None."""
    if _is_missing(value):
        return f"no text ({value!r})"
    if isinstance(value, str):
        return "an empty string" if not value and column not in MAY_BE_EMPTY else None
    if isinstance(value, (list, tuple)):  # conversational: a list of messages with text content
        for message in value:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, str):
                return f"a message without text content ({message!r})"
        return None if value or column in MAY_BE_EMPTY else "an empty list of messages"
    return f"a {type(value).__name__} ({value!r}), not text"


def check_text_columns(dataset: Any, columns: Sequence[str] = TEXT_COLUMNS) -> None:
    """Refuse a ``datasets.Dataset`` whose text columns hold a null, NaN, non-text or empty value.

    Args:
        dataset: the train (or eval) dataset; anything that is not a ``datasets.Dataset`` is left alone.
        columns: the columns to check, where present.

    Raises:
        ValueError: one line naming the first bad row and its column.
    """
    if not is_hf_dataset(dataset):
        return
    present = [c for c in columns if c in dataset.column_names]
    if not present:
        return
    start = 0
    for batch in dataset.select_columns(present).iter(batch_size=4096):  # bounded memory on a large dataset
        for offset, values in enumerate(zip(*(batch[c] for c in present))):
            for column, value in zip(present, values):
                problem = _problem(value, column)
                if problem is not None:
                    raise ValueError(f"Row {start + offset} has {problem} in column {column!r}: every row needs its "
                                     f"{column} as text (or a list of messages); fix or drop the row before training.")
        start += len(batch[present[0]])
