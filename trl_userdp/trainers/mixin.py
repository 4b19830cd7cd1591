"""What the user-level DP trainers share (README; docs/stack_findings.md): one mixin placed before the TRL trainer.

* ``randomized_response``: labels privatized once before TRL's preprocessing; the trainer's loss
  becomes the de-biased one (set by each trainer).
* ``user_dpsgd`` / ``group`` / ``aup``: on the first ``get_train_dataloader`` the model and the
  Trainer's optimizer go through :class:`~trl_userdp.PrivacyEngine` (or the adaptive engine): the
  train loader becomes a user-level Poisson loader whose dict batches carry each row's user,
  ``compute_loss`` hands that map to the per-user hooks, and ``optimizer.step()`` is private.
* Logs: ε and δ at every logging step; no raw ``grad_norm``; under DP, no training metrics computed
  on private batches (loss, accuracy, rewards, token counts) unless ``log_private_metrics=True``.
* ``privacy_report.json`` with every checkpoint and the final model; the accountant (and AUP's
  AboveThreshold state) saved in checkpoints and restored on resume; a callback stops training
  before a step the budget cannot pay for.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainerState
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import distributed
from ..accountants import PrivacyReport
from ..checkpoints import load_plain
from ..data import check_text_columns, resolve_user_ids
from ..grad_sample.checks import active_dropout, disable_dropout
from ..mechanisms import UserRandomizedResponse, get_mechanism, mechanism_names
from ..privacy_engine import PrivacyEngine
from ..stack_warnings import without_stack_deprecations
from .fused_head import unfuse_lm_head
from .model_card import PrivacyModelCardMixin
from .privacy_config import UserDPArguments
from .privacy_kinds import trainer_privacy

logger = logging.getLogger(__name__)

#: Key under which dict batches carry each row's user (popped before the model sees the batch).
USER_KEY = "_trl_userdp_row_users"
#: in a checkpoint of a sharded model: each process's shards of the optimizer state
SHARDED_OPTIMIZER_DIR = "optimizer_sharded"
PRIVACY_STATE_FILE = "privacy_state.pt"
#: Training-log keys that are not statistics of private batches.
PUBLIC_LOG_KEYS = {"epsilon", "delta", "learning_rate", "epoch", "privacy_steps", "aup_halted"}


#: share of rows dropped by contribution bounding from which the trainers warn (the data owner's console only)
DROPPED_ROWS_WARNING = 0.1


class PrivacyBudgetCallback(TrainerCallback):
    """Stops training before a step the budget cannot pay for, or after AUP-RLHF halts.

    Args:
        trainer: the user-level DP trainer whose engine is checked.
    """

    def __init__(self, trainer: "UserDPTrainerMixin"):
        self.trainer = trainer

    def _check(self, control):
        engine = self.trainer.privacy_engine
        if engine is None:
            return control
        halted = engine.optimizer.halted
        if halted or not engine.budget_allows_step():
            if not control.should_training_stop:
                logger.warning(
                    "Stopping: %s after %d private steps (ε = %.4g at δ = %g).",
                    "AUP-RLHF halted" if halted else "the privacy budget allows no further step",
                    engine.accountant.steps_taken, engine.get_epsilon(self.trainer.args.target_delta),
                    self.trainer.args.target_delta,
                )
            control.should_training_stop = True
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        """The same check before the first step (a resumed run may have spent its budget already)."""
        return self._check(control)

    def on_step_end(self, args, state, control, **kwargs):
        """Stops before a step the budget cannot pay for, or after a halt."""
        return self._check(control)


@contextlib.contextmanager
def _rank_local_gathers(accelerator):
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


def _load_full_into_shards(model: torch.nn.Module, folder: str) -> None:
    """The full model the main process saved in ``folder`` (safetensors, one file or several with their index), read
    into each process's shards of ``model``. Keys the save left out must be tied weights, filled by their twin.

    Raises:
        ValueError: a checkpoint whose keys are not the model's.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    files = [SAFE_WEIGHTS_NAME]
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    full: Dict[str, torch.Tensor] = {}
    for name in files:
        full.update(load_file(os.path.join(folder, name)))
    keys = set(model.state_dict())
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    if set(full) - keys or keys - set(full) - tied:
        raise ValueError(f"{folder}: its weights do not match this model's (missing "
                         f"{sorted(keys - set(full) - tied)[:3]}, unexpected {sorted(set(full) - keys)[:3]}).")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


