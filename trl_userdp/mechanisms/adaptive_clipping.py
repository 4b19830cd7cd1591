"""User-wise DP-SGD with private adaptive per-user clipping (docs/mechanisms.md, M1a; Andrew et al. 2021 at the
user level): the clip follows a private estimate of the γ-quantile of the sampled users' averaged-gradient norms,
so nobody has to know the users' norm scale in advance. Accounted exactly as user-wise DP-SGD at the accountant's σ
(the count's noise is paid for by raising the gradient noise: :mod:`trl_userdp.optimizers.adaptive_clip_optimizer`)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from ..accountants.events import PoissonGaussian
from ..validators import check_positive
from .base import AccountingSetting, WalkthroughColumn, register_mechanism
from .user_dpsgd import UserDPSGD


def gradient_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """``σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)``: the gradient noise that, with the count's noise ``σ_b``, makes one step
    a Gaussian mechanism at ``σ`` (Andrew et al. 2021, Thm 1).

    Args:
        noise_multiplier: σ, the step's noise multiplier in the accountant.
        count_noise_multiplier: σ_b, the std of the noise on the centred count.

    Returns:
        σ_Δ (0 when σ = 0).

    Raises:
        ValueError: ``2σ_b ≤ σ`` (the count alone would spend more than the step's budget).
    """
    if noise_multiplier == 0:
        return 0.0
    if not 2 * count_noise_multiplier > noise_multiplier:
        raise ValueError(f"count_noise_multiplier must exceed noise_multiplier / 2 = {noise_multiplier / 2:.4g} "
                         f"(got {count_noise_multiplier:.4g}): the count alone would spend more than the step's budget.")
    return (noise_multiplier ** -2 - (2 * count_noise_multiplier) ** -2) ** -0.5


def default_count_noise_multiplier(expected_units: float, noise_multiplier: float) -> float:
    """``σ_b = max(ñ/20, σ)``: Andrew et al.'s ñ/20 for hundreds of users per step; at least σ keeps ``σ_Δ ≤ 1.155σ``.

    Args:
        expected_units: ñ, the expected users per step.
        noise_multiplier: σ, the step's noise multiplier in the accountant.

    Returns:
        σ_b.
    """
    return max(expected_units / 20, noise_multiplier)


def next_clip(clip: float, centred_noisy_count: float, expected_units: float, target_quantile: float,
              clip_learning_rate: float) -> float:
    """``C_{t+1} = C_t · exp(−η (b̃ − γ))`` with ``b̃ = (Σ_u (b_u − ½) + noise)/ñ + ½`` (Andrew et al. 2021, Alg. 1).

    Args:
        clip: C_t.
        centred_noisy_count: ``Σ_u (b_u − ½)`` plus its noise.
        expected_units: ñ.
        target_quantile: γ.
        clip_learning_rate: η.

    Returns:
        C_{t+1}.
    """
    return clip * math.exp(-clip_learning_rate * (centred_noisy_count / expected_units + 0.5 - target_quantile))


@register_mechanism
class AdaptiveClipUserDPSGD(UserDPSGD):
    """User-wise DP-SGD whose clip follows a private quantile (Andrew et al. 2021); ``per_user_max_grad_norm`` is the
    initial clip ``C_0``.

    Args:
        target_quantile: γ, the share of users whose averaged gradient should lie within the clip.
        clip_learning_rate: η, the rate of the geometric update.
        count_noise_multiplier: σ_b, the std of the noise on the centred count (None: ``max(ñ/20, σ)``).

    Raises:
        ValueError: γ outside (0, 1), or a non-positive η or σ_b.
    """

    name = "user_dpsgd_adaptive_clip"
    summary = "user-wise DP-SGD whose clip follows a private quantile of the users' norms (Andrew et al. 2021)"
    clipping = "adaptive"
    walkthrough_notes = ("adaptive σ_Δ: the gradient noise of user-wise DP-SGD with an adaptive clip at the PLD σ "
                         "(the count's noise σ_b = max(ñ/20, σ) takes the rest of each step's budget).",)
    single_process_reason = ("its count of users within the clip would have to be summed across processes before its "
                             "noise is added; use user_dpsgd for data-parallel training.")

    def __init__(self, target_quantile: float = 0.5, clip_learning_rate: float = 0.2,
                 count_noise_multiplier: Optional[float] = None):
        if not 0 < target_quantile < 1:
            raise ValueError(f"target_unclipped_quantile must lie in (0, 1), got {target_quantile!r}.")
        check_positive(clip_learning_rate, "clip_learning_rate")
        if count_noise_multiplier is not None:
            check_positive(count_noise_multiplier, "count_noise_multiplier")
        self.target_quantile, self.clip_learning_rate = float(target_quantile), float(clip_learning_rate)
        self.count_noise_multiplier = count_noise_multiplier

    @classmethod
    def from_arguments(cls, args: Any) -> "AdaptiveClipUserDPSGD":
        """γ, η and σ_b from the trainer's privacy fields."""
        return cls(args.target_unclipped_quantile, args.clip_learning_rate, args.count_noise_multiplier)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        """Checks γ, η and σ_b by building the mechanism."""
        cls.from_arguments(args)

    def optimizer_options(self, **plan: Any) -> Dict[str, Any]:
        """The base's options plus γ, η and σ_b."""
        return {**super().optimizer_options(**plan), "target_quantile": self.target_quantile,
                "clip_learning_rate": self.clip_learning_rate, "count_noise_multiplier": self.count_noise_multiplier}

    def report_fields(self, fields: Dict[str, Any], optimizer: Any, *, accounted_epsilon: float) -> Dict[str, Any]:
        """Adds the initial clip, γ, η, σ_b and σ_Δ to ``extra``; ``max_grad_norm`` is the current clip."""
        fields["extra"].update({
            "clipping": "adaptive (private quantile, Andrew et al. 2021); max_grad_norm is the current clip",
            "initial_per_user_max_grad_norm": optimizer.initial_max_grad_norm, "target_quantile": self.target_quantile,
            "clip_learning_rate": self.clip_learning_rate, "count_noise_multiplier": optimizer.count_noise_multiplier,
            "gradient_noise_multiplier": optimizer.gradient_noise_multiplier})
        return fields

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """σ_Δ at the PLD σ of user-wise DP-SGD, with the default σ_b."""
        sigma = PoissonGaussian().calibrate(epsilon, setting.delta, sample_rate=setting.sample_rate,
                                            steps=setting.steps, accountant="pld", tol=1e-3)
        count = default_count_noise_multiplier(setting.users_per_batch, sigma)
        return (WalkthroughColumn("adaptive σ_Δ", "(PLD)", gradient_noise_multiplier(sigma, count)),)
