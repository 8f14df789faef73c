"""Where a simulated cluster iteration's time goes (compute, exposed communication, idle), and
which collectives carried its communication."""

from __future__ import annotations

import numpy as np
import pandas as pd

from whatif.sim.distributed import ClusterSchedule
from whatif.sim.graph import GPU_TASK_KINDS, TaskKind

from .iterations import union_within


def cluster_breakdown(run: ClusterSchedule, report: pd.DataFrame) -> pd.DataFrame:
    """Per iteration of worker 0: ``compute_ms`` (its GPU busy, or its CPU threads where the
    trace has no GPU), ``comm_ms`` (the network busy), ``exposed_comm_ms`` (the network busy
    while worker 0 computes nothing on its GPU or CPU threads: communication the iteration
    waits for) and ``idle_ms`` (the rest of the span); the three add up to the iteration."""
    schedule = run.schedule
    tasks = schedule.graph.tasks
    kinds = tasks["kind"].to_numpy()
    on_network = np.zeros(len(tasks), dtype=bool)
    on_network[run.comm_tasks] = True
    gpu = np.isin(kinds, [int(k) for k in GPU_TASK_KINDS]) & run.worker0 & ~on_network
    cpu = np.isin(kinds, [int(TaskKind.CPU), int(TaskKind.RUNTIME)]) & run.worker0
    compute = gpu if gpu.any() else cpu
    working = gpu | cpu
    start, end = schedule.start_us, schedule.end_us
    rows = []
    for lo, hi in zip(report["span_start_us"], report["span_end_us"]):
        if not np.isfinite(lo):
            rows.append({"compute_ms": np.nan, "comm_ms": np.nan, "exposed_comm_ms": np.nan, "idle_ms": np.nan})
            continue
        busy = union_within(start[compute], end[compute], lo, hi)
        comm = union_within(start[on_network], end[on_network], lo, hi)
        worked = union_within(start[working], end[working], lo, hi)
        worked_or_comm = union_within(
            np.r_[start[working], start[on_network]], np.r_[end[working], end[on_network]], lo, hi
        )
        exposed = worked_or_comm - worked
        rows.append(
            {
                "compute_ms": busy / 1e3,
                "comm_ms": comm / 1e3,
                "exposed_comm_ms": exposed / 1e3,
                "idle_ms": max(hi - lo - busy - exposed, 0.0) / 1e3,
            }
        )
    return pd.DataFrame(rows)


def collective_mix(run: ClusterSchedule) -> str:
    """The algorithms and protocols the run's collectives used, by their share of the bytes
    communicated, largest first: ``nvls_tree/simple 96%, tree/ll128 4%``."""
    collectives = run.collectives
    if not len(collectives):
        return ""
    named = (collectives["algorithm"] + "/" + collectives["protocol"]).to_numpy()
    shares = collectives["task_bytes"].groupby(named).sum().sort_values(ascending=False, kind="stable")
    return ", ".join(f"{name} {100 * b / shares.sum():.0f}%" for name, b in shares.items())


def collective_notes(run: ClusterSchedule) -> dict:
    """Per communication task, the collective it ran in, as a timeline's event arguments."""
    return {
        int(c.Index): {"collective": f"{c.op} of {c.collective_bytes / 1e6:.4g} MB: {c.algorithm}/{c.protocol}, "
                                    f"{c.channels} channels"}
        for c in run.collectives.itertuples()
    }
