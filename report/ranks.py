"""Per-rank iteration reports of a multi-rank job (``sim/multirank.py``), as tables and JSON.

Each rank gets the single-trace report (``iterations.py``: measured, predicted, GPU busy and
idle, synchronisation waits) of its part of the joined schedule, and two columns that only a
job has: ``collective_wait_ms``, the time the rank's collectives waited for the last rank to
arrive (a completion's start less its arrival's end), and ``transfer_ms``, the time they then
took to move the data. A collective kernel that spins while it waits is not GPU work, so
``gpu_busy_ms`` counts the transfers alone. :func:`step_segments` cuts one rank's iteration at
its collectives, so two runs of a rank (measured and predicted) compare part by part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from whatif.sim.engine import Schedule
from whatif.sim.graph import GraphError, TaskKind
from whatif.sim.multirank import ARRIVAL_SUFFIX, Job

from .iterations import iteration_report, steady_median, union_within
from .tables import json_records


@dataclass
class RankReport:
    rank: int
    trace: str
    iterations: pd.DataFrame


def rank_reports(job: Job, schedule: Schedule, replay: Schedule | None = None) -> list[RankReport]:
    """One report per rank of ``schedule`` (a schedule of the job's graph, or of a graph
    transformed from it). Given the unmodified ``replay``, a prediction's report has the
    replay's figure beside it (``replay_ms``) and the speed-up, and no error column: nothing
    measured the transformed run."""
    reports = []
    for where in job.ranks:
        mine = job.rank_schedule(schedule, where.rank)
        report = iteration_report(mine, where.iterations)
        waits, transfers = _collective_time(mine, report)
        report.insert(report.columns.get_loc("sync_wait_ms") + 1, "collective_wait_ms", waits)
        report.insert(report.columns.get_loc("collective_wait_ms") + 1, "transfer_ms", transfers)
        if replay is not None:
            replayed = iteration_report(job.rank_schedule(replay, where.rank), where.iterations)
            report = report.drop(columns=["error_pct"])
            report.insert(2, "replay_ms", replayed["predicted_ms"].to_numpy())
            report["speedup"] = report["replay_ms"] / report["predicted_ms"]
        reports.append(RankReport(where.rank, where.path, report))
    return reports


def _collective_time(schedule: Schedule, report: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per iteration of one rank: how long its collectives waited for the other ranks, and how
    long their transfers took, within the iteration's predicted span (ms)."""
    tasks = schedule.graph.tasks
    names = tasks["name"].astype(str).to_numpy()
    kinds = tasks["kind"].to_numpy()
    arrivals, completions = [], []
    for seq in schedule.graph.resource_order():
        for i in range(len(seq) - 1):
            a, c = int(seq[i]), int(seq[i + 1])
            if names[a].endswith(ARRIVAL_SUFFIX) and kinds[c] == int(TaskKind.COMM) and names[a] == names[c] + ARRIVAL_SUFFIX:
                arrivals.append(a)
                completions.append(c)
    arrivals, completions = np.asarray(arrivals, dtype=np.int64), np.asarray(completions, dtype=np.int64)
    start, end = schedule.start_us, schedule.end_us
    waits, transfers = [], []
    for lo, hi in zip(report["span_start_us"], report["span_end_us"]):
        if not np.isfinite(lo):
            waits.append(np.nan)
            transfers.append(np.nan)
            continue
        waits.append(union_within(end[arrivals], start[completions], lo, hi) / 1e3)
        transfers.append(union_within(start[completions], end[completions], lo, hi) / 1e3)
    return np.asarray(waits), np.asarray(transfers)


def step_segments(job: Job, schedule: Schedule, rank: int, iteration: int = 0) -> pd.DataFrame:
    """Rank ``rank``'s iteration ``iteration`` of ``schedule`` (the job's, or a graph's transformed
    from it) cut at the rank's collectives, in the order it reached them: ``to`` (from the
    iteration's start, or the previous collective's end, to the arrival: the rank's own compute
    and host time), ``wait`` (until the last rank arrived) and ``transfer`` of each collective,
    then ``after`` (from the last one's end to the iteration's end). Rows: part, collective (its
    id in :attr:`Job.collectives`; -1 for ``after``), ms. The rows sum to the iteration's
    predicted span; where two collectives overlap on the rank, the overlap counts in the first."""
    where = next((r for r in job.ranks if r.rank == rank), None)
    if where is None:
        raise GraphError(f"no rank {rank} in this job")
    report = iteration_report(job.rank_schedule(schedule, rank), where.iterations)
    if not 0 <= iteration < len(report):
        raise GraphError(f"rank {rank} has {len(report)} iterations, not an iteration {iteration}")
    lo = float(report["span_start_us"].iat[iteration]) + where.shift_us
    hi = float(report["span_end_us"].iat[iteration]) + where.shift_us
    mine = job.members[job.members["rank"] == rank]
    arrive = schedule.end_us[mine["arrival"].to_numpy()]
    begin = schedule.start_us[mine["completion"].to_numpy()]
    end = schedule.end_us[mine["completion"].to_numpy()]
    inside = (arrive >= lo) & (arrive < hi)
    order = np.argsort(arrive, kind="stable")
    rows, cursor = [], lo
    for k in order[inside[order]]:
        a = min(max(arrive[k], cursor), hi)
        s = min(max(begin[k], a), hi)
        e = min(max(end[k], s), hi)
        key = int(mine["collective"].iat[k])
        rows += [("to", key, (a - cursor) / 1e3), ("wait", key, (s - a) / 1e3), ("transfer", key, (e - s) / 1e3)]
        cursor = e
    rows.append(("after", -1, (hi - cursor) / 1e3))
    return pd.DataFrame(rows, columns=["part", "collective", "ms"])


def job_summary(job: Job, reports: list[RankReport], schedule: Schedule) -> dict:
    """The job in a few figures: its ranks and collectives, and per rank the steady median of
    its iterations (``report.iterations.steady_median``); the slowest rank's is the job's."""
    measured = {r.rank: steady_median(r.iterations["measured_ms"]) for r in reports}
    predicted = {r.rank: steady_median(r.iterations["predicted_ms"]) for r in reports}
    slowest = max(measured, key=lambda k: measured[k])
    return {
        "ranks": len(reports),
        "collectives_per_rank": int(len(job.collectives)),
        "slowest_rank": slowest,
        "slowest_measured_ms": measured[slowest],
        "slowest_predicted_ms": predicted[slowest],
        "max_predicted_ms": max(predicted.values()),
        "clock_offsets_us": {str(k): v for k, v in sorted(job.clock_offsets_us.items())},
        "tasks": len(schedule.graph.tasks),
        "edges": len(schedule.graph.edges),
    }


def job_json(job: Job, reports: list[RankReport], schedule: Schedule) -> dict:
    """``{"ranks": [{"rank", "trace", "iterations": [...]}], "summary", "skipped"}``, a missing
    number as null."""
    return {
        "ranks": [{"rank": r.rank, "trace": r.trace, "iterations": json_records(r.iterations)} for r in reports],
        "summary": job_summary(job, reports, schedule),
        "skipped": [{"path": path, "why": why} for path, why in job.skipped],
    }
