"""Horovod (Sergeev & Del Balso, 2018).

Messages: every gradient is a message of its own. Queue policy (:class:`HorovodCycle`): the
background thread wakes once per cycle (5 ms) and fuses what is ready on every worker into one
all-reduce of at most the fusion buffer (64 MB).

Synchronisation: ``optimizer.step()`` blocks the CPU until every all-reduce is done, and its
``synchronize()`` polls with ``sched_yield`` (Horovod 0.28's ``WaitAndClear``), so the training
thread's core stays busy while it waits (``sim/cpu_contention.py``).

Copies on a CPU worker (``copies.py``): the background thread copies the tensors of a fused
all-reduce into its fusion buffer and back out (``MEMCPY_IN_FUSION_BUFFER`` /
``MEMCPY_OUT_FUSION_BUFFER`` in its timeline) and scales the buffer by 1/workers in between; a
lone tensor is reduced in place and only scaled. They lengthen the all-reduce they belong to.

CPU costs: the background loop takes CPU time from a CPU worker's core in every cycle while it
coordinates with its peers (measured by ``whatif lab calibrate`` with
``lab/probes/horovod_loop.py``, and kept with the link it coordinates over:
``Link.framework_loop_us("horovod")``, YAML ``cpu_contention: {horovod_loop: 130us}``). The
training step gets the rest of the core: all of the worker's CPU work takes
``1 / (1 - loop / cycle)`` as long.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from whatif.topology import Cluster

from ..cpu_contention import driving_link
from ..engine import Policy
from ..gradients import Gradient
from ..graph import GraphError, TaskGraph, cpu_work
from .base import Framework, FrameworkOptions, Message

FUSED_PASSES = 3  # copy in, scale, copy out
LONE_PASSES = 1  # scale in place


class Horovod(Framework):
    name = "horovod"
    spins_while_waiting = True

    def split(self, gradients: list[Gradient], forward: dict, options: FrameworkOptions) -> list[Message]:
        return [
            Message(g.name, g.nbytes, g.ready_after, forward[id(g)], g.iteration, layers=[forward[id(g)]])
            for g in gradients
        ]

    def queue_policy(self, inner: Policy, nbytes: Sequence[float], priced: Sequence[float], options: FrameworkOptions,
                     cost_us: Callable[[float], float], pass_bytes_per_us: Optional[float], sliced: bool) -> Policy:
        if sliced:
            return inner
        copy_us = copy_time_us(pass_bytes_per_us) if pass_bytes_per_us else None
        return HorovodCycle(inner, nbytes, options.fusion_buffer_bytes, options.cycle_time_us, cost_us, copy_us, priced)

    def add_cpu_costs(self, worker: TaskGraph, cluster: Cluster, options: FrameworkOptions) -> TaskGraph:
        loop_us = driving_link(cluster).framework_loop_us(self.name)
        if not loop_us:
            return worker
        cycle_us = options.cycle_time_us
        if loop_us >= cycle_us:
            raise GraphError(f"Horovod's loop takes {loop_us:g} us of every {cycle_us:g} us cycle: the worker would never compute")
        slowed = worker.copy()
        slowed.scale(cpu_work(slowed.tasks), 1.0 / (1.0 - loop_us / cycle_us))
        return slowed


def copy_time_us(bytes_per_us: float) -> Callable[[float, int], float]:
    """Time of Horovod's passes over an all-reduce of ``nbytes`` made of ``tensors`` tensors."""

    def copy_us(nbytes: float, tensors: int) -> float:
        passes = FUSED_PASSES if tensors > 1 else LONE_PASSES
        return passes * nbytes / bytes_per_us

    return copy_us


class HorovodCycle(Policy):
    """Horovod's background loop: once per cycle it takes the tensors ready on every worker, in
    the order of ``inner``, and fuses them into one all-reduce of at most ``fusion_bytes``.

    The loop wakes every ``cycle_us`` (ticks at multiples of the cycle); an all-reduce that runs
    past a tick makes the loop skip it, so work starts at the first tick after both the tensors
    and the network are ready. Anchoring the ticks keeps a faster network from ever delaying
    the next start, which a loop re-timed from each finish would.
    """

    def __init__(
        self,
        inner: Policy,
        nbytes: Sequence[float],
        fusion_bytes: float,
        cycle_us: float,
        cost_us: Callable[[float], float],
        copy_us: Optional[Callable[[float, int], float]] = None,
        priced_bytes: Optional[Sequence[float]] = None,
    ):
        self.inner = inner
        self.nbytes = nbytes  # what fuses: the tensors' own bytes
        # what a batch costs: as many more bytes as CPU contention slows each tensor's transfer
        self.priced_bytes = priced_bytes if priced_bytes is not None else nbytes
        self.fusion_bytes = fusion_bytes
        self.cycle_us = cycle_us
        self.cost_us = cost_us
        self.copy_us = copy_us  # its passes over the batch's bytes and tensors (copy_time_us)

    def start_at(self, now_us: float) -> float:
        """The first tick at or after ``now_us`` (the tolerance keeps rounding from skipping one)."""
        return math.ceil(now_us / self.cycle_us - 1e-9) * self.cycle_us

    def choose_batch(self, ready: list[int], now_us: float) -> list[int]:
        batch, size = [], 0.0
        for t in self.inner.ranked(ready, now_us):
            if batch and size + self.nbytes[t] > self.fusion_bytes:
                break
            batch.append(t)
            size += self.nbytes[t]
        return batch

    def batch_duration_us(self, batch: list[int], durations_us: list[float]) -> float:
        nbytes = sum(self.priced_bytes[t] for t in batch)
        return self.cost_us(nbytes) + (self.copy_us(nbytes, len(batch)) if self.copy_us else 0.0)
