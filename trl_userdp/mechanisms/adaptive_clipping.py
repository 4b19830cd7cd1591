"""User-wise DP-SGD with private adaptive per-user clipping (docs/mechanisms.md, M1a; Andrew et al. 2021 at the
user level): the clip follows a private estimate of the γ-quantile of the sampled users' averaged-gradient norms,
so nobody has to know the users' norm scale in advance. Accounted exactly as user-wise DP-SGD at the accountant's σ
(the count's noise is paid for by raising the gradient noise: :mod:`trl_userdp.optimizers.adaptive_clip_optimizer`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..validators import check_positive
from .base import register_mechanism
from .user_dpsgd import UserDPSGD


@register_mechanism
class AdaptiveClipUserDPSGD(UserDPSGD):
    """``per_user_max_grad_norm`` is the initial clip ``C_0``; ``target_quantile`` γ, ``clip_learning_rate`` η and
    ``count_noise_multiplier`` σ_b (default ``max(ñ/20, σ)``) steer it."""

    name = "user_dpsgd_adaptive"
    summary = "user-wise DP-SGD whose clip follows a private quantile of the users' norms (Andrew et al. 2021)"
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
        return cls(args.target_unclipped_quantile, args.clip_learning_rate, args.count_noise_multiplier)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        cls.from_arguments(args)

    def optimizer_class(self, world_size: int) -> type:
        self.check_world_size(world_size)
        from ..optimizers.adaptive_clip_optimizer import AdaptiveClipUserDPOptimizer

        return AdaptiveClipUserDPOptimizer

    def optimizer_options(self, expected_units: float) -> Dict[str, Any]:
        return {"target_quantile": self.target_quantile, "clip_learning_rate": self.clip_learning_rate,
                "count_noise_multiplier": self.count_noise_multiplier}

    def report_extra(self, optimizer: Any) -> Dict[str, Any]:
        return {"clipping": "adaptive (private quantile, Andrew et al. 2021); max_grad_norm is the current clip",
                "initial_max_grad_norm": optimizer.initial_max_grad_norm, "target_quantile": self.target_quantile,
                "clip_learning_rate": self.clip_learning_rate,
                "count_noise_multiplier": optimizer.count_noise_multiplier,
                "gradient_noise_multiplier": optimizer.gradient_noise_multiplier}
