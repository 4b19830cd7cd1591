"""What the user-level DP trainers do for a model sharded by FSDP2 (before the trainer, or by accelerate's FSDP2
plugin), and for several processes: sharding with the plugin's settings, the placeholder pass of a process without
users, rank-local batch statistics, and checkpoints in :mod:`trl_userdp.checkpoints`' sharded layout."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Dict, Optional

import torch
from transformers.trainer import SCHEDULER_NAME

from .. import checkpoints, distributed


@contextlib.contextmanager
def rank_local_gathers(accelerator):
    """TRL's losses gather their batch statistics (rewards, accuracies, token counts) across processes inside the
    loss. Under user-level DP a process whose shard has no user in a step runs no loss, so such a gather would be a
    collective only the others join; the statistics are private and not logged anyway (``log_private_metrics``), so
    inside the training loss they stay on their process."""
    saved = {name: accelerator.__dict__.get(name) for name in ("gather", "gather_for_metrics")}
    accelerator.gather = lambda tensor: tensor
    accelerator.gather_for_metrics = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del accelerator.__dict__[name]
            else:
                accelerator.__dict__[name] = value


class ShardedTrainingMixin:
    """The Trainer's methods a model sharded by FSDP2 needs (composed into
    :class:`~trl_userdp.trainers.mixin.UserDPTrainerMixin`)."""

    def _prepare_sharding(self) -> None:
        """Under a gradient mechanism, before the engine: shard with accelerate's FSDP2 plugin, or take a model
        sharded before the trainer as it is."""
        if getattr(self, "is_fsdp_enabled", False):
            self._shard_with_the_fsdp_plugin()
        elif distributed.is_sharded(self.model):
            # Sharded by FSDP2 (fully_shard) before the trainer: the engine reduces the clipped sums itself, so the
            # Trainer must neither wrap the model in DDP nor have accelerate shard it again (transformers' flag for a
            # model that owns its gradient reduction; set after its __init__, whose checkpoint refusal the overrides
            # below answer: sharded optimizer state, the full model gathered and loaded into the shards)
            self.is_distributed_loading_by_transformers = True

    def _shard_with_the_fsdp_plugin(self) -> None:
        """accelerate's FSDP plugin (``fsdp_version: 2``): the model is sharded now, before the privacy engine is set up
        on it, on its blocks (the plugin's ``transformer_layer_cls_to_wrap``, or the model's) and its root, with the
        plugin's mixed precision and resharding (:func:`~trl_userdp.distributed.shard_model`; accelerate's own
        policy would also shard the input embeddings alone, a layer the per-user hooks need inside a block).
        ``accelerator.prepare`` later finds the model sharded and only maps the optimizer onto it.

        Raises:
            ValueError: FSDP1, activation checkpointing (per-user gradients need each layer's own backward pass), or
                CPU offload.
        """
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        plugin = self.accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError("accelerate's FSDP plugin with fsdp_version 1 flattens parameters, which the per-user hooks "
                             "cannot see: set fsdp_version: 2 (FSDP2), or shard before the trainer.")
        if plugin.activation_checkpointing:
            raise ValueError("FSDP activation checkpointing recomputes layers in the backward pass, so per-user "
                             "gradients would be wrong: turn activation_checkpointing off under user-level DP.")
        plugin.set_auto_wrap_policy(self.model)  # resolved on the unsharded model (accelerate resolves it once)
        blocks = plugin.transformer_cls_names_to_wrap
        if isinstance(blocks, str):
            blocks = [name.strip() for name in blocks.split(",") if name.strip()]
        options = {"mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
                   "reshard_after_forward": plugin.reshard_after_forward}
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            raise ValueError("FSDP CPU offload keeps the shards on the CPU while the clipped sums and the noise are made "
                             "on the GPU: turn cpu_offload off under user-level DP.")
        self.model = self.model_wrapped = distributed.shard_model(self.model, self.args.device.type, blocks or None,
                                                                  **options)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Nothing to defer on a model sharded before the trainer: the hooks free the raw gradient as it is accumulated
        and the engine reduces the clipped sums once per draw (transformers' version reads a ``distributed_config``
        that such a model does not have)."""
        yield

    def _placeholder_pass(self, model) -> None:
        """On a model sharded by FSDP2 a process with no user in a micro-batch still runs every layer (each gathers its
        parameters by a collective the other processes wait in): the loss of a placeholder, the training set's first
        example with every token list replaced by one padding token, inside the hooks' placeholder pass (nothing
        recorded, its gradient freed as it is accumulated). The trainer's metrics are left as they were."""
        example = {k: v for k, v in self.train_dataset[0].items() if k != self.args.user_column}
        pad = getattr(self.processing_class, "pad_token_id", None) or 0
        example = {k: [pad] if isinstance(v, list) and v and isinstance(v[0], int) else v for k, v in example.items()}
        batch = self._prepare_inputs(self.data_collator([example]))
        metrics = copy.deepcopy(getattr(self, "_metrics", None))
        with self.privacy_engine.hooks.placeholder_pass(), rank_local_gathers(self.accelerator):
            self.accelerator.backward(super().compute_loss(model, batch))
        if metrics is not None:
            self._metrics = metrics


    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[Dict[str, Any]] = None) -> None:
        """The Trainer's save; a model sharded by FSDP2 is first gathered into one full state dict on the main process
        (a collective every process joins), so that the saved model reloads with ``from_pretrained`` alone."""
        if state_dict is None and distributed.is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
            if not self.args.should_save:
                return
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's, but a sharded model's optimizer state is saved by every process, its own shards
        (:func:`~trl_userdp.checkpoints.save_shards`, the one sharded layout); the scheduler by the main process."""
        if not distributed.is_sharded(self.model) or self.is_fsdp_enabled:  # the plugin saves its own shards
            return super()._save_optimizer_and_scheduler(output_dir)
        checkpoints.save_shards(output_dir, self.model, self.optimizer, with_model=False)  # the model is saved whole
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """The Trainer's, but a sharded model's optimizer state is read back into each process's shards."""
        if checkpoint is None or checkpoints.sharded_dir(checkpoint) is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        checkpoints.load_shards(checkpoint, self.model, self.optimizer, with_model=False)
        self.lr_scheduler.load_state_dict(checkpoints.load_plain(os.path.join(checkpoint, SCHEDULER_NAME)))
