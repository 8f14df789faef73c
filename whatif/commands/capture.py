"""``whatif collect`` and ``whatif profile``: a training script run and recorded.

``collect`` runs a script that uses the capture API (``collectors/capture.py``) and writes its
trace bundle; ``profile`` runs it once per level of intrusion (XSP, ``collectors/xsp/``) and
builds the view of the runs. The measuring lives in ``collectors``; this module is the command
line over it: the arguments, and the summaries printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from whatif.collectors.capture import CaptureError, collect
from whatif.collectors.diagnostics import plural, report
from whatif.collectors.xsp.levels import LEVELS
from whatif.collectors.xsp.session import profile_command
from whatif.collectors.xsp.view import DISAGREEMENT_FACTOR, TABLE_FILE, VIEW_FILE, flat_table
from whatif.report.tables import levels_table, profile_table

ERRORS = (CaptureError,)
TOP_OPERATORS = 10
_WHY = {
    "noise": "their per-step times overlap, so a step was preempted or stalled in one run: "
             "profile with more --rounds or --steps on a quieter machine",
    "systematic": "beyond their step-to-step spread: the profiler's per-operator cost, or work "
                  "that differs between the runs; the layer run's figure is the one the view keeps",
}


def warn_disagreements(result: dict, where: Path) -> None:
    """One warning per verdict of :func:`~whatif.collectors.xsp.view.level_disagreements`, with
    the count of layers and the worst of them."""
    for verdict, why in _WHY.items():
        these = [d for d in result.get("disagreements") or [] if d["verdict"] == verdict]
        if these:
            worst = these[0]
            report(f"{where}: {plural(len(these), 'layer')} differ more than {DISAGREEMENT_FACTOR:g}x between the layer and operator runs "
                   f"(worst {worst['name']}: {worst['layer_ms']:.2f} ms against {worst['operator_ms']:.2f} ms); {why}")


def add_parsers(sub) -> None:
    capture = sub.add_parser(
        "collect",
        help="run a training script that uses the capture API and write its trace bundle",
        usage="whatif collect [-h] [--out BUNDLE] [--steps N] [--warmup N] -- python SCRIPT.py [ARGS ...]",
    )
    capture.add_argument("--out", type=Path, metavar="BUNDLE", help="bundle folder to write (default: SCRIPT.bundle)")
    capture.add_argument("--steps", type=int, metavar="N", help="profiled steps (default: the script's, else 5)")
    capture.add_argument("--warmup", type=int, metavar="N", help="steps before them (default: the script's, else 3)")
    capture.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the training command, after --")
    profile = sub.add_parser(
        "profile",
        help="run a training script once per profiling level (XSP) and build the hierarchical view",
        usage="whatif profile [-h] [--levels LEVELS] [--steps N] [--warmup N] [--rounds R] [--out DIR] [--json] -- python SCRIPT.py [ARGS ...]",
    )
    profile.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated, of {', '.join(LEVELS)} (default: all)")
    profile.add_argument("--steps", type=int, metavar="N", help="measured steps per level (default: the script's, else 10)")
    profile.add_argument("--warmup", type=int, metavar="N", help="steps before them (default: the script's, else 3)")
    profile.add_argument("--rounds", type=int, default=1, metavar="R",
                         help="run the levels R times, alternating, and pool their steps (default: 1)")
    profile.add_argument("--out", type=Path, metavar="DIR", help="folder for the runs and the view (default: SCRIPT.xsp)")
    profile.add_argument("--json", action="store_true", help="print the view as one JSON object instead of a summary")
    profile.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the training command, after --")


def run(args: argparse.Namespace) -> int:
    return run_collect(args) if args.command == "collect" else run_profile(args)


def run_collect(args: argparse.Namespace) -> int:
    bundle = collect(args.argv, args.out, args.steps, args.warmup)
    grads = bundle.parameters[bundle.parameters["requires_grad"]]
    clock = bundle.manifest.get("clock", {})
    error = clock.get("alignment_error_us")
    print(
        f"wrote {bundle.path}: {len(bundle.steps)} profiled steps ({bundle.steps[0]} to {bundle.steps[-1]}), "
        f"{len(grads)} parameters ({(grads['numel'] * grads['element_size']).sum() / 1e6:.1f} MB of gradients per step), "
        f"{len(bundle.layers)} layers, device {bundle.environment.get('device')}"
        + (f", hook clock within {error:.1f} us of the trace's" if error is not None else "")
    )
    return 0


def run_profile(args: argparse.Namespace) -> int:
    result = profile_command(args.argv, args.levels, args.out, args.steps, args.warmup, args.rounds)
    warn_disagreements(result, Path(result["folder"]) / VIEW_FILE)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    print(f"{result['model']}: {VIEW_FILE} and {TABLE_FILE} written to {result['folder']}")
    print(levels_table(result))
    table = flat_table(result)
    layers = table[table["level"].isin(["model", "layer"])]
    print()
    print(profile_table(layers[["level", "name", "latency_ms", "calls_per_step", "measured_at_level"]]))
    operators = table[table["level"] == "operator"].nlargest(TOP_OPERATORS, "latency_ms")
    if len(operators):
        print(f"\nthe {len(operators)} slowest operators per step:")
        print(profile_table(operators[["name", "parent", "latency_ms", "calls_per_step", "measured_at_level"]]))
    return 0
