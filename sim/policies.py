"""Scheduling policies for the communication queue (Daydream's Schedule primitive).

A policy sees the messages that are ready (their gradients computed on every worker) whenever
the network is free, and picks what goes next. Adding a policy is writing a small subclass of
:class:`whatif.sim.engine.Policy`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .engine import Policy


class Fifo(Policy):
    """First come, first served: messages go in the order they became ready (ties: in the order
    the framework queued them), as NCCL runs collectives in launch order."""

    def __init__(self, ready_order: Sequence[float]):
        self.ready_order = ready_order  # task id -> queue position

    def choose(self, ready: list[int], now_us: float) -> int:
        return min(ready, key=lambda t: self.ready_order[t])

    def ranked(self, ready: list[int], now_us: float) -> list[int]:
        return sorted(ready, key=lambda t: self.ready_order[t])  # stable: ties as min picks them


class Priority(Policy):
    """P3 (Jayarajan et al., MLSys 2019): the ready slice whose layer the next forward pass needs
    first goes next; since messages are slices, a large low-priority tensor is pre-empted at slice
    boundaries by a higher-priority one that becomes ready. ``priority`` and ``ready_order``
    map task ids (the same ones) to their priority and queue position."""

    def __init__(self, priority: Mapping[int, float], ready_order: Mapping[int, float]):
        self.priority = priority
        self.ready_order = ready_order
        self.rank = {t: (priority[t], ready_order[t]) for t in ready_order}  # what choose compares, made once

    def choose(self, ready: list[int], now_us: float) -> int:
        return min(ready, key=self.rank.__getitem__)

    def ranked(self, ready: list[int], now_us: float) -> list[int]:
        return sorted(ready, key=self.rank.__getitem__)
