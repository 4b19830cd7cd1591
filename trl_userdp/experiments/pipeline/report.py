"""The pipeline's outputs: the table of the final evaluations and the plot (reward against KL per ε, and
privacy–utility)."""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from .arguments import PipelineArguments
from ...utils.plots import save_figure


def format_table(results: List[Dict[str, object]], sft: Dict[str, float], args: PipelineArguments) -> str:
    """The table of the final evaluations, one row per reward model and one for the SFT policy, with its legend.

    Args:
        results: the pipeline's results, one per reward model.
        sft: the SFT policy's evaluation (without ``per_prompt``).
        args: the pipeline's settings (for the title and the legend).

    Returns:
        The table as text.
    """
    lines = [
        f"Controlled sentiment generation in miniature: n = {args.n_users} users, m = {args.max_samples_per_user}, "
        f"δ = {args.delta:g}, every ε under the {args.neighboring_relation!r} relation, GRPO {args.rl_steps} steps "
        f"(KL coefficient {args.kl_beta})",
        f"{'mechanism':<24} {'target ε':>8} {'ε spent':>8} {'RM acc':>6} {'RM p':>8} {'gold reward':>11} "
        f"{'gain over SFT':>15} {'p vs SFT':>8} {'share':>5} {'p vs none':>9} {'KL':>12} {'ended':>5}",
        "-" * 134,
    ]
    for r in results:
        eps = "—" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        spent = "∞ (none)" if r["epsilon_spent"] is None else f"{r['epsilon_spent']:.3g}"
        note = " (AUP halted)" if r.get("aup_halted") else ""
        gain = r["gain_over_sft"]
        rm_p = "—" if r.get("reward_model_vs_none_p") is None else f"{r['reward_model_vs_none_p']:.2g}"
        share = "—" if r.get("share_of_gain") is None else f"{r['share_of_gain']:.2f}"
        vs_none = "—" if r.get("vs_none") is None else f"{r['vs_none']['p']:.2g}"
        lines.append(f"{r['mechanism']:<24} {eps:>8} {spent:>8} {r['reward_model_pair_accuracy']:>6.3f} {rm_p:>8} "
                     f"{r['gold_reward']:>11.3f} {gain['mean']:>7.3f} ± {gain['half_width']:.3f} {gain['p']:>8.2g} "
                     f"{share:>5} {vs_none:>9} {r['kl']:>5.2f} ± {1.96 * r['kl_se']:.2f} {r['ended']:>5.2f}{note}")
    lines.append(f"{'SFT policy (start)':<24} {'':>8} {'':>8} {'':>6} {'':>8} {sft['gold_reward']:>11.3f} {'':>15} "
                 f"{'':>8} {'':>5} {'':>9} {0.0:>12.2f} {sft['ended']:>5.2f}")
    lines.append(
        "ε spent: the reward model's user-level guarantee (the policy inherits it by post-processing). RM acc: the reward "
        f"model's agreement with the gold preference on {args.eval_pairs} held-out pairs; RM p: exact McNemar test of it "
        "against the non-private reward model's. gold reward: mean gold log-odds over "
        f"{args.eval_prompts} held-out prompts × {args.eval_samples} sampled completions, the same prompts and sampling "
        "seed for every policy. gain over SFT: its paired difference from the SFT policy ± 95% half-width, p vs SFT its "
        "paired t-test; share: gain / the non-private policy's gain; p vs none: paired t-test against the non-private "
        "policy. KL: KL(π ‖ π_SFT) per completion ± 95% half-width over the prompts; ended: share of completions that "
        "end with EOS.")
    return "\n".join(lines)


def plot_curves(results: List[Dict[str, object]], sft: Dict[str, float], args: PipelineArguments, path: str) -> None:
    """Gold reward against KL per mechanism, one panel per ε (AUP-RLHF's Fig. 1 form), and gold reward against ε per
    mechanism with the non-private and SFT policies as references (privacy–utility).

    Args:
        results: the pipeline's results, one per reward model.
        sft: the SFT policy's evaluation (without ``per_prompt``).
        args: the pipeline's settings.
        path: where the PNG goes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epsilons = sorted({r["target_epsilon"] for r in results if r["target_epsilon"] is not None})
    mechanisms = list(dict.fromkeys(r["mechanism"] for r in results))
    colors = {m: f"C{i}" for i, m in enumerate(mechanisms)}
    none = next((r for r in results if r["target_epsilon"] is None), None)
    fig, axes = plt.subplots(1, len(epsilons) + 1, figsize=(4.4 * (len(epsilons) + 1), 3.8))
    axes = np.atleast_1d(axes)
    for ax, eps in zip(axes, epsilons):
        if ax is not axes[0]:
            ax.sharey(axes[0])
        for r in results:
            if r["target_epsilon"] not in (eps, None):
                continue
            label = r["mechanism"] if r["target_epsilon"] is not None else "none (non-private)"
            ax.plot([p["kl"] for p in r["curve"]], [p["gold_reward"] for p in r["curve"]], marker="o", ms=3,
                    label=label, color=colors[r["mechanism"]], linestyle="--" if r["target_epsilon"] is None else "-")
        ax.set(title=f"ε = {eps:g}, δ = {args.delta:g} (user level)", xlabel="KL(π ‖ π_SFT) per completion",
               ylabel="gold reward (mean log-odds)")
    ax = axes[-1]  # privacy–utility: each policy's gain over the SFT policy, paired over the held-out prompts
    for mech in mechanisms:
        rows = sorted((r for r in results if r["mechanism"] == mech and r["target_epsilon"] is not None),
                      key=lambda r: r["target_epsilon"])
        if rows:
            ax.errorbar([r["target_epsilon"] for r in rows], [r["gain_over_sft"]["mean"] for r in rows],
                        yerr=[r["gain_over_sft"]["half_width"] for r in rows], marker="o", ms=3, capsize=2, label=mech,
                        color=colors[mech])
    if none is not None:
        ax.axhline(none["gain_over_sft"]["mean"], color=colors[none["mechanism"]], linestyle="--",
                   label="none (non-private)")
    ax.axhline(0.0, color="black", linestyle=":", label="SFT policy (start)")
    ax.set(xscale="log", xlabel="ε (user level, replace one user's labels)", ylabel="gold reward gain over SFT",
           title="privacy–utility (paired 95% CI)")
    if epsilons:
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0].legend(fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
