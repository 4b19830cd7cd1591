"""AUP-RLHF's formulas, written once (docs/mechanisms.md, M4). ``AUPOptimizer``, ``AdaptiveUserPrivacyEngine``,
the linear estimator (``trl_userdp.experiments.linear.aup_rlhf``), ``trl-userdp account`` and the benchmarks all take them
from here, so the σ the CLI prints is the σ the engine trains with; and the mechanism object (:class:`AUPRLHF`)."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ..accountants.events import StepEvent, TruncatedPoissonGaussian
from ..validators import check_positive
from .base import GradientMechanism, register_mechanism


def pairwise_distances(unit_grads: List[torch.Tensor]) -> torch.Tensor:
    """``[U, U]`` Euclidean distances between per-user gradients (all parameters together), from the
    Gram matrix ``G = Σ_p g_p g_pᵀ``: ``‖g_i − g_j‖² = G_ii + G_jj − 2 G_ij``."""
    n = unit_grads[0].shape[0] if unit_grads else 0
    gram = torch.zeros((n, n), dtype=torch.float64)
    for g in unit_grads:
        flat = g.reshape(n, -1).double()
        gram += (flat @ flat.T).cpu()
    sq = torch.diagonal(gram)
    return (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0).sqrt()


def keep_probabilities(distances: torch.Tensor, radius: float, expected_users: float) -> torch.Tensor:
    """Step 12's keep probability from ``f_i`` = number of users within 2τ of user i (self included)."""
    f = (distances <= 2 * radius).sum(dim=1).double()
    return ((f - expected_users / 2) / (expected_users / 6)).clamp(0.0, 1.0)


class AboveThreshold:
    """AboveThreshold (Dwork & Roth; AUP-RLHF Alg. 3) for queries of sensitivity Δ: one noisy
    threshold per run, ``Lap(2Δ/ε)``; ``Lap(4Δ/ε)`` per query; pure ε for the whole run."""

    def __init__(self, threshold: float, epsilon: float, sensitivity: float, generator: Optional[torch.Generator] = None):
        self.threshold, self.epsilon, self.sensitivity, self.generator = threshold, epsilon, sensitivity, generator
        self.noisy_threshold: Optional[float] = None  # drawn at the first query
        self.queries = 0

    def _laplace(self, scale: float) -> float:
        u = torch.rand((), generator=self.generator, dtype=torch.float64) - 0.5
        return float(-scale * torch.sign(u) * torch.log1p(-2 * u.abs()))

    def query(self, value: float) -> bool:
        """True (⊤) if the noisy value clears the noisy threshold; False (⊥) means halt."""
        if self.noisy_threshold is None:
            self.noisy_threshold = self.threshold - self._laplace(2 * self.sensitivity / self.epsilon)
        self.queries += 1
        return value + self._laplace(4 * self.sensitivity / self.epsilon) >= self.noisy_threshold


#: AboveThreshold's bar as a share of ñ: the concentration score must reach 4ñ/5 (AUP-RLHF Alg. 2).
SCORE_THRESHOLD_FRACTION = 0.8


def default_max_users_per_batch(users_per_batch: float) -> int:
    """ñ_max = ñ + 4√ñ, rounded up: Poisson(ñ) exceeds it with probability below about 1e-4 per step."""
    return int(math.ceil(users_per_batch + 4 * math.sqrt(users_per_batch)))


def score_sensitivity(max_users_per_batch: int, users_per_batch: float) -> float:
    """Δ = (2ñ_max − 1)/ñ: one user changes up to 2|U_t| − 1 of the pair indicators of the score, |U_t| ≤ ñ_max
    (the correction to Alg. 3's sensitivity 1)."""
    return (2 * max_users_per_batch - 1) / users_per_batch


def score_test(users_per_batch: float, max_users_per_batch: int, epsilon: float,
               generator: Optional[torch.Generator] = None, threshold_fraction: float = SCORE_THRESHOLD_FRACTION,
               ) -> AboveThreshold:
    """The AboveThreshold run on concentration scores: threshold ``threshold_fraction·ñ``, budget ``epsilon``,
    sensitivity :func:`score_sensitivity`."""
    return AboveThreshold(threshold_fraction * users_per_batch, epsilon,
                          score_sensitivity(max_users_per_batch, users_per_batch), generator)


