"""User-wise DP-SGD (docs/mechanisms.md, M1; AUP-RLHF Alg. 4; Chua et al. 2024): users Poisson-sampled at
``q = ñ/n``, each user's averaged gradient clipped to C, noise ``N(0, σ²C²)``, division by ñ."""

from __future__ import annotations

from ..accountants.events import PoissonGaussian, StepEvent
from .base import GradientMechanism, register_mechanism


@register_mechanism
class UserDPSGD(GradientMechanism):
    name = "user_dpsgd"
    summary = "clip each user's averaged gradient, Gaussian noise (user-wise DP-SGD)"

    def make_loader(self, dataset, *, n_users, users_per_batch, max_samples_per_user, **loader_options):
        from ..data import UserDataLoader

        loader = UserDataLoader(dataset, users_per_batch=users_per_batch, max_samples_per_user=max_samples_per_user,
                                **loader_options)
        return loader, loader.users_per_batch

    def step_event(self, *, max_samples_per_user: int, n_users: int) -> StepEvent:
        return PoissonGaussian()
