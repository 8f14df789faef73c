"""``whatif lab run|calibrate`` and ``whatif validate``: the command-line side of the lab.

``whatif.cli`` registers these commands with :func:`add_parsers` and hands them to :func:`run`,
reporting :data:`ERRORS` as one line; the work is in ``cluster`` (running a job), ``calibrate``
and ``validate``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from whatif.report.intervals import describe
from whatif.topology import as_gbps, parse_bandwidth, parse_latency

from .calibrate import add_floor, add_shared_memory, calibrate
from .cluster import FRAMEWORKS, PREFIX, STATE_DIR, LabError, LabSpec, clean, run_job
from .validate import as_record
from .validate import validate as validate_point

ERRORS = (LabError,)


def add_parsers(sub) -> None:
    """``lab`` (with ``run`` and ``calibrate``) and ``validate``, on the ``whatif`` subparsers."""
    lab = sub.add_parser("lab", help="real multi-machine runs on an emulated cluster (root, network namespaces)")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True)
    lab_run = lab_sub.add_parser("run", help="run a training script as every worker of an emulated cluster")
    lab_run.add_argument("--machines", type=int, default=1, help="machines to emulate (at most this box's cores)")
    lab_run.add_argument("--gpus-per-machine", type=int, default=1, help="workers per machine")
    lab_run.add_argument("--bandwidth", default="200Mbps", help="each machine's NIC, both directions (e.g. 200Mbps)")
    lab_run.add_argument("--latency", default="0", help="added one-way latency (needs sch_netem)")
    lab_run.add_argument("--framework", choices=FRAMEWORKS, default="horovod",
                         help="the environment the workers get: Horovod's, or torch.distributed's (DDP and the other families)")
    lab_run.add_argument("--threads", type=int, default=1, help="torch threads (and cores) per worker")
    lab_run.add_argument("--out", type=Path, default=Path("lab-out"), help="folder for logs and per-rank reports")
    lab_run.add_argument("--timeout", type=float, default=900.0, help="seconds before the workers are stopped")
    lab_run.add_argument("script", nargs=argparse.REMAINDER, help="-- python SCRIPT.py ARGS...")
    lab_cal = lab_sub.add_parser("calibrate", help="fit latency and bandwidth efficiency of the lab's network")
    lab_cal.add_argument("--bandwidth", default="200Mbps", help="the NIC rate to calibrate at")
    lab_cal.add_argument("--out", type=Path, default=Path("lab-topology.yaml"), help="topology YAML to write")
    lab_cal.add_argument("--horovod-cycle", default="5ms", help="Horovod's cycle time to measure its loop at (default: 5ms)")
    lab_cal.add_argument("--shared-memory-into", type=Path, metavar="YAML",
                         help="measure only the workers' shared memory, into this existing topology YAML")
    lab_cal.add_argument("--floor-into", type=Path, metavar="YAML",
                         help="measure only the all-reduce's floor (its small sizes), into this existing topology YAML")
    clean_help = f"remove the namespaces, veths and /etc/netns entries ({PREFIX}<pid>...) of labs whose process is gone"
    lab_sub.add_parser(
        "clean", help=clean_help,
        description=f"{clean_help[0].upper()}{clean_help[1:]}: what a lab killed before it could clean up (SIGKILL) "
                    f"left. Every lab names what it creates {PREFIX}<its pid> and records it in {STATE_DIR} first; a "
                    "lab whose process still runs is left alone. Prints each object removed (root).")
    validate = sub.add_parser("validate", help="capture 1x1, predict, run for real on the lab, compare (root)")
    validate.add_argument("--model", required=True, help="an example model: convnet, vgg, wide_mlp, transformer, moe")
    validate.add_argument("--machines", type=int, default=2, help="machines to emulate (at most this box's cores)")
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


def run(args: argparse.Namespace) -> int:
    """Run ``lab`` or ``validate``; its errors are :class:`LabError` and the topology's."""
    if args.command == "validate":
        return run_validate(args)
    return run_lab(args)


def run_lab(args: argparse.Namespace) -> int:
    if args.lab_command == "clean":
        removed = clean()
        for kind, name in removed:
            print(f"removed {kind} {name}")
        print(f"{sum(kind != 'state' for kind, _ in removed)} objects of dead labs removed "
              f"(state files in {STATE_DIR}); running labs left alone")
        return 0
    if args.lab_command == "calibrate":
        bandwidth_mbit = as_gbps(parse_bandwidth(args.bandwidth, "--bandwidth")) * 1e3
        if args.shared_memory_into is not None:
            return _calibrate_shared_memory(args.shared_memory_into, bandwidth_mbit)
        if args.floor_into is not None:
            doc = add_floor(args.floor_into, bandwidth_mbit)
            print(f"all-reduce floor: {doc['inter_node']['floor']} across machines, {doc['intra_node']['floor']} inside one")
            print(f"added to {args.floor_into}")
            return 0
        doc = calibrate(bandwidth_mbit, args.out, horovod_cycle_ms=parse_latency(args.horovod_cycle, "--horovod-cycle") / 1e3)
        nic, intra = doc["inter_node"], doc["intra_node"]
        print(f"NIC at {nic['bandwidth']}: latency {nic['latency']}, efficiency {nic['efficiency']}")
        print(f"inside a machine: {intra['bandwidth']}, latency {intra['latency']}")
        print(f"all-reduce floor: {nic['floor']} across machines, {intra['floor']} inside one")
        if "horovod_loop" in nic["cpu_contention"]:
            loops = nic["cpu_contention"]["horovod_loop"], intra["cpu_contention"]["horovod_loop"]
            print(f"Horovod's loop per {args.horovod_cycle} cycle: {loops[0]} across machines, {loops[1]} inside one")
        _print_shared_memory(doc["shared_memory"])
        print(f"written to {args.out}")
        return 0
    argv = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not argv:
        raise LabError("lab run: give the command after --, e.g. -- python examples/run_distributed.py ...")
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
            f"predicted {describe(point.predicted_ms, point.predicted_ms_low, point.predicted_ms_high)}, "
            f"error {point.error_pct:+.1f} % "
            f"(1x1 capture {point.capture_profiled_ms:.1f} ms profiled, {point.capture_unprofiled_ms:.1f} ms without the profiler)"
        )
    return 0