def survival_probability(users_per_batch: float, max_users_per_batch: int, svt_epsilon: float, steps: int,
                         threshold_fraction: float = SCORE_THRESHOLD_FRACTION) -> float:
    """P(AboveThreshold lets all ``steps`` queries through), in AUP-RLHF's best case: every sampled user within τ of
    every other, so the score is ``|U_t|²/ñ`` with ``|U_t| ~ Poisson(ñ)`` truncated at ``ñ_max``. A query passes when
    ``score + Lap(4Δ/ε_svt) ≥ threshold − Lap(2Δ/ε_svt)``, the threshold's noise drawn once per run, so the steps are
    independent given it: ``P = E_ρ[P(pass | ρ)^T]``, integrated numerically over ρ."""
    from scipy import stats

    sensitivity = score_sensitivity(max_users_per_batch, users_per_batch)
    query_scale, threshold_scale = 4 * sensitivity / svt_epsilon, 2 * sensitivity / svt_epsilon
    counts = np.arange(max_users_per_batch + 1)
    pmf = stats.poisson.pmf(counts, users_per_batch)
    pmf[-1] += stats.poisson.sf(max_users_per_batch, users_per_batch)  # more users are cut to ñ_max
    scores = counts ** 2 / users_per_batch
    rho = np.linspace(-40 * threshold_scale, 40 * threshold_scale, 40_001)
    gap = threshold_fraction * users_per_batch - rho[:, None] - scores[None, :]  # the query noise must reach it
    clear = np.where(gap < 0, 1 - 0.5 * np.exp(np.minimum(gap, 0) / query_scale),
                     0.5 * np.exp(-np.maximum(gap, 0) / query_scale))
    passes = np.clip(clear @ pmf, 1e-300, 1.0)
    density = stats.laplace.pdf(rho, scale=threshold_scale)
    return float(np.trapezoid(density * np.exp(steps * np.log(passes)), rho))


def split_budget(epsilon: float, delta: float, svt_fraction: float) -> Tuple[float, float, float]:
    """``(ε_svt, ε_gauss, δ_gauss)``: AboveThreshold takes ``svt_fraction·ε`` (pure), the Gaussian steps
    ``(ε − ε_svt, δ/2)``; the run is their sum by basic composition (Thm 3)."""
    if not 0 < svt_fraction < 1:
        raise ValueError(f"svt_fraction must lie in (0, 1), got {svt_fraction}.")
    svt = svt_fraction * epsilon
    return svt, epsilon - svt, delta / 2


def gaussian_noise_multiplier(epsilon: float, delta: float, *, sample_rate: float, steps: int, n_users: int,
                              max_users_per_batch: int, relation: str = "add_or_remove", tol: float = 1e-4) -> float:
    """σ = PrivacyAccount(ε, δ, n, ñ, T): T truncated-Poisson-subsampled Gaussian steps (dp-accounting PLD, on the
    engine's grid) at ``(ε, δ)`` (pass the Gaussian share of :func:`split_budget`)."""
    return TruncatedPoissonGaussian(n_users, max_users_per_batch).calibrate(
        epsilon, delta, sample_rate=sample_rate, steps=steps, accountant="pld", relation=relation, tol=tol)


def noise_std(radius: float, noise_multiplier: float, epsilon: float, steps: int, delta: float,
              users_per_batch: float) -> float:
    """The std of the noise on the mean of the kept users: ``τσ·√(8·log(e^ε·T/δ))/ñ`` (Alg. 2; ``ε`` and ``δ``
    are the run's totals), with the logarithm expanded so that a large ε cannot overflow."""
    return radius * noise_multiplier * math.sqrt(8 * (epsilon + math.log(steps / delta))) / users_per_batch


@register_mechanism
class AUPRLHF(GradientMechanism):
    """AUP-RLHF (docs/mechanisms.md, M4), set up by :class:`~trl_userdp.AdaptiveUserPrivacyEngine`."""

    name = "aup"
    summary = "AUP-RLHF: concentration test, outlier removal, noise scaled to τ (needs concentration_radius)"
    adaptive = True
    accepts_noise_multiplier = False  # σ follows from (ε, δ, T) and τ (Alg. 2)
    single_process_reason = ("its concentration score compares every sampled user's gradient with every other's; use "
                             "user_dpsgd for data-parallel training.")

    def optimizer_class(self, world_size: int) -> type:
        from ..optimizers.aup_optimizer import AUPOptimizer

        return AUPOptimizer

    def step_event(self, *, max_samples_per_user: int, n_users: int, max_users_per_batch: int) -> StepEvent:
        return TruncatedPoissonGaussian(n_users, max_users_per_batch)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        check_positive(args.concentration_radius, "concentration_radius")
        if getattr(args, "grad_sample_mode", "hooks") == "ghost":
            raise ValueError("AUP-RLHF needs every sampled user's gradient (the pairwise distances of its concentration "
                             "score), which ghost clipping never materialises: use grad_sample_mode='hooks'.")
        if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in (
                "checkpoint", "all_checkpoints"):
            raise ValueError(f"hub_strategy={args.hub_strategy!r} would push checkpoints, whose privacy_state.pt "
                             "holds AUP-RLHF's secret AboveThreshold threshold: use hub_strategy='every_save' or 'end'.")

    @classmethod
    def make_private(cls, args: Any, **engine_arguments: Any) -> Tuple[Any, Any, Any]:
        from ..adaptive_engine import AdaptiveUserPrivacyEngine

        engine = AdaptiveUserPrivacyEngine(neighboring_relation=args.neighboring_relation)
        _, optimizer, loader = engine.make_private_user_level(
            concentration_radius=args.concentration_radius, max_users_per_batch=args.max_users_per_batch,
            svt_fraction=args.svt_fraction, **engine_arguments)
        return engine, optimizer, loader
