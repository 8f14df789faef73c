"""``whatif replay`` and ``whatif simulate``: one trace predicted for one worker.

``replay`` simulates the trace's graph as it is, the profiler's overhead kept, and holds every
iteration against the measured one. ``simulate`` asks the pipeline for what-ifs (optimizations,
scalings, removals) and a batch size, and reports each iteration beside the unchanged job's. As
every prediction does, it takes the profiler's overhead out of a bundle that timed plain steps
(``--profiler-overhead keep`` leaves it in), from the what-if and the unchanged job alike, so
the speed-up is the what-if's alone.

Given a job's per-rank traces (a folder of them, or several files), both build the job
(``collectors/ranks.py``, ``sim/multirank.py``: the ranks joined at their collectives), apply the
what-ifs to every rank, and report each rank's iterations.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from whatif.collectors.diagnostics import plural, warn
from whatif.collectors.ranks import is_job, load_traces
from whatif.report.intervals import LEVEL, describe
from whatif.report.iterations import iteration_report, steady_median
from whatif.report.tables import iteration_table, json_number, json_records
from whatif.sim.graph import GraphError
from whatif.sim.passes.registry import OPTIMIZATIONS, optimization_name, parse_optimization
from whatif.study import TraceStudy

from . import UsageError, add_trace_options

if TYPE_CHECKING:
    from whatif.pipeline import Prediction, Request

#: The commands whose process may end without the interpreter's teardown (``whatif.cli.main``):
#: they register nothing to run at exit and leave no temporary files.
QUICK_EXIT = ("replay",)

# The pipeline (and with it the cluster simulation), the operator models, the multi-rank job and
# the timeline writer (with the critical path) are imported by the functions that use them, so
# that ``whatif replay`` of one trace without ``--timeline`` imports none of them.


def add_parsers(sub) -> None:
    replay = sub.add_parser("replay", help="simulate the unmodified trace: measured against predicted")
    add_trace_options(replay, ranks=True)
    simulate = sub.add_parser("simulate", help="apply what-ifs to the trace's graph and predict")
    add_trace_options(simulate, ranks=True)
    simulate.add_argument(
        "--optimization",
        action="append",
        default=[],
        metavar="NAME",
        help=f"one of {', '.join(OPTIMIZATIONS)} (faster-gpu=K for a K times faster GPU, gradient-compression=K for K times fewer bytes); repeatable",
    )
    simulate.add_argument("--scale", action="append", default=[], metavar="PATTERN=FACTOR", help="scale matching tasks")
    simulate.add_argument("--remove", action="append", default=[], metavar="PATTERN", help="remove matching tasks")
    simulate.add_argument("--batch-size", type=int, metavar="B", help="rebuild the iteration at batch size B (operator performance models)")
    simulate.add_argument("--from-batch-size", "--predict-from", dest="from_batch_size", type=int, metavar="B0",
                          help="the batch size the trace was captured at (default: the bundle's, else inferred)")
    simulate.add_argument("--perfmodel", type=Path, metavar="MODELS.json",
                          help="operator models for --batch-size (default: this machine's, `whatif perfmodel fit --cache`)")
    simulate.add_argument("--profiler-overhead", choices=("remove", "keep"), default="remove",
                          help="take the profiler's cost out where a bundle timed plain steps (default), or keep it")


def run(args: argparse.Namespace) -> int:
    if args.command == "simulate":
        _check_arguments(args)
    if args.timeline is not None:
        from whatif.report.timeline import check_timeline_path

        check_timeline_path(args.timeline, protect=tuple(args.trace))
    if is_job(args.trace):
        return run_job(args)
    args.trace = args.trace[0]
    if args.command == "replay":  # the trace's own graph simulated: what predict does with no change asked
        study = TraceStudy.from_trace(args.trace, args.iteration)
        schedule, report, what = study.replay, study.replay_report(), {}
    else:
        from whatif.pipeline import predict

        try:
            prediction = predict(_simulate_request(args))
        except GraphError as err:  # an optimization this trace cannot take, a graph that cannot be scheduled
            text = str(err)
            raise UsageError(text if text.startswith(str(args.trace)) else f"{args.trace}: {text}") from None
        schedule, report, what = prediction.schedule, prediction.speedup_report(), _what_was_asked(args, prediction)
        _say_why_it_gains_little(args, prediction, report)
    if args.timeline is not None:
        from whatif.report.timeline import write_timeline

        write_timeline(schedule, args.timeline, protect=(args.trace,))
    summary = {
        "median_measured_ms": float(report["measured_ms"].median()),
        "median_predicted_ms": float(report["predicted_ms"].median()),
        # what whatif predict reports for 1x1: the median without the first and last iterations
        "steady_measured_ms": steady_median(report["measured_ms"]),
        "steady_predicted_ms": steady_median(report["predicted_ms"]),
        "tasks": len(schedule.graph.tasks),
        "edges": len(schedule.graph.edges),
    }
    if args.command == "simulate":  # a prediction: its interval (replay holds the trace's own times)
        low_ms, high_ms = prediction.iteration_interval
        summary.update(steady_predicted_ms_low=json_number(low_ms), steady_predicted_ms_high=json_number(high_ms),
                       interval_level=LEVEL)
    if args.json:
        out = {"trace": str(args.trace), "iterations": json_records(report), "summary": summary, **what}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        resources = int(schedule.graph.tasks["resource"].nunique())
        # a resource runs its tasks in order without an edge: the edges are what crosses resources
        print(f"{args.trace}: {summary['tasks']} tasks on {plural(resources, 'thread or stream', 'threads and streams')}, "
              f"{summary['edges']} dependencies across them")
        print(iteration_table(report))
        if args.command == "simulate":
            print(f"steady iteration: {describe(prediction.iteration_ms, low_ms, high_ms)}")
        if args.timeline is not None:
            print(f"timeline written to {args.timeline}")
    return 0



def run_job(args: argparse.Namespace) -> int:
    """``replay`` / ``simulate`` of a multi-rank job: every rank's iterations."""
    from whatif.pipeline import WhatIf
    from whatif.report.ranks import job_json, rank_reports
    from whatif.sim.multirank import build_job

    if args.command == "simulate" and args.batch_size is not None:
        raise UsageError("--batch-size: a multi-rank job cannot be rebatched yet; give one rank's trace")
    job = build_job(load_traces(args.trace), args.iteration)
    for path, why in job.skipped:
        warn(path, 1, f"skipped, {why}")
    replay = schedule = job.replay()
    what = {}
    if args.command == "simulate":
        what_if = WhatIf(optimizations=args.optimization, scale=[_parse_scale(s) for s in args.scale], remove=args.remove)
        schedule = job.simulate(what_if.apply(job.graph))
        what = {"optimizations": list(args.optimization), "scale": list(args.scale), "remove": list(args.remove)}
    reports = rank_reports(job, schedule, replay if args.command == "simulate" else None)
    if args.timeline is not None:
        from whatif.report.timeline import write_timeline

        write_timeline(schedule, args.timeline, protect=tuple(r.path for r in job.ranks))
    if args.json:
        out = {"traces": [str(p) for p in args.trace], **job_json(job, reports, schedule), **what}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    for report in reports:
        print(f"rank {report.rank}: {report.trace}")
        print(iteration_table(report.iterations))
    print(f"{len(reports)} ranks joined at {len(job.collectives)} collectives; "
          f"clocks aligned within {max(abs(v) for v in job.clock_offsets_us.values()):.1f} us")
    if args.timeline is not None:
        print(f"timeline written to {args.timeline}")
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Every what-if argument checked before any trace is read or model loaded."""
    for option, value in (("--batch-size", args.batch_size), ("--from-batch-size", args.from_batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"{option} {value}: expected a positive whole number")
    for spec in args.optimization:
        try:
            parse_optimization(spec)
        except GraphError as err:
            raise UsageError(str(err)) from None
    for spec in args.scale:
        _parse_scale(spec)
    for pattern in args.remove:
        try:
            re.compile(pattern)
        except re.error as err:
            raise UsageError(f"--remove {pattern!r}: not a valid regular expression ({err})") from None
    if args.perfmodel is not None and not args.perfmodel.is_file():
        raise UsageError(f"--perfmodel {args.perfmodel}: no such file")


def _simulate_request(args: argparse.Namespace) -> Request:
    from whatif.pipeline import Request, WhatIf

    from .perfmodel import load_for_cli

    what_if = WhatIf(optimizations=args.optimization, scale=[_parse_scale(s) for s in args.scale], remove=args.remove)
    models = load_for_cli(args.perfmodel) if args.batch_size is not None else None
    return Request(
        args.trace,
        args.iteration,
        remove_profiler_overhead=args.profiler_overhead == "remove",
        batch_size=args.batch_size,
        traced_batch_size=args.from_batch_size,
        perfmodel=models,
        what_if=what_if,
    )


def _what_was_asked(args: argparse.Namespace, prediction: Prediction) -> dict:
    """The what-ifs, and what the batch size's change did, for the JSON (the change also on
    stderr beside the table)."""
    what = {"optimizations": list(args.optimization), "scale": list(args.scale), "remove": list(args.remove)}
    change = prediction.batch_change
    if change is not None:
        if not args.json:
            print(change.describe(), file=sys.stderr)
        what["batch_size"] = {"from": change.from_batch, "to": change.to_batch, "from_source": change.batch_source,
                              "scaled_operator_calls": change.scaled_units, "unmodelled": dict(change.unmodelled)}
    overhead = prediction.profiler_overhead
    if overhead is not None:
        if not args.json:
            print(overhead.describe(), file=sys.stderr)
        what["profiler_overhead"] = asdict(overhead)
    return what


#: a what-if whose steady speed-up is below this is explained (on stderr)
LITTLE_GAIN = 1.02


def _say_why_it_gains_little(args: argparse.Namespace, prediction: Prediction, report) -> None:
    """Where the what-ifs speed the steady step up by less than 2 %, say beside the table (on
    stderr, as the profiler's overhead is said) what bounds
    the step, from the unchanged job's critical paths (``report.critical_path.bound_verdict``):
    a speed-up of 1.00 alone does not say that the step was CPU-bound all along."""
    from whatif.report.critical_path import bound_verdict

    if args.json or not (args.optimization or args.scale or args.remove):
        return
    speedup = steady_median(report["replay_ms"]) / steady_median(report["predicted_ms"])
    if not speedup < LITTLE_GAIN:
        return
    unchanged = prediction.unchanged_schedule
    spans = iteration_report(unchanged, prediction.study.iterations).assign(
        thread=prediction.study.iterations["thread"].to_numpy())
    changes = [optimization_name(o) for o in args.optimization]
    changes += [f"--scale {s} changes only the tasks it matches" for s in args.scale]
    changes += [f"--remove {r} removes only the tasks it matches" for r in args.remove]
    print(f"whatif: note: speed-up {speedup:.2f} (under {100 * (LITTLE_GAIN - 1):.0f} %): "
          f"{bound_verdict(unchanged, spans, changes)}", file=sys.stderr)


def _parse_scale(spec: str) -> tuple[str, float]:
    pattern, sep, factor = spec.rpartition("=")
    if not sep or not pattern:
        raise UsageError(f"--scale {spec!r}: expected PATTERN=FACTOR, e.g. 'conv=0.5'")
    try:
        value = float(factor)
    except ValueError:
        raise UsageError(f"--scale {spec!r}: factor {factor!r} is not a number") from None
    if not np.isfinite(value) or value < 0:
        raise UsageError(f"--scale {spec!r}: factor must be a non-negative number")
    return pattern, value
