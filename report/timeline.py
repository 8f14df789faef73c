"""The simulated timeline as a Chrome trace (the JSON of Google's Trace Event Format),
gzip-compressed: Perfetto (ui.perfetto.dev) and chrome://tracing open a ``.json.gz`` as they
open a ``.json``, and ``gzip -d`` gives the JSON back. Optionally with the critical paths marked.

Why gzip and not Perfetto's protobuf: the events stay the documented JSON that any script reads
(``json.load(gzip.open(f))``), no schema is compiled in, and it is small enough: a configuration
of the ResNet-50 V100 grid (81k tasks) is 19.7 MB of JSON and 1.0 MB gzip-compressed at zlib's
default level 6 (``bench/speed.py``). A timeline never replaces a file that is already there.
"""

from __future__ import annotations

import errno
import gzip
import os
import tempfile
from pathlib import Path
from typing import Optional

import msgspec
import numpy as np

from whatif.sim.critical_path import CriticalPath
from whatif.sim.engine import Schedule
from whatif.sim.graph import TaskKind

#: What a timeline's file name ends with (what Perfetto and chrome://tracing recognise)
TIMELINE_SUFFIX = ".json.gz"


def check_timeline_path(path: Path, protect: tuple = (), new: bool = True) -> Path:
    """``path`` as a timeline's target, refused (``OSError`` naming it) where it is not named
    ``*.json.gz``, is one of the inputs ``protect`` lists, by any spelling, or (``new``)
    already exists."""
    path = Path(path)
    if any(path.resolve() == Path(p).resolve() for p in protect):
        raise OSError(errno.EEXIST, "refusing to overwrite the input trace with the timeline", str(path))
    if not path.name.endswith(TIMELINE_SUFFIX) or path.name == TIMELINE_SUFFIX:
        raise OSError(errno.EINVAL, f"a timeline is written gzip-compressed, which Perfetto opens: name it "
                                    f"NAME{TIMELINE_SUFFIX}", str(path))
    if new and path.exists():
        raise OSError(errno.EEXIST, "already exists, and a timeline never replaces a file: remove it or name another",
                      str(path))
    return path


def write_timeline(schedule: Schedule, path: Path, protect: tuple = (), notes: Optional[dict] = None) -> None:
    """Write the timeline (:func:`timeline_events`) to ``path``, refused as
    :func:`check_timeline_path` says. The file is written beside the target and linked into
    place, so an interrupted run never leaves half a file and a file made meanwhile is kept;
    ``notes`` maps task ids to more event arguments (the collective a communication task ran
    in, ``report.cluster.collective_notes``)."""
    _write_new(check_timeline_path(path, protect), timeline_events(schedule, notes))


def write_timelines(timelines, protect: tuple = ()) -> None:
    """Each ``(schedule, path, notes)`` of ``timelines`` written as :func:`write_timeline`
    writes one, in order. While one is compressed and written, on a thread (zlib lets go of the
    interpreter's lock), the next one's events are made: on two cores a grid's timelines take
    about the time of their events alone. The first error is raised as it comes; the files
    written before it are kept."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="whatif-timeline") as pool:
        writing = None
        for schedule, path, notes in timelines:
            target = check_timeline_path(path, protect)
            raw = _encoded(timeline_events(schedule, notes))
            if writing is not None:
                writing.result()
            writing = pool.submit(_write_encoded, target, raw)
        if writing is not None:
            writing.result()


def timeline_events(schedule: Schedule, notes: Optional[dict] = None) -> list:
    """One complete event per task, in task order, after the metadata events: a track per
    resource, CPU threads and GPU streams in two processes."""
    tasks = schedule.graph.tasks
    resources = list(tasks["resource"].cat.categories)
    pid_of = {r: (2 if r.startswith("gpu") else 1) for r in resources}
    tid_of = {r: i for i, r in enumerate(resources)}
    kind_names = [k.name.lower() for k in TaskKind]
    # every column as a list: Python's own floats and strings, taken a row at a time far faster
    # than numpy's elements (the loop below makes one event per task: 83k a ResNet-50 worker)
    names = tasks["name"].astype(str).tolist()
    res = tasks["resource"].astype(str).tolist()
    kinds = tasks["kind"].tolist()
    context = tasks["context"].astype(str).tolist()
    measured = [None if m != m else m for m in tasks["measured_start_us"].to_numpy(dtype=np.float64).tolist()]
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "CPU threads (simulated)"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "GPU streams (simulated)"}},
    ]
    events += [
        {"ph": "M", "name": "thread_name", "pid": pid_of[r], "tid": tid_of[r], "args": {"name": r}} for r in resources
    ]
    notes = notes or {}
    start = schedule.start_us.tolist()
    dur = (schedule.end_us - schedule.start_us).tolist()
    events += [
        {
            "ph": "X",
            "name": name,
            "cat": kind_names[kind],
            "pid": pid_of[r],
            "tid": tid_of[r],
            "ts": ts,
            "dur": d,
            "args": {"context": ctx, "measured_start_us": m, **notes[i]} if i in notes
            else {"context": ctx, "measured_start_us": m},
        }
        for i, (name, kind, r, ts, d, ctx, m) in enumerate(zip(names, kinds, res, start, dur, context, measured))
    ]
    return events


def write_marked_timeline(schedule: Schedule, paths: list[CriticalPath], path: Path, protect: tuple = ()) -> None:
    """The simulated timeline (``write_timeline``) with every task on a critical path marked:
    ``args.critical = true`` and the red ``cname`` (chrome://tracing), and a flow arrow wherever
    the path crosses from one thread or stream to another (Perfetto draws those)."""
    path = check_timeline_path(path, protect)
    events = timeline_events(schedule)
    slices = [event for event in events if event["ph"] == "X"]  # one per task, in task order
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
    _write_new(path, events + arrows)


def _write_new(path: Path, events: list) -> None:
    """The events as a gzip-compressed Chrome trace, written beside ``path`` and hard-linked
    into place, which fails rather than replace a file that appeared meanwhile."""
    _write_encoded(path, _encoded(events))


def _encoded(events: list) -> bytes:
    """The events as a Chrome trace's JSON."""
    return msgspec.json.encode({"traceEvents": events, "displayTimeUnit": "ms"})


def _write_encoded(path: Path, raw: bytes) -> None:
    """:func:`_write_new`, of the JSON :func:`_encoded` made."""
    payload = gzip.compress(raw, compresslevel=6, mtime=0)
    directory = _folder_of(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        os.chmod(tmp, _new_file_mode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise OSError(errno.EEXIST, "appeared while the timeline was written; it is kept", str(path)) from None
        except OSError:  # a file system without hard links: checked, then renamed
            check_timeline_path(path)
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomically(path: Path, payload: bytes) -> None:
    """Write beside the target and rename into place: an interrupted run leaves no half file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=_folder_of(path))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _folder_of(path: Path) -> Path:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(2, "no such folder to write into", str(path))
    return directory


def _new_file_mode() -> int:
    """The mode an ordinary new file gets under the current umask (mkstemp's is 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
