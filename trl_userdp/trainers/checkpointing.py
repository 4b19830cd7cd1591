"""The user-level DP trainers' checkpoints: ``privacy_report.json`` with every checkpoint and the final model, the
privacy state (the accountant, AUP-RLHF's AboveThreshold) saved in checkpoints in :mod:`trl_userdp.checkpoints`' layout
and restored on resume, checked against the run it resumes."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import checkpoints, distributed


class PrivacyCheckpointMixin:
    """The Trainer's saving and resuming methods under user-level privacy (composed into
    :class:`~trl_userdp.trainers.mixin.UserDPTrainerMixin`)."""

    def _write_privacy_files(self, output_dir: str, with_state: bool) -> None:
        """``privacy_report.json`` (main process), and with ``with_state`` the privacy state a resume needs."""
        if not self.is_world_process_zero():
            return
        report = self._privacy.report(self)
        if report is None:  # no private step set up yet
            return
        report.save(output_dir)
        self.model.privacy_report = report  # travels with the model object (e.g. into online RL)
        if with_state and self.privacy_engine is not None:  # AUP-RLHF's AboveThreshold state: checkpoints only
            engine = self.privacy_engine
            checkpoints.save_privacy_state(output_dir, engine.accountant.state_dict(),
                                           engine.optimizer.privacy_state_dict())

    def _apply_privacy_state(self, state: Dict[str, Any], global_step: int, path: str) -> None:
        """Restore a checkpoint's privacy state, checked against the run it resumes: the accountant must be
        this configuration's, at this run's (σ, q), and account every step the checkpoint took (steps go
        unaccounted only after the budget ran out or AboveThreshold halted)."""
        engine = self.privacy_engine
        engine.restore_privacy_state(state["accountant"], state["optimizer"], source=path)
        accounted = engine.steps_accounted()
        if self.args.ignore_data_skip:  # the Trainer restarts the epoch without skipping: draw after the taken steps
            sampler = engine.data_loader.user_sampler
            sampler.resume_offset = accounted - (global_step // sampler.steps) * sampler.steps
        if accounted > global_step or (accounted < global_step and engine.stop_reason() is None):
            raise ValueError(
                f"{path}: the restored accountant holds {accounted} steps, but the checkpoint is at step {global_step}. "
                "Resuming would under-count the privacy spent (the state was edited or belongs to another run); "
                "refusing to resume."
            )

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint, plus the privacy report and state."""
        super()._save_checkpoint(model, trial)
        checkpoint = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._write_privacy_files(checkpoint, with_state=True)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        """TRL's save, plus ``privacy_report.json`` beside the model; every process returns once the main process has
        written the model, its card and the report (a process that leaves and tears its process group down while
        another still writes can abort it). Call it on every process, as the Trainer does at its checkpoints."""
        super().save_model(output_dir, _internal_call)
        self._write_privacy_files(output_dir or self.args.output_dir, with_state=False)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The privacy state first (read as data, checked against this run once the engine is set up), then the
        weights: the Trainer's, or for a model sharded before the trainer the full model read into the shards."""
        if self._dp_active:
            state = checkpoints.read_privacy_state(resume_from_checkpoint)
            global_step = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)).global_step
            path = os.path.join(resume_from_checkpoint, checkpoints.PRIVACY_STATE_FILE)
            self._restored_privacy_state = (state, global_step, path)
            if self.privacy_engine is not None:
                self._apply_privacy_state(*self._restored_privacy_state)
        model = self.model if model is None else model
        if distributed.is_sharded(model) and not self.is_fsdp_enabled:
            checkpoints.load_full_into_shards(model, resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
