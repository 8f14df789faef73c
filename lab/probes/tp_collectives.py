"""How long tensor parallelism's all-reduce takes as DTensor issues it, beside ``dist.all_reduce``.

An exploration, run by hand on the lab's box (two ranks over Gloo on loopback, each pinned to a
core of its own as ``lab/cluster.py``'s ``pin`` pins a 1 x 2 setting; Gloo's threads share the
rank's core):

    sudo flock /work/wt/lab.lock nice -n -20 .venv/bin/python -m whatif.lab.probes.tp_collectives [SIZE_BYTES]

Each way of all-reducing ``SIZE_BYTES`` (default 512 kB, the transformer's activation at batch
8) is timed ``REPEATS`` times, each after a barrier (idle) and in a loop where every rank
computes ``COMPUTE_MS`` of matrix products before each all-reduce without a barrier (as a TP
step's forward does between its row-parallel layers):

* ``dist``: ``dist.all_reduce`` (what ``whatif lab calibrate`` times);
* ``functional``: ``torch.ops._c10d_functional.all_reduce`` then ``wait_tensor`` (what DTensor's
  ``Partial -> Replicate`` redistribution calls);
* ``dtensor``: a ``Partial`` DTensor's ``redistribute(Replicate)``, waited on;
* ``exchange``: both ranks send ``SIZE_BYTES`` to each other and receive at once
  (``batch_isend_irecv``, what ``whatif lab calibrate`` times as ``send_recv``);
* ``one_way``: rank 0 sends, rank 1 receives (``batch_isend_irecv`` of one op each, as
  ``torch.distributed.pipelining`` moves an activation between two stages).

* ``dtensor_gather`` and ``dtensor_scatter``: sequence parallelism's ``Shard(1) -> Replicate``
  and ``Partial -> Shard(1)`` of the activation.

After compute each way is also timed in the training thread's CPU (``thread_cpu``,
``time.thread_time``): what the library spends on the host per collective, the transfer's wait
left out. With ``TP_PROBE_WORLD=1`` the DTensor ways run on a mesh of one, which skips the
collective (``lab/parallel.py``'s ``measure_collective_issue`` takes the difference).

Rank 0 prints one line per way and setting: the median and the quartiles in milliseconds
(``one_way``: rank 0 is the receiver). ``lab/cluster.py``'s ``run_job`` runs it across the
emulated machines (``TP_PROBE_WORKER=1`` in the job's environment).

What it found on the lab's box (2026-11-28, loopback, nice -20, the lab lock): at 512 kB the
three ways of all-reducing took the same, medians 3.6, 3.0 and 3.7 ms idle and 3.7, 3.4 and
3.9 ms after compute (quartiles 1.1 to 5.5: Gloo's small all-reduces on loopback take either
about 1.5 or about 3.7 ms), so DTensor's functional collectives cost what ``dist.all_reduce``
costs and the calibrated all-reduce prices them; at 128 kB the exchange took 1.3 ms idle and
2.6 ms after compute, the one-way send 0.3 and 0.7 ms, which is why the collectives probe times
a one-way ``send`` for the pipeline's transfers. On 2026-12-03 (loopback, 512 kB, a box 1.5x
faster than that day's): the training thread's CPU per collective after compute 0.18 ms for
``dist.all_reduce``, 0.31 functional, 0.60 to 0.75 DTensor's all-reduce, 0.69 to 0.91 its
all-gather and 0.72 to 1.13 its reduce-scatter, against 0.25 to 0.29 on a mesh of one; and
``dist.all_reduce`` took 0.63 ms idle but 3.87 ms after compute (quartiles 2.35 to 3.99): a
collective that follows compute waits about a tick for threads to wake on a core gone idle.
With a ``SCHED_IDLE`` spinner on each core it took 0.61 ms after compute, but the spinners
slowed every lab run (one-worker steps 15 to 30 %, two-rank TP steps 18 to 69 %), so the lab
does not use them (``docs/validation/parallel.md``, "Campaign F").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

REPEATS = 40
COMPUTE_MS = 8.0


def quartiles(values: list) -> tuple:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def worker(size: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    elements = size // 4
    a = torch.randn(192, 192)

    def compute(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            torch.mm(a, a)

    def by_dist():
        t = torch.ones(elements)
        dist.all_reduce(t)

    def by_functional():
        t = torch.ones(elements)
        out = torch.ops._c10d_functional.all_reduce(t, "sum", dist.group.WORLD.group_name)
        torch.ops._c10d_functional.wait_tensor(out)

    def by_dtensor():
        t = DTensor.from_local(torch.ones(elements), mesh, [Partial()])
        t.redistribute(mesh, [Replicate()]).to_local().add_(0)

    world = dist.get_world_size()
    rows = 16 * world  # the transformer's activation is [batch, sequence, hidden]; shard its sequence

    def by_dtensor_gather():  # sequence parallelism's all-gather: Shard(1) -> Replicate
        t = DTensor.from_local(torch.ones(8, rows // world, elements // (8 * rows)), mesh, [Shard(1)])
        t.redistribute(mesh, [Replicate()]).to_local().add_(0)

    def by_dtensor_scatter():  # its reduce-scatter: Partial -> Shard(1)
        t = DTensor.from_local(torch.ones(8, rows, elements // (8 * rows)), mesh, [Partial()])
        t.redistribute(mesh, [Shard(1)]).to_local().add_(0)

    peer = 1 - rank
    into = torch.empty(elements)

    def by_exchange():  # the calibration's send_recv: both ranks send and receive at once
        ops = [dist.P2POp(dist.isend, torch.ones(elements), peer), dist.P2POp(dist.irecv, into, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def by_one_way():  # a pipeline's activation: rank 0 sends, rank 1 receives
        op = dist.P2POp(dist.isend, torch.ones(elements), peer) if rank == 0 else dist.P2POp(dist.irecv, into, peer)
        for work in dist.batch_isend_irecv([op]):
            work.wait()

    results = {}
    ways = (("dist", by_dist), ("functional", by_functional), ("dtensor", by_dtensor),
            ("dtensor_gather", by_dtensor_gather), ("dtensor_scatter", by_dtensor_scatter), ("exchange", by_exchange),
            ("one_way", by_one_way))
    if world == 1:  # a mesh of one: DTensor's own host path, no collective (what the dispatch measurement sees)
        ways = tuple((name, op) for name, op in ways if name.startswith("dtensor"))
    for name, op in ways:
        for _ in range(3):
            op()
        idle = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            op()
            idle.append((time.perf_counter() - start) * 1e3)
        dist.barrier()
        looped, cpu = [], []
        for _ in range(REPEATS):
            compute(COMPUTE_MS)
            start, thread = time.perf_counter(), time.thread_time()
            op()
            cpu.append((time.thread_time() - thread) * 1e3)
            looped.append((time.perf_counter() - start) * 1e3)
        results[name] = {"idle": quartiles(idle), "after_compute": quartiles(looped), "thread_cpu": quartiles(cpu)}
    if rank == 0:
        for name, r in results.items():
            for where, (q1, med, q3) in r.items():
                print(f"{name:15} {where:14} median {med:7.2f} ms  (quartiles {q1:.2f} to {q3:.2f})", flush=True)
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(size: int, world: int = 2) -> int:
    from whatif.lab.cluster import carry_priority

    carry_priority()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(["taskset", "-c", str(rank), sys.executable, "-m", __spec__.name, str(size)],
                              env=dict(env, RANK=str(rank), TP_PROBE_WORKER="1")) for rank in range(world)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    size_bytes = int(float(sys.argv[1])) if len(sys.argv) > 1 else 512 * 1024
    if os.environ.get("TP_PROBE_WORKER"):
        worker(size_bytes)
    else:
        sys.exit(launch(size_bytes, int(os.environ.get("TP_PROBE_WORLD", "2"))))
