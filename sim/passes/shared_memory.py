"""Workers that share a memory system: how much of each CPU task streams memory, and its slowdown.

A single-worker trace times every operator with the memory system to itself. On CPU workers
that share one (the workers of a machine, or, in the lab, every worker of the box), the
data-parallel workers run the same step in lockstep, so their optimizer steps, element-wise
passes and weight reads stream at the same moment and split the bandwidth, while work that
stays in a core's caches does not notice (``lab/probes/memory.py``, ``topology.SharedMemory``).

So each CPU task is split into the time its bytes take at one core's streaming rate and the
rest, and only the first is slowed by the sharing: a task of ``d`` microseconds that moves ``b``
bytes streams for ``f = min(1, b / core_bandwidth / d)`` of its time and lasts
``d (f m + (1 - f) c)`` beside its peers (``m`` the memory slowdown, ``c`` the compute one). The
bytes are an operator's own: its tensor inputs read and its output written (the roofline's
count for the modelled families, ``sim/perfmodels/``), less what the operators it calls move
themselves, spread over the operator's own tasks by their time. Runtime gaps, Python and the
tasks inserted by optimizations move nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from whatif.topology import Cluster

from ..graph import TaskGraph, cpu_work
from ..perfmodels.families import FAMILY_OF, VIEW_OPS
from ..perfmodels.shapes import operator_units, parse_shapes
from ..perfmodels.work import work

MEMORY_BYTES = "memory_bytes"


def _nbytes(entry) -> float:
    if entry is None:
        return 0.0
    shape, element_bytes = entry
    shapes = shape if shape and isinstance(shape[0], tuple) else [shape]
    return float(sum(math.prod(s) for s in shapes) * element_bytes)


def operator_bytes(op: str, dims, types, args=()) -> float:
    """Bytes an operator call moves, its callees included: the roofline's count for a
    modelled family, else every tensor input read once and the first written once."""
    if not op.startswith("aten::") or op in VIEW_OPS:
        return 0.0
    if op in FAMILY_OF:
        bytes_ = work(op, dims, types, args)[1]
        if np.isfinite(bytes_):
            return float(bytes_)
    sizes = [_nbytes(entry) for entry in parse_shapes(dims, types)]
    if not sizes:
        return 0.0
    return sum(sizes) + sizes[0]


def add_memory_bytes(graph: TaskGraph) -> TaskGraph:
    """``graph`` with a ``memory_bytes`` column: each task's share of the bytes its operator
    moves itself."""
    graph = graph.copy()
    units = operator_units(graph.ops)
    moved = np.array([operator_bytes(op, d, t, a) for op, d, t, a in
                      zip(units["op"], units["dims"], units["types"], units["args"])])
    callees = pd.Series(moved, index=units["parent"].to_numpy()).groupby(level=0).sum()
    own = pd.Series(moved, index=units["row"].to_numpy())
    own = (own - callees.reindex(own.index).fillna(0.0)).clip(lower=0.0)
    tasks = graph.tasks
    events = tasks["event"].to_numpy()
    duration = tasks["duration_us"].to_numpy(dtype=float)
    of_event = pd.Series(duration, index=events).groupby(level=0).sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        per_us = (own / of_event.reindex(own.index)).replace([np.inf, -np.inf], 0.0).fillna(0.0)
    rate = per_us.reindex(events).fillna(0.0).to_numpy()
    tasks[MEMORY_BYTES] = np.where(events >= 0, rate * duration, 0.0)
    return graph


def slow_beside_peers(graph: TaskGraph, cluster: Cluster) -> TaskGraph:
    """A worker's graph with its CPU work slowed by its peers on the same memory system
    (``cluster.shared_memory``), who run the same tasks at the same moments."""
    shared = cluster.shared_memory
    graph = graph.copy()
    cpu = cpu_work(graph.tasks)
    graph.scale(cpu, shared_memory_factors(graph.tasks, cpu, shared.core_bandwidth_bytes_per_us,
                                           shared.memory_slowdown(cluster.workers_sharing_memory),
                                           shared.compute_slowdown))
    return graph


def shared_memory_factors(tasks: pd.DataFrame, task_ids: np.ndarray, core_bytes_per_us: float,
                          memory_slowdown: float, compute_slowdown: float) -> np.ndarray:
    """Each of ``task_ids``' factor beside its peers (see the module doc)."""
    duration = tasks["duration_us"].to_numpy(dtype=float)[task_ids]
    moved = tasks[MEMORY_BYTES].to_numpy(dtype=float)[task_ids] if MEMORY_BYTES in tasks else np.zeros(len(task_ids))
    with np.errstate(divide="ignore", invalid="ignore"):
        streaming = np.where(duration > 0, np.nan_to_num(moved) / core_bytes_per_us / duration, 0.0)
    streaming = np.clip(streaming, 0.0, 1.0)
    return streaming * memory_slowdown + (1.0 - streaming) * compute_slowdown
