"""A trace read and its graph built once, kept for the next command on the same trace.

Reading a trace and building its dependency graph is most of a replay's time (on the 216k-event
trace of ``bench/speed.py``, 1.0 s of 1.4), and a user asking what-if after what-if of one trace
pays it on every command. :func:`read_and_build` keeps the two, pickled, in
``$WHATIF_CACHE_DIR/graphs`` (else ``$XDG_CACHE_HOME/whatif/graphs`` or
``~/.cache/whatif/graphs``), and hands them back while nothing they came from has changed:

* the key is the trace as named (a file, or every file of a bundle folder) with each file's size,
  modification and change times, inode, and a digest of its first and last 64 KiB; the code
  that reads and builds (the size and modification time of every module of ``collectors/`` and
  ``sim/``, and of this one); and the Python, NumPy and pandas versions the pickle was written
  by. Any change is a miss, and the entry is rebuilt;
* the warnings that reading and building gave (``collectors/diagnostics.py``: events dropped,
  fields missing) are kept with the entry and said again on every hit, so a cached trace is
  never quieter than a fresh one, and ``--strict`` stops on them alike;
* an entry that cannot be read (cut short, from another version) is removed and rebuilt; one
  that cannot be written (a read-only home) is simply not kept;
* the folder is held under ``$WHATIF_GRAPH_CACHE_MB`` (default 2048 MB): the entries used
  longest ago go first. ``WHATIF_GRAPH_CACHE=0`` turns the cache off; removing the folder
  empties it.

A study's replay (the graph simulated unchanged, ``TraceStudy.replay``) is kept beside its entry
too (``KEY.replay``: every task's start and end): the engine is in ``sim/``, so the key that
names the graph names its replay, and a later ``whatif replay`` or grid does not simulate it
again (a tenth of a second on the largest shared trace, a fifth of a cached replay).

The first command on a trace pays the read in full; the figures of ``bench/speed.py`` say which
they measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Optional, Union

from whatif.collectors.cache_folder import MARK_PREFIX, MARK_SUFFIX, graph_cache_enabled, graph_folder, mark_held
from whatif.collectors.diagnostics import recording, report
from whatif.collectors.kineto import KinetoTrace
from whatif.collectors.load import load_trace
from whatif.collectors.tracefile import discard_read_ahead
from whatif.sim.build import build_graph
from whatif.sim.graph import TaskGraph

FORMAT = 1  # what an entry holds; a new layout gets a new number
REPLAY_FORMAT = 1  # what a replay file holds
DEFAULT_LIMIT_MB = 2048
MAX_BUNDLE_FILES = 1000  # a folder with more is no bundle: not cached


def read_and_build(path: Union[str, Path]) -> tuple[KinetoTrace, TaskGraph]:
    """``path``'s trace (``collectors/load.py``) and its graph (``sim/build.py``), from the cache
    where an entry for this trace and this code is kept, else read, built and kept."""
    trace, graph, _ = read_build_and_key(path)
    return trace, graph


def read_build_and_key(path: Union[str, Path]) -> tuple[KinetoTrace, TaskGraph, Optional[str]]:
    """:func:`read_and_build`, and the entry's key (None with the cache off, or for a trace it
    cannot name), which names the replay kept with it (:func:`kept_replay`)."""
    key = entry_key(path) if graph_cache_enabled() else None
    entry = _load(key) if key else None
    if entry is not None:
        discard_read_ahead(path)  # the file the command line began reading: not needed now
        mark_held(path)  # and the next command on it will not begin (collectors/cache_folder.py)
        for text in entry["warnings"]:
            report(text)
        return entry["trace"], entry["graph"], key
    with recording() as texts:
        trace = load_trace(path)
        graph = build_graph(trace)
    if key:
        if _store(key, {"format": FORMAT, "trace": trace, "graph": graph, "warnings": list(texts)}):
            mark_held(path)  # only where the entry was kept: a mark without one would cost the read-ahead
    return trace, graph, key


def kept_replay(key: str, tasks: int) -> Optional[dict]:
    """The replay kept under ``key`` (``start_us``, ``end_us``, ``simpy_events``, ``wall_s``),
    where one of ``tasks`` tasks is; one that cannot be read is removed."""
    return _read(_replay_path(key), lambda kept: kept.get("format") == REPLAY_FORMAT
                 and all(len(kept.get(k, ())) == tasks for k in ("start_us", "end_us")))


def keep_replay(key: str, start_us, end_us, simpy_events: int, wall_s: float) -> None:
    """Keep a replay under ``key`` (see :func:`kept_replay`); where it cannot be written, it is not."""
    _write(_replay_path(key), {"format": REPLAY_FORMAT, "start_us": start_us, "end_us": end_us,
                               "simpy_events": simpy_events, "wall_s": wall_s})


def entry_key(path: Union[str, Path]) -> Optional[str]:
    """The entry's name for ``path`` as it is now and for this code; None where it cannot be
    told (no such file, a folder too large to be a bundle)."""
    path = Path(path)
    try:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            if len(files) > MAX_BUNDLE_FILES:
                return None
        else:
            files = [path]
        stamps = [[str(p.relative_to(path)) if p != path else "", *_stamp(p)] for p in files]
    except OSError:
        return None
    doc = {"format": FORMAT, "named": str(path), "resolved": str(path.resolve()), "files": stamps,
           "code": _code_stamp(), "python": sys.version, "libraries": _library_versions()}
    return hashlib.sha1(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _stamp(path: Path) -> list:
    """What tells this file's content from another's without reading it all: its size, times and
    inode, and a digest of its first and last 64 KiB (a gzipped trace's last 8 bytes are the
    CRC and length of all it holds), for a file rewritten within one tick of a coarse clock."""
    st = path.stat()
    edge = 1 << 16
    with open(path, "rb") as f:
        head = f.read(edge)
        if st.st_size > edge:
            f.seek(max(st.st_size - edge, edge))
        tail = f.read(edge)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, hashlib.sha1(head + b"|" + tail).hexdigest()]


_CODE_STAMP: Optional[list] = None


def _code_stamp() -> list:
    """Size and modification time of every module that reads traces or builds graphs."""
    global _CODE_STAMP
    if _CODE_STAMP is None:
        import whatif.collectors
        import whatif.sim

        stamps = []
        for package in (whatif.collectors, whatif.sim):
            root = Path(package.__file__).parent
            for module in sorted(root.rglob("*.py")):
                st = module.stat()
                stamps.append([str(module.relative_to(root.parent)), st.st_size, st.st_mtime_ns])
        st = Path(__file__).stat()  # this module: what an entry holds
        _CODE_STAMP = stamps + [[Path(__file__).name, st.st_size, st.st_mtime_ns]]
    return _CODE_STAMP


def _library_versions() -> list:
    import numpy
    import pandas

    return [numpy.__version__, pandas.__version__, pickle.HIGHEST_PROTOCOL]


def _entry_path(key: str) -> Path:
    return graph_folder() / f"{key}.pickle"


def _replay_path(key: str) -> Path:
    return graph_folder() / f"{key}.replay"


def _load(key: str) -> Optional[dict]:
    return _read(_entry_path(key), lambda entry: entry.get("format") == FORMAT)


def _read(path: Path, valid) -> Optional[dict]:
    """The dict pickled at ``path`` where ``valid`` says it is one this code wrote, marked used
    now (the last to go when the folder is trimmed); one that cannot be read (cut short, from
    another version) or is not valid is removed, and None."""
    try:
        with open(path, "rb") as f:
            value = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # cut short, or written by another version: made again by the caller
        _remove(path)
        return None
    if not isinstance(value, dict) or not valid(value):
        _remove(path)
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return value


def _store(key: str, entry: dict) -> bool:
    return _write(_entry_path(key), entry)


def _write(path: Path, value) -> bool:
    """``value`` pickled to ``path`` whole or not at all, then the folder trimmed; nothing where
    it cannot be written (the next command makes it again). Whether ``path`` is there after the
    trim (one entry larger than the folder's limit is not)."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".writing-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(temporary, path)
        except BaseException:
            _remove(Path(temporary))
            raise
        trim(folder)
    except (OSError, pickle.PicklingError):
        return False
    return path.exists()


def limit_bytes() -> float:
    try:
        return float(os.environ.get("WHATIF_GRAPH_CACHE_MB", DEFAULT_LIMIT_MB)) * 2**20
    except ValueError:
        return DEFAULT_LIMIT_MB * 2**20


def trim(folder: Path) -> None:
    """Remove the entries used longest ago until the folder holds at most :func:`limit_bytes`,
    and the marks of traces (``collectors/cache_folder.py``) last used before every entry kept."""
    entries = []
    for path in [*folder.glob("*.pickle"), *folder.glob("*.replay")]:
        try:
            st = path.stat()
        except OSError:
            continue
        entries.append((st.st_mtime_ns, st.st_size, path))
    total, limit = sum(size for _, size, _ in entries), limit_bytes()
    kept = sorted(entries)
    while kept and total > limit:
        _, size, path = kept.pop(0)
        _remove(path)
        total -= size
    oldest_kept = kept[0][0] if kept else None
    for mark in folder.glob(f"{MARK_PREFIX}*{MARK_SUFFIX}"):
        try:
            if oldest_kept is None or mark.stat().st_mtime_ns < oldest_kept:
                _remove(mark)
        except OSError:
            continue


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
