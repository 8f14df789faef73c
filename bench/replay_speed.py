"""Replay speed: how long ``whatif replay`` takes on the largest shared trace, and where it goes.

Two measurements, each repeated ``--runs`` times (best and median reported):

* end to end: the installed ``whatif replay TRACE`` command as a subprocess, interpreter start
  and imports included, as a user sees it (after one untimed warm-up run, so the trace file is
  in the page cache);
  Python start and ``import whatif.cli`` alone are timed beside it, as part of that total;
* in process, phase by phase: trace load (``load_trace``), graph build (``build_graph``),
  simulation by the fast engine (``simulate``) and by the reference engine
  (``simulate_event_per_task``), and the iteration report. For each engine: the whole call,
  the time SimPy ran (``Schedule.wall_s``, which leaves out compiling the graph into lists),
  simulated tasks per second (``len(schedule.start_us) / schedule.wall_s``) and the SimPy
  events it created. Both engines must give the same schedule; the largest difference is shown.

Target: the median ``whatif replay`` at most 2.0 s. Prints PASS or FAIL, and exits with status 1
on FAIL (2 when the command itself fails). It is a benchmark to rerun, not a test:

    .venv/bin/python bench/replay_speed.py [--runs N] [--whatif PATH] [--trace FILE]
"""

from __future__ import annotations

import argparse
import gzip
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import msgspec
import numpy as np

from whatif.collectors.iterations import find_iterations
from whatif.collectors.host import cpu_model
from whatif.collectors.load import load_trace
from whatif.report.iterations import iteration_report
from whatif.sim.build import build_graph
from whatif.sim.engine import Schedule, simulate, simulate_event_per_task

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "hta-misc" / "v100_ddp2_compiled_rank1.json.gz"
DEFAULT_WHATIF = Path(sys.executable).parent / "whatif"
TARGET_S = 2.0
LABEL = 38  # width of the row labels


@dataclass
class EngineRun:
    """What one engine run reports about itself (the schedule minus its arrays)."""

    wall_s: float
    tasks_per_second: float
    simpy_events: int

    @classmethod
    def of(cls, schedule: Schedule) -> "EngineRun":
        return cls(schedule.wall_s, len(schedule.start_us) / schedule.wall_s, schedule.simpy_events)


class _RawTrace(msgspec.Struct):
    traceEvents: list[msgspec.Raw] = []


def count_raw_events(path: Path) -> int:
    """All entries of ``traceEvents`` (flows, counters and metadata too), the size users quote."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return len(msgspec.json.decode(raw, type=_RawTrace).traceEvents)


def time_command(command: list[str]) -> float:
    """Wall seconds of one run of ``command``; raises CalledProcessError if it fails."""
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t0


def time_call(fn: Callable, *args):
    """The result of ``fn(*args)`` and the wall seconds it took."""
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def best_and_median(samples: list[float]) -> str:
    return f"best {min(samples):7.3f} s   median {statistics.median(samples):7.3f} s"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, metavar="FILE", help="trace to replay (default: the 216k-event v100_ddp2_compiled_rank1)")
    parser.add_argument("--whatif", type=Path, default=DEFAULT_WHATIF, metavar="PATH", help=f"the whatif command to time (default: {DEFAULT_WHATIF})")
    parser.add_argument("--runs", type=int, default=5, metavar="N", help="timed runs of each measurement (default: 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for path, what in ((args.trace, "trace"), (args.whatif, "whatif command")):
        if not path.is_file():
            print(f"replay_speed: error: {what} {path}: no such file", file=sys.stderr)
            return 2

    trace_shown = os.path.relpath(args.trace, REPO)
    print(f"code:    {code_version()}")
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}, {platform.system()} {platform.release()}")
    print(f"trace:   {trace_shown} ({count_raw_events(args.trace):,} trace events)")
    print(f"runs:    {args.runs} timed (plus 1 untimed warm-up of the command)")
    print()

    command = [str(args.whatif), "replay", str(args.trace)]
    try:
        time_command(command)
        end_to_end = [time_command(command) for _ in range(args.runs)]
        startup = [time_command([sys.executable, "-P", "-c", "import whatif.cli"]) for _ in range(args.runs)]
    except subprocess.CalledProcessError as err:
        print(f"replay_speed: error: {' '.join(command)} exited with {err.returncode}:\n{err.stderr.decode()}", file=sys.stderr)
        return 2

    phases: dict[str, list[float]] = {"trace load": [], "graph build": [], "iterations and report": []}
    engines: dict[str, Callable[..., Schedule]] = {"simulate": simulate, "simulate_event_per_task": simulate_event_per_task}
    call_s: dict[str, list[float]] = {name: [] for name in engines}
    runs: dict[str, list[EngineRun]] = {name: [] for name in engines}
    for _ in range(args.runs):
        trace, seconds = time_call(load_trace, args.trace)
        phases["trace load"].append(seconds)
        graph, seconds = time_call(build_graph, trace)
        phases["graph build"].append(seconds)
        schedules = {}
        for name, engine in engines.items():
            schedules[name], seconds = time_call(engine, graph)
            call_s[name].append(seconds)
            runs[name].append(EngineRun.of(schedules[name]))
        _, seconds = time_call(iteration_report, schedules["simulate"], find_iterations(trace))
        phases["iterations and report"].append(seconds)

    print(f"end to end: {' '.join([os.path.relpath(args.whatif), 'replay', trace_shown])}")
    print(f"  {'whatif replay':<{LABEL}}{best_and_median(end_to_end)}")
    print(f"  {'of which python + import whatif.cli':<{LABEL}}{best_and_median(startup)}")
    print()
    print(f"in process: {len(trace.events):,} timed events -> {len(graph.tasks):,} tasks, {len(graph.edges):,} dependencies")
    for name, samples in phases.items():
        print(f"  {name:<{LABEL}}{best_and_median(samples)}")
    for name in engines:
        print(f"  {'simulation, ' + name:<{LABEL}}{best_and_median(call_s[name])}")
    print()

    print("engines (SimPy run only, Schedule.wall_s):")
    print(f"  {'engine':<{LABEL}}{'best wall s':>12}{'median wall s':>15}{'tasks/s (best)':>16}{'SimPy events':>14}")
    wall_s = {name: [r.wall_s for r in runs[name]] for name in engines}
    for name in engines:
        best = min(runs[name], key=lambda r: r.wall_s)
        print(
            f"  {name:<{LABEL}}{best.wall_s:>12.4f}{statistics.median(wall_s[name]):>15.4f}"
            f"{best.tasks_per_second:>16,.0f}{best.simpy_events:>14,}"
        )
    speedup = statistics.median(wall_s["simulate_event_per_task"]) / statistics.median(wall_s["simulate"])
    call_speedup = statistics.median(call_s["simulate_event_per_task"]) / statistics.median(call_s["simulate"])
    fast, reference = schedules["simulate"], schedules["simulate_event_per_task"]
    differ_us = float(np.max(np.abs(fast.end_us - reference.end_us))) if len(fast.end_us) else 0.0
    print(f"  fast engine speed-up (median): {speedup:.1f}x in SimPy, {call_speedup:.1f}x per simulate call")
    print(f"  largest end-time difference between the engines: {differ_us:g} us")
    print()

    median_s = statistics.median(end_to_end)
    verdict = "PASS" if median_s <= TARGET_S else "FAIL"
    print(f"{verdict}: whatif replay median {median_s:.3f} s (target <= {TARGET_S:.1f} s on this {os.cpu_count()}-CPU machine)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
