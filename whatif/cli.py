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
from whatif.collectors.calibrate import add_shared_memory, calibrate
from whatif.collectors.lab import LabError, LabSpec, run_job
from whatif.collectors.validate import as_record
from whatif.collectors.validate import validate as validate_point
from whatif.perfmodel_cli import add_batch_size_options, rebatch, run_perfmodel
from whatif.perfmodel_cli import add_parser as add_perfmodel_parser
from whatif.predict import predict_scenario
from whatif.profiling import add_parser as add_profile_parser
from whatif.profiling import run_profile
from whatif.report.iterations import steady_median
from whatif.report.plots import plot_scenario
from whatif.report.timeline import write_atomically, write_timeline
from whatif.scenario import ScenarioError, load_scenario
from whatif.sim.graph import GraphError
from whatif.sim.optimizations import OPTIMIZATIONS
from whatif.sim.perfmodels import PerfModelError
from whatif.topology import TopologyError, as_gbps, parse_bandwidth, parse_latency
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

    def common(p):
        p.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder")
        p.add_argument("--iteration", metavar="NAME", help="annotation that marks an iteration (default: ProfilerStep#N)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        p.add_argument("--timeline", type=Path, metavar="OUT.json", help="write the simulated timeline (Chrome trace)")

    replay = sub.add_parser("replay", help="simulate the unmodified trace: measured against predicted")
    common(replay)
    simulate = sub.add_parser("simulate", help="apply what-ifs to the trace's graph and predict")
    common(simulate)
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
    comm_cli.add_parsers(sub)
    lab = sub.add_parser("lab", help="real multi-machine runs on an emulated cluster (root, network namespaces)")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True)
    lab_run = lab_sub.add_parser("run", help="run a training script as every worker of an emulated cluster")
    lab_run.add_argument("--machines", type=int, default=1)
    lab_run.add_argument("--gpus-per-machine", type=int, default=1, help="workers per machine")
    lab_run.add_argument("--bandwidth", default="200Mbps", help="each machine's NIC, both directions (e.g. 200Mbps)")
    lab_run.add_argument("--latency", default="0", help="added one-way latency (needs sch_netem)")
    lab_run.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    lab_run.add_argument("--threads", type=int, default=1, help="torch threads (and cores) per worker")
    lab_run.add_argument("--out", type=Path, default=Path("lab-out"), help="folder for logs and per-rank reports")
    lab_run.add_argument("--timeout", type=float, default=900.0, help="seconds before the workers are stopped")
    lab_run.add_argument("script", nargs=argparse.REMAINDER, help="-- python SCRIPT.py ARGS...")
    validate = sub.add_parser("validate", help="capture 1x1, predict, run for real on the lab, compare (root)")
    validate.add_argument("--model", required=True, help="an example model: convnet, vgg, wide_mlp, transformer")
    validate.add_argument("--machines", type=int, default=2)
    validate.add_argument("--gpus-per-machine", type=int, default=1, help="workers per machine")
    validate.add_argument("--bandwidth", default="200Mbps")
    validate.add_argument("--latency", default="0")
    validate.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    validate.add_argument("--steps", type=int, default=20, help="timed iterations of the real run")
    validate.add_argument("--repeats", type=int, default=3, help="real runs; the median run is compared (default: 3)")
    validate.add_argument("--steady-allocator", action="store_true", help="capture and run with glibc's allocator fixed")
    validate.add_argument("--batch-size", type=int, metavar="B", help="predict and run at this batch size")
    validate.add_argument("--predict-from", type=int, metavar="B0", help="capture at this batch size (with --batch-size)")
    validate.add_argument("--work", type=Path, default=Path("lab-validate"), help="captures, calibrations and logs")
    validate.add_argument("--json", action="store_true")
    lab_cal = lab_sub.add_parser("calibrate", help="fit latency and bandwidth efficiency of the lab's network")
    lab_cal.add_argument("--bandwidth", default="200Mbps", help="the NIC rate to calibrate at")
    lab_cal.add_argument("--out", type=Path, default=Path("lab-topology.yaml"), help="topology YAML to write")
    lab_cal.add_argument("--horovod-cycle", default="5ms", help="Horovod's cycle time to measure its loop at (default: 5ms)")
    lab_cal.add_argument("--shared-memory-into", type=Path, metavar="YAML",
                         help="measure only the workers' shared memory, into this existing topology YAML")
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


