"""``UserDPGRPOTrainer``: TRL's ``GRPOTrainer`` with user-level differential privacy for the policy, on the users' own
prompts (docs/trainers.md, "GRPO on the users' own prompts").

Each optimizer step is one draw of users (Poisson, q = ñ / n) from the prompt dataset, up to ``max_samples_per_user``
prompts each. Every drawn prompt gets its group of ``num_generations`` completions from the current policy, rewards
(scored one user at a time) and advantages within its group; the GRPO loss of each completion is its own, so the
per-user hooks average a user's completions' gradients, clip the average to C and add one Gaussian draw per step.
Generation, rewards and advantages are functions of one user's prompts and the current (already private) policy, so a
user's whole influence on the step is their clipped averaged gradient. Each user's completions are sampled one user at
a time from a stream keyed by the run's secret, the step and that user's id (never torch's global stream, which the
public ``seed`` sets and every user's rows would consume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Dict, Iterator, List, Optional

import torch
from trl import GRPOTrainer

from .. import distributed
from ..accountants import PrivacyReport
from ..mechanisms import get_mechanism
from ..seeding import derive_seed, run_secret, user_key
from .fused_head import unfuse_lm_head
from .grpo_config import UserDPGRPOConfig
from .mixin import USER_KEY, UserDPTrainerMixin
from .online import inherited_extra, inherited_privacy_reports, listed
from .privacy_config import UserDPArguments
from .privacy_kinds import TrainerPrivacy

#: GRPO losses whose completions are each normalised on their own (a token mean, a constant, or a sequence sum)
PER_COMPLETION_LOSSES = ("grpo", "dr_grpo", "sapo", "luspo")


class ComposedPrivacy(TrainerPrivacy):
    """What a policy trained on the users' prompts reports: its own mechanism's guarantee composed with the reports
    it inherits (reward models, a private starting policy) by basic composition, ε and δ added.

    Args:
        own: what the trainer's mechanism does (:func:`~trl_userdp.trainers.privacy_kinds.trainer_privacy`).
        policy_report: the starting policy's report, if any.
        reward_reports: the reward models' reports.
    """

    def __init__(self, own: TrainerPrivacy, policy_report: Optional[PrivacyReport],
                 reward_reports: List[PrivacyReport]):
        self.own = own
        self.private, self.gradient = own.private, own.gradient
        self.policy_report, self.reward_reports = policy_report, reward_reports

    @property
    def inherited(self) -> List[PrivacyReport]:
        """The inherited reports (the starting policy's first)."""
        return listed(self.policy_report, self.reward_reports)

    def prepare_dataset(self, trainer: Any, dataset: Any, args: Any) -> Any:
        """The own mechanism's."""
        return self.own.prepare_dataset(trainer, dataset, args)

    def report(self, trainer: Any) -> Optional[PrivacyReport]:
        """The own report with ε and δ summed over it and the inherited ones; the own one is kept in
        ``extra["prompts_report"]``, the inherited ones beside it (None before the engine is set up)."""
        own = self.own.report(trainer)
        if own is None or not self.inherited:
            return own
        extra = {**own.extra, **inherited_extra(self.policy_report, self.reward_reports), "prompts_report": own.to_dict()}
        return dataclasses.replace(own, epsilon=self.epsilon(trainer), delta=self.delta(trainer), extra=extra,
                                   accountant=f"{own.accountant}, composed with the inherited reports (basic composition)")

    def epsilon(self, trainer: Any) -> float:
        """The own ε plus the inherited ones."""
        return self.own.epsilon(trainer) + sum(r.epsilon for r in self.inherited)

    def delta(self, trainer: Any) -> float:
        """The own δ plus the inherited ones."""
        return self.own.delta(trainer) + sum(r.delta for r in self.inherited)


class UserDPGRPOTrainer(UserDPTrainerMixin, GRPOTrainer):
    """Drop-in for ``trl.GRPOTrainer`` on the users' own prompts: a :class:`UserDPGRPOConfig` and a user column in
    ``train_dataset``. A reward model must carry its privacy report (or be declared public): the policy's report
    composes its own ε for the prompts with the reward model's and a private starting policy's.

    Args:
        *args: ``trl.GRPOTrainer``'s arguments.
        reward_model_is_public: declare the rewards without a report public (a rule, or a model trained on public data).
        allow_non_private_reward: accept a reward model trained on the users without privacy, reporting ε = ∞.
        **kwargs: ``trl.GRPOTrainer``'s keyword arguments.

    Raises:
        ValueError: a setting that couples users or reuses a draw (:meth:`dp_refusals`), tools, environments or a
            rollout function, several processes or a sharded model under DP, or a reward model refused by
            :func:`~trl_userdp.trainers.online.inherited_privacy_reports`.
    """

    config_class = UserDPGRPOConfig
    rows_per_example = 1

    def __init__(self, *args, reward_model_is_public: bool = False, allow_non_private_reward: bool = False, **kwargs):
        given = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments
        config = given.get("args")
        if isinstance(config, UserDPArguments) and get_mechanism(config.privacy_mechanism).kind == "gradient" and (
                given.get("tools") or given.get("environment_factory") is not None
                or given.get("rollout_func") is not None):
            raise ValueError("Tools, environment_factory and rollout_func see the whole batch of users' prompts, which "
                             "couples users: not supported under user-level DP.")
        policy_report, reward_reports = inherited_privacy_reports(
            given.get("reward_funcs"), given.get("model"), reward_model_is_public=reward_model_is_public,
            allow_non_private_reward=allow_non_private_reward)
        relations = {r.neighboring_relation for r in listed(policy_report, reward_reports)}
        if isinstance(config, UserDPArguments) and relations - {config.neighboring_relation}:
            raise ValueError(f"The inherited reports hold under {sorted(relations)} and this run under "
                             f"{config.neighboring_relation!r}; their ε cannot be added. Set neighboring_relation to "
                             "theirs.")
        #: the row -> user map of the completions being scored (set while a private batch is generated)
        self._scored_users: Optional[torch.Tensor] = None
        super().__init__(*args, **kwargs)
        self._privacy = ComposedPrivacy(self._privacy, policy_report, reward_reports)
        #: the secret keying each user's sampling stream (:meth:`_user_stream`)
        self._run_secret = run_secret(self.args.privacy_seed)
        if self._dp_active:
            self._refuse_parallel_runs()
            if self.ref_model is not None and "forward" in vars(self.ref_model):
                # the reference's log-probabilities enter each user's KL term: its positions, too, must be the row's own
                unfuse_lm_head(self.ref_model, temperature=self.temperature)

    # -- what the mixin asks of a trainer --------------------------------------------------------
    @property
    def lm_head_temperature(self) -> float:
        """GRPO's temperature, which TRL's fused head divides the logits by."""
        return self.temperature

    def default_users_per_batch(self) -> float:
        """TRL's prompts per optimizer step: ``per_device_train_batch_size`` counts completions, ``num_generations``
        per prompt.

        Returns:
            ``per_device_train_batch_size × gradient_accumulation_steps × processes / num_generations``.
        """
        return super().default_users_per_batch() / self.num_generations

    def user_level_collator(self):
        """GRPO takes the raw examples (its collator is the identity): the user-level loader gets them as columns."""
        return _as_columns

    def dp_refusals(self, args) -> List[str]:
        """Settings that couple users within a step, reuse a draw, or change gradients the per-user hooks cannot see.

        Args:
            args: the :class:`UserDPGRPOConfig`.

        Returns:
            One message per such setting.
        """
        refusals = []
        if args.num_iterations != 1:
            refusals.append(f"num_iterations={args.num_iterations} takes several optimizer steps on one draw of users' "
                            "completions: each is another release the accountant would not count. Set num_iterations=1.")
        if args.steps_per_generation != args.gradient_accumulation_steps:
            refusals.append(f"steps_per_generation={args.steps_per_generation} (or generation_batch_size) makes "
                            "generation batches that are not one draw of users: leave both unset under user-level DP.")
        if args.scale_rewards == "batch":
            refusals.append("scale_rewards='batch' divides every advantage by the batch's reward spread, so one user's "
                            "rewards would scale every other user's gradient: use scale_rewards='group' or 'none'.")
        if args.multi_objective_aggregation == "normalize_then_sum":
            refusals.append("multi_objective_aggregation='normalize_then_sum' normalises the summed rewards over the "
                            "batch, which couples users: use 'sum_then_normalize'.")
        if args.loss_type not in PER_COMPLETION_LOSSES:
            refusals.append(f"loss_type={args.loss_type!r} divides by the batch's token count, so one user's completion "
                            f"lengths would weigh every other user's gradient: use one of {list(PER_COMPLETION_LOSSES)}.")
        if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
            refusals.append("The entropy bonus is a token mean over the whole batch, which couples users: set "
                            "entropy_coef=0.0 and use_adaptive_entropy=False under user-level DP.")
        if args.top_entropy_quantile < 1.0:
            refusals.append("top_entropy_quantile < 1 keeps the tokens above a quantile of the whole batch's entropies, "
                            "which couples users: leave it at 1.0 under user-level DP.")
        if args.log_completions:
            refusals.append("log_completions=True prints and saves the users' prompts and completions: turn it off "
                            "under user-level DP.")
        if args.cast_lm_head_to_fp32:
            refusals.append("cast_lm_head_to_fp32=True patches the LM head outside the per-user hooks: leave it off "
                            "under user-level DP.")
        if args.use_vllm:
            refusals.append("use_vllm=True generates outside this process and corrects the loss by importance ratios "
                            "the per-user hooks were not checked against: generate with transformers under user-level DP.")
        if args.use_transformers_paged or args.use_transformers_continuous_batching:
            refusals.append("The paged / continuous-batching generation casts the policy to half precision in place: "
                            "generate with transformers' generate() under user-level DP.")
        if args.use_liger_kernel:
            refusals.append("use_liger_kernel=True replaces layers by fused kernels without per-sample gradients: turn "
                            "it off under user-level DP.")
        return refusals

    def _refuse_parallel_runs(self) -> None:
        """Several processes gather rewards across them and slice equal rows per process; a sharded model needs
        placeholder passes this trainer does not make. Neither is supported under user-level DP yet."""
        if self.accelerator.num_processes > 1:
            raise ValueError("UserDPGRPOTrainer runs on one process under user-level DP: TRL's GRPO gathers rewards "
                             "across processes and slices equal rows per process. Use one GPU.")
        if distributed.is_sharded(self.model):
            raise ValueError("UserDPGRPOTrainer does not support a sharded (FSDP2) model under user-level DP.")

    # -- the private step -------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        """Under DP in training: the draw's prompts (columns from the user-level loader), each repeated
        ``num_generations`` times as TRL's sampler does, generated for and scored now (no buffering: one draw, one
        optimizer step), with the row -> user map of the completions. Otherwise TRL's."""
        if not (self._dp_active and self.model.training):
            return super()._prepare_inputs(generation_batch)
        batch = dict(generation_batch)
        users = batch.pop(USER_KEY).repeat_interleave(self.num_generations)
        examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
        examples = [example for example in examples for _ in range(self.num_generations)]
        self._scored_users = users
        try:
            inputs = self._generate_and_score_completions(examples)
        finally:
            self._scored_users = None
        inputs[USER_KEY] = users
        return inputs

    def _generate(self, prompts):
        """TRL's generation; under DP in training, TRL's count of the batch's tokens (``num_input_tokens_seen``, saved
        with the state and handed to the reward functions as ``trainer_state``) is left as it was."""
        tokens_seen = self.state.num_input_tokens_seen
        try:
            return super()._generate(prompts)
        finally:
            if self._scored_users is not None:
                self.state.num_input_tokens_seen = tokens_seen

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Under DP in training, TRL's sampling one user at a time, each user's completions from their own stream
        (:meth:`_user_stream`): what a user is answered depends on their prompts, the policy and the run's secret only,
        not on who else was drawn nor on the public ``seed``.

        Raises:
            ValueError: multimodal prompts (their fields are batched across users) under DP.
        """
        users = self._scored_users
        if users is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images=has_tool_images)
        if images is not None or multimodal_fields:
            raise ValueError("Multimodal prompts are not supported by UserDPGRPOTrainer under user-level DP.")
        completions: List[Any] = [None] * len(prompt_ids)
        for user in users.unique().tolist():
            rows = (users == user).nonzero().flatten().tolist()
            with self._user_stream(user):
                ids, _ = super()._generate_single_turn([prompt_ids[i] for i in rows], None, {}, num_generations)
            for i, completion in zip(rows, ids):
                completions[i] = completion
        return completions, None

    @contextlib.contextmanager
    def _user_stream(self, user: int) -> Iterator[None]:
        """torch's global generators (the CPU's and this process's accelerator's), for the block, seeded from
        ``(run secret, "generation", step, user id)``, then put back as they were: the global stream the public seed
        set is neither read nor advanced by the users' sampling."""
        device = self.accelerator.device
        key = user_key(self._private_loader.user_index.keys[user].item())
        seed = derive_seed(self._run_secret, "generation", self.state.global_step, key)
        accelerator = device.type != "cpu"
        with torch.random.fork_rng(devices=[device] if accelerator else [],
                                   device_type=device.type if accelerator else None):
            torch.manual_seed(seed)
            yield

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Under DP in training, TRL's rewards one user at a time: no reward model or function sees two users'
        completions, so none can couple them."""
        users = self._scored_users
        if users is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards = torch.empty(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
        for user in users.unique().tolist():
            rows = (users == user).nonzero().flatten().tolist()
            pick = lambda values: [values[i] for i in rows]  # noqa: E731
            rewards[rows] = super()._calculate_rewards(pick(inputs), pick(prompts), pick(completions),
                                                       pick(completion_ids_list))
        return rewards

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's GRPO loss, but under DP in training not divided by the accumulation steps: each micro-batch's loss is
        the mean of its own completions', so that the hooks read each completion's gradient."""
        context = (self._loss_not_divided_by_accumulation() if self._dp_active and model.training
                   else contextlib.nullcontext())
        with context:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    @contextlib.contextmanager
    def _loss_not_divided_by_accumulation(self) -> Iterator[None]:
        steps = self.current_gradient_accumulation_steps
        self.current_gradient_accumulation_steps = 1
        try:
            yield
        finally:
            self.current_gradient_accumulation_steps = steps


def _as_columns(examples: List[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """GRPO's raw examples as one list per column (the user-level loader needs a mapping)."""
    return {key: [example[key] for example in examples] for key in examples[0]}
