"""How fast this machine runs the same operators from one process to the next.

Most figures under ``bench/`` compare timings taken in different processes: a capture against
a real cluster run, one operator sweep against another. On a shared virtual machine the host decides how fast a
process runs, and it does not decide the same way twice. This script starts ``--processes``
fresh Python processes one after another, pinned to one core, and each times the same few
operators (one torch thread; the fastest of many back-to-back calls, in thread CPU time):

- ``gelu_backward`` of [4, 64, 1024] (1 MB, vector arithmetic: an ``erf`` and an ``exp`` per element);
- a 256 x 256 x 256 GEMM (fused multiply-adds on data in the core's cache);
- ``add_`` of 8 M elements (32 MB, beyond the last-level cache: memory bandwidth).

It prints each process's timings and, per operator, the slowest over the fastest process. On a
quiet dedicated machine that is a few percent; where it is far above the 5 % the validations aim
for, their figures move by as much from one run to the next, whatever the model predicts.

:func:`probe` is also what the batch-size validation records in every round it starts.
``--results OUT/results.json`` reads such a record instead and prints, per probe operator, how
well a round's probe (its slower of before and after, over the host's fast state) tells how
slow its real run at the model's own batch size was (its median over the fastest round's of the
same model): the correlation, over every round. Near zero, the probes do not see what slows a run.

    .venv/bin/python bench/host_speed.py [--processes 10] [--pause 5] [--cpu 0]
    .venv/bin/python bench/host_speed.py --results bench/out/batch_size_validation/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from whatif.sim.perfmodels.sweep import fastest_call_us

CALLS = 30


def probe() -> dict:
    """The fastest of :data:`CALLS` back-to-back calls of each probe operator, in microseconds of
    this thread's CPU time, on one torch thread."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grad, x = torch.randn(4, 64, 1024), torch.randn(4, 64, 1024)
        a, b = torch.rand(256, 256), torch.rand(256, 256)
        big, other = torch.rand(8 * 2**20), torch.rand(8 * 2**20)
        calls = {
            "gelu_backward_us": lambda: torch.ops.aten.gelu_backward(grad, x),
            "gemm_256_us": lambda: torch.mm(a, b),
            "add_32MB_us": lambda: big.add_(other),
        }
        return {name: round(fastest_call_us(call, CALLS), 1) for name, call in calls.items()}
    finally:
        torch.set_num_threads(previous)


def probe_in_fresh_processes(count: int, pause_s: float = 0.0, cpu: Optional[int] = None, progress=None) -> list[dict]:
    """:func:`probe` in ``count`` fresh processes, one after another, ``pause_s`` apart, each
    pinned to core ``cpu`` where one is given; ``progress`` sees each process's probe as it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    runs = []
    for n in range(count):
        if n:
            time.sleep(pause_s)
        done = subprocess.run(pin + [sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                              check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if progress:
            progress(n, runs[-1])
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between processes")
    parser.add_argument("--cpu", type=int, default=0, help="the core every process is pinned to")
    parser.add_argument("--results", type=Path, help="a batch-size validation's results.json to read instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(probe()))
        return 0
    if args.results:
        print_probe_correlation(json.loads(args.results.read_text()))
        return 0
    print(f"load:    {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min averages at the start)")
    runs = probe_in_fresh_processes(
        args.processes, args.pause, args.cpu,
        lambda n, run: print(f"process {n + 1:2d}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()), flush=True))
    print()
    for name in runs[0]:
        times = [run[name] for run in runs]
        print(f"{name}: fastest {min(times):.1f}, slowest {max(times):.1f} "
              f"(slowest / fastest {max(times) / min(times):.2f})")
    return 0


def print_probe_correlation(results: dict) -> None:
    fast = results["host_fast_state_us"]
    slowness, probed = [], {name: [] for name in fast}
    for point in results["per_round"]:
        if point["batch"] != point["from"]:
            continue  # a round is one process: its batch size B0 stands for it
        for median, probes in zip(point["real_ms"], point["probes"]):
            slowness.append(median / min(point["real_ms"]))
            for name in fast:
                probed[name].append(max(p[name] for p in probes) / fast[name])
    print(f"{len(slowness)} rounds; their real run's median at B0 over the fastest round's: "
          f"{min(slowness):.2f} to {max(slowness):.2f}")
    if len(slowness) < 3:
        print("too few rounds for a correlation")
        return
    for name, ratios in probed.items():
        print(f"{name}: probe over the fast state {min(ratios):.2f} to {max(ratios):.2f}; "
              f"correlation with the run's slowness {np.corrcoef(ratios, slowness)[0, 1]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
