"""The ``whatif`` command."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import msgspec
import numpy as np
import pandas as pd

from whatif.analyses import run_critical_path, run_overheads
from whatif import comm_cli
from whatif.collectors.capture import CaptureError, collect
from whatif.collectors.kineto import TraceError
from whatif.collectors.ranks import is_job, load_traces
from whatif.lab import cli as lab_cli
from whatif.lab.cluster import LabError
from whatif.perfmodel_cli import add_batch_size_options, rebatch, run_perfmodel
from whatif.perfmodel_cli import add_parser as add_perfmodel_parser
from whatif.predict import predict_scenario
from whatif.profiling import add_parser as add_profile_parser
from whatif.profiling import run_profile
from whatif.report.iterations import steady_median
from whatif.report.plots import plot_scenario
from whatif.report.ranks import job_json, rank_reports
from whatif.report.timeline import write_atomically, write_timeline
from whatif.scenario import ScenarioError, load_scenario
from whatif.sim.graph import GraphError
from whatif.sim.multirank import build_job
from whatif.sim.passes.optimizations import OPTIMIZATIONS
from whatif.sim.perfmodels.models import PerfModelError
from whatif.topology import TopologyError
from whatif.study import TraceStudy, WhatIf


class UsageError(Exception):
    """A command-line value that is well-formed for argparse but means nothing."""


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="whatif",
        description="Predict DNN training iteration time from a PyTorch profiler trace, and what "
        "an optimization would change.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, ranks=False):
        if ranks:
            p.add_argument("trace", type=Path, nargs="+", help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle "
                           "folder; or a job's per-rank traces: a folder of them, or several files")
        else:
            p.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder")
        p.add_argument("--iteration", metavar="NAME", help="annotation that marks an iteration (default: ProfilerStep#N)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        p.add_argument("--timeline", type=Path, metavar="OUT.json", help="write the simulated timeline (Chrome trace)")

    replay = sub.add_parser("replay", help="simulate the unmodified trace: measured against predicted")
    common(replay, ranks=True)
    simulate = sub.add_parser("simulate", help="apply what-ifs to the trace's graph and predict")
    common(simulate, ranks=True)
    simulate.add_argument(
        "--optimization",
        action="append",
        default=[],
        metavar="NAME",
        help=f"one of {', '.join(OPTIMIZATIONS)} (faster-gpu=K for a K times faster GPU); repeatable",
    )
    simulate.add_argument("--scale", action="append", default=[], metavar="PATTERN=FACTOR", help="scale matching tasks")
    simulate.add_argument("--remove", action="append", default=[], metavar="PATTERN", help="remove matching tasks")
    add_batch_size_options(simulate)
    add_perfmodel_parser(sub)

    critical = sub.add_parser("critical-path", help="what each simulated iteration's critical path is made of")
    common(critical)
    overheads = sub.add_parser("overheads", help="the five CPU overheads around operators, per operator type")
    overheads.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder")
    overheads.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    overheads.add_argument("--csv", type=Path, metavar="OUT.csv", help="every operator type's distributions as CSV")

    predict = sub.add_parser("predict", help="data-parallel training on a cluster, from a scenario YAML")
    predict.add_argument("scenario", type=Path, help="scenario file (see scenarios/)")
    predict.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    predict.add_argument("--plot", type=Path, metavar="OUT.png", help="scaling curve and time breakdown")
    predict.add_argument("--csv", type=Path, metavar="OUT.csv", help="the results table as CSV")
    predict.add_argument("--timeline", type=Path, metavar="OUT.json", help="simulated timeline of each configuration")

    capture = sub.add_parser(
        "collect",
        help="run a training script that uses the capture API and write its trace bundle",
        usage="whatif collect [-h] [--out BUNDLE] [--steps N] [--warmup N] -- python SCRIPT.py [ARGS ...]",
    )
    capture.add_argument("--out", type=Path, metavar="BUNDLE", help="bundle folder to write (default: SCRIPT.bundle)")
    capture.add_argument("--steps", type=int, metavar="N", help="profiled steps (default: the script's, else 5)")
    capture.add_argument("--warmup", type=int, metavar="N", help="steps before them (default: the script's, else 3)")
    capture.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the training command, after --")
    add_profile_parser(sub)
    lab_cli.add_parsers(sub)
    comm_cli.add_parsers(sub)
    return parser


_COLUMNS = {
    "name": "iteration",
    "measured_ms": "measured ms",
    "replay_ms": "replay ms",
    "predicted_ms": "predicted ms",
    "error_pct": "error %",
    "speedup": "speed-up",
    "gpu_busy_ms": "GPU busy ms",
    "gpu_idle_ms": "GPU idle ms",
    "sync_wait_ms": "sync wait ms",
    "collective_wait_ms": "collective wait ms",
    "transfer_ms": "transfer ms",
}


def _table(report: pd.DataFrame) -> str:
    shown = report[[c for c in report.columns if c in _COLUMNS]].rename(columns=_COLUMNS)
    return shown.to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-")


def _json_records(report: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in row.items()}
        for row in report.to_dict(orient="records")
    ]


def run_predict(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    inputs = (args.scenario, scenario.trace)
    outcome = predict_scenario(scenario)
    results = outcome.results
    if args.csv is not None:
        _refuse_inputs(args.csv, inputs)
        write_atomically(args.csv, results.to_csv(index=False).encode())
    if args.plot is not None:
        _refuse_inputs(args.plot, inputs)
        plot_scenario(results, args.plot, title=scenario.path.name)
    if args.timeline is not None:
        for label, run in outcome.runs.items():
            target = args.timeline if len(outcome.runs) == 1 else _suffixed(args.timeline, label)
            write_timeline(run.schedule, target, protect=inputs)
    if args.json:
        out = {
            "scenario": str(args.scenario),
            "trace": str(scenario.trace),
            "gradients": {"source": outcome.gradient_source, "mb_per_iteration": outcome.bytes_per_iteration / 1e6},
            "baseline_1x1_ms": outcome.baseline_ms,
            "profiler_overhead": None if outcome.profiler_overhead is None else asdict(outcome.profiler_overhead),
            "results": _json_records(results),
        }
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{scenario.trace}: 1x1 iteration {outcome.baseline_ms:.2f} ms; gradients: "
          f"{outcome.bytes_per_iteration / 1e6:.1f} MB per iteration ({outcome.gradient_source})")
    if outcome.profiler_overhead is not None:
        print(outcome.profiler_overhead.describe())
    shown = results.rename(columns=_PREDICT_COLUMNS)[list(_PREDICT_COLUMNS.values())]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for what, path in (("plot", args.plot), ("CSV", args.csv)):
        if path is not None:
            print(f"{what} written to {path}")
    return 0


_PREDICT_COLUMNS = {
    "machines": "machines",
    "gpus_per_machine": "GPUs/machine",
    "inter_node_gbps": "Gbps",
    "framework": "framework",
    "policy": "policy",
    "iteration_ms": "iteration ms",
    "speedup": "speed-up",
    "scaling_efficiency": "efficiency",
    "exposed_comm_ms": "exposed comm ms",
    "comm_ms": "comm ms",
}


def _suffixed(path: Path, label: str) -> Path:
    slug = label.replace(" ", "_").replace("/", "-")
    return path.with_name(f"{path.stem}.{slug}{path.suffix}")


def _refuse_inputs(path: Path, inputs: tuple) -> None:
    if any(path.resolve() == Path(p).resolve() for p in inputs):
        raise UsageError(f"{path}: refusing to overwrite an input file")


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


def run(args: argparse.Namespace) -> int:
    if args.command == "predict":
        return run_predict(args)
    if args.command == "collect":
        return run_collect(args)
    if args.command == "profile":
        return run_profile(args)
    if args.command in lab_cli.COMMANDS:
        return lab_cli.run(args)
    if args.command == "overheads":
        return run_overheads(args)
    if args.command == "critical-path":
        return run_critical_path(args)
    if args.command == "perfmodel":
        return run_perfmodel(args)
    if args.command in ("collective", "calibrate"):
        return comm_cli.run(args)
    if is_job(args.trace):
        return run_job(args)
    args.trace = args.trace[0]
    study = TraceStudy.from_trace(args.trace, args.iteration)
    if args.command == "replay":
        schedule, report = study.replay, study.replay_report()
        what = {}
    else:
        what_if = WhatIf(
            optimizations=args.optimization,
            scale=[_parse_scale(s) for s in args.scale],
            remove=args.remove,
        )
        batch = rebatch(study, args) if args.batch_size is not None else None
        schedule, report = study.predict(what_if)
        what = {"optimizations": list(args.optimization), "scale": list(args.scale), "remove": list(args.remove)}
        if batch is not None:
            what["batch_size"] = batch
    if args.timeline is not None:
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
    if args.json:
        out = {"trace": str(args.trace), "iterations": _json_records(report), "summary": summary, **what}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        print(f"{args.trace}: {summary['tasks']} tasks, {summary['edges']} dependencies")
        print(_table(report))
        if args.timeline is not None:
            print(f"timeline written to {args.timeline}")
    return 0


def run_job(args: argparse.Namespace) -> int:
    """``replay`` / ``simulate`` of a multi-rank job: every rank's iterations."""
    if args.command == "simulate" and args.batch_size is not None:
        raise UsageError("--batch-size: a multi-rank job cannot be rebatched yet; give one rank's trace")
    job = build_job(load_traces(args.trace), args.iteration)
    for path, why in job.skipped:
        print(f"whatif: skipped {path}: {why}", file=sys.stderr)
    replay = schedule = job.replay()
    what = {}
    if args.command == "simulate":
        what_if = WhatIf(optimizations=args.optimization, scale=[_parse_scale(s) for s in args.scale], remove=args.remove)
        schedule = job.simulate(what_if.apply(job.graph))
        what = {"optimizations": list(args.optimization), "scale": list(args.scale), "remove": list(args.remove)}
    reports = rank_reports(job, schedule, replay if args.command == "simulate" else None)
    if args.timeline is not None:
        write_timeline(schedule, args.timeline, protect=tuple(r.path for r in job.ranks))
    if args.json:
        out = {"traces": [str(p) for p in args.trace], **job_json(job, reports, schedule, _json_records), **what}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    for report in reports:
        print(f"rank {report.rank}: {report.trace}")
        print(_table(report.iterations))
    print(f"{len(reports)} ranks joined at {len(job.collectives)} collectives; "
          f"clocks aligned within {max(abs(v) for v in job.clock_offsets_us.values()):.1f} us")
    if args.timeline is not None:
        print(f"timeline written to {args.timeline}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (TraceError, GraphError, UsageError, ScenarioError, TopologyError, CaptureError, LabError, PerfModelError) as err:
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
