"""The ``whatif`` command: the parser, and each command handed to the module that owns it.

The commands live in ``whatif/commands/`` (and the lab's in ``lab/cli.py``), a module per group,
each with ``add_parsers(subparsers)`` and ``run(args)``. A new group is one line in
:data:`COMMAND_MODULES`. Every error a user can cause is one line on stderr and exit status 2.
Input the tool could leave out and still answer (``collectors/diagnostics.py``) is one warning
line per class on stderr, with its count; ``--strict``, before or after the command, makes the
first of them an error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from whatif.collectors.diagnostics import Diagnostics, StrictError, collecting
from whatif.collectors.kineto import TraceError
from whatif.commands import UsageError, advise, capture, collective, explain, perfmodel, predict, simulate
from whatif.lab import cli as lab_cli
from whatif.sim.graph import GraphError
from whatif.sim.perfmodels.models import PerfModelError
from whatif.topology import TopologyError

#: The command modules, in the order ``whatif --help`` lists their commands.
COMMAND_MODULES = (simulate, perfmodel, explain, predict, advise, collective, capture, lab_cli)
#: What any command may raise for a mistake in its input; a module adds its own as ``ERRORS``.
ERRORS = (TraceError, GraphError, UsageError, TopologyError, PerfModelError, StrictError)
_STRICT_HELP = "make every warning (input the tool could not use) an error, exit status 2"


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and the module that runs each command."""
    parser = argparse.ArgumentParser(
        prog="whatif",
        description="Predict DNN training iteration time from a PyTorch profiler trace, and what "
        "an optimization would change.",
    )
    parser.add_argument("--strict", action="store_true", help=_STRICT_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    owner = {}
    for module in COMMAND_MODULES:
        before = set(sub.choices)
        module.add_parsers(sub)
        owner.update((command, module) for command in set(sub.choices) - before)
    for command in _leaf_parsers(sub):  # also after the command: whatif replay T --strict
        command.add_argument("--strict", action="store_true", default=argparse.SUPPRESS, help=_STRICT_HELP)
    return parser, owner


def _leaf_parsers(sub) -> list:
    """Every command's parser, those of command groups (``perfmodel fit``) included."""
    leaves = []
    for parser in dict.fromkeys(sub.choices.values()):
        groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += [leaf for group in groups for leaf in _leaf_parsers(group)] if groups else [parser]
    return leaves


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, owner = _parser()
    args = parser.parse_args(argv)
    errors = ERRORS + tuple(error for module in COMMAND_MODULES for error in getattr(module, "ERRORS", ()))
    diagnostics = Diagnostics(strict=args.strict, sink=lambda text: print(f"whatif: warning: {text}", file=sys.stderr))
    try:
        with collecting(diagnostics):
            return owner[args.command].run(args)
    except errors as err:
        print(f"whatif: error: {err}", file=sys.stderr)
    except BrokenPipeError:
        return 0  # the reader of our output went away (| head): nothing left to say
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        print(f"whatif: error: {where}{err.strerror or err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("whatif: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
