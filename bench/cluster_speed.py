"""Cluster prediction speed: Daydream's 21-configuration grid and one 512-GPU cluster, timed.

Both run on the shared ResNet-50 trace (V100, batch 32) with Horovod and FIFO, each repeated
``--runs`` times (best and median reported), and each timed as a user of ``whatif predict``
waits for it: ``Scenario.from_file`` plus ``predict``, which reads the trace, builds its
graph, replays the 1x1 baseline, finds the gradients and simulates every configuration.

* the grid: 1x1, 2x1, 3x1, 4x1, 2x2, 3x2 and 4x2 at 10, 20 and 40 Gbps (Daydream, Zhu et al.,
  USENIX ATC 2020). Per configuration it also reports the ``simulate_cluster`` call, which
  builds that configuration's graph and simulates it; the rest of the total is paid once.
* one cluster of 64 machines x 8 GPUs at 40 Gbps.

Targets: the grid at most 10 s in all, the large cluster at most 5 s (medians). Prints the
grid's predictions as a Markdown table, then PASS or FAIL, and exits with status 1 on FAIL (2
when the trace is missing). It is a benchmark to rerun, not a test:

    .venv/bin/python bench/cluster_speed.py [--runs N] [--trace FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import whatif.pipeline
from whatif.pipeline import Prediction, predict
from whatif.scenario import Scenario

from measured_code import code_version
from whatif.collectors.host import cpu_model

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "kineto-resnet50-v100" / "resnet50_bs32_workers0.pt.trace.json.gz"
GRID = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2)]  # machines x GPUs per machine
GRID_TARGET_S = 10.0
LARGE = (64, 8)
LARGE_TARGET_S = 5.0

GRID_YAML = """\
trace: {trace}
cluster:
  machines: [1, 2, 3, 4]
  gpus_per_machine: [1, 2]
  intra_node: nvlink2
  inter_node: [10gbe, 20gbe, 40gbe]
framework: horovod
policy: fifo
"""
LARGE_YAML = """\
trace: {trace}
cluster:
  machines: {machines}
  gpus_per_machine: {gpus}
  intra_node: nvlink2
  inter_node: 40gbe
