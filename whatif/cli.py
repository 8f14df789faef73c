"""The ``whatif`` command: the parser, and each command handed to the module that owns it.

The commands live in ``whatif/commands/`` (and the lab's in ``lab/cli.py``), a module per group,
each with ``add_parsers(subparsers)`` and ``run(args)``. A new group is one line in
:data:`COMMAND_MODULES`, which names its commands so that only their module is imported. Every
error a user can cause is one line on stderr and exit status 2. Input the tool could leave out
and still answer (``collectors/diagnostics.py``) is one warning line per class on stderr, with
its count; ``--strict``, before or after the command, makes the first of them an error.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from whatif.collectors.cache_folder import is_held
from whatif.collectors.diagnostics import Diagnostics, collecting
from whatif.collectors.tracefile import read_ahead

#: The command modules, in the order ``whatif --help`` lists their commands, with the commands
#: each adds. Only the module of the command given is imported (``whatif replay`` does not import
#: the cluster simulation); ``whatif --help`` and a mistyped command import them all.
COMMAND_MODULES = {
    "whatif.commands.simulate": ("replay", "simulate"),
    "whatif.commands.perfmodel": ("perfmodel",),
    "whatif.commands.explain": ("critical-path", "overheads"),
    "whatif.commands.predict": ("predict",),
    "whatif.commands.advise": ("advise",),
    "whatif.commands.collective": ("collective", "calibrate"),
    "whatif.commands.capture": ("collect", "profile"),
    "whatif.lab.cli": ("lab", "validate"),
}
#: What any command may raise for a mistake in its input, by module; a command module adds its
#: own as ``ERRORS``. A module the command did not import cannot have raised its error.
ERRORS = {
    "whatif.collectors.kineto": "TraceError",
    "whatif.sim.graph": "GraphError",
    "whatif.commands": "UsageError",
    "whatif.topology": "TopologyError",
    "whatif.sim.perfmodels.models": "PerfModelError",
    "whatif.collectors.diagnostics": "StrictError",
}
#: The commands whose first positional argument is a trace file, each with its options that take a
#: value (so that ``--timeline OUT.json.gz`` is not taken for the trace): run as the process's own
#: command, the file is read and decompressed on a thread (``collectors/tracefile.py``) while the
#: command's modules import. Only a file that exists, and whose graph the graph cache does not
#: hold (``collectors/cache_folder.py``), is read ahead; the command reads its trace as
#: ever, taking those bytes where they are of its path. A test holds the options to the parser's.
READ_AHEAD = {
    "replay": ("--iteration", "--timeline"),
    "simulate": ("--batch-size", "--from-batch-size", "--iteration", "--optimization", "--perfmodel", "--predict-from",
                 "--profiler-overhead", "--remove", "--scale", "--timeline"),
    "critical-path": ("--iteration", "--timeline"),
    "overheads": ("--csv",),
}
#: The same for the commands whose first positional argument is a scenario file: the trace it
#: names on a line of its own (``trace: PATH``, relative to the scenario) is read ahead, where it
#: is a file; the scenario itself is read as ever (a trace it names otherwise is not read ahead).
SCENARIO_READ_AHEAD = {"predict": ("--address", "--csv", "--executor", "--jobs", "--plot", "--timeline")}
_SCENARIO_TRACE = re.compile(r"""^trace:[ \t]*(["']?)([^"'#\r\n]+?)\1[ \t]*(?:#.*)?$""", re.MULTILINE)
_STRICT_HELP = "make every warning (input the tool could not use) an error, exit status 2"


def _parser(argv: Sequence[str] = ()) -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and the module that runs each command: the parser of the command ``argv``
    names, or, where it names none of them, of every command."""
    parser = argparse.ArgumentParser(
        prog="whatif",
        description="Predict DNN training iteration time from a PyTorch profiler trace, and what "
        "an optimization would change.",
    )
    parser.add_argument("--strict", action="store_true", help=_STRICT_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    owner = {}
    command = next((a for a in argv if a in ("-h", "--help") or not a.startswith("-")), None)
    named = [m for m, commands in COMMAND_MODULES.items() if command in commands]
    for name in named or COMMAND_MODULES:
        module = importlib.import_module(name)
        before = set(sub.choices)
        module.add_parsers(sub)
        owner.update((command, module) for command in set(sub.choices) - before)
    for command in _leaf_parsers(sub):  # also after the command: whatif replay T --strict
        command.add_argument("--strict", action="store_true", default=argparse.SUPPRESS, help=_STRICT_HELP)
    return parser, owner


def _input_errors(module) -> tuple:
    """The errors a user's mistake raises: those of the modules imported so far, and ``module``'s."""
    loaded = tuple(getattr(sys.modules[m], name) for m, name in ERRORS.items() if m in sys.modules)
    return loaded + tuple(getattr(module, "ERRORS", ()))


def _leaf_parsers(sub) -> list:
    """Every command's parser, those of command groups (``perfmodel fit``) included."""
    leaves = []
    for parser in dict.fromkeys(sub.choices.values()):
        groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += [leaf for group in groups for leaf in _leaf_parsers(group)] if groups else [parser]
    return leaves


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command ``argv`` names (default: this process's arguments) and return its exit
    status. Run as the process's own command (no ``argv``), a command its module lists in
    ``QUICK_EXIT`` ends the process here once its output is flushed: the interpreter's teardown,
    freeing every object the command made one by one, is a tenth of a replay's time on a large
    trace, and such a command leaves nothing for it to do (its exit handlers run first, and it
    leaves no temporary files).
    Such a command also runs, its imports included, without Python's cyclic garbage collector:
    what it makes lives until the process ends, so the collector's passes over the objects of a
    large trace and of the imported libraries would find next to nothing to free. A command
    whose module's ``ends_quickly(args)`` says so ends the process the same way, with the
    collector on (a grid's simulations make cycles that it frees as they go)."""
    own = quick = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    collector_on = gc.isenabled()
    if quick:
        gc.disable()  # on again below for a command that does not end the process itself
        _read_ahead(argv)
    parser, owner = _parser(argv)
    args = parser.parse_args(argv)
    module = owner[args.command]
    quick = quick and args.command in getattr(module, "QUICK_EXIT", ())
    if collector_on and not quick:
        gc.enable()
    status = _run(module, args)
    if quick or (own and getattr(module, "ends_quickly", lambda _: False)(args)):
        _exit_now(status)  # returns under a tracer or profiler
    return status


def _read_ahead(argv: Sequence[str]) -> None:
    """Start reading the trace of a :data:`READ_AHEAD` command, where ``argv`` names one: the
    first word after the command that is neither an option nor an option's value."""
    command, valued = None, ()
    words = iter(argv)
    for word in words:
        if word in valued:
            next(words, None)  # the option's value
        elif word.startswith("-"):
            continue  # a flag, or --option=value
        elif command is None:
            if word not in READ_AHEAD and word not in SCENARIO_READ_AHEAD:
                return
            command, valued = word, READ_AHEAD.get(word) or SCENARIO_READ_AHEAD[word]
        else:
            trace = _scenario_trace(word) if command in SCENARIO_READ_AHEAD else word
            if trace is not None and os.path.isfile(trace) and not is_held(trace):  # a cached graph needs no bytes
                read_ahead(trace)
            return


def _scenario_trace(scenario: str) -> Optional[str]:
    """The trace file the scenario file ``scenario`` names on a line of its own, as the scenario's
    reader will name it (relative to the scenario's folder); None where it names none so, or is
    not a small text file (a scenario is at most 1 MB: the reader refuses more)."""
    try:
        if os.path.getsize(scenario) > 1_000_000:
            return None
        with open(scenario, encoding="utf-8") as f:
            found = _SCENARIO_TRACE.search(f.read())
    except (OSError, UnicodeDecodeError):
        return None
    if found is None:
        return None
    given = Path(found.group(2))
    return str(given if given.is_absolute() else Path(scenario).parent / given)


def _exit_now(status: int) -> None:
    """End the process with ``status`` once the exit handlers have run (a library's temporary
    folder removed: matplotlib makes one where its configuration folder cannot be written) and
    stdout and stderr are flushed, without freeing every object. Under a tracer or a profiler
    (coverage, ``python -m cProfile``), which write their data at the teardown, it returns."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream was closed
            pass
    os._exit(status)


def _run(module, args: argparse.Namespace) -> int:
    diagnostics = Diagnostics(strict=args.strict, sink=lambda text: print(f"whatif: warning: {text}", file=sys.stderr))
    try:
        with collecting(diagnostics):
            return module.run(args)
    except _input_errors(module) as err:
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
