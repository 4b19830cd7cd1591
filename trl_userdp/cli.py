"""``trl-userdp`` command line (TRL style: one sub-command per job, arguments from dataclasses,
``--config file.yaml`` accepted through ``TrlParser``).

Bad input ends with a one-line ``trl-userdp: error: …`` and exit status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Dict, List, Optional, Sequence

from .validators import check_delta, check_epsilon, check_max_samples_per_user, check_steps, check_users_per_batch


@dataclasses.dataclass
class AccountArguments:
    """A user-level setting to calibrate. Defaults: the AUP-RLHF IMDb experiment (n = 2500 users,
    m = 10 pairs each, ε ∈ {3, 8}, δ = 1e-5, 5 epochs) with 50 users per step."""

    n_users: int = dataclasses.field(default=2500, metadata={"help": "Number of users n."})
    max_samples_per_user: int = dataclasses.field(default=10, metadata={"help": "Contribution bound m."})
    users_per_batch: float = dataclasses.field(default=50.0, metadata={"help": "Expected users per step ñ."})
    epochs: Optional[float] = dataclasses.field(default=5.0, metadata={"help": "Epochs (1/q steps each)."})
    steps: Optional[int] = dataclasses.field(default=None, metadata={"help": "Steps T (instead of epochs)."})
    delta: float = dataclasses.field(default=1e-5, metadata={"help": "Target δ."})
    epsilons: List[float] = dataclasses.field(default_factory=lambda: [1.0, 3.0, 8.0], metadata={"help": "Target ε values."})


def _walkthrough_rows(args: AccountArguments, progress: Callable) -> List[Dict[str, float]]:
    from .accountants import (
        calibrate_noise_multiplier,
        compute_epsilon,
        els_event,
        poisson_gaussian_event,
        randomized_response_noise_parameter,
    )

    q = args.users_per_batch / args.n_users
    steps = check_steps(args.steps, None if args.steps is not None else args.epochs, q)
    m = args.max_samples_per_user
    user_event = lambda s: poisson_gaussian_event(s, q, steps)  # noqa: E731 - q over users
    # Group privacy samples records at the same rate: ñ·m of the n·m records per step in expectation.
    els = lambda s: els_event(s, q, steps, m)  # noqa: E731
    rows = []
    for eps in args.epsilons:
        cal = dict(target_epsilon=eps, target_delta=args.delta, tol=1e-3)
        row = {"epsilon": eps}
        progress(f"ε={eps}: user-wise DP-SGD (RDP)")
        row["user_rdp"] = calibrate_noise_multiplier(user_event, accountant="rdp", **cal)
        progress(f"ε={eps}: user-wise DP-SGD (PLD)")
        row["user_pld"] = calibrate_noise_multiplier(user_event, accountant="pld", **cal)
        row["user_pld_replace_eps"] = compute_epsilon(
            user_event(row["user_pld"]), args.delta, accountant="pld", relation="replace"
        )
        progress(f"ε={eps}: group privacy")
        row["group_pld"] = calibrate_noise_multiplier(user_event, accountant="pld", group_size=m, **cal)
        progress(f"ε={eps}: ELS")
        row["els_pld"] = calibrate_noise_multiplier(els, accountant="pld", value_discretization_interval=1e-2, **cal)
        progress(f"ε={eps}: AUP Gaussian half")
        row["aup_half"] = calibrate_noise_multiplier(
            user_event, accountant="pld", target_epsilon=eps / 2, target_delta=args.delta / 2, tol=1e-3
        )
        row["rr_flip"] = randomized_response_noise_parameter(eps / m) / 2
        rows.append(row)
    return rows


def account(args: AccountArguments) -> int:
    """Print σ for each target ε and each mechanism in a user-level setting (SPEC §2, §4)."""
    from tqdm.auto import tqdm

    check_max_samples_per_user(args.max_samples_per_user)
    check_users_per_batch(args.users_per_batch, args.n_users)
    check_delta(args.delta, "delta")
    for e in args.epsilons:
        check_epsilon(e, "epsilons")
    q = args.users_per_batch / args.n_users
    steps = check_steps(args.steps, None if args.steps is not None else args.epochs, q)

    print("User-level DP accounting walkthrough (dp-accounting; privacy unit = one user)")
    print(
        f"  n = {args.n_users} users, m = {args.max_samples_per_user} records per user, "
        f"ñ = {args.users_per_batch:g} users per step (q = {q:.4g}), T = {steps} steps, δ = {args.delta:g}"
    )
    print("  Relation: add/remove one user, except the 'replace' column (one user's data replaced).\n")
    bar = tqdm(total=6 * len(args.epsilons), desc="calibrating", leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    rows = _walkthrough_rows(args, progress)
    bar.close()
    header = (
        f"{'ε':>5} | {'user-wise σ':>11} {'user-wise σ':>11} {'ε replace':>10} | {'group σ':>9} {'ELS σ':>8} "
        f"| {'AUP σ':>7} | {'RR flip':>8}"
    )
    sub = (
        f"{'':>5} | {'(RDP)':>11} {'(PLD)':>11} {'at PLD σ':>10} | {'(PLD)':>9} {'(PLD)':>8} "
        f"| {'ε/2,δ/2':>7} | {'per label':>8}"
    )
    print(header)
    print(sub)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['epsilon']:>5g} | {r['user_rdp']:>11.4f} {r['user_pld']:>11.4f} {r['user_pld_replace_eps']:>10.3f} "
            f"| {r['group_pld']:>9.3f} {r['els_pld']:>8.3f} | {r['aup_half']:>7.4f} | {r['rr_flip']:>8.4f}"
        )
    print(
        "\nuser-wise σ: noise multiplier of user-wise DP-SGD (clip each user's averaged gradient to C, noise σC).\n"
        "group σ: item-level DP-SGD whose (ε/m, δ/(m·e^{(m-1)ε/m})) guarantee gives (ε, δ) per user by group privacy.\n"
        "ELS σ: the same item-level DP-SGD accounted per user directly (Charles et al. 2024, mixture of Gaussians).\n"
        "AUP σ: AUP-RLHF's PrivacyAccount(ε/2, δ/2); its noise variance per coordinate is 8τ²·log(e^ε·T/δ)·σ²/ñ².\n"
        "RR flip: user-level randomized response flips each label with probability 1 − sigmoid(ε/m)."
    )
    return 0


COMMANDS: Dict[str, tuple] = {"account": (AccountArguments, account)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: trl-userdp {{{','.join(COMMANDS)}}} [--help] [options]")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trl-userdp: error: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    from trl import TrlParser

    arg_type, run = COMMANDS[name]
    parser = TrlParser(dataclass_types=[arg_type], prog=f"trl-userdp {name}")
    (args,) = parser.parse_args_and_config(args=rest)
    try:
        return run(args)
    except ValueError as err:
        print(f"trl-userdp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