framework: horovod
policy: fifo
"""


@contextmanager
def timing_simulate_cluster(seconds: list):
    """Append the wall seconds of every ``simulate_cluster`` call ``predict`` makes."""
    inner = whatif.pipeline.simulate_cluster

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    whatif.pipeline.simulate_cluster = timed
    try:
        yield
    finally:
        whatif.pipeline.simulate_cluster = inner


def grid_scenario(path: Path) -> Scenario:
    """The scenario file's 4 x 2 x 3 grid less 1x2, which Daydream's grid leaves out."""
    scenario = Scenario.from_file(path)
    scenario.points = [p for p in scenario.points if (p.cluster.machines, p.cluster.gpus_per_machine) in GRID]
    return scenario


def time_prediction(load, path: Path) -> tuple[Prediction, float, list]:
    """The prediction, the seconds it took from the scenario file, and those of each configuration."""
    per_point: list = []
    with timing_simulate_cluster(per_point):
        t0 = time.perf_counter()
        outcome = predict(load(path).request())
        total = time.perf_counter() - t0
    return outcome, total, per_point


def best_and_median(samples: list) -> str:
    return f"best {min(samples):7.3f} s   median {statistics.median(samples):7.3f} s"


def markdown_table(outcome: Prediction) -> str:
    """Iteration time and speed-up over 1x1 of each configuration, one column per bandwidth."""
    frame = outcome.results
    gbps = sorted(frame["inter_node_gbps"].unique())
    head = ["machines x GPUs", "workers"] + [f"iteration ms, {g:g} Gbps" for g in gbps] + [f"speed-up, {g:g} Gbps" for g in gbps]
    lines = ["| " + " | ".join(head) + " |", "|---|--:|" + "--:|" * (2 * len(gbps))]
    for machines, gpus in GRID:
        rows = frame[(frame["machines"] == machines) & (frame["gpus_per_machine"] == gpus)].set_index("inter_node_gbps")
        cells = [f"{rows.at[g, 'iteration_ms']:.1f}" for g in gbps] + [f"{rows.at[g, 'speedup']:.2f}" for g in gbps]
        lines.append(f"| {machines}x{gpus} | {machines * gpus} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, metavar="FILE", help="trace of one worker (default: the shared ResNet-50 V100 trace)")
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs of each measurement (default: 3)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not args.trace.is_file():
        print(f"cluster_speed: error: trace {args.trace}: no such file", file=sys.stderr)
        return 2

    trace = args.trace.resolve()
    print(f"code:    {code_version()}")
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}, {platform.system()} {platform.release()}")
    print(f"load:    {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min averages at the start)")
    print(f"trace:   {os.path.relpath(trace, REPO)}")
    print(f"runs:    {args.runs} timed, each from the scenario file to the results table")
    print()

    with tempfile.TemporaryDirectory(prefix="cluster_speed.") as tmp:
        grid_path, large_path = Path(tmp) / "grid.yaml", Path(tmp) / "large.yaml"
        grid_path.write_text(GRID_YAML.format(trace=trace))
        large_path.write_text(LARGE_YAML.format(trace=trace, machines=LARGE[0], gpus=LARGE[1]))
        trace.read_bytes()  # into the page cache, as for any later run
        grid_runs = [time_prediction(grid_scenario, grid_path) for _ in range(args.runs)]
        large_runs = [time_prediction(Scenario.from_file, large_path) for _ in range(args.runs)]

    outcome = grid_runs[0][0]
    grid_s = [total for _, total, _ in grid_runs]
    large_s = [total for _, total, _ in large_runs]
    print(f"grid: {len(outcome.results)} configurations (1x1 .. 4x2 x 10, 20, 40 Gbps), Horovod, FIFO")
    print(f"  {'Scenario.from_file + predict':<36}{best_and_median(grid_s)}")
    per_point = [statistics.median(run[2][i] for run in grid_runs) for i in range(len(outcome.results))]
    print(f"  {'of which the 21 simulate_cluster':<36}median sum {sum(per_point):7.3f} s")
    print("  per configuration (simulate_cluster, median):")
    for row, seconds in zip(outcome.results.itertuples(), per_point):
        print(f"    {row.machines}x{row.gpus_per_machine} {row.inter_node_gbps:>4g} Gbps  {seconds:6.3f} s")
    print()
    large = large_runs[0][0].results.iloc[0]
    print(f"large: {LARGE[0]} machines x {LARGE[1]} GPUs = {int(large.workers)} workers at 40 Gbps, Horovod, FIFO")
    print(f"  {'Scenario.from_file + predict':<36}{best_and_median(large_s)}")
    print(f"  predicted iteration {large.iteration_ms:.2f} ms, speed-up {large.speedup:.1f} "
          f"(1x1 {large_runs[0][0].iteration_ms:.2f} ms)")
    print()
    print(f"grid predictions (1x1 iteration {outcome.iteration_ms:.2f} ms; {outcome.bytes_per_iteration / 1e6:.1f} MB of gradients, {outcome.gradient_source}):")
    print()
    print(markdown_table(outcome))
    print()

    failures = statistics.median(grid_s) > GRID_TARGET_S or statistics.median(large_s) > LARGE_TARGET_S
    summary = (f"grid of 21 median {statistics.median(grid_s):.3f} s (target <= {GRID_TARGET_S:.0f} s), "
               f"{LARGE[0]}x{LARGE[1]} median {statistics.median(large_s):.3f} s (target <= {LARGE_TARGET_S:.0f} s) "
               f"on this {os.cpu_count()}-CPU machine")
    print(f"{'FAIL' if failures else 'PASS'}: {summary}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