def run_lab(args: argparse.Namespace) -> int:
    if args.lab_command == "calibrate":
        bandwidth_mbit = as_gbps(parse_bandwidth(args.bandwidth, "--bandwidth")) * 1e3
        if args.shared_memory_into is not None:
            return _calibrate_shared_memory(args.shared_memory_into, bandwidth_mbit)
        doc = calibrate(bandwidth_mbit, args.out, horovod_cycle_ms=parse_latency(args.horovod_cycle, "--horovod-cycle") / 1e3)
        nic, intra = doc["inter_node"], doc["intra_node"]
        print(f"NIC at {nic['bandwidth']}: latency {nic['latency']}, efficiency {nic['efficiency']}")
        print(f"inside a machine: {intra['bandwidth']}, latency {intra['latency']}")
        if "horovod_loop" in nic["cpu_contention"]:
            loops = nic["cpu_contention"]["horovod_loop"], intra["cpu_contention"]["horovod_loop"]
            print(f"Horovod's loop per {args.horovod_cycle} cycle: {loops[0]} across machines, {loops[1]} inside one")
        _print_shared_memory(doc["shared_memory"])
        print(f"written to {args.out}")
        return 0
    argv = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not argv:
        raise UsageError("lab run: give the command after --, e.g. -- python examples/run_distributed.py ...")
    spec = LabSpec(
        machines=args.machines,
        gpus_per_machine=args.gpus_per_machine,
        bandwidth_mbit=as_gbps(parse_bandwidth(args.bandwidth, "--bandwidth")) * 1e3,
        latency_ms=parse_latency(args.latency, "--latency") / 1e3,
        threads_per_worker=args.threads,
    )
    result = run_job(spec, args.framework, argv, args.out, args.timeout)
    for rank, (code, log) in enumerate(zip(result.exit_codes, result.logs)):
        print(f"rank {rank}: exit {code}, log {log}")
    failed = [r for r, code in enumerate(result.exit_codes) if code != 0]
    if failed:
        raise LabError(f"workers {failed} failed; see their logs in {args.out}")
    return 0


def _calibrate_shared_memory(path: Path, bandwidth_mbit: float) -> int:
    _print_shared_memory(add_shared_memory(path, bandwidth_mbit)["shared_memory"])
    print(f"added to {path}")
    return 0


def _print_shared_memory(shared: dict) -> None:
    print(f"memory: one worker streams {shared['core_bandwidth']} alone, all together {shared['total_bandwidth']}; "
          f"compute beside them x{shared['compute']}")


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


def run_validate(args: argparse.Namespace) -> int:
    point = validate_point(
        args.model,
        args.machines,
        args.gpus_per_machine,
        as_gbps(parse_bandwidth(args.bandwidth, "--bandwidth")) * 1e3,
        args.framework,
        args.work,
        latency_ms=parse_latency(args.latency, "--latency") / 1e3,
        steps=args.steps,
        batch_size=args.batch_size,
        predict_from=args.predict_from,
        repeats=args.repeats,
        steady_allocator=args.steady_allocator,
    )
    record = as_record(point)
    if args.json:
        sys.stdout.write(msgspec.json.encode({"results": [record]}).decode() + "\n")
    else:
        print(
            f"{point.model} {point.framework} {point.machines}x{point.gpus_per_machine} at {point.bandwidth_mbps:g} Mbps: "
            f"measured {point.measured_ms:.1f} ms (median of runs {', '.join(f'{ms:.1f}' for ms in point.runs_measured_ms)}), "
            f"predicted {point.predicted_ms:.1f} ms, error {point.error_pct:+.1f} % "
            f"(1x1 capture {point.capture_profiled_ms:.1f} ms profiled, {point.capture_unprofiled_ms:.1f} ms without the profiler)"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.command == "predict":
        return run_predict(args)
    if args.command == "validate":
        return run_validate(args)
    if args.command == "collect":
        return run_collect(args)
    if args.command == "profile":
        return run_profile(args)
    if args.command == "lab":
        return run_lab(args)
    if args.command == "overheads":
        return run_overheads(args)
    if args.command == "critical-path":
        return run_critical_path(args)
    if args.command == "perfmodel":
        return run_perfmodel(args)
    if args.command in ("collective", "calibrate"):
        return comm_cli.run(args)
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
