"""Online RL on a user-level private reward model (the PPO stage of AUP-RLHF; TRL ≥ 1.13 ships RLOO
and GRPO instead of PPO).

Training a policy against a private reward model on public prompts is post-processing: it spends no
new budget. These wrappers enforce the conditions that make that true — every reward model carries a
privacy report (unless declared public), the prompts carry no preference labels — and write the
carried-over report with the policy and its ε in the training logs. A reward model trained on the users
without privacy is not public: with ``allow_non_private_reward=True`` (baselines) its ε = ∞ is carried.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from trl import GRPOTrainer, RLOOTrainer

from ..accountants import REPORT_FILENAME, PrivacyReport
from ..stack_warnings import without_stack_deprecations
from .model_card import PrivacyModelCardMixin



def find_privacy_report(reward: Any) -> Optional[PrivacyReport]:
    """The privacy report of a reward model (or of a starting policy).

    Args:
        reward: a model, whose ``privacy_report`` attribute (set by this package's trainers) or
            ``privacy_report.json`` in the directory it was loaded from is read; or a string naming such a directory.

    Returns:
        The :class:`PrivacyReport`, or None if there is none (e.g. a reward function).
    """
    report = getattr(reward, "privacy_report", None)
    if isinstance(report, PrivacyReport):
        return report
    if isinstance(report, dict):
        return PrivacyReport.from_dict(report)
    path = reward if isinstance(reward, str) else getattr(getattr(reward, "config", None), "_name_or_path", "")
    if path and os.path.isfile(os.path.join(path, REPORT_FILENAME)):
        return PrivacyReport.load(path)
    return None


def is_trl_rule(func: Any) -> bool:
    """Whether a reward is one of TRL's rule-based rewards (``trl.rewards``: format, length, accuracy against the
    example's own solution), which were trained on nothing.

    Args:
        func: a reward model or function.

    Returns:
        True for a plain function defined in ``trl.rewards``.
    """
    return callable(func) and not isinstance(func, torch.nn.Module) and (
        getattr(func, "__module__", None) or "").startswith("trl.rewards.")


def listed(policy_report: Optional[PrivacyReport], reward_reports: List[PrivacyReport]) -> List[PrivacyReport]:
    """The inherited reports in one list: the starting policy's (if any) first, then the reward models'.

    Args:
        policy_report: the starting policy's report, if any.
        reward_reports: the reward models' reports.

    Returns:
        The list.
    """
    return ([policy_report] if policy_report is not None else []) + list(reward_reports)


def inherited_privacy_reports(reward_funcs: Any, policy: Any, *, reward_model_is_public: bool,
                              allow_non_private_reward: bool) -> Tuple[Optional[PrivacyReport], List[PrivacyReport]]:
    """The privacy reports an online-RL policy inherits: its starting weights' and its reward models'.

    Args:
        reward_funcs: the reward model(s) or function(s), as TRL's; TRL's own rules (:func:`is_trl_rule`) are public.
        policy: the starting policy (a model or a folder); a report it carries (e.g. a private DPO model) is inherited.
        reward_model_is_public: declare the rewards *without a report* public (a rule, or a model trained on public
            data); a report is inherited whatever the flag.
        allow_non_private_reward: accept a reward whose report says it was trained on the users without privacy
            (ε = ∞) and inherit that ε = ∞ (a non-private baseline).

    Returns:
        ``(the policy's report or None, the reward models' reports)``.

    Raises:
        ValueError: a reward without a report that is not declared public, a non-private reward without
            ``allow_non_private_reward``, or reports under different neighbouring relations.
    """
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    rewards: List[PrivacyReport] = []
    policy_report = find_privacy_report(policy) if policy is not None else None
    for func in funcs:
        report = find_privacy_report(func)
        name = func if isinstance(func, str) else getattr(func, "__name__", type(func).__name__)
        if report is None:
            if not (reward_model_is_public or is_trl_rule(func)):
                raise ValueError(
                    f"Reward {name!r} has no privacy report: train it with UserDPRewardTrainer (which attaches one "
                    "and saves privacy_report.json), or pass reward_model_is_public=True if it saw no private data."
                )
            continue
        if math.isinf(report.epsilon) and not allow_non_private_reward:
            raise ValueError(
                f"Reward {name!r} was trained on the users without privacy (mechanism {report.mechanism!r}, ε = ∞), "
                "so it is not public: pass allow_non_private_reward=True to train a non-private baseline (the policy "
                "then reports ε = ∞)."
            )
        rewards.append(report)
    relations = {r.neighboring_relation for r in listed(policy_report, rewards)}
    if len(relations) > 1:
        raise ValueError(f"The policy and reward models' reports hold under different neighbouring relations "
                         f"{sorted(relations)}; their ε cannot be added. Train them under one relation.")
    return policy_report, rewards


def inherited_extra(policy_report: Optional[PrivacyReport], reward_reports: List[PrivacyReport]) -> Dict[str, Any]:
    """The ``extra`` entries of a report that composes inherited reports: each of them, and whether a text is left
    unprotected by one of them (randomized response protects labels only).

    Args:
        policy_report: the starting policy's report, if any.
        reward_reports: the reward models' reports.

    Returns:
        ``reward_model_reports``, ``initial_policy_report`` (if any) and ``protects`` (if labels only).
    """
    extra: Dict[str, Any] = {"reward_model_reports": [r.to_dict() for r in reward_reports]}
    if policy_report is not None:
        extra["initial_policy_report"] = policy_report.to_dict()
    if any(r.extra.get("protects") == "labels only" for r in listed(policy_report, reward_reports)):
        extra["protects"] = "labels only"
    return extra


class PublicPromptOnlineMixin(PrivacyModelCardMixin):
    """Shared by :class:`PublicPromptRLOOTrainer` and :class:`PublicPromptGRPOTrainer`: TRL's arguments, plus three keywords,
    checked before TRL's ``__init__`` (see :meth:`_check_private_inputs`).

    Args:
        model: the policy, as TRL's; a privacy report it carries (e.g. a private DPO model) is composed in.
        reward_funcs: the reward model(s) or function(s), as TRL's.
        args: TRL's config.
        train_dataset: the public prompts.
        eval_dataset: likewise (a dataset or a dict of them).
        *rest: TRL's further positional arguments.
        reward_model_is_public: declare the rewards without a report public (a rule, or a model trained on public
            data).
        public_columns: the dataset columns allowed (default: the prompts only).
        allow_non_private_reward: accept a reward trained on the users without privacy and carry its ε = ∞ (a
            non-private baseline).
        **kwargs: TRL's further keyword arguments.

    Raises:
        ValueError: a reward without a report that is not declared public, a non-private reward without
            ``allow_non_private_reward``, reports under different neighbouring relations, or a dataset column
            outside ``public_columns``.
    """

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, *rest,
                 reward_model_is_public: bool = False, public_columns=("prompt",), allow_non_private_reward: bool = False,
                 **kwargs):
        self._check_private_inputs(reward_funcs, train_dataset, eval_dataset, reward_model_is_public, public_columns,
                                   allow_non_private_reward, policy=model)
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kwargs)

    def _check_private_inputs(self, reward_funcs, train_dataset, eval_dataset, reward_model_is_public: bool,
                              public_columns=("prompt",), allow_non_private_reward: bool = False,
                              policy: Any = None) -> None:
        """The reward and starting-policy reports (:func:`inherited_privacy_reports`), and no dataset column outside
        ``public_columns``."""
        self.policy_privacy_report, self.reward_privacy_reports = inherited_privacy_reports(
            reward_funcs, policy, reward_model_is_public=reward_model_is_public,
            allow_non_private_reward=allow_non_private_reward)
        datasets = {"train_dataset": train_dataset}
        if isinstance(eval_dataset, dict):
            datasets.update({f"eval_dataset[{k!r}]": v for k, v in eval_dataset.items()})
        else:
            datasets["eval_dataset"] = eval_dataset
        for where, dataset in datasets.items():
            extra = sorted(set(getattr(dataset, "column_names", ()) or ()) - set(public_columns))
            if extra:
                raise ValueError(
                    f"The online-RL {where} has columns {extra} besides {list(public_columns)}: online RL must not see "
                    "the private preference data (GRPO hands every column to the reward functions). Drop them, or "
                    "list public ones in `public_columns`."
                )

    def train(self, *args, **kwargs):
        """TRL's training, without the FutureWarnings of TRL's use of transformers' renamed gradient-checkpointing API
        (:mod:`~trl_userdp.stack_warnings`)."""
        with without_stack_deprecations():
            return super().train(*args, **kwargs)

    def _inherited_reports(self) -> List[PrivacyReport]:
        return listed(self.policy_privacy_report, self.reward_privacy_reports)

    def carried_privacy_report(self) -> PrivacyReport:
        """The policy's guarantee: that of its starting weights and reward model(s), by post-processing (several
        private releases on the same users compose: their ε and δ add up). What one of them leaves unprotected (the
        texts, under randomized response) stays unprotected.

        Returns:
            The composed :class:`PrivacyReport` (ε = 0 when every reward is public and the policy has no report).
        """
        reports = self._inherited_reports()
        if not reports:
            return PrivacyReport(mechanism="post-processing of public rewards", n_users=0, max_samples_per_user=None,
                                 sample_rate=None, noise_multiplier=None, steps=None, steps_taken=self.state.global_step,
                                 accountant="none", epsilon=0.0, delta=0.0)
        first = reports[0]
        return PrivacyReport(
            mechanism="post-processing", n_users=first.n_users, max_samples_per_user=first.max_samples_per_user,
            sample_rate=None, noise_multiplier=None, steps=None, steps_taken=self.state.global_step,
            accountant="basic composition of the inherited reports",
            epsilon=sum(r.epsilon for r in reports), delta=sum(r.delta for r in reports),
            neighboring_relation=first.neighboring_relation, privacy_unit=first.privacy_unit,
            extra={**inherited_extra(self.policy_privacy_report, self.reward_privacy_reports),
                   "online_trainer": type(self).__name__},
        )

    def card_privacy_report(self) -> PrivacyReport:
        """The carried-over report (:meth:`carried_privacy_report`)."""
        return self.carried_privacy_report()

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """The policy's inherited ε and δ in every training log, as in its report."""
        report = self.carried_privacy_report()
        super().log({**logs, "epsilon": report.epsilon, "delta": report.delta}, start_time)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False):
        """TRL's save, then the carried-over report in ``privacy_report.json`` and on the model; every process returns
        once the main process has written (a process that leaves and tears its process group down while another still
        writes can abort it). Call it on every process, as the Trainer does at its checkpoints."""
        super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():
            report = self.carried_privacy_report()
            report.save(output_dir or self.args.output_dir)
            self.model.privacy_report = report
        self.accelerator.wait_for_everyone()


class PublicPromptRLOOTrainer(PublicPromptOnlineMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` whose reward model(s) must be user-level private (or declared public); the extra keywords
    are :class:`PublicPromptOnlineMixin`'s."""


class PublicPromptGRPOTrainer(PublicPromptOnlineMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` whose reward model(s) must be user-level private (or declared public); the extra keywords
    are :class:`PublicPromptOnlineMixin`'s."""
