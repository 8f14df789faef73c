"""The simulated timeline as a Chrome trace that Perfetto and chrome://tracing open, optionally
with the critical paths marked."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import msgspec
import numpy as np

from whatif.sim.critical_path import CriticalPath
from whatif.sim.engine import Schedule
from whatif.sim.graph import TaskKind


def write_timeline(schedule: Schedule, path: Path, protect: tuple = (), notes: Optional[dict] = None) -> None:
    """Write one complete event per task, a track per resource, CPU threads and GPU streams in
    two processes. The file is written beside the target and renamed into place, so an
    interrupted run never leaves half a file; ``protect`` lists paths (the input trace) that
    must never be overwritten; ``notes`` maps task ids to more event arguments (the collective a
    communication task ran in, ``report.cluster.collective_notes``)."""
    path = Path(path)
    if any(path.resolve() == Path(p).resolve() for p in protect):
        raise OSError(f"{path}: refusing to overwrite the input trace with the timeline")
    tasks = schedule.graph.tasks
    resources = list(tasks["resource"].cat.categories)
    pid_of = {r: (2 if r.startswith("gpu") else 1) for r in resources}
    tid_of = {r: i for i, r in enumerate(resources)}
    kind_names = [k.name.lower() for k in TaskKind]
    names = tasks["name"].astype(str).to_numpy()
    res = tasks["resource"].astype(str).to_numpy()
    kinds = tasks["kind"].to_numpy()
    context = tasks["context"].astype(str).to_numpy()
    measured = tasks["measured_start_us"].to_numpy()
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "CPU threads (simulated)"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "GPU streams (simulated)"}},
    ]
    events += [
        {"ph": "M", "name": "thread_name", "pid": pid_of[r], "tid": tid_of[r], "args": {"name": r}} for r in resources
    ]
    notes = notes or {}
    start = schedule.start_us
    dur = schedule.end_us - schedule.start_us
    for i in range(len(tasks)):
        events.append(
            {
                "ph": "X",
                "name": names[i],
                "cat": kind_names[kinds[i]],
                "pid": pid_of[res[i]],
                "tid": tid_of[res[i]],
                "ts": float(start[i]),
                "dur": float(dur[i]),
                "args": {
                    "context": context[i],
                    "measured_start_us": None if np.isnan(measured[i]) else float(measured[i]),
                    **notes.get(i, {}),
                },
            }
        )
    write_atomically(path, msgspec.json.encode({"traceEvents": events, "displayTimeUnit": "ms"}))


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


def write_atomically(path: Path, payload: bytes) -> None:
    """Write beside the target and rename into place: an interrupted run leaves no half file."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(2, "no such folder to write into", str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _new_file_mode() -> int:
    """The mode an ordinary new file gets under the current umask (mkstemp's is 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
