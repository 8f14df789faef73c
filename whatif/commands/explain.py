"""The commands that explain one trace rather than predict a change to it: ``whatif overheads``
(the five CPU overheads per operator type) and ``whatif critical-path`` (what each simulated
iteration's longest chain is made of, optionally marked in the timeline)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from whatif.collectors.load import load_trace
from whatif.report.overheads import LAUNCH_TYPES, OVERHEAD_TYPES, Overheads, measure_overheads
from whatif.report.timeline import write_atomically, write_timeline
from whatif.sim.critical_path import PATH_KINDS, CriticalPath, iteration_critical_paths
from whatif.sim.engine import Schedule
from whatif.study import TraceStudy

#: How many operator types and path tasks the tables show (JSON and CSV have them all).
SHOWN_ROWS = 15
#: Kernel names run to hundreds of characters of template arguments; tables cut them here.
SHOWN_NAME_CHARS = 72


def _records(frame: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in row.items()}
        for row in frame.to_dict(orient="records")
    ]


def _number(value: float) -> str:
    return "-" if not np.isfinite(value) else f"{value:.2f}"


def _table(frame: pd.DataFrame, text_columns: tuple) -> str:
    """``frame`` as text, names left-aligned and cut to :data:`SHOWN_NAME_CHARS`."""
    frame = frame.copy()
    formatters = {}
    for column in text_columns:
        cut = frame[column].astype(str).map(lambda s: s if len(s) <= SHOWN_NAME_CHARS else s[: SHOWN_NAME_CHARS - 3] + "...")
        width = max([len(column), *cut.str.len()])
        frame[column] = cut
        formatters[column] = lambda s, width=width: f"{s:<{width}}"
    return frame.to_string(index=False, float_format=_number, na_rep="-", formatters=formatters)


# -- whatif overheads -----------------------------------------------------------------------------


def run_overheads(args: argparse.Namespace) -> int:
    overheads = measure_overheads(load_trace(args.trace))
    if args.csv is not None:
        if Path(args.csv).resolve() == Path(args.trace).resolve():
            raise OSError(0, "refusing to overwrite the input trace with the table", str(args.csv))
        write_atomically(args.csv, overheads.by_operator().to_csv(index=False).encode())
    if args.json:
        out = {
            "trace": str(args.trace),
            "operators": overheads.operators,
            "launch_calls": overheads.launches,
            "launch_types_apply": overheads.has_launches,
            "types": OVERHEAD_TYPES,
            "summary": _records(overheads.summary()),
            "by_operator": _records(overheads.by_operator()),
        }
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{args.trace}: {overheads.operators} top-level operators, {overheads.launches} launch calls")
    print(_overhead_summary_table(overheads))
    if not overheads.has_launches:
        print(f"{', '.join(LAUNCH_TYPES)} do not apply: the trace launches nothing (a CPU-only trace)")
    print(f"\nmedian us per operator type (the {SHOWN_ROWS} with the most overhead; --csv or --json for all):")
    print(_per_operator_table(overheads))
    if args.csv is not None:
        print(f"table written to {args.csv}")
    return 0


def _overhead_summary_table(overheads: Overheads) -> str:
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
    return _table(shown, ("type", "what"))


def _per_operator_table(overheads: Overheads) -> str:
    table = overheads.by_operator()
    types = ["T1", *(LAUNCH_TYPES if overheads.has_launches else ()), "op"]
    medians = table.pivot(index="operator", columns="type", values="median_us").reindex(columns=types)
    overhead_us = table[table["type"].isin(types[:-1])].groupby("operator", observed=True)["total_us"].sum()
    count = table[table["type"] == "op"].set_index("operator")["count"]
    shown = medians.assign(count=count).reindex(overhead_us.sort_values(ascending=False).index[:SHOWN_ROWS])
    shown = shown[["count", *types]].reset_index()
    shown["count"] = shown["count"].fillna(0).astype(int)
    return _table(shown, ("operator",))


# -- whatif critical-path -------------------------------------------------------------------------


def run_critical_path(args: argparse.Namespace) -> int:
    study = TraceStudy.from_trace(args.trace, args.iteration)
    report = study.replay_report()
    spans = report.assign(thread=study.iterations["thread"].to_numpy())
    paths = iteration_critical_paths(study.replay, spans)
    if args.timeline is not None:
        write_marked_timeline(study.replay, paths, args.timeline, protect=(args.trace,))
    kinds_ms = pd.DataFrame([path.by_kind() / 1e3 for path in paths]).reset_index(drop=True)
    top = path_tasks(study.replay, paths)
    if args.json:
        iterations = [
            {"name": name, "predicted_ms": predicted, "tasks_on_path": len(path.tasks), "kinds_ms": kinds}
            for name, predicted, path, kinds in zip(
                report["name"], report["predicted_ms"], paths, kinds_ms.to_dict(orient="records")
            )
        ]
        out = {"trace": str(args.trace), "kinds": list(PATH_KINDS), "iterations": iterations, "top_tasks": _records(top)}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(f"{args.trace}: the critical path of each simulated iteration, ms of each kind")
    table = pd.concat([report[["name", "predicted_ms"]].rename(columns={"name": "iteration", "predicted_ms": "predicted ms"}), kinds_ms], axis=1)
    print(_table(table, ("iteration",)))
    print(f"\nthe {SHOWN_ROWS} tasks with the most time on the paths (all iterations):")
    shown = top.head(SHOWN_ROWS).rename(columns={"ms": "ms on path", "share_pct": "% of paths", "count": "times"})
    print(_table(shown, ("name", "kind")))
    if args.timeline is not None:
        print(f"timeline written to {args.timeline} (critical-path tasks have args.critical = true)")
    return 0


def path_tasks(schedule: Schedule, paths: list[CriticalPath]) -> pd.DataFrame:
    """The tasks on the paths grouped by name and kind of time, most time first: name, kind, ms,
    share_pct (of all the paths' time), count (how many times a task of that name is on them)."""
    steps = pd.concat([path.steps for path in paths], ignore_index=True)
    steps = steps[steps["task"] >= 0]
    names = schedule.graph.tasks["name"].astype(str).to_numpy()
    total_us = sum(path.end_us - path.start_us for path in paths)
    grouped = (
        steps.assign(name=names[steps["task"].to_numpy()])
        .groupby(["name", "kind"], sort=False)["duration_us"]
        .agg(["sum", "count"])
        .sort_values("sum", ascending=False)
        .reset_index()
    )
    return pd.DataFrame(
        {
            "name": grouped["name"],
            "kind": grouped["kind"],
            "ms": grouped["sum"] / 1e3,
            "share_pct": 100.0 * grouped["sum"] / total_us if total_us > 0 else np.nan,
            "count": grouped["count"],
        }
    )


def write_marked_timeline(schedule: Schedule, paths: list[CriticalPath], path: Path, protect: tuple = ()) -> None:
    """The simulated timeline (``write_timeline``) with every task on a critical path marked:
    ``args.critical = true`` and the red ``cname`` (chrome://tracing), and a flow arrow wherever
    the path crosses from one thread or stream to another (Perfetto draws those)."""
    write_timeline(schedule, path, protect=protect)
    doc = msgspec.json.decode(Path(path).read_bytes())
    slices = [event for event in doc["traceEvents"] if event["ph"] == "X"]  # one per task, in task order
    arrows = []
    for chain in (p.tasks for p in paths):
        for t in chain.tolist():
            slices[t]["args"]["critical"] = True
            slices[t]["cname"] = "terrible"
        crossing = np.flatnonzero(
            [slices[a]["tid"] != slices[b]["tid"] or slices[a]["pid"] != slices[b]["pid"] for a, b in zip(chain[:-1], chain[1:])]
        )
        for i in crossing.tolist():
            source, target = slices[chain[i]], slices[chain[i + 1]]
            flow = {"name": "critical path", "cat": "critical_path", "id": len(arrows) // 2}
            arrows.append({**flow, "ph": "s", "pid": source["pid"], "tid": source["tid"], "ts": source["ts"]})
            arrows.append({**flow, "ph": "f", "bp": "e", "pid": target["pid"], "tid": target["tid"], "ts": target["ts"]})
    doc["traceEvents"].extend(arrows)
    write_atomically(Path(path), msgspec.json.encode(doc))
