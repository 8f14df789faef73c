"""The five CPU overheads around PyTorch operators, after the DLRM performance model (Lin et al.,
"Building a Performance Model for Deep Learning Recommendation Model Training on GPUs").

A GPU that waits for the CPU is idle, and what it waits for is the host work around each
operator's kernels. The seed splits that work, per top-level operator (one not nested in another
operator on its thread), into five types whose distributions per operator type let a model
price an operator's CPU side without running it:

- ``T1`` between operators: from the previous top-level operator's end on the same thread to
  this operator's start (Python, the dispatcher before the operator is recorded);
- ``T2`` from the operator's start to its first launch call;
- ``T3`` from its last launch call's end to the operator's end;
- ``T4`` the launch call itself (``cudaLaunchKernel``, ``cudaMemcpyAsync`` ...);
- ``T5`` between consecutive launch calls of the operator.

A launch call is a runtime call whose correlation id names a GPU task in the trace, the link
``sim.build`` uses. Other runtime calls inside an operator (event records, synchronisations)
fall in whichever of T2, T3 or T5 they lie in, so for an operator with launches
``T2 + sum(T4) + sum(T5) + T3`` is its duration. A CPU-only trace has no launches: only T1 and
the operators' own CPU time (``op``) apply there.

A gap between operators in which the thread was blocked on another thread (the autograd thread
idle through the forward pass, the main thread idle through backward) is waiting, not overhead;
it is kept apart as ``wait`` so that it does not swamp T1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from whatif.collectors.kineto import GPU_KINDS, EventKind, KinetoTrace
from whatif.sim.build import IDLE_GAP_US

from .tables import SHOWN_ROWS, named_table

#: Sample types and what they measure; ``T1``..``T5`` are the seed's five overheads.
OVERHEAD_TYPES = {
    "T1": "between operators",
    "T2": "operator start to first launch",
    "T3": "last launch end to operator end",
    "T4": "launch call",
    "T5": "between launches in an operator",
    "op": "operator CPU time",
    "wait": "thread blocked on another thread",
}
LAUNCH_TYPES = ("T2", "T3", "T4", "T5")
#: The operator a launch call outside every operator is filed under.
NO_OPERATOR = "(no operator)"


@dataclass
class Overheads:
    """The overhead samples of one trace: one row per gap, launch call or operator.

    ``samples`` columns: type (a key of :data:`OVERHEAD_TYPES`), operator (the top-level
    operator's name), event (its row in the trace's event table, -1 for none), thread, ts_us
    (where the sample starts), duration_us.
    """

    trace: str
    samples: pd.DataFrame
    operators: int
    launches: int

    @property
    def has_launches(self) -> bool:
        """Whether T2 to T5 mean anything here: a CPU-only trace launches nothing."""
        return self.launches > 0

    def by_operator(self) -> pd.DataFrame:
        """Per sample type and operator type: count, mean_us, median_us, p90_us, total_us."""
        return _distribution(self.samples, ["type", "operator"])

    def summary(self) -> pd.DataFrame:
        """Per sample type over all operators: the same columns plus ``description``, one row per
        type in :data:`OVERHEAD_TYPES` order (count 0 where a type has no samples)."""
        table = _distribution(self.samples, ["type"]).set_index("type").reindex(list(OVERHEAD_TYPES))
        table["count"] = table["count"].fillna(0).astype(int)
        table["total_us"] = table["total_us"].fillna(0.0)
        table.insert(0, "description", [OVERHEAD_TYPES[t] for t in table.index])
        return table.reset_index()


def _distribution(samples: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    grouped = samples.groupby(keys, observed=True, sort=True)["duration_us"]
    table = grouped.agg(["count", "mean", "median", "sum"])
    table.columns = ["count", "mean_us", "median_us", "total_us"]
    table.insert(3, "p90_us", grouped.quantile(0.9))
    return table.reset_index()


def measure_overheads(trace: KinetoTrace) -> Overheads:
    """Classify the CPU time around every top-level operator of ``trace``."""
    ev = trace.events
    kinds = ev["kind"].to_numpy()
    ts = ev["ts_us"].to_numpy()
    end = ts + ev["dur_us"].to_numpy()
    thread = ev["thread"].cat.codes.to_numpy()
    names = np.asarray(ev["name"].cat.categories, dtype=object)[ev["name"].cat.codes.to_numpy()]

    ops = _top_level_operators(np.flatnonzero(kinds == int(EventKind.CPU_OP)), ts, end, thread)
    correlation = ev["correlation"].to_numpy()
    gpu = np.isin(kinds, [int(k) for k in GPU_KINDS])
    launched = np.unique(correlation[gpu & (correlation >= 0)])
    launches = np.flatnonzero((kinds == int(EventKind.RUNTIME)) & np.isin(correlation, launched))
    launches = launches[np.lexsort((ts[launches], thread[launches]))]
    owner = _enclosing(launches, ops, ts, end, thread)

    samples = [
        _samples("op", ops, names, thread[ops], ts[ops], end[ops] - ts[ops]),
        *_gap_samples(ops, names, ts, end, thread),
        _samples("T4", owner, names, thread[launches], ts[launches], end[launches] - ts[launches]),
        *_launch_window_samples(launches, owner, names, ts, end, thread),
    ]
    table = pd.concat(samples, ignore_index=True)
    table["type"] = pd.Categorical(table["type"], categories=list(OVERHEAD_TYPES))
    table["operator"] = table["operator"].astype("category")
    table["thread"] = pd.Categorical.from_codes(table["thread"], categories=ev["thread"].cat.categories)
    return Overheads(trace=trace.path, samples=table, operators=len(ops), launches=len(launches))


def _samples(kind: str, event: np.ndarray, names: np.ndarray, thread, ts_us, duration_us) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "type": kind,
            "operator": np.where(event >= 0, names[np.maximum(event, 0)], NO_OPERATOR),
            "event": event,
            "thread": np.asarray(thread, dtype=np.int64),
            "ts_us": np.asarray(ts_us, dtype=np.float64),
            "duration_us": np.asarray(duration_us, dtype=np.float64),
        }
    )


def _top_level_operators(rows: np.ndarray, ts, end, thread) -> np.ndarray:
    """The operators no other operator on their thread encloses, by thread and start.

    Sorted by start with the longer first, an operator is nested exactly when it starts before
    the latest end among the operators before it on its thread.
    """
    rows = rows[np.lexsort((-(end[rows] - ts[rows]), ts[rows], thread[rows]))]
    reach = pd.Series(end[rows]).groupby(thread[rows]).cummax().to_numpy()
    previous_reach = np.r_[-np.inf, reach[:-1]]
    previous_reach[np.r_[True, thread[rows][1:] != thread[rows][:-1]]] = -np.inf
    return rows[ts[rows] >= previous_reach]


def _enclosing(rows: np.ndarray, ops: np.ndarray, ts, end, thread) -> np.ndarray:
    """For each event in ``rows``: the top-level operator on its thread that it starts inside,
    or -1. ``ops`` are sorted by thread and start and do not overlap."""
    owner = np.full(len(rows), -1, dtype=np.int64)
    for code in np.unique(thread[rows]).tolist():
        mine = np.flatnonzero(thread[rows] == code)
        candidates = ops[thread[ops] == code]
        pos = np.searchsorted(ts[candidates], ts[rows[mine]], side="right") - 1
        inside = pos >= 0
        inside[inside] &= ts[rows[mine][inside]] < end[candidates[pos[inside]]]
        owner[mine[inside]] = candidates[pos[inside]]
    return owner


def _gap_samples(ops: np.ndarray, names, ts, end, thread) -> list[pd.DataFrame]:
    """T1 for each top-level operator after the first on its thread, and the gaps that were a
    thread waiting: at least ``IDLE_GAP_US`` long, with another thread running an operator."""
    after = np.flatnonzero(thread[ops][1:] == thread[ops][:-1]) + 1
    gap_start = end[ops[after - 1]]
    gap_end = ts[ops[after]]
    busy_elsewhere = np.zeros(len(after), dtype=bool)
    for code in np.unique(thread[ops]).tolist():
        theirs = ops[thread[ops] == code]
        others = thread[ops[after]] != code
        pos = np.searchsorted(ts[theirs], gap_end[others], side="left") - 1
        overlaps = pos >= 0
        overlaps[overlaps] &= end[theirs[pos[overlaps]]] > gap_start[others][overlaps]
        busy_elsewhere[others] |= overlaps
    waiting = busy_elsewhere & (gap_end - gap_start >= IDLE_GAP_US)
    rows = ops[after]
    return [
        _samples(kind, rows[m], names, thread[rows[m]], gap_start[m], (gap_end - gap_start)[m])
        for kind, m in (("T1", ~waiting), ("wait", waiting))
    ]


def _launch_window_samples(launches: np.ndarray, owner: np.ndarray, names, ts, end, thread) -> list[pd.DataFrame]:
    """T2, T3 and T5 of every operator that launched something. ``launches`` are sorted by
    thread and start, so an operator's launches are consecutive."""
    inside = owner >= 0
    launches, owner = launches[inside], owner[inside]
    if not len(launches):
        return []
    first = np.r_[True, owner[1:] != owner[:-1]]
    last = np.r_[owner[1:] != owner[:-1], True]
    op_first, op_last = owner[first], owner[last]
    t2 = _samples("T2", op_first, names, thread[op_first], ts[op_first], ts[launches[first]] - ts[op_first])
    t3 = _samples("T3", op_last, names, thread[op_last], end[launches[last]], end[op_last] - end[launches[last]])
    between = ~first
    t5 = _samples(
        "T5",
        owner[between],
        names,
        thread[owner[between]],
        end[launches[np.flatnonzero(between) - 1]],
        ts[launches[between]] - end[launches[np.flatnonzero(between) - 1]],
    )
    return [t2, t3, t5]


