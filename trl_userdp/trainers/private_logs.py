"""What the user-level DP trainers log: ε and δ at every logging step, and nothing computed from private batches (the
raw gradient's norm, the loss, TRL's batch statistics, token and FLOP counts) unless ``log_private_metrics=True``."""

from __future__ import annotations

from typing import Dict, Optional

#: Training-log keys that are not statistics of private batches.
PUBLIC_LOG_KEYS = {"epsilon", "delta", "learning_rate", "epoch", "privacy_steps", "aup_halted"}


class PrivateLogsMixin:
    """The Trainer's logging methods under user-level DP (composed into
    :class:`~trl_userdp.trainers.mixin.UserDPTrainerMixin`)."""

    def floating_point_ops(self, inputs):
        """0 under DP: the count (saved as ``total_flos``) would follow the private batches' sizes."""
        return 0 if self._dp_active else super().floating_point_ops(inputs)

    def _get_grad_norm(self, model, grad_norm=None):
        """Never compute or log the norm of the raw, non-private gradient."""
        return None

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """TRL's log with ε and δ added, and without statistics of private batches (unless ``log_private_metrics``)."""
        logs = dict(logs)
        logs.pop("grad_norm", None)
        training = not any(k.startswith("eval_") for k in logs)
        private = self._privacy.private
        if private and not self.args.log_private_metrics:
            if training:
                if hasattr(self, "_metrics"):
                    self._metrics["train"].clear()  # TRL's batch statistics (rewards, accuracy, logps, tokens)
                logs = {k: v for k, v in logs.items() if k in PUBLIC_LOG_KEYS}
            else:  # evaluation metrics are the user's, but TRL adds its running count of *training* tokens
                logs = {k: v for k, v in logs.items() if not k.endswith("num_tokens")}
                if hasattr(self, "_metrics"):  # ... inside its own log(), from _metrics["eval"]
                    self._metrics["eval"].pop("num_tokens", None)
        if private:
            logs["epsilon"] = self.current_epsilon()
            logs["delta"] = self._privacy.delta(self)
            if self._dp_active and self.privacy_engine is not None:
                logs["privacy_steps"] = self.privacy_engine.accountant.steps_taken
        super().log(logs, start_time)
