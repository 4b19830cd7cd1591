"""The white-box audit of the engine as implemented (docs/audit.md): gradient canary users trained through
:meth:`~trl_userdp.PrivacyEngine.make_private_user_level`, path included (the mechanism, ``grad_sample_mode``, the
parameters' dtype, micro-batches).

Canary user ``c`` has a Dirac gradient (Steinke et al. 2023, §6): its rows are the one-hot vector ``e_c`` into a
``Linear(m, 1)`` model and its loss is ``−s·output`` with ``s`` far above the clip, so whatever the step, its averaged
gradient is ``−s·e_c`` and its clipped one ``−C·e_c``. Each step releases ``(Σ clipped + noise)/ñ``; the auditor reads
each canary's coordinate of the released updates, in units of ``C/ñ``, and scores it by their sum (what the final
model shows) or by the likelihood ratio of the subsampled Gaussian step by step (what every iterate shows).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..mechanisms import GradientMechanism
from ..privacy_engine import PrivacyEngine
from ..seeding import derive_seed
from ..validators import check_confidence
from .bounds import audit_scores, each_test_confidence
from .canaries import CanaryDraw
from .fdp import audit_curve, audits_curve, run_curves
from .planning import plan_guesses
from .report import AuditReport

#: the canaries' loss scale, as a multiple of the clip: every canary user is clipped, whatever its rows
CANARY_SCALE = 100.0
#: near-cancelling canary users: rows of gradient +10⁴·C and −0.98·10⁴·C, whose average is 100·C; a norm computed
#: in low precision from the rows (ghost clipping's Gram route) can lose it entirely
CANCELLING_SCALE, CANCELLING_KEEP = 1e4, 0.98
SCORES = ("sum", "steps")


class _OneHotRows(Dataset):
    """Row ``i`` is the one-hot vector of canary ``index[i]`` (built on access: ``m × m`` floats are never held) and the
    row's loss weight."""

    def __init__(self, index: np.ndarray, weights: np.ndarray, m: int, dtype: torch.dtype):
        self.index, self.m, self.dtype = torch.as_tensor(index, dtype=torch.long), m, dtype
        self.weights = torch.as_tensor(weights, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        return nn.functional.one_hot(self.index[i], self.m).to(self.dtype), self.weights[i]


def step_log_likelihood_ratio(x: np.ndarray, sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """The log-likelihood ratio of one step's release ``x`` (in units of ``C/ñ``) for "the canary is in" against "it
    is out", under the Poisson-subsampled Gaussian: ``log(1 − q + q·exp((2x − 1)/(2σ²)))``.

    Args:
        x: the canaries' coordinates of one step's update, in units of ``C/ñ``.
        sample_rate: q.
        noise_multiplier: σ (> 0).

    Returns:
        The ratios, elementwise.
    """
    shift = (2 * x - 1) / (2 * noise_multiplier ** 2)
    if sample_rate >= 1:
        return shift
    return np.logaddexp(np.log1p(-sample_rate), np.log(sample_rate) + shift)


def audit_gradient_canaries(
    n_canaries: int = 1000,
    *,
    steps: int = 10,
    target_epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    delta: float = 1e-5,
    users_per_batch: Optional[float] = None,
    max_grad_norm: float = 1.0,
    rows_per_user: int = 1,
    mechanism: Union[str, GradientMechanism] = "user_dpsgd",
    grad_sample_mode: str = "hooks",
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    micro_batches: int = 1,
    near_cancelling: bool = False,
    score: str = "sum",
    confidence: float = 0.95,
    seed: Optional[int] = None,
    accountant: str = "pld",
    fdp: bool = True,
    plan: bool = True,
    before_training: Optional[Callable[[PrivacyEngine, Any], None]] = None,
    progress: bool = False,
) -> AuditReport:
    """Train ``n_canaries`` gradient canary users, each in by a secret draw of probability ½, through the engine, and
    audit the run's ε (Steinke et al. 2023's one-run bound, :func:`~trl_userdp.audit.bounds.audit_scores`, and the
    f-DP audit of the run's curve, :func:`~trl_userdp.audit.fdp.audit_curve`).

    Under data parallelism (a process group initialised, every process calling this with the same arguments) the
    engine shards the canary users by id across the processes, as any users; every process gets the same report.

    Args:
        n_canaries: m, the canary users (the model has one coordinate each).
        steps: T, the private steps.
        target_epsilon: the run's target ε (σ calibrated to it); or give ``noise_multiplier``.
        noise_multiplier: a fixed σ instead of a target.
        delta: δ of the claim and of the audit.
        users_per_batch: ñ (default: every included canary user at every step, q = 1, the strongest audit).
        max_grad_norm: C.
        rows_per_user: the records of each canary user (all of them one-hot in its coordinate).
        mechanism: a clipping mechanism (name or object): ``"user_dpsgd"``, ``"group"``, ``"user_dpsgd_adaptive_clip"``.
        grad_sample_mode: ``"hooks"``, ``"functorch"`` or ``"ghost"``.
        dtype: the parameters' and inputs' dtype (``torch.bfloat16`` audits the bf16 path).
        device: where the model, its rows and the noise live (``"cuda"`` audits the GPU path).
        micro_batches: each draw in this many micro-batches of whole users.

        near_cancelling: adversarial canary users of two rows whose gradients nearly cancel (``±10⁴·C``, average
            ``100·C``), which a norm computed in low precision from the rows can lose: the audit of a path's precision.
        score: ``"sum"`` (each canary's coordinate of the summed updates) or ``"steps"`` (its likelihood ratio over
            every step's update, which needs σ > 0).
        confidence: the confidence of the bound.
        seed: seeds the draw, the sampling and the noise (None: the OS; a seeded audit is reproducible, and its seed
            a secret of the auditor's).
        accountant: the engine's accountant.
        fdp: also run the f-DP audit of the run's own trade-off curve (:func:`~trl_userdp.audit.fdp.audit_curve`;
            runs with σ > 0 of a mechanism whose claim is its accountant's, :func:`~trl_userdp.audit.fdp.audits_curve`).
            Each of the two tests then runs at half the significance, so that the report's verdict keeps
            ``confidence``.
        plan: test the number of guesses each bound should make on a run of the claimed ε, chosen from the claim
            alone (:func:`~trl_userdp.audit.planning.plan_guesses`), at the full confidence; False: try
            :func:`~trl_userdp.audit.bounds.default_abstentions` under a union bound.
        before_training: called with the engine and the private optimizer before the first step (e.g. to break the
            run on purpose, and see the audit catch it).
        progress: show a progress bar over the steps.

    Returns:
        The :class:`~trl_userdp.audit.report.AuditReport`.

    Raises:
        ValueError: an unknown ``score``, ``score="steps"`` at σ = 0, ``near_cancelling`` without two rows per user,
            or what the engine refuses.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    check_confidence(confidence)
    if near_cancelling and rows_per_user != 2:
        raise ValueError("near_cancelling canary users have two rows each: rows_per_user=2.")
    draw = CanaryDraw.draw(n_canaries, None if seed is None else derive_seed(seed, "audit-draw"))
    members = np.flatnonzero(draw.included)
    index = np.repeat(members, rows_per_user)
    scale = CANCELLING_SCALE if near_cancelling else CANARY_SCALE
    weights = np.tile([1.0, -CANCELLING_KEEP] if near_cancelling else [1.0] * rows_per_user, len(members))
    device = torch.device(device)
    model = nn.Linear(n_canaries, 1, bias=False).to(device=device, dtype=dtype)
    nn.init.zeros_(model.weight)
    engine = PrivacyEngine(accountant=accountant)
    length = {"noise_multiplier": noise_multiplier} if noise_multiplier is not None else {
        "target_epsilon": target_epsilon, "target_delta": delta}
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(_OneHotRows(index, weights, n_canaries, dtype)), user_ids=index.tolist(),
        max_samples_per_user=rows_per_user, users_per_batch=float(users_per_batch or len(members)),
        max_grad_norm=max_grad_norm, steps=steps, mechanism=mechanism, grad_sample_mode=grad_sample_mode,
        micro_batches=micro_batches,
        sampling_seed=None if seed is None else derive_seed(seed, "audit-sampling"),
        noise_generator=None if seed is None else torch.Generator(device).manual_seed(
            derive_seed(seed, "audit-noise")),
        **length)
    sigma = optimizer.noise_multiplier
    if score == "steps" and not sigma > 0:
        raise ValueError("score='steps' weighs each step by the noise; at σ = 0 use score='sum'.")
    if before_training is not None:
        before_training(engine, optimizer)
    units = getattr(optimizer, "global_expected_batch_size", optimizer.expected_batch_size)
    scores = np.zeros(n_canaries)
    rows_here = 0  # the canary rows this process trained on (its shard of the users, under data parallelism)
    previous = model.weight.detach().double().flatten().cpu().clone()
    bar = tqdm(total=steps, desc="audit steps", disable=not progress)
    while engine.steps_accounted() < steps:  # the loader yields epochs of round(1/q) steps
        before = engine.steps_accounted()
        for i, (x, w) in enumerate(loader):
            if i % micro_batches == 0:
                optimizer.zero_grad()
            clip = float(optimizer.max_grad_norm)  # the clip this step uses (an adaptive clip moves after it)
            rows_here += len(x)
            x, w = x.to(device), w.to(device)
            if len(x):
                with warnings.catch_warnings():  # the one-hot inputs need no gradient; torch says so at every step
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    (-scale * max_grad_norm * (w * model(x)[:, 0]).sum() / len(x)).backward()
            if i % micro_batches < micro_batches - 1:
                continue
            optimizer.step()
            current = model.weight.detach().double().flatten().cpu().clone()
            released = (current - previous).numpy() * units / clip  # one step's update, in units of C/ñ
            previous = current
            scores += released if score == "sum" else step_log_likelihood_ratio(released, loader.sample_rate, sigma)
            bar.update(1)
            if engine.steps_accounted() == steps:
                break
        if engine.steps_accounted() == before:  # a loader that stops early (a halted mechanism) would loop forever
            raise ValueError(f"The run stopped after {before} of {steps} steps; audit a mechanism that takes them all.")
    bar.close()
    claimed = engine.get_epsilon(delta)
    with_curve = fdp and sigma > 0 and audits_curve(engine.mechanism)
    level = each_test_confidence(confidence, 2 if with_curve else 1)
    planned = plan_guesses(claimed, delta, n_canaries, level) if plan else {}
    audit = audit_scores(scores, draw.included, delta, level, abstentions=[planned["steinke"]] if planned else None)
    curve = audit_curve(scores, draw.included, run_curves(engine.accountant, delta), level,
                        abstentions=[planned["fdp"]] if planned else None) if with_curve else None
    settings = {"mechanism": engine.mechanism.report_name, "grad_sample_mode": grad_sample_mode,
                "dtype": str(dtype).replace("torch.", ""), "device": device.type, "micro_batches": micro_batches,
                "noise_multiplier": sigma, "sample_rate": loader.sample_rate, "steps": engine.steps_accounted(),
                "max_grad_norm": max_grad_norm, "rows_per_user": rows_per_user, "accountant": accountant,
                "near_cancelling": near_cancelling, "rows_on_this_process": rows_here,
                "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
                "abstentions_tried": list(audit.tried), "k_in": audit.guesses.k_in, "k_out": audit.guesses.k_out,
                "guesses_planned": planned or None, "level_of_each_test": level,
                "fdp": None if curve is None else {"guesses": curve.guesses, "correct": curve.correct,
                                                   "scale": curve.scale}}
    return AuditReport(
        epsilon_lower=audit.epsilon_lower, epsilon_claimed=claimed, delta=delta,
        confidence=confidence, canaries=n_canaries, canaries_in=len(members), guesses=audit.guesses.guesses,
        correct=audit.guesses.correct, auditor=f"white-box gradient canary users, score: {score}", settings=settings,
        scores_in=scores[draw.included].tolist(), scores_out=scores[~draw.included].tolist(),
        epsilon_lower_fdp=None if curve is None else curve.epsilon_lower,
        fdp_claim_rejected=None if curve is None else curve.claim_rejected)
