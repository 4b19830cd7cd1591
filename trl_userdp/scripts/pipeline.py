"""``trl-userdp pipeline``: the main job, the paper's controlled-sentiment experiment in miniature
(:mod:`trl_userdp.experiments.pipeline`, docs/pipeline.md).

```bash
python -m trl_userdp.scripts.pipeline --epsilons 3 8 --mechanisms none user_dpsgd
```
"""

from __future__ import annotations

import argparse
from typing import Optional

from .utils import command_parser, run_script

#: the command's line in ``trl-userdp --help``
HELP = "The paper's controlled-sentiment experiment in miniature (see trl_userdp.experiments.pipeline)."


def main(args) -> int:
    """Run the pipeline: private reward models, online RL against each, evaluation; the table printed, results and
    plot saved.

    Args:
        args: its settings (:class:`~trl_userdp.experiments.pipeline.PipelineArguments`).

    Returns:
        0.

    Raises:
        ValueError: settings out of range or an unknown mechanism.
    """
    from ..experiments.pipeline import run_pipeline  # lazy: the experiments load datasets and transformers

    run_pipeline(args)
    return 0


def make_parser(subparsers: Optional[argparse._SubParsersAction] = None, prog: Optional[str] = None):
    """The parser of ``pipeline`` (:class:`~trl_userdp.experiments.pipeline.PipelineArguments`).

    Args:
        subparsers: add it to these (see :func:`~trl_userdp.scripts.utils.command_parser`); None: its own parser.
        prog: the program name in its usage line.

    Returns:
        The parser.
    """
    from ..experiments.pipeline import PipelineArguments  # lazy, as in main

    return command_parser("pipeline", [PipelineArguments], help=HELP, subparsers=subparsers, prog=prog)


if __name__ == "__main__":
    raise SystemExit(run_script("pipeline", make_parser, main, prog="python -m trl_userdp.scripts.pipeline"))
