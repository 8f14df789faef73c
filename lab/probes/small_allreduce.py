"""A worker that times Gloo's small all-reduces, one at a time and in a burst, for calibrating
the floor of the lab's all-reduce (``topology.Link.floors_us``).

Started by the lab as every worker of a job (``whatif lab calibrate``, or by hand: ``whatif lab
run --machines 2 --framework ddp --out DIR -- python -m whatif.lab.probes.small_allreduce``).
Tensor parallelism with sequence parallelism all-reduces each replicated parameter's gradient
(the layer norms' weights and biases: about 1 kB each on the lab's transformer) one after
another in its step. The calibration's all-reduce probe (``allreduce.py``) times 64 kB and up,
and its fitted line is set by the large sizes. This probe times ``dist.all_reduce`` at
``SIZES``:

* ``single``: ``REPEATS`` all-reduces, each after a barrier;
* ``burst``: ``BURST`` all-reduces back to back, as a step issues them, ``REPEATS_BURST`` times;
  the figure is the burst's time over ``BURST``.

Rank 0 writes ``$WHATIF_LAB_OUT/small_allreduce.json``: ``sizes_bytes``, and for each way its
medians in seconds (``single``, ``burst``) and quartiles (``single_q1``, ``single_q3``, ...),
and prints a line per size.

What it found on the lab's box (2026-11-28, nice -20, the lab lock): up to 64 kB every
all-reduce took 2.1 to 3.4 ms each in a burst, across machines at 1000 and 200 Mbps and on
loopback alike, where the line fitted over 64 kB to 64 MB prices 1 kB at 0.97 ms (1000 Mbps)
and 0.52 ms (200 Mbps); one at a time they took either about 0.45 or about 3.9 ms (quartiles
0.4 to 4.1), so the burst, the mean of many, is the figure. From 256 kB on both ways agree
with the line (1 MB: 9.7 ms against 9.8 at 1000 Mbps, 45 against 45 at 200).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

SIZES = (1024, 4096, 16384, 65536, 262144, 1048576)
REPEATS = 40
BURST = 24
REPEATS_BURST = 10


def _quartiles(values: list) -> list:
    q = statistics.quantiles(values, n=4)
    return [q[0], statistics.median(values), q[2]]


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"sizes_bytes": list(SIZES)}
    for way in ("single", "burst"):
        results.update({way: [], f"{way}_q1": [], f"{way}_q3": []})
    for size in SIZES:
        tensors = [torch.ones(size // 4) for _ in range(BURST)]
        for t in tensors[:3]:
            dist.all_reduce(t)
        single = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensors[0])
            single.append(time.perf_counter() - start)
        burst = []
        for _ in range(REPEATS_BURST):
            dist.barrier()
            start = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            burst.append((time.perf_counter() - start) / BURST)
        for way, values in (("single", single), ("burst", burst)):
            q1, median, q3 = _quartiles(values)
            results[way].append(median)
            results[f"{way}_q1"].append(q1)
            results[f"{way}_q3"].append(q3)
        if rank == 0:
            s, b = _quartiles(single), _quartiles(burst)
            print(f"{size:>8} B  single median {s[1] * 1e3:6.2f} ms ({s[0] * 1e3:.2f} to {s[2] * 1e3:.2f})"
                  f"  burst of {BURST} {b[1] * 1e3:6.2f} ms each ({b[0] * 1e3:.2f} to {b[2] * 1e3:.2f})", flush=True)
    if rank == 0:
        (out_dir / "small_allreduce.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(os.environ["WHATIF_LAB_OUT"]))
