"""A worker that measures the CPU time Horovod's background loop takes from a worker's core.

Horovod's background thread wakes once per cycle (``HOROVOD_CYCLE_TIME``) and coordinates with
the other workers even when no tensor is waiting: with Gloo, a few small collectives over TCP.
On a CPU worker pinned to its own core that thread shares the core with the training step, so
forward and backward run slower than in a single-worker trace, by the loop's CPU time per cycle
over the cycle. A 1x2 vgg run in the lab showed it: its forward took 70 to 72 ms of wall time
for 66 ms of the training thread's CPU.

Started by the lab as every worker of a Horovod job (``python -m
whatif.lab.probes.horovod_loop``). Each worker multiplies matrices on its training thread
for ``LOOP_S`` seconds after ``hvd.init()`` and counts the CPU time the process's other threads
took meanwhile. Rank 0 writes ``$WHATIF_LAB_OUT/horovod_loop.json``: the cycle time and, per
rank, the other threads' CPU time per cycle in microseconds.
"""

from __future__ import annotations

import json
import os
import time

LOOP_S = 2.0


def other_threads_cpu_s(seconds: float, torch) -> tuple[float, float]:
    """Compute for ``seconds`` on this thread; the other threads' CPU time and the wall time."""
    a = torch.randn(256, 256)
    process, thread, start = time.process_time(), time.thread_time(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, a)
    wall = time.perf_counter() - start
    return max((time.process_time() - process) - (time.thread_time() - thread), 0.0), wall


def main() -> None:
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm-up")  # the loop's first cycles set up its caches
    cycle_ms = float(os.environ.get("HOROVOD_CYCLE_TIME", "1"))
    cpu_s, wall_s = other_threads_cpu_s(LOOP_S, torch)
    per_cycle_us = cpu_s / (wall_s * 1e3 / cycle_ms) * 1e6
    per_rank = hvd.allgather_object(per_cycle_us)
    if hvd.rank() == 0:
        with open(os.path.join(os.environ["WHATIF_LAB_OUT"], "horovod_loop.json"), "w") as f:
            json.dump({"cycle_ms": cycle_ms, "cpu_us_per_cycle": per_rank}, f)
    hvd.allreduce(torch.ones(1), name="leave")  # leave together
    hvd.shutdown()


if __name__ == "__main__":
    main()
