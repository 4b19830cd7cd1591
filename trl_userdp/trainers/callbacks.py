"""The trainers' callback that ends training where the privacy budget or AUP-RLHF ends it."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class PrivacyBudgetCallback(TrainerCallback):
    """Stops training before a step the budget cannot pay for, or after AUP-RLHF halts.

    Args:
        trainer: the user-level DP trainer whose engine is checked.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def _check(self, control):
        engine = self.trainer.privacy_engine
        if engine is None:
            return control
        reason = engine.stop_reason()
        if reason is not None:
            if not control.should_training_stop:
                logger.warning(
                    "Stopping: %s after %d private steps (ε = %.4g at δ = %g).", reason, engine.accountant.steps_taken,
                    engine.get_epsilon(self.trainer.args.target_delta), self.trainer.args.target_delta,
                )
            control.should_training_stop = True
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        """The same check before the first step (a resumed run may have spent its budget already)."""
        return self._check(control)

    def on_step_end(self, args, state, control, **kwargs):
        """Stops before a step the budget cannot pay for, or after a halt."""
        return self._check(control)
