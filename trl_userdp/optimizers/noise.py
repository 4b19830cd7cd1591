"""The Gaussian mechanism's draw on a clipped sum, as Opacus's ``DPOptimizer.add_noise`` makes it, added in place."""

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


def add_gaussian_noise_(summed: torch.Tensor, std: float, generator: Optional[torch.Generator],
                        secure_mode: bool) -> torch.Tensor:
    """``summed += N(0, std²)`` elementwise (:func:`gaussian_draw`), in place: the values of Opacus's ``add_noise``
    (``summed + noise``; addition commutes exactly), without the new full-size tensor it keeps as ``p.grad`` beside
    the sum. The draw is the one transient tensor, freed at once, so that the next parameter's draw reuses its memory:
    the noise adds no parameter-sized tensor to the step's resident memory (docs/benchmarks.md, "Cost of a step at a
    realistic size").

    Args:
        summed: The clipped sum (``p.summed_grad``), which the step owns and which becomes ``p.grad``.
        std: The noise's standard deviation, σ·C.
        generator: The generator of the draw.
        secure_mode: As :func:`gaussian_draw`'s.

    Returns:
        ``summed``, now ``summed + noise``.
    """
    return summed.add_(gaussian_draw(std, summed, generator, secure_mode))
