"""A worker that times Gloo all-reduces of several sizes, for calibrating the lab's network.

Started by the lab as every worker of a job (``python -m whatif.collectors.allreduce_probe
SIZE_BYTES ...``). Each size is timed twice: on an otherwise idle worker, and while a thread of
the same process computes (matrix products on the core the worker is pinned to, as a training
step's backward pass would while its gradients are all-reduced). The computing thread also
counts its products, alone and during the all-reduces, which says how much the communication
slows the compute down. Rank 0 writes ``$WHATIF_LAB_OUT/allreduce.json``: ``sizes_bytes``,
``seconds`` (idle) and ``seconds_busy`` (medians of several repetitions), and
``compute_rate_alone`` / ``compute_rate_during_comm`` (products per second).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

REPEATS = 5
ALONE_S = 0.5


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

    def rate_over(self, seconds: float) -> float:
        before, start = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - before) / (time.perf_counter() - start)


def time_allreduces(dist, torch, sizes, compute=None) -> tuple[list, float]:
    """Median all-reduce time per size; and the compute thread's rate while they ran."""
    seconds, counted, elapsed = [], 0, 0.0
    for size in sizes:
        tensor = torch.ones(max(size // 4, 1))
        dist.all_reduce(tensor)  # warm the connections for this size
        repeats = []
        for _ in range(REPEATS):
            dist.barrier()
            before = compute.count if compute else 0
            start = time.perf_counter()
            dist.all_reduce(tensor)
            repeats.append(time.perf_counter() - start)
            if compute:
                counted += compute.count - before
                elapsed += repeats[-1]
        seconds.append(statistics.median(repeats))
    return seconds, counted / elapsed if elapsed else float("nan")


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    sizes = [int(float(a)) for a in argv]
    idle, _ = time_allreduces(dist, torch, sizes)
    compute = Compute(torch)
    compute.thread.start()
    alone = compute.rate_over(ALONE_S)
    dist.barrier()
    busy, during = time_allreduces(dist, torch, sizes, compute)
    compute.stopped = True
    compute.thread.join()
    if dist.get_rank() == 0:
        out = os.environ["WHATIF_LAB_OUT"]
        with open(os.path.join(out, "allreduce.json"), "w") as f:
            json.dump({
                "sizes_bytes": sizes, "seconds": idle, "seconds_busy": busy, "world_size": dist.get_world_size(),
                "compute_rate_alone": alone, "compute_rate_during_comm": during,
            }, f)
    dist.barrier()  # leave together: tearing Gloo down under a peer can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
