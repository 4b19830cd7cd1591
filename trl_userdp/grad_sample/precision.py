"""Clip factors in low precision (docs/privacy_model.md, "Precision and paths")."""

from __future__ import annotations

import torch


def round_down(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A clip factor in a lower precision, rounded towards zero.

    A clip factor rounded up in bf16 would let a unit's clipped gradient exceed ``C`` by up to 2⁻⁸.

    Args:
        factor: The clip factors (fp32, in [0, 1]).
        dtype: The target dtype.

    Returns:
        ``factor`` in ``dtype``, never above the fp32 value.
    """
    low = factor.to(dtype)
    if low.dtype == factor.dtype:
        return low
    # two epsilons below, rounding to nearest cannot come back above the factor
    lower = (factor * (1 - 2 * torch.finfo(dtype).eps)).to(dtype)
    return torch.where(low.float() > factor, lower, low)
