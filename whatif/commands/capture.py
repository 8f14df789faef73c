"""``whatif profile``: a training script run once per level of intrusion, and the view built from the runs.

The measuring and the hierarchy live in :mod:`whatif.collectors.xsp`; this module is the
command line over them: its arguments, and the summary it prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from whatif.collectors.xsp.levels import LEVELS
from whatif.collectors.xsp.session import profile_command
from whatif.collectors.xsp.view import TABLE_FILE, VIEW_FILE, flat_table

TOP_OPERATORS = 10


def add_parser(sub) -> None:
    """The ``profile`` subcommand, on the subparsers of ``whatif``."""
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


def run_profile(args: argparse.Namespace) -> int:
    result = profile_command(args.argv, args.levels, args.out, args.steps, args.warmup, args.rounds)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    print(f"{result['model']}: {VIEW_FILE} and {TABLE_FILE} written to {result['folder']}")
    print(_levels_table(result))
    table = flat_table(result)
    layers = table[table["level"].isin(["model", "layer"])]
    print()
    print(_shown(layers[["level", "name", "latency_ms", "calls_per_step", "measured_at_level"]]))
    operators = table[table["level"] == "operator"].nlargest(TOP_OPERATORS, "latency_ms")
    if len(operators):
        print(f"\nthe {len(operators)} slowest operators per step:")
        print(_shown(operators[["name", "parent", "latency_ms", "calls_per_step", "measured_at_level"]]))
    return 0


def _levels_table(result: dict) -> str:
    rows, not_run = [], []
    for level, info in result["overhead"].items():
        if not info["run"]:
            not_run.append(f"{level}: not run, {info['reason']}")
            continue
        rows.append({
            "level": level,
            "step ms": info["step_ms"],
            "overhead %": info["overhead_pct"],
            "CPU ms": info["cpu_step_ms"],
            "CPU overhead %": info["cpu_overhead_pct"],
            "events/step": info["events_per_step"],
            "CPU us/event": info["cpu_overhead_us_per_event"],
        })
    table = pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-")
    return "\n".join([table] + not_run)


def _shown(frame: pd.DataFrame) -> str:
    return frame.to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="-")
