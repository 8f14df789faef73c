"""A worker that times Gloo all-reduces of several sizes, for calibrating the lab's network.

Started by the lab as every worker of a job (``python -m whatif.lab.probes.allreduce
SIZE_BYTES ...``). Each size is timed twice: on an otherwise idle worker, and while a thread of
the same process computes without pause (matrix products on the core the worker is pinned to, as
a training step's backward pass would while its gradients are all-reduced). The computing thread
also counts its products, during the all-reduces and in a window just before each of them, as
long as that size's idle all-reduce, which says how much the communication slows the compute
down. The windows alternate with the all-reduces because this machine's speed drifts: with one
half-second window before them all, the rate alone came out at 1 866 products a second in one
calibration and 2 816 in the next, and the compute slowdown of two workers sharing a machine at
1.0 and 1.55 (three calibrations with these windows: 1.50 to 1.53). The thread does not pause
between them: the kernel favours a thread that has slept, and a compute thread paused for each
idle all-reduce and woken for the busy one lost 1.16 to 1.22 times its rate and slowed the
all-reduces 2.1 to 2.5 times, where a training step's backward pass computes without pause. Rank
0 writes ``$WHATIF_LAB_OUT/allreduce.json``: ``sizes_bytes``, ``seconds`` (idle) and
``seconds_busy`` (medians of several repetitions), and ``compute_rate_alone`` /
``compute_rate_during_comm`` (products per second, over all the windows of each kind).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

REPEATS = 5
MIN_WINDOW_S = 0.02  # the shortest compute window alone: a product takes about 0.4 ms


class Compute:
    """A thread multiplying matrices until stopped, counting the products."""

    def __init__(self, torch):
        self.torch, self.count, self.stopped = torch, 0, False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        a = self.torch.randn(256, 256)
        while not self.stopped:
            self.torch.mm(a, a)
            self.count += 1


class Rate:
    """Products counted over seconds, summed over windows."""

    def __init__(self):
        self.products, self.seconds = 0, 0.0

    def add(self, products: int, seconds: float) -> None:
        self.products, self.seconds = self.products + products, self.seconds + seconds

    @property
    def per_second(self) -> float:
        return self.products / self.seconds if self.seconds else float("nan")


def time_allreduces(dist, torch, sizes, compute=None, idle_seconds=None) -> tuple[list, Rate, Rate]:
    """Median all-reduce time per size; with ``compute`` running, its rates alone (in a window
    as long as the size's idle all-reduce, ``idle_seconds``, before each repetition) and during
    the all-reduces."""
    seconds, alone, during = [], Rate(), Rate()
    for index, size in enumerate(sizes):
        tensor = torch.ones(max(size // 4, 1))
        dist.all_reduce(tensor)  # warm the connections for this size
        repeats = []
        for _ in range(REPEATS):
            dist.barrier()
            if compute:
                before, start = compute.count, time.perf_counter()
                time.sleep(max(idle_seconds[index], MIN_WINDOW_S))
                alone.add(compute.count - before, time.perf_counter() - start)
                dist.barrier()
            before = compute.count if compute else 0
            start = time.perf_counter()
            dist.all_reduce(tensor)
            repeats.append(time.perf_counter() - start)
            if compute:
                during.add(compute.count - before, repeats[-1])
        seconds.append(statistics.median(repeats))
    return seconds, alone, during


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    sizes = [int(float(a)) for a in argv]
    idle, _, _ = time_allreduces(dist, torch, sizes)
    compute = Compute(torch)
    compute.thread.start()
    busy, alone, during = time_allreduces(dist, torch, sizes, compute, idle)
    compute.stopped = True
    compute.thread.join()
    if dist.get_rank() == 0:
        out = os.environ["WHATIF_LAB_OUT"]
        with open(os.path.join(out, "allreduce.json"), "w") as f:
            json.dump({
                "sizes_bytes": sizes, "seconds": idle, "seconds_busy": busy, "world_size": dist.get_world_size(),
                "compute_rate_alone": alone.per_second, "compute_rate_during_comm": during.per_second,
            }, f)
    dist.barrier()  # leave together: tearing Gloo down under a peer can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
