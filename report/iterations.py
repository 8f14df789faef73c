"""Per-iteration figures of a simulated schedule: measured against predicted, and where the time went."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from whatif.sim.engine import Schedule
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind

_TOLERANCE_US = 1e-6


def iteration_report(schedule: Schedule, iterations: pd.DataFrame, worker: Optional[np.ndarray] = None) -> pd.DataFrame:
    """One row per iteration: name, measured_ms, predicted_ms, error_pct, and the breakdown of the
    predicted span into gpu_busy_ms, gpu_idle_ms (the GPU waiting for the CPU) and sync_wait_ms
    (CPU threads blocked in a GPU synchronisation).

    The predicted span is the simulated time between the first and the last task that the
    measured span holds on the iteration's thread, so both cover the same part of the timeline;
    ``span_start_us`` and ``span_end_us`` give it. ``worker`` masks the tasks of the worker to
    report on when the schedule holds several.
    """
    tasks = schedule.graph.tasks
    m_start = tasks["measured_start_us"].to_numpy()
    m_end = tasks["measured_end_us"].to_numpy()
    resource = tasks["resource"].astype(str).to_numpy()
    mine = np.ones(len(tasks), dtype=bool) if worker is None else worker
    on_network = np.char.startswith(resource.astype(str), "network")
    gpu = np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS]) & mine & ~on_network
    waits = _sync_waits(schedule)
    rows = []
    for it in iterations.itertuples(index=False):
        inside = (m_start >= it.start_us - _TOLERANCE_US) & (m_end <= it.end_us + _TOLERANCE_US) & mine
        if it.thread is not None:
            inside &= resource == f"cpu {it.thread}"
        ids = np.flatnonzero(inside)
        measured_us = it.end_us - it.start_us
        if len(ids) == 0:
            rows.append(_row(it.name, measured_us, np.nan, np.nan, np.nan, gpu.any(), np.nan, np.nan))
            continue
        span_start = float(schedule.start_us[ids].min())
        span_end = float(schedule.end_us[ids].max())
        busy = union_within(schedule.start_us[gpu], schedule.end_us[gpu], span_start, span_end)
        sync = union_within(waits[0], waits[1], span_start, span_end)
        rows.append(_row(it.name, measured_us, span_end - span_start, busy, sync, gpu.any(), span_start, span_end))
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


def _sync_waits(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """The intervals in which CPU calls waited for the GPU: from the moment their thread was free
    to the moment the call could start."""
    graph = schedule.graph
    edges = graph.edges
    waiting = np.unique(edges.loc[edges["kind"] == int(EdgeKind.SYNC), "dst"].to_numpy())
    if not len(waiting):
        return np.zeros(0), np.zeros(0)
    prev_end = np.full(len(graph.tasks), -np.inf)
    for seq in graph.resource_order():
        prev_end[seq[1:]] = schedule.end_us[seq[:-1]]
    free = prev_end[waiting]
    start = schedule.start_us[waiting]
    has_wait = np.isfinite(free) & (start > free)
    return free[has_wait], start[has_wait]


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
