"""Replay fidelity: how closely the unmodified graph reproduces each measured iteration.

For every Kineto trace under a folder (by default the shared real-GPU traces, ``../shared/traces``
next to the repository) and the bundled CPU trace, this replays the trace as ``whatif replay``
does (the pipeline, the profiler's overhead kept) and prints one markdown row per trace: the
iterations found (``ProfilerStep#N`` ranges, or the whole trace where it has none), the median and
the largest per-iteration |error|, and the median measured and predicted iteration time.

Target: every iteration within 2 % and the median within 1 %. The script exits with status 1
when a trace misses it (or cannot be replayed) and names the trace; with status 2 on a usage
error. Rerun it from anywhere:

    .venv/bin/python bench/replay_fidelity.py [--traces DIR] [--markdown-out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from whatif.collectors.iterations import WHOLE_TRACE
from whatif.collectors.kineto import TraceError
from whatif.sim.graph import GraphError
from whatif.pipeline import Request, predict

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)
DEFAULT_TRACES = REPO.parent / "shared" / "traces"
BUNDLED_TRACE = REPO / "data" / "convnet_cpu.pt.trace.json.gz"
TRACE_SUFFIXES = (".json", ".json.gz")
#: Files in the traces folder that are not Kineto traces, and what they are instead.
NOT_KINETO = {
    "execution_trace_rank0.json.gz": "a PyTorch execution trace (operator graph without timings), not a Kineto trace",
}
MAX_ITERATION_ERROR_PCT = 2.0
MAX_MEDIAN_ERROR_PCT = 1.0


@dataclass
class Fidelity:
    """The replay of one trace, summarised; ``problem`` is set when it misses the target."""

    trace: str
    iterations: int = 0
    iteration_kind: str = ""
    median_error_pct: float = np.nan
    max_error_pct: float = np.nan
    measured_median_ms: float = np.nan
    predicted_median_ms: float = np.nan
    problem: Optional[str] = None


def shown_path(path: Path) -> str:
    """The path relative to the repository root, so it can be pasted into ``whatif replay``."""
    return os.path.relpath(path, REPO)


def find_traces(folder: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The trace files under ``folder`` in path order, and the skipped ones with the reason."""
    traces, skipped = [], []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES)):
        if path.name in NOT_KINETO:
            skipped.append((path, NOT_KINETO[path.name]))
        else:
            traces.append(path)
    return traces, skipped


def measure_fidelity(path: Path) -> Fidelity:
    """Replay one trace and compare every iteration with its measured length."""
    result = Fidelity(trace=shown_path(path))
    try:
        replay = predict(Request(path, remove_profiler_overhead=False))
    except (TraceError, GraphError) as err:
        result.problem = f"cannot be replayed: {err}"
        return result
    report = replay.report
    abs_error_pct = report["error_pct"].abs().to_numpy(dtype=np.float64)
    result.iterations = len(report)
    whole = list(replay.study.iterations["name"]) == [WHOLE_TRACE]
    result.iteration_kind = "whole trace" if whole else "ProfilerStep"
    result.measured_median_ms = float(report["measured_ms"].median())
    result.predicted_median_ms = float(report["predicted_ms"].median())
    if len(abs_error_pct) == 0:
        result.problem = "no iterations found"
        return result
    result.median_error_pct = float(np.median(abs_error_pct))
    result.max_error_pct = float(np.max(abs_error_pct))
    unpredicted = int(np.isnan(abs_error_pct).sum())
    if unpredicted:
        result.problem = f"{unpredicted} iteration(s) with no predicted time"
    elif result.max_error_pct > MAX_ITERATION_ERROR_PCT:
        worst = str(report["name"].iloc[int(np.argmax(abs_error_pct))])
        result.problem = f"{worst} is off by {result.max_error_pct:.2f} % (> {MAX_ITERATION_ERROR_PCT} %)"
    elif result.median_error_pct > MAX_MEDIAN_ERROR_PCT:
        result.problem = f"median |error| {result.median_error_pct:.2f} % (> {MAX_MEDIAN_ERROR_PCT} %)"
    return result


def markdown_table(results: list[Fidelity]) -> str:
    def number(value: float) -> str:
        return "-" if np.isnan(value) else f"{value:.2f}"

    lines = [
        "| trace | iterations | median \\|error\\| % | max \\|error\\| % | measured median ms | predicted median ms |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for r in results:
        iterations = f"{r.iterations} ({r.iteration_kind})" if r.iteration_kind else "-"
        lines.append(
            f"| {r.trace} | {iterations} | {number(r.median_error_pct)} | {number(r.max_error_pct)} "
            f"| {number(r.measured_median_ms)} | {number(r.predicted_median_ms)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, metavar="DIR", help=f"folder of Kineto traces (default: {shown_path(DEFAULT_TRACES)})")
    parser.add_argument("--markdown-out", type=Path, metavar="FILE", help="also write the table alone to FILE")
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"replay_fidelity: error: {args.traces}: no such folder", file=sys.stderr)
        return 2

    traces, skipped = find_traces(args.traces)
    results = [measure_fidelity(path) for path in traces + [BUNDLED_TRACE]]
    table = markdown_table(results)
    print(f"code: {code_version()}\n")
    print(table)
    for path, reason in skipped:
        print(f"skipped {shown_path(path)}: {reason}")
    if args.markdown_out is not None:
        args.markdown_out.write_text(table)
        print(f"table written to {args.markdown_out}")

    target = f"every iteration |error| <= {MAX_ITERATION_ERROR_PCT} %, median <= {MAX_MEDIAN_ERROR_PCT} %"
    missed = [r for r in results if r.problem]
    if not missed:
        print(f"PASS: all {len(results)} traces meet the target ({target})")
        return 0
    print(f"FAIL: {len(missed)} of {len(results)} traces miss the target ({target}):")
    for r in missed:
        print(f"  {r.trace}: {r.problem}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
