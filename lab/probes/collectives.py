"""A worker that times the collectives the parallel families call, on Gloo, at several sizes.

Started by the lab as every worker of a job (``python -m whatif.lab.probes.collectives
SIZE_BYTES ...``). Each size is timed, on an otherwise idle worker, for what
``examples/parallel.py``'s families run through ``torch.distributed`` on Gloo:

* ``all_gather``: ``all_gather_into_tensor`` (FSDP2's parameter gathers, sequence
  parallelism's), ``SIZE`` the gathered tensor, each rank giving ``SIZE / n``;
* ``reduce_scatter``: ``reduce_scatter_tensor`` (FSDP2's gradients, sequence parallelism's),
  ``SIZE`` the tensor every rank reduces;
* ``all_to_all``: ``all_to_all_single`` with equal splits (expert parallelism's dispatch and
  combine), ``SIZE`` a rank's send buffer;
* ``send_recv``: every rank sends ``SIZE`` to the next and receives as much from the previous at
  once (``batch_isend_irecv``, as ``torch.distributed.pipelining`` posts a stage's sends and
  receives);
* ``send``: rank 1 sends ``SIZE`` to rank 0, which receives it, nothing the other way (a
  pipeline's activation between two stages; ``batch_isend_irecv`` of one op on each side); the
  receiver's time. On the lab's loopback at 128 kB a one-way transfer took 0.3 to 0.7 ms where
  the exchange above took 1.3 to 2.6 (``lab/probes/tp_collectives.py``);
* ``all_reduce``: ``all_reduce`` (tensor parallelism's), timed beside them so that they can be
  compared in the same run.

The nccl-tests convention for ``SIZE`` is ``topology/cost.py``'s. Rank 0 writes
``$WHATIF_LAB_OUT/collectives.json``: ``sizes_bytes``, ``world_size`` and, per op,
``seconds`` (the mean of ``REPEATS`` after one that warms the connections, each started
after a barrier: between two machines Gloo runs the two directions of an exchange at once or
one after the other, and the mean, not a median that picks one mode, is the op's expected time).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

REPEATS = 5
OPS = ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "send", "all_reduce")


def run_op(dist, torch, op: str, size: int):
    """A function that runs ``op`` once on buffers of ``size`` bytes (nccl-tests' convention)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    elements = max(size // 4 // n, 1) * n  # a multiple of the ranks, as the ops need
    whole, shard = torch.ones(elements), torch.ones(elements // n)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, shard)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, whole)
    if op == "all_to_all":
        out = torch.empty(elements)
        return lambda: dist.all_to_all_single(out, whole)
    if op == "send_recv":
        into = torch.empty(elements)

        def exchange():
            ops = [dist.P2POp(dist.isend, whole, (rank + 1) % n), dist.P2POp(dist.irecv, into, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return exchange
    if op == "send":
        into = torch.empty(elements)
        one = {1: dist.P2POp(dist.isend, whole, 0), 0: dist.P2POp(dist.irecv, into, 1)}.get(rank)

        def one_way():
            if one is not None:
                for work in dist.batch_isend_irecv([one]):
                    work.wait()
        return one_way
    return lambda: dist.all_reduce(whole)


def time_op(dist, torch, op: str, sizes: list) -> list:
    """Mean seconds of ``op`` at each size."""
    seconds = []
    for size in sizes:
        run = run_op(dist, torch, op, size)
        run()  # warm the connections for this size
        repeats = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            run()
            repeats.append(time.perf_counter() - start)
        seconds.append(statistics.fmean(repeats))
    return seconds


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    sizes = [int(float(a)) for a in argv]
    record = {"sizes_bytes": sizes, "world_size": dist.get_world_size()}
    for op in OPS:
        record[op] = time_op(dist, torch, op, sizes)
    if dist.get_rank() == 0:
        with open(os.path.join(os.environ["WHATIF_LAB_OUT"], "collectives.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()  # leave together: tearing Gloo down under a peer can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
