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

from ..mechanisms.adaptive_clipping import default_count_noise_multiplier, gradient_noise_multiplier, next_clip
from .noise import add_gaussian_noise_
from .user_optimizer import UserDPOptimizer, UserDPOptimizerFastGradientClipping


class AdaptiveClipUserDPOptimizer(UserDPOptimizer):
    """:class:`UserDPOptimizer` with Andrew et al.'s private quantile clipping on per-user norms; ``max_grad_norm`` is
    the initial clip ``C_0``.

    Args:
        optimizer: the wrapped optimizer.
        target_quantile: γ, the fraction of users whose averaged gradient should lie within the clip.
        clip_learning_rate: η of the geometric update.
        count_noise_multiplier: σ_b, the std of the noise on the centred count; default ``max(ñ/20, σ)`` (Andrew et
            al. suggest ñ/20 for hundreds of users per step; at least σ keeps the gradient noise within 1.16σ).
        **kwargs: :class:`UserDPOptimizer`'s other arguments.

    Raises:
        ValueError: γ outside (0, 1), a non-positive η, or ``2σ_b ≤ σ``.
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
        draw: the norms the clip factors were computed from (all micro-batches and physical batches of the draw).

        Returns:
            ``Σ_u b_u``.
        """
        return sum(int((norms <= self.max_grad_norm).sum()) for norms in self.hooks.unit_norms)

    def add_noise(self) -> None:
        """Gradient noise ``N(0, (σ_Δ C_t)²)``; then the noisy centred count moves the clip for the next step."""
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.grad = add_gaussian_noise_(p.summed_grad, self.gradient_noise_multiplier * self.max_grad_norm,
                                         self.generator, self.secure_mode).view_as(p)
            _mark_as_processed(p.summed_grad)
        centred = self.within_clip() - self.units_in_step / 2
        reference = torch.zeros((), device=self.params[0].device if self.params else "cpu")
        noisy = centred + float(_generate_noise(std=self.count_noise_multiplier, reference=reference,
                                                generator=self.generator, secure_mode=self.secure_mode))
        self.max_grad_norm = next_clip(self.max_grad_norm, noisy, self.expected_batch_size, self.target_quantile,
                                       self.clip_learning_rate)

    @property
    def units_in_step(self) -> int:
        """The units (users) of the step's draw."""
        return self.hooks.units_in_step

    def privacy_state_dict(self) -> Dict[str, Any]:
        """The current clip ``C_t`` (a post-processing of the noisy counts), so a resumed run continues it."""
        return {"max_grad_norm": float(self.max_grad_norm)}

    def load_privacy_state_dict(self, state: Dict[str, Any], *, accounted_steps: int, source: str = "checkpoint") -> None:
        """Restore the clip ``C_t``; a missing, non-finite or non-positive clip is refused (``ValueError``)."""
        if set(state) != {"max_grad_norm"} or not (isinstance(state["max_grad_norm"], float)
                                                    and math.isfinite(state["max_grad_norm"])
                                                    and state["max_grad_norm"] > 0):
            raise ValueError(f"{source}: no adaptive clip for this run (got {state!r}); refusing to resume.")
        self.max_grad_norm = state["max_grad_norm"]


class AdaptiveClipUserDPOptimizerFastGradientClipping(AdaptiveClipUserDPOptimizer, UserDPOptimizerFastGradientClipping):
    """:class:`AdaptiveClipUserDPOptimizer` with per-user ghost clipping (``grad_sample_mode="ghost"``): the count of
    users within the clip reads the norms the ghost hooks clipped by."""
