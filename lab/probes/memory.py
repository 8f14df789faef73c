"""A worker that measures how much the workers sharing a memory system slow each other down.

The lab runs every worker on one box, each pinned to a core of its own, so two workers that
the cluster puts on different machines still share the box's memory: where both stream large
tensors at once (the optimizer step, which data-parallel workers run in lockstep), each gets
part of the bandwidth. A wide MLP's SGD step took 14.8 ms of CPU time on a worker alone and
24.6 to 24.9 ms on each of two workers that ran it at the same moment (a barrier before each
phase), while its forward pass, matrix products, went from 33.9 to 36.7 and 38.3 ms. A
single-worker trace sees none of it.

Started by the lab as every worker of a job (``python -m whatif.lab.probes.memory``).
Each measurement runs twice: on rank 0 while the others wait, then on every rank at once,
for ``SECONDS`` each. Streaming is an SGD momentum update over tensors far larger than the
caches (read the gradient, the momentum and the weight, write the momentum and the weight:
the traffic of the step that contends most); compute is matrix products that fit in the core's
own caches. Rank 0 writes ``$WHATIF_LAB_OUT/shared_memory.json``: ``stream_bytes_per_s_alone``,
``stream_bytes_per_s_shared`` (every rank's rate while all stream), ``gemm_flops_per_s_alone``
and ``gemm_flops_per_s_shared``, and ``world_size``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

SECONDS = 3.0
STREAM_ELEMENTS = 16 * 2**20  # 64 MB per float32 tensor, three of them
GEMM_SIZE = 256


def rate(call, work: float, seconds: float) -> float:
    """Work per second of this thread's CPU time: the median over the calls of ``seconds``."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return work / statistics.median(times)


def main() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    weight, gradient, momentum = (torch.rand(STREAM_ELEMENTS) for _ in range(3))

    def sgd_update():
        momentum.mul_(0.9).add_(gradient)
        weight.add_(momentum, alpha=-0.01)

    stream_bytes = 8 * 4 * STREAM_ELEMENTS  # mul_: 2 passes, add_: 3, add_: 3
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    gemm_flops = 2 * GEMM_SIZE**3

    measured = {}
    for name, call, work in (("stream_bytes_per_s", sgd_update, stream_bytes), ("gemm_flops_per_s", lambda: torch.mm(a, b), gemm_flops)):
        call()
        dist.barrier()
        if rank == 0:
            measured[f"{name}_alone"] = rate(call, work, SECONDS)
        dist.barrier()
        mine = torch.tensor([rate(call, work, SECONDS)], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(every, mine)
        measured[f"{name}_shared"] = [float(t) for t in every]
    if rank == 0:
        with open(os.path.join(os.environ["WHATIF_LAB_OUT"], "shared_memory.json"), "w") as f:
            json.dump({**measured, "world_size": size}, f)
    dist.barrier()  # leave together: tearing Gloo down under a peer can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
