"""Per-iteration figures of a simulated schedule: measured against predicted, and where the time went."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from whatif.sim.engine import Schedule
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind, TaskGraph, label_mask

_TOLERANCE_US = 1e-6


def iteration_report(schedule: Schedule, iterations: pd.DataFrame, worker: Optional[np.ndarray] = None) -> pd.DataFrame:
    """One row per iteration: name, measured_ms, predicted_ms, error_pct, and the breakdown of the
    predicted span into gpu_busy_ms, gpu_idle_ms (the GPU waiting for the CPU) and sync_wait_ms
    (CPU threads blocked in a GPU synchronisation).

    The predicted span is the simulated time between the first and the last task that the
    measured span holds on the iteration's thread, so both cover the same part of the timeline;
    ``span_start_us`` and ``span_end_us`` give it. ``worker`` masks the tasks of the worker to
    report on when the schedule holds several. (:class:`IterationSpans` keeps what this reads
    of the graph, for schedules of graphs that differ only in durations.)
    """
    return IterationSpans(schedule.graph, iterations, worker).report(schedule)


class IterationSpans:
    """What :func:`iteration_report` reads of a graph, which no schedule of it changes: the tasks
    each iteration's measured span holds (on its thread, of the worker), the GPU tasks, and the
    CPU calls that waited for the GPU with the task before each on its resource. A grid's
    configurations whose graphs differ only in durations share one."""

    def __init__(self, graph: TaskGraph, iterations: pd.DataFrame, worker: Optional[np.ndarray] = None):
        tasks = graph.tasks
        m_start = tasks["measured_start_us"].to_numpy()
        m_end = tasks["measured_end_us"].to_numpy()
        resource = tasks["resource"]  # tested a category at a time, not a string per task
        mine = np.ones(len(tasks), dtype=bool) if worker is None else worker
        on_network = label_mask(resource, lambda r: r.startswith("network"))
        self.gpu = np.flatnonzero(np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS]) & mine & ~on_network)
        self.iterations = []  # (name, measured_us, the ids its span holds)
        for it in iterations.itertuples(index=False):
            inside = (m_start >= it.start_us - _TOLERANCE_US) & (m_end <= it.end_us + _TOLERANCE_US) & mine
            if it.thread is not None:
                inside &= label_mask(resource, f"cpu {it.thread}".__eq__)
            self.iterations.append((it.name, it.end_us - it.start_us, np.flatnonzero(inside)))
        edges = graph.edges
        self.waiting = np.unique(edges.loc[edges["kind"] == int(EdgeKind.SYNC), "dst"].to_numpy())
        before = np.full(len(tasks), -1, dtype=np.int64)  # the task before each on its resource
        if len(self.waiting):
            for seq in graph.resource_order():
                before[seq[1:]] = seq[:-1]
        self.before = before[self.waiting]

    def report(self, schedule: Schedule) -> pd.DataFrame:
        """:func:`iteration_report` of ``schedule``, a schedule of this graph's tasks."""
        start_us, end_us = schedule.start_us, schedule.end_us
        has_gpu = len(self.gpu) > 0
        busy = IntervalUnion(start_us[self.gpu], end_us[self.gpu])
        free = np.where(self.before >= 0, end_us[np.maximum(self.before, 0)], -np.inf)
        start = start_us[self.waiting]
        has_wait = np.isfinite(free) & (start > free)
        sync = IntervalUnion(free[has_wait], start[has_wait])
        rows = []
        for name, measured_us, ids in self.iterations:
            if len(ids) == 0:
                rows.append(_row(name, measured_us, np.nan, np.nan, np.nan, has_gpu, np.nan, np.nan))
                continue
            span_start = float(start_us[ids].min())
            span_end = float(end_us[ids].max())
            rows.append(_row(name, measured_us, span_end - span_start, busy.within(span_start, span_end),
                             sync.within(span_start, span_end), has_gpu, span_start, span_end))
        return pd.DataFrame(rows)


def speedup_report(report: pd.DataFrame, unchanged: pd.DataFrame) -> pd.DataFrame:
    """``report`` (of a changed graph) with the unchanged job's prediction beside it
    (``replay_ms``, from ``unchanged``, the same iterations' report) and the speed-up over it.
    There is no error column: nothing measured the changed run."""
    report = report.drop(columns=["error_pct"])
    report.insert(2, "replay_ms", unchanged["predicted_ms"].to_numpy())
    report["speedup"] = report["replay_ms"] / report["predicted_ms"]
    return report


def _row(name, measured_us, predicted_us, busy_us, sync_us, has_gpu, span_start, span_end) -> dict:
    return {
        "name": name,
        "measured_ms": measured_us / 1e3,
        "predicted_ms": predicted_us / 1e3,
        "error_pct": 100.0 * (predicted_us - measured_us) / measured_us if measured_us > 0 else np.nan,
        "gpu_busy_ms": busy_us / 1e3 if has_gpu else np.nan,
        "gpu_idle_ms": (predicted_us - busy_us) / 1e3 if has_gpu else np.nan,
        "sync_wait_ms": sync_us / 1e3,
        "span_start_us": span_start,
        "span_end_us": span_end,
    }


def union_within(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    """Total length of the union of intervals, clipped to [lo, hi]."""
    s = np.clip(starts, lo, hi)
    e = np.clip(ends, lo, hi)
    keep = e > s
    if not keep.any():
        return 0.0
    s, e = s[keep], e[keep]
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    # a new block starts where an interval begins after everything before it has ended
    new_block = np.r_[True, s[1:] > reach[:-1]]
    block_start = s[new_block]
    block_end = np.r_[reach[:-1][new_block[1:]], reach[-1]]
    return float(np.sum(block_end - block_start))


class IntervalUnion:
    """The union of intervals, merged once, measured within any window: :func:`union_within`
    for many windows of the same intervals, to the same bits (the blocks a window's clipped
    intervals merge into are the merged blocks clipped to it, summed in the same order)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        keep = ends > starts
        s, e = starts[keep], ends[keep]
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        if not len(s):
            self.start = self.end = np.zeros(0)
            return
        reach = np.maximum.accumulate(e)
        new_block = np.r_[True, s[1:] > reach[:-1]]
        self.start = s[new_block]
        self.end = np.r_[reach[:-1][new_block[1:]], reach[-1]]

    def within(self, lo: float, hi: float) -> float:
        """Total length of the union, clipped to [lo, hi]."""
        first = np.searchsorted(self.end, lo, side="right")  # blocks ending at or before lo add nothing
        last = np.searchsorted(self.start, hi, side="left")  # nor those starting at or after hi
        length = np.clip(self.end[first:last], lo, hi) - np.clip(self.start[first:last], lo, hi)
        length = length[length > 0]
        return float(np.sum(length)) if len(length) else 0.0


def steady_median(values: pd.Series) -> float:
    """The median over iterations, leaving out the first and the last where there are three or
    more: the first starts with an idle network and the last pays for draining it (with
    layer-by-layer synchronisation its own communication and the previous one's); neither is
    the steady state a training run lives in."""
    return float(pd.Series(steady_values(values)).median())


def steady_values(values: pd.Series) -> np.ndarray:
    """The iterations :func:`steady_median` takes the median of: all but the first and the last
    where there are three or more."""
    values = values.to_numpy()
    return values[1:-1] if len(values) >= 3 else values
