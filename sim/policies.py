"""Scheduling policies for the communication queue (Daydream's Schedule primitive).

A policy sees the messages that are ready (their gradients computed on every worker) whenever
the network is free, and picks what goes next. Adding a policy is writing a small subclass of
:class:`whatif.sim.engine.Policy`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from .engine import Policy


class Fifo(Policy):
    """First come, first served: messages go in the order they became ready (ties: in the order
    the framework queued them), as NCCL runs collectives in launch order."""

    def __init__(self, ready_order: Sequence[float]):
        self.ready_order = ready_order  # task id -> queue position

    def choose(self, ready: list[int], now_us: float) -> int:
        return min(ready, key=lambda t: self.ready_order[t])


class Priority(Policy):
    """P3 (Jayarajan et al., MLSys 2019): the ready slice whose layer the next forward pass needs
    first goes next; since messages are slices, a large low-priority tensor is pre-empted at slice
    boundaries by a higher-priority one that becomes ready."""

    def __init__(self, priority: Sequence[float], ready_order: Sequence[float]):
        self.priority = priority
        self.ready_order = ready_order

    def choose(self, ready: list[int], now_us: float) -> int:
        return min(ready, key=lambda t: (self.priority[t], self.ready_order[t]))


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
        self.copy_us = copy_us  # its passes over the batch's bytes and tensors (sim/framework_copies.py)

    def start_at(self, now_us: float) -> float:
        """The first tick at or after ``now_us`` (the tolerance keeps rounding from skipping one)."""
        return math.ceil(now_us / self.cycle_us - 1e-9) * self.cycle_us

    def choose_batch(self, ready: list[int], now_us: float) -> list[int]:
        batch, size, left = [], 0.0, list(ready)
        while left:
            t = self.inner.choose(left, now_us)
            if batch and size + self.nbytes[t] > self.fusion_bytes:
                break
            batch.append(t)
            size += self.nbytes[t]
            left.remove(t)
        return batch

    def batch_duration_us(self, batch: list[int], durations_us: list[float]) -> float:
        nbytes = sum(self.priced_bytes[t] for t in batch)
        return self.cost_us(nbytes) + (self.copy_us(nbytes, len(batch)) if self.copy_us else 0.0)
