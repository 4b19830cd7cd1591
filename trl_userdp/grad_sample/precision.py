"""Clip factors in low precision (docs/privacy_model.md, "Precision and paths")."""

from __future__ import annotations

from typing import Iterable

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


def product_margin(dtypes: Iterable[torch.dtype]) -> float:
    """The share of the clip a unit is clipped to so that its clipped gradient, rounded to nearest into the lowest of
    ``dtypes``, stays within the clip.

    Rounding to nearest moves a value by at most a factor ``1 + eps/2``, so a unit clipped to ``(1 − eps)·C`` is at
    most ``C`` once rounded (bf16: the clip 0.8% lower; fp32: 1.2e-7 lower). A unit below that is not scaled at all, and
    a factor of 1 rounds nothing.

    Args:
        dtypes: The dtypes the clipped gradients are rounded into (the parameters' or their sums').

    Returns:
        ``1 − eps`` of the lowest-precision dtype (1 for none).
    """
    return min((1.0 - torch.finfo(dtype).eps for dtype in dtypes), default=1.0)
