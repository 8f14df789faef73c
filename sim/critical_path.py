"""The critical path of a simulated schedule: the chain of tasks and waits that decided when an
iteration ended, and what kind of time it is made of.

The engine starts a task at ``max(resource free, release, max(end(pred) + lag))``, so one of
those terms decided each start: an edge whose ``end + lag`` is the start, the task before it on
its resource, or its release (a resource under a scheduling policy may start a task later
still, at a cycle; that wait is counted as idle). Following those deciders back from the task that ends an
iteration gives a chain in which every task, and every lag between two of them, lies on the
iteration's longest path: shortening a task on it shortens the iteration (until another path
takes over), shortening one off it does not. This is the critical-path view of the DLRM
performance model (seed 002), taken from the simulated schedule rather than from the trace, so it
also answers for a transformed graph.

The chain's time is split into kinds, so that "where does the iteration go" has one answer:
``gpu`` (kernels, copies, memsets), ``communication`` (collective kernels and network
transfers), ``cpu`` (operator and annotation CPU time), ``cpu overhead`` (runtime calls and
CPU time no event names), ``synchronisation`` (a thread or stream waiting for another: the
lag of a synchronisation, launch-queue, thread-wake or stream-wait edge, waiting tasks, and the
tail of a call that waited) and ``idle`` (launch latency and other lags, and time before a task
that nothing in the graph started).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .engine import Schedule
from .graph import EdgeKind, GraphError, TaskKind

PATH_KINDS = ("gpu", "communication", "cpu", "cpu overhead", "synchronisation", "idle")
#: How a task's start was decided when no edge decided it.
BY_RESOURCE = -1  # the task before it on its resource ended
BY_RELEASE = -2  # its release time (or the start of simulated time)
#: Edges that make their destination wait for another resource's progress.
_WAITING_EDGES = {int(k) for k in (EdgeKind.SYNC, EdgeKind.QUEUE, EdgeKind.THREAD, EdgeKind.STREAM_WAIT)}
_KIND_OF_TASK = {
    TaskKind.KERNEL: "gpu",
    TaskKind.MEMCPY: "gpu",
    TaskKind.MEMSET: "gpu",
    TaskKind.COMM: "communication",
    TaskKind.CPU: "cpu",
    TaskKind.RUNTIME: "cpu overhead",
    TaskKind.GAP: "cpu overhead",
    TaskKind.WAIT: "synchronisation",
    TaskKind.INSERTED: "cpu",  # or "gpu" on a GPU stream
}
#: Engine arithmetic is exact for fixed-order resources; policies start on the SimPy clock.
_TOLERANCE_US = 1e-6


@dataclass
class Deciders:
    """For every task of a schedule: the task whose end decided its start (-1 where none did),
    and how (an :class:`EdgeKind`, :data:`BY_RESOURCE` or :data:`BY_RELEASE`)."""

    task: np.ndarray
    via: np.ndarray


def find_deciders(schedule: Schedule) -> Deciders:
    """Which predecessor decided each task's start: the latest of the terms the engine took the
    maximum of. Where an edge and the resource tie, the edge wins: it is the cause that crosses
    to another resource, and the resource predecessor ends at the same instant anyway. Among
    edges that tie, the one whose source ended last wins."""
    graph = schedule.graph
    start, end = schedule.start_us, schedule.end_us
    n = len(start)
    previous = np.full(n, -1, dtype=np.int64)
    for seq in graph.resource_order():
        ran = seq[np.argsort(start[seq], kind="stable")]  # a policy may have reordered them
        previous[ran[1:]] = ran[:-1]
    resource_ready = np.where(previous >= 0, end[np.maximum(previous, 0)], -np.inf)

    edges = graph.edges
    src, dst, kind = edges["src"].to_numpy(), edges["dst"].to_numpy(), edges["kind"].to_numpy()
    ready = end[src] + edges["lag_us"].to_numpy()
    edge_ready = np.full(n, -np.inf)
    edge_src = np.full(n, -1, dtype=np.int64)
    edge_kind = np.zeros(n, dtype=np.int64)
    if len(src):
        order = np.lexsort((end[src], ready, dst))  # per destination, the deciding edge last
        last = order[np.r_[dst[order][1:] != dst[order][:-1], True]]
        edge_ready[dst[last]], edge_src[dst[last]], edge_kind[dst[last]] = ready[last], src[last], kind[last]

    release = graph.tasks["release_us"].to_numpy()
    by_edge = (edge_src >= 0) & (edge_ready >= np.maximum(resource_ready, release) - _TOLERANCE_US)
    by_resource = ~by_edge & (previous >= 0) & (resource_ready >= release - _TOLERANCE_US)
    task = np.where(by_edge, edge_src, np.where(by_resource, previous, -1))
    via = np.where(by_edge, edge_kind, np.where(by_resource, BY_RESOURCE, BY_RELEASE))
    return Deciders(task=task, via=via)


@dataclass
class CriticalPath:
    """The chain that decided when ``[start_us, end_us]`` ended, as time intervals that tile it.

    ``steps`` columns, in time order: task (-1 for time between tasks), kind (one of
    :data:`PATH_KINDS`), start_us, end_us, duration_us. A task's interval is
    the part of its run before the next step begins (empty where a successor that may start
    before it ends overlaps all of it), so the durations add up to ``end_us - start_us``.
    """

    start_us: float
    end_us: float
    steps: pd.DataFrame

    @property
    def tasks(self) -> np.ndarray:
        """The ids of the tasks on the path, in time order."""
        ids = self.steps["task"].to_numpy()
        return ids[ids >= 0]

    def by_kind(self) -> pd.Series:
        """Microseconds of the path per kind, every kind of :data:`PATH_KINDS` present."""
        return self.steps.groupby("kind")["duration_us"].sum().reindex(list(PATH_KINDS), fill_value=0.0)


def critical_path(schedule: Schedule, last_task: int, from_us: float = -np.inf, deciders: Deciders | None = None) -> CriticalPath:
    """The chain that decided when ``last_task`` ended, followed back to ``from_us`` (by default
    to the task that nothing before it started). ``deciders`` saves recomputing them when
    several paths are taken from one schedule."""
    deciders = deciders if deciders is not None else find_deciders(schedule)
    time_kind = _time_kinds(schedule, deciders)
    start, end = schedule.start_us, schedule.end_us
    cursor = float(end[last_task])  # everything after it is attributed already
    rows = []
    t = int(last_task)
    while True:
        begin = min(max(float(start[t]), from_us), cursor)  # empty when its successor overlaps it
        rows.append((t, time_kind[t], begin, cursor))
        cursor = begin
        if start[t] <= from_us:
            break
        decider = int(deciders.task[t])
        gap_from = max(float(end[decider]), from_us) if decider >= 0 else from_us
        if cursor > gap_from and np.isfinite(gap_from):
            waiting = int(deciders.via[t]) in _WAITING_EDGES
            rows.append((-1, "synchronisation" if waiting else "idle", gap_from, cursor))
            cursor = gap_from
        if decider < 0:
            break
        t = decider
    steps = pd.DataFrame(rows[::-1], columns=["task", "kind", "start_us", "end_us"])
    steps["duration_us"] = steps["end_us"] - steps["start_us"]
    return CriticalPath(start_us=cursor, end_us=float(end[last_task]), steps=steps)


def _time_kinds(schedule: Schedule, deciders: Deciders) -> np.ndarray:
    """The kind each task's own time counts as. A runtime call whose start a synchronisation
    edge decided is the tail of a wait (``cudaStreamSynchronize`` returning), not launch
    overhead; an inserted task is GPU or CPU time by where it runs."""
    tasks = schedule.graph.tasks
    kind = tasks["kind"].to_numpy()
    labels = np.array([_KIND_OF_TASK[k] for k in TaskKind], dtype=object)[kind]
    resource = tasks["resource"]
    on_gpu = np.asarray(resource.cat.categories.str.startswith("gpu").tolist() + [False])[resource.cat.codes.to_numpy()]
    labels[(kind == int(TaskKind.INSERTED)) & on_gpu] = "gpu"
    labels[(kind == int(TaskKind.RUNTIME)) & (deciders.via == int(EdgeKind.SYNC))] = "synchronisation"
    return labels


def iteration_critical_paths(schedule: Schedule, spans: pd.DataFrame) -> list[CriticalPath]:
    """The critical path of each iteration over the span its report predicted.

    ``spans`` has one row per iteration with ``name``, ``thread`` (the iteration's CPU thread,
    None for the whole trace), ``span_start_us`` and ``span_end_us``: an iteration report
    (``report.iterations``) with its iterations' thread beside it. Each path is followed back
    from the task on that thread that ends at ``span_end_us`` to ``span_start_us``, so its
    durations add up to the predicted iteration time.
    """
    deciders = find_deciders(schedule)
    resource = schedule.graph.tasks["resource"].astype(str).to_numpy()
    paths = []
    for it in spans.itertuples(index=False):
        ending = np.flatnonzero(np.abs(schedule.end_us - it.span_end_us) <= _TOLERANCE_US)
        if it.thread is not None:
            ending = ending[resource[ending] == f"cpu {it.thread}"]
        if not len(ending):
            raise GraphError(f"iteration {it.name!r} has no simulated task to follow a critical path back from")
        last = int(ending[np.argmax(schedule.start_us[ending])])
        paths.append(critical_path(schedule, last, it.span_start_us, deciders))
    return paths
