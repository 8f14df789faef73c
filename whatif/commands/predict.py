"""``whatif predict SCENARIO``: a scenario's grid of clusters predicted, as a table, JSON, CSV, a
plot, and each configuration's timeline. The configurations run on this machine's cores, or on
a Dask cluster (``whatif/sweep.py``), with a progress bar on a terminal."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import msgspec
import yaml

from whatif.pipeline import pipeline_note, predict, slowest_rank_note, traced_gpu_note
from whatif.report.cluster import collective_notes
from whatif.report.intervals import LEVEL, describe
from whatif.report.plots import plot_scenario
from whatif.report.tables import json_number, json_records, results_table
from whatif.report.timeline import TIMELINE_SUFFIX, check_timeline_path, write_atomically, write_timelines
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.graph import GraphError
from whatif.topology import TopologyError
from whatif.sweep import EXECUTORS, Sweep, SweepError, available_cores

from . import MAX_GRID_WORKERS, UsageError, check_grid_size, refuse_inputs

ERRORS = (ScenarioError, SweepError)


def add_parsers(sub) -> None:
    predict_ = sub.add_parser("predict", help="training on a cluster (data, FSDP/ZeRO, tensor, pipeline, expert parallelism), from a scenario YAML")
    predict_.add_argument("scenario", type=Path, help="scenario file (see scenarios/)")
    predict_.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    predict_.add_argument("--plot", type=Path, metavar="OUT.png", help="scaling curve and time breakdown")
    predict_.add_argument("--csv", type=Path, metavar="OUT.csv", help="the results table as CSV")
    predict_.add_argument("--timeline", type=Path, metavar="OUT.json.gz",
                          help="simulated timeline of each configuration (gzip-compressed Chrome trace: Perfetto opens it), "
                               "OUT.LABEL.json.gz for each of several")
    predict_.add_argument("--yes", action="store_true",
                          help=f"run a grid that simulates more than {MAX_GRID_WORKERS} workers' graphs in all (identical workers count once; refused without it)")
    predict_.add_argument("--jobs", type=int, metavar="N", default=available_cores(),
                          help="configurations simulated at once, each in a process of its own "
                               "(default: this machine's cores, %(default)s; 1: one after the other, in this process)")
    predict_.add_argument("--executor", choices=EXECUTORS, default="local",
                          help="where the configurations run: this machine (default), or the workers of a Dask "
                               "or Ray cluster (pip install 'whatif[dask]' or 'whatif[ray]'; --jobs is then the "
                               "cluster's)")
    predict_.add_argument("--address", metavar="ADDRESS",
                          help="the cluster's address: Dask's scheduler, tcp://HOST:8786 (default: "
                               "DASK_SCHEDULER_ADDRESS); Ray's, HOST:6379, ray://HOST:10001 or auto (default: RAY_ADDRESS)")


def plot_titles(path: Path, scenario: Scenario) -> tuple[str, str]:
    """The plot's title and subtitle: the scenario's ``name`` and ``description`` (read again
    from the file, which ``Scenario.from_file`` has just accepted), else what was predicted
    from which trace; never the file's name, which says nothing in a design doc."""
    doc = yaml.safe_load(path.read_text())
    name, description = (str(doc.get(key) or "").strip() for key in ("name", "description"))
    return name or f"Predicted scaling of {scenario.trace.name}", description


def ends_quickly(args: argparse.Namespace) -> bool:
    """Whether the process, ``whatif predict`` as its own command, may end without the
    interpreter's teardown (``whatif.cli.main``), which on Daydream's grid of the ResNet-50 trace
    is a tenth of the command's time: on this machine's cores, yes; the command leaves nothing
    for the teardown to do (every file it writes is closed and renamed into place before it
    returns, its processes are joined). A Dask or Ray client's threads and connections are left
    to close as Python closes them."""
    return args.executor == "local"


