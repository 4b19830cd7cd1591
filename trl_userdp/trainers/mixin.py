"""What the user-level DP trainers share (README; docs/stack_findings.md): one mixin placed before the TRL trainer.

* ``randomized_response``: labels privatized once before TRL's preprocessing; the trainer's loss
  becomes the de-biased one (set by each trainer).
* ``user_dpsgd`` / ``group`` / ``aup``: on the first ``get_train_dataloader`` the model and the
  Trainer's optimizer go through :class:`~trl_userdp.PrivacyEngine` (AUP-RLHF through the same set-up): the
  train loader becomes a user-level Poisson loader whose dict batches carry each row's user,
  ``compute_loss`` hands that map to the per-user hooks, and ``optimizer.step()`` is private.
* Composed from :mod:`.private_logs` (ε and δ at every logging step, nothing computed on private batches),
  :mod:`.checkpointing` (the privacy report and state with every checkpoint, checked on resume), :mod:`.sharding`
  (FSDP2 and several processes) and :mod:`.callbacks` (training stops before a step the budget cannot pay for).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .. import distributed
from ..accountants import PrivacyReport
from ..data import check_text_columns, resolve_user_ids
from ..grad_sample.checks import active_dropout, disable_dropout
from ..mechanisms import UserRandomizedResponse, get_mechanism, mechanism_names
from ..privacy_engine import PrivacyEngine
from ..stack_warnings import without_stack_deprecations
from .callbacks import PrivacyBudgetCallback
from .checkpointing import PrivacyCheckpointMixin
from .fused_head import unfuse_lm_head
from .model_card import PrivacyModelCardMixin
from .privacy_config import UserDPArguments
from .privacy_kinds import trainer_privacy
from .private_logs import PrivateLogsMixin
from .sharding import ShardedTrainingMixin, rank_local_gathers

logger = logging.getLogger(__name__)

#: Key under which dict batches carry each row's user (popped before the model sees the batch).
USER_KEY = "_trl_userdp_row_users"

#: share of rows dropped by contribution bounding from which the trainers warn (the data owner's console only)
DROPPED_ROWS_WARNING = 0.1


class UserDPTrainerMixin(PrivateLogsMixin, PrivacyCheckpointMixin, ShardedTrainingMixin, PrivacyModelCardMixin):
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
            self._prepare_sharding()
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

    @property
    def _dp_active(self) -> bool:
        """The optimizer steps are private (a gradient mechanism)."""
        return self._privacy.gradient

    def _make_private(self) -> None:
        """Set the run up through :class:`~trl_userdp.PrivacyEngine`, on the first ``get_train_dataloader``: the Trainer
        asks for its loader before it creates the optimizer, and under DP the loader is the engine's."""
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
                with rank_local_gathers(self.accelerator):
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

