"""The Gaussian mechanism's draw on a clipped sum, as Opacus's ``DPOptimizer.add_noise`` makes it, in one new tensor."""

from __future__ import annotations

from typing import Optional

import torch
from opacus.optimizers.optimizer import _generate_noise


def gaussian_draw(std: float, reference: torch.Tensor, generator: Optional[torch.Generator],
                  secure_mode: bool) -> torch.Tensor:
    """Opacus's draw ``N(0, std²)`` of ``reference``'s shape and dtype (``opacus.optimizers.optimizer._generate_noise``:
    the same generator calls, so the same values), without the zero tensor Opacus allocates first and uses only for
    ``std = 0`` or ``secure_mode``.

    Args:
        std: The noise's standard deviation, σ·C.
        reference: A tensor of the wanted shape, dtype and device.
        generator: The generator of the draw.
        secure_mode: Opacus's ``secure_mode`` (its draw, summed over four, against floating-point attacks).

    Returns:
        A new tensor.
    """
    if std == 0 or secure_mode:
        return _generate_noise(std=std, reference=reference, generator=generator, secure_mode=secure_mode)
    return torch.normal(mean=0, std=std, size=reference.shape, device=reference.device, generator=generator,
                        dtype=reference.dtype)


def add_gaussian_noise(summed: torch.Tensor, std: float, generator: Optional[torch.Generator],
                       secure_mode: bool) -> torch.Tensor:
    """``summed + N(0, std²)`` elementwise (:func:`gaussian_draw`), added into the draw: one new tensor of the
    parameter's size where Opacus's ``add_noise`` allocates three (zeros, the draw, their sum), with the same values.
    On a CPU every fresh full-size tensor costs its page faults (docs/benchmarks.md, "Cost of a step at a realistic
    size").

    Args:
        summed: The clipped sum (``p.summed_grad``).
        std: The noise's standard deviation, σ·C.
        generator: The generator of the draw.
        secure_mode: As :func:`gaussian_draw`'s.

    Returns:
        A new tensor ``summed + noise``, of ``summed``'s shape and dtype.
    """
    return gaussian_draw(std, summed, generator, secure_mode).add_(summed)
