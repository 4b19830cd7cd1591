"""Warnings of the stack that name nothing a user wrote, and the filter the package applies to them.

transformers 5 renamed gradient checkpointing "activation checkpointing". TRL 1.16 still uses the old names: its
configs default ``gradient_checkpointing=True`` and its trainers call ``is_gradient_checkpointing()`` and
``gradient_checkpointing_enable()``. Each use raises a FutureWarning about TRL's code, not the user's, so the configs,
the trainers' ``train()`` and the commands run without them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

#: the messages of transformers' FutureWarnings for TRL's use of its renamed gradient-checkpointing API
STACK_DEPRECATIONS = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"


@contextlib.contextmanager
def without_stack_deprecations() -> Iterator[None]:
    """A block in which :data:`STACK_DEPRECATIONS` are not shown (other warnings are, as before)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=STACK_DEPRECATIONS, category=FutureWarning)
        yield
