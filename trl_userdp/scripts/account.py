"""``trl-userdp account``: the noise each registered mechanism needs for each target ε in a user-level setting, from
the same accounting the engines train with (docs/mechanisms.md).

```bash
python -m trl_userdp.scripts.account --n_users 2500 --max_samples_per_user 10 --users_per_batch 50 --epsilons 3 8
```

Every mechanism in :data:`~trl_userdp.mechanisms.MECHANISM_REGISTRY` contributes its columns
(:meth:`~trl_userdp.mechanisms.Mechanism.walkthrough`) and its notes, in registration order: a mechanism registered
from outside the package shows up with no change here.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

from ..validators import (
    check_delta,
    check_epsilon,
    check_max_samples_per_user,
    check_positive,
    check_steps,
    check_users_per_batch,
)
from .utils import command_parser, run_script

#: the command's line in ``trl-userdp --help``
HELP = "Print σ for each target ε and each mechanism in a user-level setting (docs/mechanisms.md)."


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
    public_users_per_batch: Optional[float] = dataclasses.field(default=None, metadata={
        "help": "Expected users per step ñ_pub of a run on public users that chooses the learning rate: prints, for "
                "user-wise DP-SGD, the noise on the averaged gradient σC/ñ and the σ_pub that gives the public run the "
                "same noise (docs/users_scaling.md, 'Set-up')."})


def walkthrough_rows(setting, epsilons: Sequence[float], mechanisms: Optional[Sequence[type]] = None,
                     progress: Optional[Callable[[str], None]] = None) -> List[Tuple[tuple, ...]]:
    """Each mechanism's columns for each target ε, from the accounting events (and grids) the engines train with.

    Args:
        setting: n, m, ñ, T and δ (:class:`~trl_userdp.mechanisms.AccountingSetting`).
        epsilons: the target ε values.
        mechanisms: the mechanism classes, in table order (default: the registry's, in registration order).
        progress: called with what is about to be calibrated, once per (ε, mechanism).

    Returns:
        One row per ε: for each mechanism, the tuple of its
        :class:`~trl_userdp.mechanisms.WalkthroughColumn` (empty for a mechanism with nothing to show).
    """
    # lazy: the mechanisms load torch, which `trl-userdp --help` does not need
    from ..mechanisms import MECHANISM_REGISTRY

    mechanisms = list(MECHANISM_REGISTRY.values()) if mechanisms is None else list(mechanisms)
    rows = []
    for epsilon in epsilons:
        row = []
        for mechanism in mechanisms:
            if progress is not None:
                progress(f"ε={epsilon:g}: {mechanism.name}")
            row.append(tuple(mechanism.walkthrough(epsilon, setting)))
        rows.append(tuple(row))
    return rows


def format_table(epsilons: Sequence[float], rows: Sequence[Tuple[tuple, ...]]) -> List[str]:
    """The walkthrough's table: a header line, a line of the columns' details, a rule, one line per ε.

    Args:
        epsilons: the target ε of each row.
        rows: :func:`walkthrough_rows`' output.

    Returns:
        The lines: ε, then each mechanism's columns (mechanisms with none are left out), mechanisms separated by
        ``|``; each column as wide as its header, detail and values, values right-aligned with their ``digits``.

    Raises:
        ValueError: a mechanism whose columns differ between two ε (a bug of its ``walkthrough``).
    """
    first = rows[0] if rows else ()
    for epsilon, row in zip(epsilons, rows):
        for group, reference in zip(row, first):
            if [(c.header, c.detail) for c in group] != [(c.header, c.detail) for c in reference]:
                raise ValueError(f"a mechanism's walkthrough columns differ between ε={epsilons[0]:g} and "
                                 f"ε={epsilon:g}: {[c.header for c in reference]} vs {[c.header for c in group]}.")
    shown = [i for i, group in enumerate(first) if group]
    cells = [[[f"{c.value:.{c.digits}f}" for c in row[i]] for i in shown] for row in rows]
    widths = [[max(len(c.header), len(c.detail), *(len(r[k][j]) for r in cells)) for j, c in enumerate(first[i])]
              for k, i in enumerate(shown)]

    def line(eps: str, texts: Sequence[Sequence[str]]) -> str:
        groups = [" ".join(f"{t:>{w}}" for t, w in zip(group, width)) for group, width in zip(texts, widths)]
        return " | ".join([f"{eps:>5}", *groups])

    header = line("ε", [[c.header for c in first[i]] for i in shown])
    lines = [header, line("", [[c.detail for c in first[i]] for i in shown]), "-" * len(header)]
    lines += [line(f"{epsilon:g}", texts) for epsilon, texts in zip(epsilons, cells)]
    return lines


def main(args: AccountArguments) -> int:
    """Print σ for each target ε and each registered mechanism in a user-level setting, then the columns' notes.

    Args:
        args: the setting and the target ε values.

    Returns:
        0.

    Raises:
        ValueError: a setting out of range (ε, δ, m, ñ > n, steps).
    """
    from tqdm.auto import tqdm  # lazy, as the mechanisms below

    from ..mechanisms import MECHANISM_REGISTRY, AccountingSetting

    check_max_samples_per_user(args.max_samples_per_user)
    check_users_per_batch(args.users_per_batch, args.n_users)
    check_delta(args.delta, "delta")
    for e in args.epsilons:
        check_epsilon(e, "epsilons")
    if args.public_users_per_batch is not None:
        check_positive(args.public_users_per_batch, "public_users_per_batch")
    q = args.users_per_batch / args.n_users
    steps = check_steps(args.steps, None if args.steps is not None else args.epochs, q)
    setting = AccountingSetting(n_users=args.n_users, max_samples_per_user=args.max_samples_per_user,
                                users_per_batch=args.users_per_batch, steps=steps, delta=args.delta)

    print("User-level DP accounting walkthrough (dp-accounting; privacy unit = one user)")
    print(
        f"  n = {args.n_users} users, m = {args.max_samples_per_user} records per user, "
        f"ñ = {args.users_per_batch:g} users per step (q = {q:.4g}), T = {steps} steps, δ = {args.delta:g}"
    )
    print("  Relation: add/remove one user, except the 'replace' column (one user's data replaced).\n")
    mechanisms = list(MECHANISM_REGISTRY.values())
    bar = tqdm(total=len(mechanisms) * len(args.epsilons), desc="calibrating", leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    rows = walkthrough_rows(setting, args.epsilons, mechanisms, progress)
    bar.close()
    print("\n".join(format_table(args.epsilons, rows)))
    notes = [note for mechanism in mechanisms for note in mechanism.walkthrough_notes]
    if notes:
        print("\n" + "\n".join(notes))
    if args.public_users_per_batch is not None:
        print("\n" + "\n".join(step_size_lines(args, setting)))
    return 0


def step_size_lines(args: AccountArguments, setting) -> List[str]:
    """The step-size rule's numbers for user-wise DP-SGD at each target ε: σ (PLD), the noise on the averaged gradient
    σC/ñ in units of C, and the fixed σ_pub a public-user run at ñ_pub needs for the same noise
    (:mod:`trl_userdp.step_size`).

    Args:
        args: the command's arguments (``public_users_per_batch`` set).
        setting: the :class:`~trl_userdp.mechanisms.AccountingSetting`.

    Returns:
        The lines to print.
    """
    from ..accountants import PoissonGaussian
    from ..step_size import averaged_gradient_noise, public_noise_multiplier

    lines = [f"Step size (user-wise DP-SGD; choose it on public users at this noise, ñ_pub = "
             f"{args.public_users_per_batch:g} per step, with the private run's clip):",
             f"{'ε':>5} | {'σ (PLD)':>8} | {'σC/ñ (× C)':>11} | {'σ_pub':>8}"]
    for epsilon in args.epsilons:
        sigma = PoissonGaussian().calibrate(epsilon, setting.delta, accountant="pld", tol=1e-3,
                                            sample_rate=setting.sample_rate, steps=setting.steps)
        lines.append(f"{epsilon:>5g} | {sigma:>8.4f} | {averaged_gradient_noise(sigma, 1.0, args.users_per_batch):>11.3g}"
                     f" | {public_noise_multiplier(sigma, args.users_per_batch, args.public_users_per_batch):>8.4f}")
    lines.append("Train each candidate learning rate on public users with --noise_multiplier σ_pub (no target_epsilon) "
                 "and keep the one their held-out pairs score best (trl_userdp.step_size.choose_learning_rate).")
    return lines


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``account`` (:class:`AccountArguments`).

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser.
    """
    return command_parser("account", [AccountArguments], help=HELP, subparsers=subparsers, prog=prog)


if __name__ == "__main__":
    raise SystemExit(run_script("account", make_parser, main, prog="python -m trl_userdp.scripts.account"))
