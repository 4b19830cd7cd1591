"""``AUPOptimizer``: the private mean oracle of AUP-RLHF (Zhang et al., Alg. 2 steps 8–16;
Liu & Asi 2024) in place of clipping, with the sensitivity correction of docs/mechanisms.md, M4.

Per step, on the per-user averaged gradients ``g_i`` of the sampled users ``U_t``:

1. concentration score ``s_t = (1/ñ) Σ_{i,i'∈U_t} 1(‖g_i − g_i'‖ ≤ τ)`` (ordered pairs, i = i'
   included), distances from the Gram matrix of the ``g_i``;
2. AboveThreshold with budget ``ε_svt`` and threshold ``4ñ/5``: one noisy threshold per run
   (``Lap(2Δ/ε_svt)``), ``Lap(4Δ/ε_svt)`` per query, ``Δ = (2ñ_max − 1)/ñ`` (one user changes up
   to ``2|U_t| − 1`` pair indicators; ``|U_t| ≤ ñ_max`` by truncated sampling). Below threshold (⊥):
   halt — no update, no further steps;
3. ``f_i = Σ_{i'} 1(‖g_i' − g_i‖ ≤ 2τ)``; keep user i with probability 0 if ``f_i < ñ/2``, 1 if
   ``f_i ≥ 2ñ/3``, else ``(f_i − ñ/2)/(ñ/6)``;
4. ``ĝ`` = mean of the kept ``g_i`` (0 if none), plus ``N(0, 8τ²·log(e^ε T/δ)·σ²/ñ² · I)``.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Dict, List, Optional

import torch

from ..mechanisms.aup import keep_probabilities, noise_std, pairwise_distances, score_test
from ..seeding import derive_seed
from .user_optimizer import UserDPOptimizer

logger = logging.getLogger(__name__)


class AUPOptimizer(UserDPOptimizer):
    """AUP-RLHF's adaptive private mean estimation around any ``torch.optim.Optimizer``; τ takes the place of
    :class:`UserDPOptimizer`'s clip C.

    Args:
        optimizer: the wrapped optimizer.
        noise_multiplier: σ = PrivacyAccount(ε − ε_svt, δ/2, n, ñ, T) (the Gaussian half).
        concentration_radius: τ.
        expected_batch_size: ñ, expected users per step.
        max_users_per_batch: ñ_max (the truncation of the sampler).
        epsilon: the run's total ε, which enters the noise scale.
        delta: the run's total δ, likewise.
        steps: T, the planned steps, likewise.
        svt_epsilon: the AboveThreshold budget ε_svt (ε/2 in the paper).
        hooks: as for :class:`UserDPOptimizer`.
        generator: as for :class:`UserDPOptimizer` (AboveThreshold and the removal draw from a CPU stream seeded
            from it).
        noise_seed: as for :class:`UserDPOptimizer`; it also keys AboveThreshold's and the removal's draws.
        step_index: as for :class:`UserDPOptimizer`.
        secure_mode: Opacus's ``secure_mode`` for the Gaussian noise.
        self_check: as for :class:`UserDPOptimizer`.
        budget_guard: as for :class:`UserDPOptimizer`.
        average_iterates: keep the running average of the iterates (the output for convex models).
    """

    def __init__(
        self,
        optimizer,
        *,
        noise_multiplier: float,
        concentration_radius: float,
        expected_batch_size: float,
        max_users_per_batch: int,
        epsilon: float,
        delta: float,
        steps: int,
        svt_epsilon: float,
        hooks,
        generator: Optional[torch.Generator] = None,
        noise_seed: Optional[int] = None,
        step_index=None,
        secure_mode: bool = False,
        self_check: bool = True,
        budget_guard=None,
        average_iterates: bool = False,
    ):
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=concentration_radius,  # Opacus's noise std is σ·max_grad_norm; unused here
            expected_batch_size=expected_batch_size,
            hooks=hooks,
            generator=generator,
            noise_seed=noise_seed,
            step_index=step_index,
            secure_mode=secure_mode,
            self_check=self_check,
            budget_guard=budget_guard,
        )
        self.concentration_radius = float(concentration_radius)
        self.max_users_per_batch = int(max_users_per_batch)
        self.svt_epsilon = float(svt_epsilon)
        # AboveThreshold's Laplace draws and the keep decisions run on the CPU, from their own stream
        self.cpu_generator = torch.Generator()
        self.cpu_generator.manual_seed(int(torch.randint(2**62, (), generator=self.generator, device=self.generator.device))
                                       if self.generator is not None else secrets.randbits(63))
        self.epsilon, self.delta = float(epsilon), float(delta)
        #: AboveThreshold queries of the phases already finished (Alg. 1), one entry per phase
        self.finished_phase_queries: List[int] = []
        self.halted = False
        self._begin_phase(noise_multiplier, steps)
        self.halted_at_query: Optional[int] = None
        self.average_iterates = average_iterates
        self.iterate_average: Optional[List[torch.Tensor]] = None
        self._averaged = 0

    def _begin_phase(self, noise_multiplier: float, steps: int) -> None:
        """A fresh AboveThreshold (its own noisy threshold) and the Gaussian scale for ``steps`` steps."""
        n_tilde = self.expected_batch_size
        self.svt = score_test(n_tilde, self.max_users_per_batch, self.svt_epsilon, self.cpu_generator)
        self.noise_multiplier = float(noise_multiplier)
        self.noise_std = noise_std(self.concentration_radius, self.noise_multiplier, self.epsilon, steps, self.delta,
                                   n_tilde)

    def start_phase(self, noise_multiplier: float, steps: int) -> None:
        """Move to the next phase of Alg. 1 (a disjoint set of users): Alg. 2 starts afresh from the
        current parameters, with a fresh AboveThreshold and the phase's σ and T. A halted run stays halted.

        Args:
            noise_multiplier: the phase's σ.
            steps: the phase's T.
        """
        self.finished_phase_queries.append(self.svt.queries)
        self._begin_phase(noise_multiplier, steps)

    @property
    def svt_queries(self) -> int:
        """AboveThreshold queries of the current phase."""
        return self.svt.queries

    @property
    def svt_queries_by_phase(self) -> List[int]:
        """AboveThreshold queries of each phase, the current one last."""
        return self.finished_phase_queries + [self.svt.queries]

    def key_randomness(self) -> None:
        """With ``noise_seed``: the Gaussian noise and AboveThreshold's and the removal's draws of this step from
        ``(noise_seed, step_index())``."""
        super().key_randomness()
        if self.noise_seed is not None:
            self.cpu_generator.manual_seed(derive_seed(self.noise_seed, "aup", self.step_index()))

    def privacy_state_dict(self) -> Dict[str, Any]:
        """AboveThreshold's state: its one noisy threshold (a secret of the mechanism: checkpoints only, never
        ``save_model``), its queries and whether it halted."""
        return {"noisy_threshold": self.svt.noisy_threshold, "queries": self.svt.queries, "halted": self.halted,
                "halted_at_query": self.halted_at_query}

    def load_privacy_state_dict(self, state: Dict[str, Any], *, accounted_steps: int, source: str = "checkpoint") -> None:
        """Restore the run's threshold (not a new draw) and queries; each accounted step made one query, and a halt
        one more.

        Raises:
            ValueError: no AboveThreshold state, or a query count that does not match ``accounted_steps``.
        """
        if set(state) != {"noisy_threshold", "queries", "halted", "halted_at_query"}:
            raise ValueError(f"{source}: no AboveThreshold state for this AUP-RLHF run; refusing to resume.")
        if state["queries"] != accounted_steps + int(state["halted"]):
            raise ValueError(f"{source}: {state['queries']} AboveThreshold queries for {accounted_steps} accounted steps; "
                             "the state was edited; refusing to resume.")
        self.svt.noisy_threshold, self.svt.queries = state["noisy_threshold"], state["queries"]
        self.halted, self.halted_at_query = state["halted"], state["halted_at_query"]

    def pre_step(self, closure=None) -> bool:
        """Alg. 2 steps 8–16 in place of clipping: concentration score, AboveThreshold, randomized removal, and the
        noisy mean of the kept users as ``p.grad``.

        Args:
            closure: unused here (Opacus's ``step`` calls it).

        Returns:
            True to take the step; False when AboveThreshold answers ⊥ (the run halts).

        Raises:
            ValueError: more than ñ_max users in the step (a loader without truncated sampling).
        """
        self.key_randomness()
        grads = self.unit_gradients()
        n_units = len(self.hooks.unit_counts)
        if n_units > self.max_users_per_batch:
            raise ValueError(
                f"{n_units} users in a step but max_users_per_batch={self.max_users_per_batch}: the AboveThreshold "
                "sensitivity assumes truncated sampling; use the loader made by AdaptiveUserPrivacyEngine."
            )
        n_tilde, tau = self.expected_batch_size, self.concentration_radius
        dist = pairwise_distances(grads) if n_units else torch.zeros((0, 0), dtype=torch.float64)
        score = float((dist <= tau).sum()) / n_tilde
        if not self.svt.query(score):
            self.halted, self.halted_at_query = True, sum(self.svt_queries_by_phase)
            logger.warning("AUP-RLHF halted: AboveThreshold answered ⊥ at query %d; no further steps are taken.",
                           self.svt_queries)
            return False
        probs = keep_probabilities(dist, tau, n_tilde)
        keep = torch.rand(n_units, generator=self.cpu_generator, dtype=torch.float64) < probs
        kept = int(keep.sum())
        for p, g in zip(self.params, grads):
            mean = g[keep.to(g.device)].mean(0) if kept else torch.zeros_like(p)
            noise = torch.normal(0.0, self.noise_std, size=p.shape, generator=self.generator, dtype=p.dtype, device=p.device)
            p.grad = (mean + noise).view_as(p)
        if self.step_hook:
            self.step_hook(self)
        return True

    def step(self, closure=None):
        """One AUP step; after a halt, a no-op (AboveThreshold answers no more queries).

        Args:
            closure: as ``torch.optim.Optimizer.step``'s.

        Returns:
            The wrapped optimizer's result, or None after a halt or for a skipped step.

        Raises:
            PrivacyBudgetExhausted: as :meth:`UserDPOptimizer.step`.
        """
        if self.halted:
            self.hooks.reset_step(clear_pending=True)
            return None
        result = super().step(closure)
        if self.average_iterates and not self.halted:
            self._update_average()
        return result

    def _update_average(self) -> None:
        self._averaged += 1
        current = [p.detach() for p in self.params]
        if self.iterate_average is None:
            self.iterate_average = [c.clone() for c in current]
        else:
            for avg, c in zip(self.iterate_average, current):
                avg.add_((c - avg) / self._averaged)

    def load_iterate_average(self) -> None:
        """Copy the running average of the iterates into the parameters (AUP-RLHF's output for
        convex models; for networks the last iterate is the usual output).

        Raises:
            ValueError: no average (built without ``average_iterates`` or before the first step).
        """
        if self.iterate_average is None:
            raise ValueError("No iterate average: construct with average_iterates=True and take a step.")
        with torch.no_grad():
            for p, avg in zip(self.params, self.iterate_average):
                p.copy_(avg)
