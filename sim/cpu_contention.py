"""Communication and computation on the same CPU core slowing each other down.

Where the workers' own CPU cores drive the link (Gloo on CPU workers: the TCP stack and the
reductions run on the core that also computes), a transfer takes longer while the worker's CPU
computes and CPU work takes longer while a transfer is in flight (``Link.comm_slowdown`` /
``compute_slowdown``, measured by ``whatif lab calibrate``). The link that applies is the one
the worker talks over: the NIC across machines, loopback inside one (:func:`driving_link`).
A simulated cluster is re-simulated until the two settle (:func:`with_cpu_contention`).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pandas as pd

from whatif.topology import Cluster, Link

from .engine import Schedule, simulate
from .graph import TaskGraph, cpu_work

_CONTENTION_PASSES = 4


def driving_link(cluster: Cluster) -> Link:
    """The link whose CPU contention applies: the NIC across machines, loopback inside one."""
    return cluster.inter_node if cluster.machines > 1 else cluster.intra_node


def with_cpu_contention(graph: TaskGraph, schedule: Schedule, comm: np.ndarray, size: dict, link: Link,
                        policies_for: Callable[[dict], dict], n: int, polling_thread: Optional[str] = None) -> Schedule:
    """Re-simulate with communication and CPU work slowing each other where they overlapped.

    Worker 0's core is busy while it runs CPU work, and, where ``polling_thread`` is named
    (Horovod's), while that thread waits for communication: Horovod's ``synchronize()`` spins on
    ``sched_yield`` until the all-reduce is done, so the transfers it waits for share the core
    as they would with compute (DDP's wait blocks). A transfer that overlaps a busy core for a
    fraction ``f`` of its time lasts
    ``1 + (comm_slowdown - 1) f`` times as long, with the link's slowdown at the size of the
    all-reduce it went in (a fused batch's, whose bytes are priced as that many more; the
    tensors still fuse by their own bytes); a CPU task overlapping communication for a fraction
    ``g`` lasts
    ``1 + (compute_slowdown - 1) g`` times as long. The overlaps come from the previous
    schedule and the factors always apply to the uncontended durations, so the passes settle
    on a schedule consistent with its own overlaps (a few passes; the loop stops when the
    makespan moves less than 0.1 %).
    """
    tasks = graph.tasks
    base = tasks["duration_us"].to_numpy(dtype=float).copy()
    comm_bytes = np.array([size[t] for t in comm.tolist()], dtype=float)
    comm_resource = tasks["resource"].astype(str).to_numpy()[comm]
    cpu = cpu_work(tasks)
    worker0_cpu = cpu[cpu < n]
    waits = _CommWaits(graph, comm, polling_thread) if polling_thread else None
    for _ in range(_CONTENTION_PASSES):
        wait_start, wait_end = waits.intervals(schedule) if waits else ([], [])
        busy = Intervals(np.concatenate([schedule.start_us[worker0_cpu], wait_start]),
                      np.concatenate([schedule.end_us[worker0_cpu], wait_end]))
        in_flight = Intervals(schedule.start_us[comm], schedule.end_us[comm])
        batch_bytes = fused_bytes(comm_resource, schedule.start_us[comm], schedule.end_us[comm], comm_bytes)
        comm_factor = 1 + (link.comm_slowdown_at(batch_bytes) - 1) * busy.fraction_of(schedule.start_us[comm], schedule.end_us[comm])
        cpu_factor = 1 + (link.compute_slowdown - 1) * in_flight.fraction_of(schedule.start_us[cpu], schedule.end_us[cpu])
        duration = base.copy()
        duration[comm] *= comm_factor
        duration[cpu] *= cpu_factor
        tasks["duration_us"] = duration
        priced = dict(zip(comm.tolist(), (comm_bytes * comm_factor).tolist()))
        previous = schedule.makespan_us
        schedule = simulate(graph, policies_for(priced))
        if abs(schedule.makespan_us - previous) <= 1e-3 * previous:
            break
    return schedule


def fused_bytes(resource: np.ndarray, start_us: np.ndarray, end_us: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The bytes of the all-reduce each transfer went in: transfers on one resource that start
    and end together were fused into one."""
    start_us, end_us = np.asarray(start_us, dtype=float), np.asarray(end_us, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    if not len(nbytes):
        return np.zeros(0)
    whole = bool(np.all(nbytes >= 0) and np.all(nbytes == np.floor(nbytes)) and nbytes.sum() < 2**53)
    if not whole or np.isnan(start_us).any() or np.isnan(end_us).any():
        # pandas' rules for missing keys and values (a row without a time has no batch), and its
        # compensated sum for fractional bytes (scaled gradients, P3's slices), whose plain sum
        # may differ in the last bit; whole bytes sum exactly in any order
        batches = pd.DataFrame({"resource": resource, "start": start_us, "end": end_us, "nbytes": nbytes})
        return batches.groupby(["resource", "start", "end"])["nbytes"].transform("sum").to_numpy(dtype=float)
    _, code = np.unique(np.asarray(resource), return_inverse=True)
    order = np.lexsort((end_us, start_us, code.ravel()))  # stable: a batch's transfers in their own order
    key = (code.ravel()[order], start_us[order], end_us[order])
    first = np.flatnonzero(np.r_[True, (key[0][1:] != key[0][:-1]) | (key[1][1:] != key[1][:-1])
                                 | (key[2][1:] != key[2][:-1])])
    total = np.empty(len(nbytes))
    total[order] = np.repeat(np.add.reduceat(nbytes[order], first), np.diff(np.r_[first, len(nbytes)]))
    return total


class _CommWaits:
    """Worker 0's waits on ``thread`` for communication in a schedule: from the end of the task
    before one that a transfer feeds to that task's start. Which tasks those are does not change
    from one contention pass to the next; only their times do."""

    def __init__(self, graph: TaskGraph, comm: np.ndarray, thread: str):
        resource = graph.tasks["resource"].astype(str).to_numpy()
        self.on_thread = np.flatnonzero(resource == thread)
        edges = graph.edges
        self.fed_by_comm = np.isin(self.on_thread, edges["dst"].to_numpy()[np.isin(edges["src"].to_numpy(), comm)])

    def intervals(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        """Start and end times of the waits."""
        order = np.argsort(schedule.start_us[self.on_thread], kind="stable")
        tasks = self.on_thread[order]
        waiting = self.fed_by_comm[order][1:]
        starts, ends = schedule.end_us[tasks[:-1]][waiting], schedule.start_us[tasks[1:]][waiting]
        return starts[ends > starts], ends[ends > starts]


class Intervals:
    """A set of time intervals, merged, for measuring how much of another interval it covers."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        order = np.argsort(starts, kind="stable")
        merged_start, merged_end = [], []
        for a, b in zip(starts[order].tolist(), ends[order].tolist()):
            if merged_end and a <= merged_end[-1]:
                merged_end[-1] = max(merged_end[-1], b)
            else:
                merged_start.append(a)
                merged_end.append(b)
        self.start = np.asarray(merged_start)
        self.end = np.asarray(merged_end)
        self.before = np.concatenate([[0.0], np.cumsum(self.end - self.start)])  # covered before each interval

    def covered_until(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.start, t, side="right")  # intervals starting at or before t
        last = np.maximum(i - 1, 0)
        partial = np.where(i > 0, np.clip(t - self.start[last], 0, self.end[last] - self.start[last]), 0.0)
        return self.before[last] * (i > 0) + partial

    def fraction_of(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        length = ends - starts
        covered = self.covered_until(ends) - self.covered_until(starts)
        return np.where(length > 0, covered / np.where(length > 0, length, 1), 0.0)
