"""The five CPU overheads (DLRM performance model) of every shared trace and the bundled CPU ones.

For each Kineto trace under a folder (by default ``../shared/traces``) and each trace in
``data/``, prints one markdown row: the top-level operators and launch calls found, and per
overhead type the median and 90th percentile in microseconds over all operators (``-`` where a
type does not apply: a CPU-only trace launches nothing), then how many gaps were a thread
waiting for another rather than overhead. Rerun it from anywhere:

    .venv/bin/python bench/overheads_table.py [--traces DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from whatif.collectors.load import load_trace
from whatif.report.overheads import measure_overheads

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)
from replay_fidelity import DEFAULT_TRACES, find_traces, shown_path  # noqa: E402

TYPES = ("T1", "T2", "T3", "T4", "T5", "op")


def overhead_row(path: Path) -> str:
    overheads = measure_overheads(load_trace(path))
    summary = overheads.summary().set_index("type")
    cells = []
    for kind in TYPES:
        row = summary.loc[kind]
        cells.append("-" if row["count"] == 0 else f"{row['median_us']:.1f} ({row['p90_us']:.1f})")
    waits = summary.loc["wait"]
    wait_cell = f"{int(waits['count'])} ({waits['total_us'] / 1e3:.1f} ms)" if waits["count"] else "0"
    return f"| {shown_path(path)} | {overheads.operators} | {overheads.launches} | " + " | ".join(cells) + f" | {wait_cell} |"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, metavar="DIR", help=f"folder of Kineto traces (default: {shown_path(DEFAULT_TRACES)})")
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"overheads_table: error: {args.traces}: no such folder", file=sys.stderr)
        return 2
    traces, skipped = find_traces(args.traces)
    traces += sorted((REPO / "data").glob("*.json.gz"))
    print(f"code: {code_version()}\n")
    print("median (p90) us per top-level operator; waits: gaps in which the thread was blocked on another thread\n")
    print("| trace | operators | launch calls | T1 between ops | T2 op start to 1st launch | T3 last launch to op end "
          "| T4 launch call | T5 between launches | op CPU time | waits |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for path in traces:
        print(overhead_row(path))
    for path, reason in skipped:
        print(f"\nskipped {shown_path(path)}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
