"""AUP-RLHF's formulas, written once (docs/mechanisms.md, M4), and its mechanism (:class:`AUPRLHF`).
``AUPOptimizer``, the engines, the linear estimator (``trl_userdp.experiments.linear.aup_rlhf``), ``trl-userdp account``
and the benchmarks all take them from here, so the σ the CLI prints is the σ the engine trains with."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from scipy import stats

from ..accountants.events import StepEvent, TruncatedPoissonGaussian
from ..data import UserDataLoader
from ..validators import check_positive
from .base import AccountingSetting, GradientMechanism, WalkthroughColumn, register_mechanism


def pairwise_distances(unit_grads: List[torch.Tensor]) -> torch.Tensor:
    """``[U, U]`` Euclidean distances between per-user gradients (all parameters together), from the
    Gram matrix ``G = Σ_p g_p g_pᵀ``: ``‖g_i − g_j‖² = G_ii + G_jj − 2 G_ij``.

    Args:
        unit_grads: one ``[U, *p.shape]`` tensor per parameter p, row i user i's averaged gradient g_i.

    Returns:
        The ``[U, U]`` distances, float64 on the CPU.
    """
    n = unit_grads[0].shape[0] if unit_grads else 0
    gram = torch.zeros((n, n), dtype=torch.float64)
    for g in unit_grads:
        flat = g.reshape(n, -1).double()
        gram += (flat @ flat.T).cpu()
    sq = torch.diagonal(gram)
    return (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0).sqrt()


def keep_probabilities(distances: torch.Tensor, radius: float, expected_users: float) -> torch.Tensor:
    """Step 12's keep probability (AUP-RLHF Alg. 2): 0 if ``f_i < ñ/2``, 1 if ``f_i ≥ 2ñ/3``, else
    ``(f_i − ñ/2)/(ñ/6)``, with ``f_i`` = number of users within 2τ of user i (self included).

    Args:
        distances: ``[U, U]``, the :func:`pairwise_distances` of the step's users.
        radius: τ, the concentration radius.
        expected_users: ñ, the expected users per step.

    Returns:
        ``[U]`` keep probabilities in [0, 1].
    """
    f = (distances <= 2 * radius).sum(dim=1).double()
    return ((f - expected_users / 2) / (expected_users / 6)).clamp(0.0, 1.0)


class AboveThreshold:
    """AboveThreshold (Dwork & Roth; AUP-RLHF Alg. 3) for queries of sensitivity Δ: one noisy
    threshold per run, ``Lap(2Δ/ε)``; ``Lap(4Δ/ε)`` per query; pure ε for the whole run.

    Args:
        threshold: the threshold before its noise.
        epsilon: ε, the budget of the whole run.
        sensitivity: Δ, the sensitivity of the queries.
        generator: the source of the Laplace draws (None: torch's default generator).
    """

    def __init__(self, threshold: float, epsilon: float, sensitivity: float, generator: Optional[torch.Generator] = None):
        self.threshold, self.epsilon, self.sensitivity, self.generator = threshold, epsilon, sensitivity, generator
        self.noisy_threshold: Optional[float] = None  # drawn at the first query
        self.queries = 0

    def _laplace(self, scale: float) -> float:
        u = torch.rand((), generator=self.generator, dtype=torch.float64) - 0.5
        return float(-scale * torch.sign(u) * torch.log1p(-2 * u.abs()))

    def query(self, value: float) -> bool:
        """Answer one query (the noisy threshold is drawn at the first).

        Args:
            value: the query's value on the data, of sensitivity at most Δ.

        Returns:
            True (⊤) if the noisy value clears the noisy threshold; False (⊥) means halt.
        """
        if self.noisy_threshold is None:
            self.noisy_threshold = self.threshold - self._laplace(2 * self.sensitivity / self.epsilon)
        self.queries += 1
        return value + self._laplace(4 * self.sensitivity / self.epsilon) >= self.noisy_threshold


#: AboveThreshold's bar as a share of ñ: the concentration score must reach 4ñ/5 (AUP-RLHF Alg. 2).
SCORE_THRESHOLD_FRACTION = 0.8


def default_max_users_per_batch(users_per_batch: float) -> int:
    """ñ_max = ñ + 4√ñ, rounded up: Poisson(ñ) exceeds it with probability below about 1e-4 per step.

    Args:
        users_per_batch: ñ, the expected users per step.

    Returns:
        ñ_max.
    """
    return int(math.ceil(users_per_batch + 4 * math.sqrt(users_per_batch)))


def score_sensitivity(max_users_per_batch: int, users_per_batch: float) -> float:
    """Δ = (2ñ_max − 1)/ñ: one user changes up to 2|U_t| − 1 of the pair indicators of the score, |U_t| ≤ ñ_max
    (the correction to Alg. 3's sensitivity 1).

    Args:
        max_users_per_batch: ñ_max, the truncation of the sampler.
        users_per_batch: ñ, the expected users per step.

    Returns:
        Δ.
    """
    return (2 * max_users_per_batch - 1) / users_per_batch


def score_test(users_per_batch: float, max_users_per_batch: int, epsilon: float,
               generator: Optional[torch.Generator] = None, threshold_fraction: float = SCORE_THRESHOLD_FRACTION,
               ) -> AboveThreshold:
    """The AboveThreshold run on concentration scores (AUP-RLHF Alg. 2), of sensitivity :func:`score_sensitivity`.

    Args:
        users_per_batch: ñ, the expected users per step.
        max_users_per_batch: ñ_max, the truncation of the sampler.
        epsilon: ε_svt, AboveThreshold's budget.
        generator: the source of its Laplace draws.
        threshold_fraction: the threshold as a share of ñ (4/5 in Alg. 2).

    Returns:
        The :class:`AboveThreshold`, with threshold ``threshold_fraction·ñ``.
    """
    return AboveThreshold(threshold_fraction * users_per_batch, epsilon,
                          score_sensitivity(max_users_per_batch, users_per_batch), generator)


def survival_probability(users_per_batch: float, max_users_per_batch: int, svt_epsilon: float, steps: int,
                         threshold_fraction: float = SCORE_THRESHOLD_FRACTION) -> float:
    """P(AboveThreshold lets all ``steps`` queries through), in AUP-RLHF's best case: every sampled user within τ of
    every other, so the score is ``|U_t|²/ñ`` with ``|U_t| ~ Poisson(ñ)`` truncated at ``ñ_max``. A query passes when
    ``score + Lap(4Δ/ε_svt) ≥ threshold − Lap(2Δ/ε_svt)``, the threshold's noise drawn once per run, so the steps are
    independent given it: ``P = E_ρ[P(pass | ρ)^T]``, integrated numerically over ρ.

    Args:
        users_per_batch: ñ, the expected users per step.
        max_users_per_batch: ñ_max, the truncation of the sampler.
        svt_epsilon: ε_svt, AboveThreshold's budget.
        steps: T, the number of queries.
        threshold_fraction: the threshold as a share of ñ.

    Returns:
        The probability that AboveThreshold never halts.
    """
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
    """Split the run's budget: AboveThreshold takes ``svt_fraction·ε`` (pure), the Gaussian steps
    ``(ε − ε_svt, δ/2)``; the run is their sum by basic composition (Thm 3).

    Args:
        epsilon: the run's ε.
        delta: the run's δ.
        svt_fraction: AboveThreshold's share of ε.

    Returns:
        ``(ε_svt, ε_gauss, δ_gauss)``.

    Raises:
        ValueError: ``svt_fraction`` outside (0, 1).
    """
    if not 0 < svt_fraction < 1:
        raise ValueError(f"svt_fraction must lie in (0, 1), got {svt_fraction}.")
    svt = svt_fraction * epsilon
    return svt, epsilon - svt, delta / 2


def gaussian_noise_multiplier(epsilon: float, delta: float, *, sample_rate: float, steps: int, n_users: int,
                              max_users_per_batch: int, relation: str = "add_or_remove", tol: float = 1e-4) -> float:
    """σ = PrivacyAccount(ε, δ, n, ñ, T): T truncated-Poisson-subsampled Gaussian steps (dp-accounting PLD, on the
    engine's grid) at ``(ε, δ)``.

    Args:
        epsilon: ε_gauss, the Gaussian share of :func:`split_budget`.
        delta: δ_gauss, likewise.
        sample_rate: q = ñ/n.
        steps: T, the number of steps.
        n_users: n, the number of users.
        max_users_per_batch: ñ_max, the truncation of the sampler.
        relation: the neighbouring relation, ``"add_or_remove"`` or ``"replace"``.
        tol: the calibration's tolerance on σ.

    Returns:
        σ.

    Raises:
        ValueError: ε or δ out of range, or a budget that needs σ above 10⁴ or is met below σ = 0.05.
    """
    return TruncatedPoissonGaussian(n_users, max_users_per_batch).calibrate(
        epsilon, delta, sample_rate=sample_rate, steps=steps, accountant="pld", relation=relation, tol=tol)


def noise_std(radius: float, noise_multiplier: float, epsilon: float, steps: int, delta: float,
              users_per_batch: float) -> float:
    """The std of the noise on the mean of the kept users, ``τσ·√(8·log(e^ε·T/δ))/ñ`` (Alg. 2), with the logarithm
    expanded so that a large ε cannot overflow.

    Args:
        radius: τ, the concentration radius.
        noise_multiplier: σ.
        epsilon: ε, the run's total.
        steps: T, the number of steps.
        delta: δ, the run's total.
        users_per_batch: ñ, the expected users per step.

    Returns:
        The std.
    """
    return radius * noise_multiplier * math.sqrt(8 * (epsilon + math.log(steps / delta))) / users_per_batch


@register_mechanism
class AUPRLHF(GradientMechanism):
    """AUP-RLHF (Zhang et al., Alg. 2; docs/mechanisms.md, M4): per-user gradients, concentration score, AboveThreshold,
    randomized outlier removal, the mean of the kept users plus Gaussian noise scaled to τ. Users are Poisson-sampled
    at ``q = ñ/n`` and each step truncated to ``ñ_max`` users; AboveThreshold spends ``ε_svt = svt_fraction·ε`` (pure),
    the Gaussian steps are calibrated to ``(ε − ε_svt, δ/2)`` (dp-accounting PLD, truncated Poisson), and the run's ε is
    their sum (basic composition, Thm 3). :class:`~trl_userdp.AdaptiveUserPrivacyEngine` adds Alg. 1's phases.

    Args:
        concentration_radius: τ.
        max_users_per_batch: ñ_max (default :func:`default_max_users_per_batch` of ñ).
        svt_fraction: the share of ε for AboveThreshold.
        radius_epsilon: the part of the target ε already spent choosing τ on these users
            (:func:`~trl_userdp.propose_concentration_radius_private`); the run gets the rest.
        average_iterates: keep the running average of the iterates (the output for convex models).

    Raises:
        ValueError: a non-positive τ or ``svt_fraction`` outside (0, 1).
    """

    name = "aup"
    summary = "AUP-RLHF: concentration test, outlier removal, noise scaled to τ (needs concentration_radius)"
    clipping = "aup"
    accepts_noise_multiplier = False  # σ follows from (ε, δ, T) and τ (Alg. 2)
    single_process_reason = ("its concentration score compares every sampled user's gradient with every other's; use "
                             "user_dpsgd for data-parallel training.")
    ghost_reason = ("AUP-RLHF needs every sampled user's gradient (the pairwise distances of its concentration score), "
                    "which ghost clipping never materialises: use grad_sample_mode='hooks'.")
    walkthrough_notes = (
        "AUP σ: AUP-RLHF's PrivacyAccount(ε/2, δ/2) over steps truncated to ñ + 4√ñ users (the engine's σ); its noise",
        "  variance per coordinate is 8τ²·log(e^ε·T/δ)·σ²/ñ².")

    def __init__(self, concentration_radius: float, *, max_users_per_batch: Optional[int] = None,
                 svt_fraction: float = 0.5, radius_epsilon: float = 0.0, average_iterates: bool = False):
        self.concentration_radius = check_positive(concentration_radius, "concentration_radius")
        if not 0 < svt_fraction < 1:
            raise ValueError(f"svt_fraction must lie in (0, 1), got {svt_fraction}.")
        self.max_users_per_batch = None if max_users_per_batch is None else int(max_users_per_batch)
        self.svt_fraction, self.radius_epsilon = float(svt_fraction), float(radius_epsilon)
        self.average_iterates = average_iterates

    @classmethod
    def from_arguments(cls, args: Any) -> "AUPRLHF":
        """τ, ñ_max and ``svt_fraction`` from the trainer's privacy fields."""
        return cls(args.concentration_radius, max_users_per_batch=args.max_users_per_batch,
                   svt_fraction=args.svt_fraction)

    @classmethod
    def check_arguments(cls, args: Any) -> None:
        """Requires a positive τ; refuses ghost clipping and a hub strategy that pushes checkpoints (their
        ``privacy_state.pt`` holds the secret AboveThreshold threshold)."""
        check_positive(args.concentration_radius, "concentration_radius")
        if getattr(args, "grad_sample_mode", "hooks") == "ghost":
            raise ValueError(cls.ghost_reason)
        if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in (
                "checkpoint", "all_checkpoints"):
            raise ValueError(f"hub_strategy={args.hub_strategy!r} would push checkpoints, whose privacy_state.pt "
                             "holds AUP-RLHF's secret AboveThreshold threshold: use hub_strategy='every_save' or 'end'.")

    def check_setup(self, *, max_grad_norm: Optional[float], noise_multiplier: Optional[float], world_size: int,
                    grad_sample_mode: str, sharded: bool = False) -> None:
        """As every gradient mechanism's, but τ takes the place of C (``max_grad_norm`` is not used)."""
        super().check_setup(max_grad_norm=self.concentration_radius, noise_multiplier=noise_multiplier,
                            world_size=world_size, grad_sample_mode=grad_sample_mode, sharded=sharded)

    def users_cap(self, users_per_batch: float) -> int:
        """ñ_max, the truncation of the sampler.

        Args:
            users_per_batch: ñ, the expected users per step.

        Returns:
            The given ñ_max, or :func:`default_max_users_per_batch` of ñ.
        """
        return default_max_users_per_batch(users_per_batch) if self.max_users_per_batch is None else self.max_users_per_batch

    def make_loader(self, dataset, *, n_users, users_per_batch, max_samples_per_user, **loader_options):
        """Users Poisson-sampled at ``q = ñ/n``, each step truncated to ñ_max users."""
        loader = UserDataLoader(dataset, users_per_batch=users_per_batch, max_samples_per_user=max_samples_per_user,
                                max_users_per_batch=self.users_cap(users_per_batch), **loader_options)
        return loader, loader.users_per_batch

    def step_event(self, *, max_samples_per_user: int, n_users: int, users_per_batch: float) -> StepEvent:
        """The Poisson-subsampled Gaussian step truncated to ñ_max users (:class:`TruncatedPoissonGaussian`)."""
        return TruncatedPoissonGaussian(n_users, self.users_cap(users_per_batch))

    def run_epsilon(self, target_epsilon: float) -> float:
        """What the run may spend: the target less ``radius_epsilon``.

        Args:
            target_epsilon: the run's target ε.

        Returns:
            ε − ε_radius.

        Raises:
            ValueError: ``radius_epsilon`` is not below the target.
        """
        if not 0 <= self.radius_epsilon < target_epsilon:
            raise ValueError(f"radius_epsilon must lie in [0, target_epsilon={target_epsilon}), got {self.radius_epsilon}.")
        return target_epsilon - self.radius_epsilon

    def budget(self, target_epsilon: float, target_delta: float) -> Tuple[float, float]:
        """The Gaussian steps' share, ``(ε − ε_radius − ε_svt, δ/2)`` (:func:`split_budget`)."""
        _, eps_gauss, delta_gauss = split_budget(self.run_epsilon(target_epsilon), target_delta, self.svt_fraction)
        return eps_gauss, delta_gauss

    def epsilon(self, accounted_epsilon: float, optimizer: Any) -> float:
        """The Gaussian steps' ε, plus ε_svt once AboveThreshold was queried, plus ``radius_epsilon``."""
        return self.radius_epsilon + accounted_epsilon + (optimizer.svt_epsilon if optimizer.svt_queries else 0.0)

    def optimizer_options(self, *, max_grad_norm: Optional[float], expected_units: float, steps: Optional[int],
                          target_epsilon: Optional[float], target_delta: Optional[float]) -> Dict[str, Any]:
        """τ (in place of C), ñ_max, the run's (ε, δ, T) and ε_svt for :class:`~trl_userdp.optimizers.AUPOptimizer`."""
        run_epsilon = self.run_epsilon(target_epsilon)
        svt_epsilon, _, _ = split_budget(run_epsilon, target_delta, self.svt_fraction)
        return {"concentration_radius": self.concentration_radius, "max_users_per_batch": self.users_cap(expected_units),
                "epsilon": run_epsilon, "delta": target_delta, "steps": steps, "svt_epsilon": svt_epsilon,
                "average_iterates": self.average_iterates}

    def report_fields(self, fields: Dict[str, Any], optimizer: Any, *, accounted_epsilon: float) -> Dict[str, Any]:
        """τ in place of C; the ε split (ε_svt, ε_radius, the Gaussian ε) and AboveThreshold's state in ``extra``."""
        fields.update(per_user_max_grad_norm=None, concentration_radius=optimizer.concentration_radius)
        fields["extra"].update({
            "svt_epsilon": optimizer.svt_epsilon if any(optimizer.svt_queries_by_phase) else 0.0,
            "radius_epsilon": self.radius_epsilon,
            "gaussian_epsilon": accounted_epsilon,
            "svt_queries": sum(optimizer.svt_queries_by_phase),
            "halted": optimizer.halted,
            "halted_at_query": optimizer.halted_at_query,
            "max_users_per_batch": optimizer.max_users_per_batch,
            "noise_std": optimizer.noise_std,
            "composition": "basic: Gaussian (PLD, truncated Poisson) + AboveThreshold (pure ε)"
            + (" + τ selection (pure ε)" if self.radius_epsilon else ""),
        })
        return fields

    @classmethod
    def walkthrough(cls, epsilon: float, setting: AccountingSetting) -> Tuple[WalkthroughColumn, ...]:
        """AUP's σ at ``(ε/2, δ/2)`` with the default ñ_max."""
        _, eps_gauss, delta_gauss = split_budget(epsilon, setting.delta, svt_fraction=0.5)
        sigma = gaussian_noise_multiplier(eps_gauss, delta_gauss, sample_rate=setting.sample_rate, steps=setting.steps,
                                          n_users=setting.n_users,
                                          max_users_per_batch=default_max_users_per_batch(setting.users_per_batch))
        return (WalkthroughColumn("AUP σ", "ε/2,δ/2", sigma),)