def summary_table(overheads: Overheads) -> str:
    """Each overhead type's count, total, mean, median and 90th percentile, as text."""
    summary = overheads.summary()
    shown = pd.DataFrame(
        {
            "type": summary["type"],
            "what": summary["description"],
            "count": summary["count"],
            "total ms": summary["total_us"] / 1e3,
            "mean us": summary["mean_us"],
            "median us": summary["median_us"],
            "p90 us": summary["p90_us"],
        }
    )
    return named_table(shown, ("type", "what"))


def per_operator_table(overheads: Overheads) -> str:
    """The median of each overhead type per operator type, for the :data:`SHOWN_ROWS` operator
    types with the most overhead in all, as text."""
    table = overheads.by_operator()
    types = ["T1", *(LAUNCH_TYPES if overheads.has_launches else ()), "op"]
    medians = table.pivot(index="operator", columns="type", values="median_us").reindex(columns=types)
    overhead_us = table[table["type"].isin(types[:-1])].groupby("operator", observed=True)["total_us"].sum()
    count = table[table["type"] == "op"].set_index("operator")["count"]
    shown = medians.assign(count=count).reindex(overhead_us.sort_values(ascending=False).index[:SHOWN_ROWS])
    shown = shown[["count", *types]].reset_index()
    shown["count"] = shown["count"].fillna(0).astype(int)
    return named_table(shown, ("operator",))
