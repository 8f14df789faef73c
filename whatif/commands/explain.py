"""The commands that explain one trace rather than predict a change to it: ``whatif overheads``
(the five CPU overheads per operator type) and ``whatif critical-path`` (what each simulated
iteration's longest chain is made of, optionally marked in the timeline)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import pandas as pd

from whatif.collectors.load import load_trace
from whatif.collectors.tracefile import TraceError
from whatif.pipeline import Request, predict
from whatif.report.critical_path import path_tasks
from whatif.report.overheads import LAUNCH_TYPES, OVERHEAD_TYPES, measure_overheads, per_operator_table, summary_table
from whatif.report.tables import SHOWN_ROWS, json_records, named_table
from whatif.report.timeline import check_timeline_path, write_atomically, write_marked_timeline
from whatif.sim.critical_path import PATH_KINDS, iteration_critical_paths

from . import add_trace_options


def add_parsers(sub) -> None:
    critical = sub.add_parser("critical-path", help="what each simulated iteration's critical path is made of")
    add_trace_options(critical)
    overheads = sub.add_parser("overheads", help="the five CPU overheads around operators, per operator type")
    overheads.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder")
    overheads.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    overheads.add_argument("--csv", type=Path, metavar="OUT.csv", help="every operator type's distributions as CSV")


def run(args: argparse.Namespace) -> int:
    return run_overheads(args) if args.command == "overheads" else run_critical_path(args)


# -- whatif overheads -----------------------------------------------------------------------------


def run_overheads(args: argparse.Namespace) -> int:
    overheads = measure_overheads(load_trace(args.trace))
    if not overheads.operators:
        raise TraceError(args.trace, "no top-level operators (cpu_op events) to measure the overheads around; "
                                     "was the profiler's window empty (a schedule whose trace was never exported)?")
    if args.csv is not None:
        if Path(args.csv).resolve() == Path(args.trace).resolve():
            raise OSError(0, "refusing to overwrite the input trace with the table", str(args.csv))
        write_atomically(args.csv, overheads.by_operator().to_csv(index=False).encode())
    if args.json:
        out = {
            "trace": str(args.trace),
            "operators": overheads.operators,
            "launch_calls": overheads.launches,
            "launch_types_apply": overheads.has_launches,
            "types": OVERHEAD_TYPES,
            "summary": json_records(overheads.summary()),
            "by_operator": json_records(overheads.by_operator()),
        }
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{args.trace}: {overheads.operators} top-level operators, {overheads.launches} launch calls")
    print(summary_table(overheads))
    if not overheads.has_launches:
        print(f"{', '.join(LAUNCH_TYPES)} do not apply: the trace launches nothing (a CPU-only trace)")
    print(f"\nmedian us per operator type (the {SHOWN_ROWS} with the most overhead; --csv or --json for all):")
    print(per_operator_table(overheads))
    if args.csv is not None:
        print(f"table written to {args.csv}")
    return 0


# -- whatif critical-path -------------------------------------------------------------------------


def run_critical_path(args: argparse.Namespace) -> int:
    """The replay's critical paths: the trace as measured, the profiler's overhead kept."""
    if args.timeline is not None:
        check_timeline_path(args.timeline, protect=(args.trace,))
    replay = predict(Request(args.trace, args.iteration, remove_profiler_overhead=False))
    report, schedule = replay.report, replay.schedule
    spans = report.assign(thread=replay.study.iterations["thread"].to_numpy())
    paths = iteration_critical_paths(schedule, spans)
    if args.timeline is not None:
        write_marked_timeline(schedule, paths, args.timeline, protect=(args.trace,))
    kinds_ms = pd.DataFrame([path.by_kind() / 1e3 for path in paths]).reset_index(drop=True)
    top = path_tasks(schedule, paths)
    if args.json:
        iterations = [
            {"name": name, "predicted_ms": predicted, "tasks_on_path": len(path.tasks), "kinds_ms": kinds}
            for name, predicted, path, kinds in zip(
                report["name"], report["predicted_ms"], paths, kinds_ms.to_dict(orient="records")
            )
        ]
        out = {"trace": str(args.trace), "kinds": list(PATH_KINDS), "iterations": iterations, "top_tasks": json_records(top)}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{args.trace}: the critical path of each simulated iteration, ms of each kind")
    table = pd.concat([report[["name", "predicted_ms"]].rename(columns={"name": "iteration", "predicted_ms": "predicted ms"}), kinds_ms], axis=1)
    print(named_table(table, ("iteration",)))
    print(f"\nthe {SHOWN_ROWS} tasks with the most time on the paths (all iterations):")
    shown = top.head(SHOWN_ROWS).rename(columns={"ms": "ms on path", "share_pct": "% of paths", "count": "times"})
    print(named_table(shown, ("name", "kind")))
    if args.timeline is not None:
        print(f"timeline written to {args.timeline} (critical-path tasks have args.critical = true)")
    return 0
