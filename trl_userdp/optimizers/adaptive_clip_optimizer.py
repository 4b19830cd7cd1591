"""``AdaptiveClipUserDPOptimizer``: user-wise DP-SGD whose clip norm follows a private quantile of the users' norms
(Andrew et al. 2021, "Differentially private learning with adaptive clipping", Alg. 1 and Thm 1, at the user level;
docs/mechanisms.md, M1a).

Each step: each sampled user's averaged gradient ``g_u`` is clipped to the current ``C_t``; besides the noisy clipped
sum, the step releases the noisy count ``b̃ = (Σ_u (b_u − ½) + N(0, σ_b²)) / ñ + ½`` of users with ``‖g_u‖ ≤ C_t``
(``b_u ∈ {0, 1}``; centred, so adding or removing a user moves the sum by ½), and the clip moves geometrically
towards the target quantile γ: ``C_{t+1} = C_t · exp(−η (b̃ − γ))``. The pair (sum, count) is one Gaussian mechanism:
with gradient noise ``σ_Δ·C_t`` and count noise ``σ_b`` its ℓ2 sensitivity, in units of the noise, gives
``σ⁻² = σ_Δ⁻² + (2σ_b)⁻²``, so the gradient noise is raised to ``σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)`` and the step is
accounted as one Poisson-subsampled Gaussian step at the accountant's σ. The clip trajectory is a post-processing of
these noisy releases: it may be logged and reported.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

from .user_optimizer import UserDPOptimizer


def gradient_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """``σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)``: the gradient noise that, with the count's noise ``σ_b``, makes one step
    a Gaussian mechanism at ``σ`` (Andrew et al. 2021, Thm 1). Needs ``2σ_b > σ``."""
    if noise_multiplier == 0:
        return 0.0
    if not 2 * count_noise_multiplier > noise_multiplier:
        raise ValueError(f"count_noise_multiplier must exceed noise_multiplier / 2 = {noise_multiplier / 2:.4g} "
                         f"(got {count_noise_multiplier:.4g}): the count alone would spend more than the step's budget.")
    return (noise_multiplier ** -2 - (2 * count_noise_multiplier) ** -2) ** -0.5


def default_count_noise_multiplier(expected_units: float, noise_multiplier: float) -> float:
    """``σ_b = max(ñ/20, σ)``: Andrew et al.'s ñ/20 for hundreds of users per step; at least σ keeps ``σ_Δ ≤ 1.155σ``."""
    return max(expected_units / 20, noise_multiplier)


def next_clip(clip: float, centred_noisy_count: float, expected_units: float, target_quantile: float,
              clip_learning_rate: float) -> float:
    """``C_{t+1} = C_t · exp(−η (b̃ − γ))`` with ``b̃ = (Σ_u (b_u − ½) + noise)/ñ + ½`` (Andrew et al. 2021, Alg. 1)."""
    return clip * math.exp(-clip_learning_rate * (centred_noisy_count / expected_units + 0.5 - target_quantile))


class AdaptiveClipUserDPOptimizer(UserDPOptimizer):
    """:class:`UserDPOptimizer` with Andrew et al.'s private quantile clipping on per-user norms.

    Args (beyond :class:`UserDPOptimizer`'s; ``max_grad_norm`` is the initial clip ``C_0``):
        target_quantile: γ, the fraction of users whose averaged gradient should lie within the clip.
        clip_learning_rate: η of the geometric update.
        count_noise_multiplier: σ_b, the std of the noise on the centred count; default ``max(ñ/20, σ)`` (Andrew et
            al. suggest ñ/20 for hundreds of users per step; at least σ keeps the gradient noise within 1.16σ).
    """

    def __init__(self, optimizer, *, target_quantile: float, clip_learning_rate: float,
                 count_noise_multiplier: Optional[float] = None, **kwargs: Any):
        super().__init__(optimizer, **kwargs)
        if not 0 < target_quantile < 1:
            raise ValueError(f"target_quantile must lie in (0, 1), got {target_quantile!r}.")
        if not clip_learning_rate > 0:
            raise ValueError(f"clip_learning_rate must be > 0, got {clip_learning_rate!r}.")
        self.target_quantile = float(target_quantile)
        self.clip_learning_rate = float(clip_learning_rate)
        if count_noise_multiplier is None:
            count_noise_multiplier = default_count_noise_multiplier(self.expected_batch_size, self.noise_multiplier)
        self.count_noise_multiplier = float(count_noise_multiplier)
        self.gradient_noise_multiplier = gradient_noise_multiplier(self.noise_multiplier, self.count_noise_multiplier)
        self.initial_max_grad_norm = float(self.max_grad_norm)

    def within_clip(self) -> int:
        """The step's count of users within the clip, ``Σ_u b_u`` with ``b_u = [‖g_u‖ ≤ C_t]``, over every unit of the
        draw: the norms the clip factors were computed from (all micro-batches and physical batches of the draw)."""
        return sum(int((norms <= self.max_grad_norm).sum()) for norms in self.hooks.unit_norms)

    def add_noise(self) -> None:
        """Gradient noise ``N(0, (σ_Δ C_t)²)``; then the noisy centred count moves the clip for the next step."""
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(std=self.gradient_noise_multiplier * self.max_grad_norm, reference=p.summed_grad,
                                    generator=self.generator, secure_mode=self.secure_mode)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)
        centred = self.within_clip() - self.units_in_step / 2
        reference = torch.zeros((), device=self.params[0].device if self.params else "cpu")
        noisy = centred + float(_generate_noise(std=self.count_noise_multiplier, reference=reference,
                                                generator=self.generator, secure_mode=self.secure_mode))
        self.max_grad_norm = next_clip(self.max_grad_norm, noisy, self.expected_batch_size, self.target_quantile,
                                       self.clip_learning_rate)

    @property
    def units_in_step(self) -> int:
        return self.hooks.units_in_step

    def privacy_state_dict(self) -> Dict[str, Any]:
        """The current clip ``C_t`` (a post-processing of the noisy counts), so a resumed run continues it."""
        return {"max_grad_norm": float(self.max_grad_norm)}

    def load_privacy_state_dict(self, state: Dict[str, Any], *, accounted_steps: int, source: str = "checkpoint") -> None:
        if set(state) != {"max_grad_norm"} or not (isinstance(state["max_grad_norm"], float)
                                                    and math.isfinite(state["max_grad_norm"])
                                                    and state["max_grad_norm"] > 0):
            raise ValueError(f"{source}: no adaptive clip for this run (got {state!r}); refusing to resume.")
        self.max_grad_norm = state["max_grad_norm"]