def run(args: argparse.Namespace) -> int:
    scenario = Scenario.from_file(args.scenario)
    check_grid_size(args.scenario, scenario, args.yes)
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: at least 1")
    if args.address is not None and args.executor == "local":
        raise UsageError("--address is a Dask or Ray cluster's: give it with --executor dask or --executor ray")
    if scenario.job_traces:
        return _run_job(args, scenario)
    inputs = (args.scenario, scenario.trace)
    if args.timeline is not None:  # several configurations: each file is checked once it has a name
        check_timeline_path(args.timeline, protect=inputs, new=len(scenario.points) == 1)
    sweep = Sweep(jobs=args.jobs, executor=args.executor, address=args.address, progress=sys.stderr.isatty())
    try:
        prediction = predict(replace(scenario.request(), keep_runs=args.timeline is not None), sweep)
    except (GraphError, TopologyError) as err:  # the scenario's parallelism, cluster or what-ifs on this trace
        raise UsageError(f"{args.scenario}: {err}") from None
    results = prediction.results
    for note in (traced_gpu_note(prediction), slowest_rank_note(prediction), pipeline_note(prediction)):
        if note:
            print(f"whatif: note: {note}", file=sys.stderr)
    if args.csv is not None:
        refuse_inputs(args.csv, inputs)
        write_atomically(args.csv, results.to_csv(index=False).encode())
    if args.plot is not None:
        refuse_inputs(args.plot, inputs)
        plot_scenario(results, args.plot, *plot_titles(args.scenario, scenario))
    timelines = {}
    if args.timeline is not None:
        several = len(prediction.runs) > 1
        timelines = {label: _suffixed(args.timeline, label) if several else args.timeline for label in prediction.runs}
        for target in timelines.values():  # every name checked before any file is written
            check_timeline_path(target, protect=inputs)
        write_timelines(((run_.schedule, timelines[label], collective_notes(run_)) for label, run_ in prediction.runs.items()),
                        protect=inputs)
    overhead = prediction.profiler_overhead
    low_ms, high_ms = prediction.iteration_interval
    if args.json:
        out = {
            "scenario": str(args.scenario),
            "trace": str(scenario.trace),
            "gradients": {"source": prediction.gradient_source, "mb_per_iteration": prediction.bytes_per_iteration / 1e6},
            "baseline_1x1_ms": prediction.iteration_ms,
            "baseline_1x1_ms_low": json_number(low_ms),
            "baseline_1x1_ms_high": json_number(high_ms),
            "interval_level": LEVEL,
            "profiler_overhead": None if overhead is None else asdict(overhead),
            "results": json_records(results),
        }
        if timelines:
            out["timelines"] = [str(path) for path in timelines.values()]
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{scenario.trace}: 1x1 iteration {describe(prediction.iteration_ms, low_ms, high_ms)}; gradients: "
          f"{prediction.bytes_per_iteration / 1e6:.1f} MB per iteration ({prediction.gradient_source})")
    if overhead is not None:
        print(overhead.describe())
    print(results_table(results))
    for what, path in (("plot", args.plot), ("CSV", args.csv)):
        if path is not None:
            print(f"{what} written to {path}")
    if len(timelines) == 1:
        print(f"timeline written to {args.timeline}")
    elif timelines:
        print(f"{len(timelines)} timelines written to {_suffixed(args.timeline, '*')}, one per configuration")
    return 0


def _suffixed(path: Path, label: str) -> Path:
    """``out.json.gz`` -> ``out.2x1_10Gbps_horovod_fifo.json.gz``"""
    slug = label.replace(" ", "_").replace("/", "-")
    return path.with_name(f"{path.name[:-len(TIMELINE_SUFFIX)]}.{slug}{TIMELINE_SUFFIX}")


def _run_job(args: argparse.Namespace, scenario: Scenario) -> int:
    """``predict`` of a multi-rank job's scenario (``whatif/jobs.py``): a row per configuration,
    and with ``--json`` every rank's iterations in each."""
    from whatif.jobs import job_results_note, predict_job
    from whatif.report.ranks import job_json

    for option, given in (("--timeline", args.timeline), ("--plot", args.plot), ("--executor", args.executor != "local")):
        if given:
            raise UsageError(f"{option}: not for a multi-rank job's scenario yet (its table and --json, --csv are)")
    prediction = predict_job(scenario)
    results = prediction.results
    if prediction.gpu_note:
        print(f"whatif: note: {prediction.gpu_note}", file=sys.stderr)
    if args.csv is not None:
        refuse_inputs(args.csv, (args.scenario, *scenario.job_traces))
        write_atomically(args.csv, results.to_csv(index=False).encode())
    if args.json:
        out = {"scenario": str(args.scenario), "traces": [str(p) for p in scenario.job_traces],
               "replay_ms": prediction.replay_ms, "results": json_records(results),
               "configurations": [{"label": label, **job_json(prediction.job, reports, prediction.runs[label])}
                                  for label, reports in prediction.reports.items()]}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(job_results_note(prediction, scenario))
    print(results_table(results))
    if args.csv is not None:
        print(f"CSV written to {args.csv}")
    return 0
