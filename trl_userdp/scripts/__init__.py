"""The ``trl-userdp`` commands, one module each, as TRL's ``trl/scripts/``: :mod:`.account`, :mod:`.reward`,
:mod:`.dpo`, :mod:`.rl`, :mod:`.pipeline` and :mod:`.audit`. Each has ``make_parser(subparsers=None, prog=None)``, ``main(...)`` and
``HELP`` (its line in ``trl-userdp --help``), and runs by itself as ``python -m trl_userdp.scripts.<command>``;
:mod:`trl_userdp.cli` dispatches to them. What several commands share (the parser, data loading, the one-line errors)
is :mod:`.utils`.

This package imports none of its modules, so that ``python -m trl_userdp.scripts.<command>`` runs a module that is
not imported yet.
"""
