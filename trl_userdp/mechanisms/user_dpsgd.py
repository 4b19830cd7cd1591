"""User-wise DP-SGD (docs/mechanisms.md, M1; AUP-RLHF Alg. 4; Chua et al. 2024): users Poisson-sampled at
``q = ñ/n``, each user's averaged gradient clipped to C, noise ``N(0, σ²C²)``, division by ñ."""

from __future__ import annotations

from typing import Tuple

from ..accountants.events import PoissonGaussian, StepEvent
from .base import AccountingSetting, GradientMechanism, WalkthroughColumn, register_mechanism


@register_mechanism
class UserDPSGD(GradientMechanism):
    """User-wise DP-SGD: the defaults of :class:`GradientMechanism` with the Poisson-subsampled Gaussian event."""

    name = "user_dpsgd"
    summary = "clip each user's averaged gradient, Gaussian noise (user-wise DP-SGD)"
    walkthrough_notes = (
        "user-wise σ: noise multiplier of user-wise DP-SGD (clip each user's averaged gradient to C, noise σC); "
        "'ε replace': its ε at the PLD σ when one user's data is replaced instead of added or removed.",)

    def step_event(self, *, max_samples_per_user: int, n_users: int, users_per_batch: float) -> StepEvent:
        """The Poisson-subsampled Gaussian step (:class:`PoissonGaussian`)."""
        return PoissonGaussian()

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """σ under RDP and PLD, and the ε under the replace relation at the PLD σ."""
        plan = dict(sample_rate=setting.sample_rate, steps=setting.steps)
        rdp = PoissonGaussian().calibrate(epsilon, setting.delta, accountant="rdp", tol=1e-3, **plan)
        pld = PoissonGaussian().calibrate(epsilon, setting.delta, accountant="pld", tol=1e-3, **plan)
        replace = PoissonGaussian().epsilon([(pld, setting.sample_rate, setting.steps)], setting.delta,
                                            accountant="pld", relation="replace")
        return (WalkthroughColumn("user-wise σ", "(RDP)", rdp), WalkthroughColumn("user-wise σ", "(PLD)", pld),
                WalkthroughColumn("ε replace", "at PLD σ", replace, digits=3))
