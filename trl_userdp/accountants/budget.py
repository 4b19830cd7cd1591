"""The privacy budget a run may spend, and the one place that decides whether another step fits in it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional, Tuple

if TYPE_CHECKING:
    from .accountant import DPAccountingAccountant


@dataclasses.dataclass
class PrivacyBudget:
    """The (ε, δ) a run may reach. The engine's optimizer guard, the trainers' budget callback and a resumed checkpoint
    all ask :meth:`allows_step`; nothing else decides it.

    Args:
        epsilon: the ε the run may reach.
        delta: the δ at which ε is read.
        calibrated_steps: T when σ was calibrated to spend the budget in exactly T steps at one (σ, q) (then T steps
            fit, whatever the calibration's rounding); None when σ was fixed (the steps that fit are searched).
    """

    epsilon: float
    delta: float
    calibrated_steps: Optional[int] = None
    _affordable: Dict[Tuple[float, float], int] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                    compare=False)

    def allows_step(self, accountant: DPAccountingAccountant, noise_multiplier: float, sample_rate: float) -> bool:
        """Whether one more step at (σ, q) stays within the budget, read from the accountant's history (so it
        survives checkpoint resumes).

        Args:
            accountant: the run's accountant.
            noise_multiplier: the next step's σ.
            sample_rate: the next step's q.

        Returns:
            With one (σ, q) throughout, whether fewer than :meth:`affordable_steps` are accounted; otherwise whether ε
            of the history plus one step stays within the budget.
        """
        step = (noise_multiplier, sample_rate)
        if all((s, q) == step for s, q, _ in accountant.history):
            return accountant.steps_taken < self.affordable_steps(accountant, *step)
        trial = accountant.spawn()
        trial.history = list(accountant.history)
        trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        return trial.get_epsilon(self.delta) <= self.epsilon

    def affordable_steps(self, accountant: DPAccountingAccountant, noise_multiplier: float, sample_rate: float) -> int:
        """Most steps at (σ, q) within the budget.

        Args:
            accountant: an accountant of the run's kind (only its configuration is used).
            noise_multiplier: σ.
            sample_rate: q.

        Returns:
            :attr:`calibrated_steps` when σ was calibrated to them, otherwise the largest T found by search (once per
            (σ, q)); 0 if one step already exceeds the budget.
        """
        if self.calibrated_steps is not None:
            return self.calibrated_steps
        key = (noise_multiplier, sample_rate)
        if key not in self._affordable:
            def eps_after(t: int) -> float:
                trial = accountant.spawn()
                trial.history = [(noise_multiplier, sample_rate, t)]
                return trial.get_epsilon(self.delta)

            lo = 0
            if eps_after(1) <= self.epsilon:
                lo, hi = 1, 2
                while eps_after(hi) <= self.epsilon and hi < 10**7:
                    lo, hi = hi, 2 * hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if eps_after(mid) <= self.epsilon else (lo, mid)
            self._affordable[key] = lo
        return self._affordable[key]

    def exhausted(self, steps_taken: int) -> str:
        """The message of a refused step.

        Args:
            steps_taken: the steps accounted so far.

        Returns:
            What was refused and what to do.
        """
        return (f"Another step would take ε past target_epsilon={self.epsilon} (δ={self.delta}); {steps_taken} steps "
                "are already accounted. Stop training here.")