class UserDPTrainerMixin(PrivacyModelCardMixin):
    """Mixed in before a TRL trainer class; see the module docstring.

    One cooperative ``__init__`` serves every trainer: it finds ``args`` and ``train_dataset`` in the TRL
    trainer's own signature, refuses what breaks the per-user bound, prepares the data (randomized response),
    lets the trainer adapt its loss to label privacy, runs the TRL ``__init__``, then prepares the model (TRL's
    fused LM head replaced by the model's own forward) and the privacy state. A new trainer declares:

    * :attr:`config_class` and :attr:`rows_per_example`;
    * :meth:`dp_refusals`: the settings that couple users in a batch (checked for gradient mechanisms);
    * :meth:`use_label_privacy`: how randomized response changes the loss (default: not supported).
    """

    #: the config class this trainer needs (TRL's config plus :class:`UserDPArguments`)
    config_class: type = UserDPArguments
    #: rows the trainer's collator emits per example ([chosen; rejected] for preference trainers)
    rows_per_example = 2

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        config = bound.arguments.get("args")
        if not isinstance(config, self.config_class):
            raise ValueError(f"{type(self).__name__} needs `args={self.config_class.__name__}(...)` "
                             f"(TRL's config plus the privacy fields).")
        self._privacy = trainer_privacy(config)
        if self._privacy.gradient:
            refusals = self.dp_refusals(config)
            if refusals:
                raise ValueError(refusals[0])
        bound.arguments["train_dataset"] = self._prepare_train_dataset(bound.arguments.get("train_dataset"), config)
        super().__init__(*bound.args, **bound.kwargs)
        self._init_privacy()

    # -- declared by each trainer ---------------------------------------------------------------
    def dp_refusals(self, args) -> List[str]:
        """The settings that couple users in a batch (docs/stack_findings.md), checked for gradient mechanisms.

        Args:
            args: the trainer config.

        Returns:
            One message per such setting (none by default).
        """
        return []

    def use_label_privacy(self, args, rr: UserRandomizedResponse) -> None:
        """Adapt the loss to privatized labels (called before the TRL ``__init__``).

        Args:
            args: the trainer config (a trainer may set its loss fields).
            rr: the randomized response the labels are privatized with.

        Raises:
            ValueError: the trainer has no de-biased loss (the default).
        """
        raise ValueError(f"privacy_mechanism='randomized_response' has no de-biased loss for {type(self).__name__}; "
                         f"use a gradient mechanism {mechanism_names('gradient')}.")

    #: the temperature TRL's fused LM head divides the logits by (GRPO's sampling temperature; 1 for the others)
    lm_head_temperature: float = 1.0

    def default_users_per_batch(self) -> float:
        """ñ when ``users_per_batch`` is unset: TRL's global batch, ``per_device_train_batch_size ×
        gradient_accumulation_steps × processes`` (each process gets about ``per_device_train_batch_size`` users per
        micro-batch).

        Returns:
            The expected number of users per optimizer step, over all processes.
        """
        args = self.args
        return float(args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes)

    def user_level_collator(self):
        """The collate function of the user-level loader; it must return a mapping (the row users are added to it).

        Returns:
            The trainer's ``data_collator`` by default.
        """
        return self.data_collator

    # -- set-up ---------------------------------------------------------------------------------
    def _prepare_train_dataset(self, train_dataset, args):
        """Before the TRL trainer's ``__init__`` (which tokenizes the dataset): refuse datasets user-level sampling
        cannot use, and what the mechanism's kind does to the data (:mod:`.privacy_kinds`; randomized response flips
        the labels once per output directory)."""
        check_text_columns(train_dataset)
        return self._privacy.prepare_dataset(self, train_dataset, args)

    def _init_privacy(self) -> None:
        """After the TRL trainer's ``__init__``: check the privacy fields again (they may have been changed
        after the config was built) and the user column, replace a fused LM head, add the budget callback."""
        self.args._validate_privacy_fields()
        self.privacy_engine = None
        self._restored_privacy_state: Optional[Tuple[Dict[str, Any], int, str]] = None
        if self._dp_active:
            if getattr(self, "aux_loss_enabled", False):
                raise ValueError(
                    "The Mixture-of-Experts router auxiliary loss is computed over the whole batch and couples users, "
                    "which breaks the per-user bound: set router_aux_loss_coef=0.0 under user-level DP."
                )
            self._turn_dropout_off()
            policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            if "forward" in vars(policy):  # TRL patched the instance's forward (its fused LM head)
                unfuse_lm_head(policy, temperature=self.lm_head_temperature)
            resolve_user_ids(self.train_dataset, user_column=self.args.user_column)  # fail now, not at step 1
            get_mechanism(self.args.privacy_mechanism).check_world_size(self.accelerator.num_processes)
            if getattr(self, "is_deepspeed_enabled", False):
                raise ValueError("DeepSpeed reduces and partitions raw gradients inside its engine, before any per-user "
                                 "clipping: use DDP (`accelerate launch --multi_gpu`), which the trainers support.")
            if getattr(self, "is_fsdp_enabled", False):
                self._shard_with_the_fsdp_plugin()
            elif distributed.is_sharded(self.model):
                # Sharded by FSDP2 (fully_shard) before the trainer: the engine reduces the clipped sums itself, so the
                # Trainer must neither wrap the model in DDP nor have accelerate shard it again (transformers' flag for a
                # model that owns its gradient reduction; set after its __init__, whose checkpoint refusal the overrides
                # below answer: sharded optimizer state, the full model gathered and loaded into the shards)
                self.is_distributed_loading_by_transformers = True
            self.add_callback(PrivacyBudgetCallback(self))
            # Each micro-batch's loss is the mean of its own rows and each row's gradient must be its own (the hooks
            # average per user), so the Trainer must not divide the loss by gradient_accumulation_steps.
            self.loss_is_scaled_for_ga = True
        #: position of the next training micro-batch within its draw of users, and whether the current one continues a draw
        self._draw_part, self._continuation = 0, False

    def _turn_dropout_off(self) -> None:
        """Under DP, dropout must be off: its masks come from torch's global stream, which the public ``seed`` sets and
        every user's rows advance, one mask for the whole batch. ``disable_dropout=True`` (every trainer's default under
        DP) turns off what TRL's own switch leaves on too (attention layers' rates, the config's fields).

        Raises:
            ValueError: ``disable_dropout=False`` with dropout in the model.
        """
        if getattr(self.args, "disable_dropout", True):
            for model in (self.model, getattr(self, "ref_model", None)):
                if isinstance(model, torch.nn.Module):
                    disable_dropout(model)
        found = active_dropout(self.model)
        if found:
            raise ValueError(f"disable_dropout=False with dropout in the model ({', '.join(found[:2])}"
                             f"{', ...' if len(found) > 2 else ''}): its masks come from torch's public stream, one per "
                             "batch, so one user's rows would move the other users' masks. Set disable_dropout=True "
                             "under user-level DP.")

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

    @property
    def _dp_active(self) -> bool:
        """The optimizer steps are private (a gradient mechanism)."""
        return self._privacy.gradient

    def _make_private(self) -> None:
        args = self.args
        self.model.train()  # from_pretrained leaves models in eval mode; the Trainer switches later
        if self.optimizer is None:
            self.create_optimizer()
        users_per_batch = self.default_users_per_batch() if args.users_per_batch is None else args.users_per_batch
        common = dict(
            module=self.model,
            optimizer=self.optimizer,
            data_loader=DataLoader(self.train_dataset, collate_fn=self.user_level_collator(),
                                   num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory),
            target_epsilon=args.target_epsilon,
            target_delta=args.target_delta,
            max_samples_per_user=args.max_samples_per_user,
            users_per_batch=users_per_batch,
            user_column=args.user_column,
            rows_per_example=self.rows_per_example,
            bounding_seed=args.seed,  # which rows a user keeps: a function of that user's rows only
            sampling_seed=args.privacy_seed,
            noise_seed=args.privacy_seed,  # keyed by (seed, step): a resumed run continues the noise, never replays it
            user_key=USER_KEY,
            micro_batches=args.gradient_accumulation_steps,  # one draw of users, accumulated over the micro-batches
            grad_sample_mode=args.grad_sample_mode,
        )
        length = dict(steps=args.max_steps) if args.max_steps > 0 else dict(epochs=args.num_train_epochs)
        mechanism = get_mechanism(args.privacy_mechanism).from_arguments(args)
        if args.noise_multiplier is not None and mechanism.accepts_noise_multiplier:
            common.update(noise_multiplier=args.noise_multiplier)  # a fixed σ; target_epsilon (if any) caps the run
            if args.target_epsilon is None:
                common.update(target_epsilon=None, target_delta=None)
        engine = PrivacyEngine(accountant=args.accountant, neighboring_relation=args.neighboring_relation)
        _, optimizer, loader = engine.make_private_user_level(
            mechanism=mechanism, max_grad_norm=args.per_user_max_grad_norm, **common, **length)
        optimizer.skip_when_exhausted = True  # the budget callback then ends training cleanly
        self.privacy_engine, self.optimizer, self._private_loader = engine, optimizer, loader
        if self._restored_privacy_state is not None:
            self._apply_privacy_state(*self._restored_privacy_state)
        logger.info("User-level DP (%s): n=%d users, q=%.4g, σ=%.4g.", args.privacy_mechanism, loader.n_users,
                    loader.sample_rate, optimizer.noise_multiplier)
        bounding = engine.bounding
        dropped = bounding.rows_dropped / max(bounding.rows_in, 1)
        (logger.warning if dropped >= DROPPED_ROWS_WARNING else logger.info)(
            "Private, for the data owner only (not in the report; ε does not cover it): contribution bounding dropped "
            "%d of %d rows (%.0f%%), the rows of users beyond max_samples_per_user=%d.%s", bounding.rows_dropped,
            bounding.rows_in, 100 * dropped, args.max_samples_per_user,
            " Raise max_samples_per_user to keep them: user-wise DP-SGD averages a user's rows, so its noise does not "
            "grow with m (group privacy's does)." if dropped >= DROPPED_ROWS_WARNING else "")

    # -- Trainer extension points ---------------------------------------------------------------
    def get_train_dataloader(self):
        """Under a gradient mechanism, the engine's user-level Poisson loader (set up on the first call)."""
        if not self._dp_active:
            return super().get_train_dataloader()
        if self.privacy_engine is None:
            self._make_private()
        return self._private_loader

    def create_optimizer(self, model=None):
        """Under a gradient mechanism, once set up, the private optimizer itself."""
        if self._dp_active and self.privacy_engine is not None:
            return self.optimizer  # already the private optimizer
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, after handing the batch's row -> user map to the per-user hooks."""
        row_users = inputs.pop(USER_KEY, None)
        if self._dp_active and model.training:
            if row_users is None:
                raise ValueError("A training batch came without its row -> user map; use the trainer's own train loader.")
            self.privacy_engine.hooks.set_row_users(row_users.cpu(), continuation=self._continuation)
            if self.accelerator.num_processes > 1:
                with _rank_local_gathers(self.accelerator):
                    return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                                num_items_in_batch=num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step, but no forward pass for an empty draw (a placeholder's on a sharded model) or a spent budget, and
        no raw all-reduce under DDP."""
        if self._dp_active:  # the loader yields each draw as gradient_accumulation_steps micro-batches
            self._continuation = self._draw_part > 0
            self._draw_part = (self._draw_part + 1) % self.args.gradient_accumulation_steps
        if self._dp_active and self.control.should_training_stop:
            # the budget callback found the budget spent (or AUP-RLHF halted) before this step, e.g. in a resumed
            # run: no forward pass; the optimizer's own guard skips the step
            inputs.pop(USER_KEY, None)
            return torch.zeros((), device=self.args.device)
        if self._dp_active and len(inputs[USER_KEY]) == 0:
            # A step with no sampled user: no forward pass (models fail on zero rows); the optimizer still
            # takes its noise-only step, and the accountant counts it.
            inputs.pop(USER_KEY, None)
            self.privacy_engine.hooks.set_row_users(torch.zeros(0, dtype=torch.long), continuation=self._continuation)
            if distributed.is_sharded(model):
                self._placeholder_pass(model)
            return torch.zeros((), device=self.args.device)
        if self._dp_active and isinstance(model, DistributedDataParallel):
            # Data-parallel: every process holds its own users (sharded by rank) and clips them; the private optimizer
            # all-reduces the clipped sums once, with rank 0's noise. DDP's all-reduce of the raw gradients would mix
            # users across processes (and is wasted work), so it never runs.
            with model.no_sync():
                return super().training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

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
        with self.privacy_engine.hooks.placeholder_pass(), _rank_local_gathers(self.accelerator):
            self.accelerator.backward(super().compute_loss(model, batch))
        if metrics is not None:
            self._metrics = metrics

    def train(self, *args, **kwargs):
        """TRL's training (without the FutureWarnings of TRL's use of transformers' renamed gradient-checkpointing API,
        :mod:`~trl_userdp.stack_warnings`); the model then carries its privacy report, and the mean training loss is
        not returned."""
        with without_stack_deprecations():
            output = super().train(*args, **kwargs)
        if self._privacy.private:
            report = self._privacy.report(self)
            if report is not None:
                self.model.privacy_report = report  # what was spent, even without a final save
            if not self.args.log_private_metrics:  # the mean training loss is a statistic of private batches
                output.metrics.pop("train_loss", None)
                output = type(output)(output.global_step, float("nan"), output.metrics)
        return output

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

    # -- privacy state: report, checkpoints, resume --------------------------------------------
    def current_epsilon(self) -> float:
        """ε spent so far (0 before the first private step; ∞ without privacy)."""
        return self._privacy.epsilon(self)

    def privacy_report(self) -> PrivacyReport:
        """What this run has spent so far.

        Raises:
            ValueError: no private step has been set up yet.
        """
        report = self._privacy.report(self)
        if report is None:
            raise ValueError("No private step has been set up yet (call train()).")
        return report

    def card_privacy_report(self) -> Optional[PrivacyReport]:
        """The report the model card shows (None before a private step is set up)."""
        return self._privacy.report(self)

    def _write_privacy_files(self, output_dir: str, with_state: bool) -> None:
        if not self.is_world_process_zero():
            return
        report = self._privacy.report(self)
        if report is None:  # no private step set up yet
            return
        report.save(output_dir)
        self.model.privacy_report = report  # travels with the model object (e.g. into online RL)
        if with_state and self.privacy_engine is not None:
            torch.save(self._privacy_state(), os.path.join(output_dir, PRIVACY_STATE_FILE))

    def _privacy_state(self) -> Dict[str, Any]:
        """What a checkpoint needs to resume the privacy: the accountant's history and the optimizer's own state
        (AUP-RLHF's AboveThreshold, whose noisy threshold is a secret of the mechanism: checkpoints only)."""
        engine = self.privacy_engine
        return {"accountant": engine.accountant.state_dict(), "optimizer": engine.optimizer.privacy_state_dict()}

    def _apply_privacy_state(self, state: Dict[str, Any], global_step: int, path: str) -> None:
        """Restore a checkpoint's privacy state, checked against the run it resumes: the accountant must be
        this configuration's, at this run's (σ, q), and account every step the checkpoint took (steps go
        unaccounted only after the budget ran out or AboveThreshold halted)."""
        engine = self.privacy_engine
        engine.restore_privacy_state(state["accountant"], state.get("optimizer", {}), source=path)
        accounted = engine.steps_accounted()
        if self.args.ignore_data_skip:  # the Trainer restarts the epoch without skipping: draw after the taken steps
            sampler = engine.data_loader.user_sampler
            sampler.resume_offset = accounted - (global_step // sampler.steps) * sampler.steps
        finished = engine.optimizer.halted or not engine.budget_allows_step()
        if accounted > global_step or (accounted < global_step and not finished):
            raise ValueError(
                f"{path}: the restored accountant holds {accounted} steps, but the checkpoint is at step {global_step}. "
                "Resuming would under-count the privacy spent (the state was edited or belongs to another run); "
                "refusing to resume."
            )

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
        (``torch.distributed.checkpoint`` under ``optimizer_sharded/``); the scheduler by the main process."""
        if not distributed.is_sharded(self.model) or self.is_fsdp_enabled:  # the plugin saves its own shards
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(self.model, self._torch_optimizer())
        dcp.save({"optimizer": state}, checkpoint_id=os.path.join(output_dir, SHARDED_OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """The Trainer's, but a sharded model's optimizer state is read back into each process's shards."""
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, SHARDED_OPTIMIZER_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        optimizer = self._torch_optimizer()
        state = {"optimizer": get_optimizer_state_dict(self.model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, SHARDED_OPTIMIZER_DIR))
        set_optimizer_state_dict(self.model, optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(load_plain(os.path.join(checkpoint, SCHEDULER_NAME)))

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside accelerate's and the private optimizer's wrappers (its state is the model's)."""
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer") or hasattr(optimizer, "original_optimizer"):
            optimizer = getattr(optimizer, "original_optimizer", None) or optimizer.optimizer
        return optimizer

    def _save_checkpoint(self, model, trial):
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
        path = os.path.join(resume_from_checkpoint, PRIVACY_STATE_FILE)
        if self._dp_active:
            if not os.path.isfile(path):
                raise ValueError(f"{resume_from_checkpoint} has no {PRIVACY_STATE_FILE}: resuming would reset the accountant.")
            state = load_plain(path)
            global_step = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)).global_step
            self._restored_privacy_state = (state, global_step, path)
            if self.privacy_engine is not None:
                self._apply_privacy_state(*self._restored_privacy_state)
        model = self.model if model is None else model
        if distributed.is_sharded(model) and not self.is_fsdp_enabled:
            _load_full_into_shards(model, resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
