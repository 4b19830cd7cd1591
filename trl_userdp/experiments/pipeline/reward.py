"""The reward models: the frozen MiniLM-L6 with a linear head (:mod:`.embedding_reward`) trained on the users' pairs
by :class:`~trl_userdp.trainers.UserDPRewardTrainer`, once per privacy mechanism and ε; and AUP-RLHF's τ from the
public users."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Optional

import torch
from datasets import Dataset
from torch.utils.data import TensorDataset

from ...accountants import PrivacyReport
from ...adaptive_engine import propose_concentration_radius
from ...data import UserDataLoader
from ...losses import BTLLoss
from ...mechanisms import AUPRLHF, get_mechanism
from .arguments import PipelineArguments
from .data import SentimentData
from .embedding_reward import (LinearRewardHead, MiniLMEncoder, MiniLMRewardConfig, MiniLMRewardModel, btl_margin,
                               pair_correct)


@dataclasses.dataclass
class RewardResult:
    """One trained reward model: its mechanism and target ε (``None``: non-private), its head, its privacy report
    and its agreement with the gold preference on the held-out pairs."""

    mechanism: str
    epsilon: Optional[float]
    head: LinearRewardHead
    report: PrivacyReport
    eval_accuracy: float
    #: whether it ranks each held-out pair as the gold preference does (for paired tests between reward models)
    eval_correct: torch.Tensor


def new_reward_model(encoder: MiniLMEncoder, seed: int) -> MiniLMRewardModel:
    """A fresh reward model (the same head for a seed) on the shared, frozen encoder.

    Args:
        encoder: the frozen encoder shared by every reward model of a run.
        seed: seed of the head's initialisation (set as torch's global seed).

    Returns:
        The reward model.
    """
    torch.manual_seed(seed)
    tokenizer = encoder.tokenizer
    config = MiniLMRewardConfig(hidden_size=encoder.dim, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    return MiniLMRewardModel(config, encoder)


def train_reward_model(mechanism: str, epsilon: Optional[float], encoder: MiniLMEncoder, emb: torch.Tensor,
                       data: SentimentData, args: PipelineArguments, tau: Optional[float] = None) -> RewardResult:
    """Train one reward model on the users' pairs with :class:`~trl_userdp.trainers.UserDPRewardTrainer` and the
    given mechanism ("none": plain TRL training, ε = ∞). The steps match across mechanisms: ``reward_epochs`` epochs of
    ñ·m pairs per step (each step's users drawn by Poisson sampling under the DP-SGD family), SGD at ``reward_lr``.
    AUP-RLHF takes every user in every step (it halts on small Poisson batches), for the same number of steps, with the
    public ``tau``. ``emb`` holds the pool's embeddings (for the held-out accuracy).

    Args:
        mechanism: a registered mechanism's name, or "none".
        epsilon: its target ε (``None`` for "none").
        encoder: the frozen encoder shared by every reward model of a run.
        emb: the pool's embeddings by ``encoder``.
        data: the users' pairs and the held-out pairs.
        args: the pipeline's settings.
        tau: AUP-RLHF's concentration radius (:func:`public_tau`), for a mechanism that needs one.

    Returns:
        The reward model's head, privacy report and held-out accuracy.
    """
    name = mechanism + ("" if epsilon is None else f"_eps{epsilon:g}")
    steps = int(round(args.reward_epochs * args.n_users / args.users_per_batch))
    model = new_reward_model(encoder, args.reward_training_seed)
    report = fit_reward_model(model, Dataset.from_dict(data.preference_rows()), mechanism, epsilon, args, steps,
                              os.path.join(args.output_dir, "reward_models", name), tau, processing_class=encoder.tokenizer)
    correct = pair_correct(model.head, emb[data.eval_pairs[:, 0]], emb[data.eval_pairs[:, 1]])
    return RewardResult(mechanism, epsilon, model.head, report, float(correct.float().mean()), correct)


def fit_reward_model(model: MiniLMRewardModel, dataset: Dataset, mechanism: str, epsilon: Optional[float],
                     args: PipelineArguments, steps: int, out_dir: str, tau: Optional[float] = None, *,
                     processing_class=None, data_collator=None, noise_free: bool = False,
                     aup_takes_every_user: bool = True, privacy_seed: Optional[int] = None,
                     noise_multiplier: Optional[float] = None, max_grad_norm: float = 1.0) -> PrivacyReport:
    """Train a reward model in place with :class:`~trl_userdp.trainers.UserDPRewardTrainer`: ``steps`` steps of ñ·m
    pairs (each step's users drawn by Poisson sampling under the DP-SGD family), SGD at ``reward_lr``, C = 1 unless told, the
    pipeline's seed, bf16 autocast; AUP-RLHF takes every user in every step (it halts on small Poisson batches) unless
    told otherwise.

    Args:
        model: the reward model (a :class:`MiniLMRewardModel` or :class:`PoolRewardModel`), trained in place.
        dataset: the users' pairs as TRL takes them (text columns, or processed ``chosen_ids``/``rejected_ids``).
        mechanism: a registered mechanism's name, or "none".
        epsilon: its target ε (``None`` for "none" and for ``noise_free``).
        args: the pipeline's settings (n, m, ñ, learning rate, δ, relation, seed).
        steps: the optimizer steps.
        out_dir: the trainer's output directory (emptied first).
        tau: AUP-RLHF's concentration radius, for a mechanism that needs one.
        processing_class: the tokenizer (pad and EOS ids).
        data_collator: the trainer's collator (None: TRL's).
        noise_free: the mechanism's noise-free control: the same sampling, clipping (or outlier removal) and steps
            with σ = 0 (no ε).
        aup_takes_every_user: AUP-RLHF samples every user at every step (else ñ = ``users_per_batch``, as the others).
        privacy_seed: keys the privacy draws, for tests that compare two runs (None: secrets from the OS, as a
            release must).
        noise_multiplier: a fixed σ instead of the target ε (no ε): the step-size rule's runs on public users at a
            private run's noise level (:func:`~trl_userdp.step_size.public_noise_multiplier`).
        max_grad_norm: the per-user clip C (the adaptive clip's start).

    Returns:
        The trainer's privacy report.
    """
    from ...trainers import UserDPRewardConfig, UserDPRewardTrainer

    shutil.rmtree(out_dir, ignore_errors=True)  # randomized response reuses a saved draw: never one of an older run
    m, seed = args.max_samples_per_user, args.reward_training_seed
    fixed = 0.0 if noise_free else noise_multiplier
    privacy = dict(privacy_mechanism=mechanism, target_epsilon=epsilon if fixed is None else None,
                   target_delta=args.delta, accountant="pld", neighboring_relation=args.neighboring_relation,
                   per_user_max_grad_norm=max_grad_norm, max_samples_per_user=m, users_per_batch=args.users_per_batch,
                   privacy_seed=privacy_seed, noise_multiplier=fixed)
    if needs_public_tau(mechanism):
        privacy.update(concentration_radius=tau)
        if aup_takes_every_user:
            privacy.update(users_per_batch=float(args.n_users), max_users_per_batch=args.n_users)
    config = UserDPRewardConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=int(round(args.users_per_batch * m)),
        optim="sgd", learning_rate=args.reward_lr, lr_scheduler_type="constant", weight_decay=0.0, max_length=None,
        max_grad_norm=0.0, gradient_checkpointing=False,  # no raw-gradient clipping (DP clips per user); nothing to recompute
        seed=seed, data_seed=seed, save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        # bf16 autocast, TRL's default when these results were made (docs/pipeline_results.json); the package's
        # configs now leave bf16 off on a CPU unless asked, so it is asked here (docs/privacy_model.md, "Precision and paths")
        bf16=True, disable_tqdm=True, **privacy)
    trainer = UserDPRewardTrainer(model=model, args=config, train_dataset=dataset, processing_class=processing_class,
                                  data_collator=data_collator)
    trainer.train()
    report = trainer.privacy_report()
    if trainer.privacy_engine is not None:
        trainer.privacy_engine.detach()
    return report


def needs_public_tau(mechanism: str) -> bool:
    """AUP-RLHF (and a mechanism built on it) takes its concentration radius τ from the public users.

    Args:
        mechanism: a registered mechanism's name.

    Returns:
        Whether the mechanism is AUP-RLHF's.
    """
    return issubclass(get_mechanism(mechanism), AUPRLHF)


def public_tau(encoder: MiniLMEncoder, emb: torch.Tensor, data: SentimentData, args: PipelineArguments) -> float:
    """AUP's τ from the public users (no privacy cost), at the reward model's initial head.

    Args:
        encoder: the frozen encoder shared by every reward model of a run.
        emb: the pool's embeddings by ``encoder``.
        data: the public users' pairs.
        args: the pipeline's settings (the head's seed and the loader's).

    Returns:
        The proposed τ.
    """
    return tau_from_public_users(new_reward_model(encoder, args.reward_training_seed).head, emb, data.public_pairs,
                                 data.public_users, args.seed)


def tau_from_public_users(head: LinearRewardHead, emb: torch.Tensor, pairs, users, seed: int) -> float:
    """AUP's τ at ``head`` from public users' pairs: every public user in each of 3 steps, coverage 0.9
    (:func:`~trl_userdp.propose_concentration_radius`).

    Args:
        head: the initial reward head.
        emb: the pool's embeddings.
        pairs: ``[N, 2]`` the public pairs (indices into ``emb``, chosen first).
        users: ``[N]`` their users (0 … U − 1).
        seed: the loader's seed.

    Returns:
        The proposed τ.
    """
    public = TensorDataset(emb[pairs[:, 0]], emb[pairs[:, 1]])
    loader = UserDataLoader(public, users_per_batch=float(users.max() + 1), user_ids=users.tolist(), rows_per_example=2,
                            seed=seed, steps=3)
    return propose_concentration_radius(head, lambda h, b: BTLLoss()(btl_margin(h, *b)), loader, coverage=0.9)
