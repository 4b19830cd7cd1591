"""``trl-userdp`` command line: a thin dispatcher over :mod:`trl_userdp.scripts`, one module per command, as TRL's
``trl`` over ``trl/scripts`` (arguments from dataclasses, ``--config file.yaml`` accepted through ``TrlParser``).

Bad input ends with a one-line ``trl-userdp: error: …`` and exit status 2, never a traceback
(:func:`trl_userdp.scripts.utils.run_script`).
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Dict, Optional, Sequence

from .scripts import account, audit, dpo, grpo, pipeline, reward, rl
from .scripts.utils import run_script

#: command -> its module in :mod:`trl_userdp.scripts` (``make_parser``, ``main`` and ``HELP``), in ``--help`` order
COMMANDS: Dict[str, ModuleType] = {"account": account, "reward": reward, "dpo": dpo, "rl": rl, "grpo": grpo,
                                   "pipeline": pipeline, "audit": audit}


def _help() -> str:
    """The top-level help: one line per command (its ``HELP``), as TRL's ``trl --help``."""
    parser = argparse.ArgumentParser(
        prog="trl-userdp", description="User-level differential privacy for TRL's trainers.",
        epilog="`trl-userdp <command> --help` lists a command's options; `--config file.yaml` sets any of them.")
    commands = parser.add_subparsers(title="commands", metavar="<command>")
    for name, module in COMMANDS.items():
        commands.add_parser(name, help=module.HELP)
    return parser.format_help()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command: ``trl-userdp <command> [options]``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 after a one-line error (an unknown command, bad input, a missing package).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trl-userdp: error: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    script = COMMANDS[name]
    return run_script(name, script.make_parser, script.main, rest, prog=f"trl-userdp {name}")


if __name__ == "__main__":
    raise SystemExit(main())
