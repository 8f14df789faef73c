"""The traces of a distributed job: one Kineto trace per rank, from a folder or a list of files.

Holistic Trace Analysis reads a job as a folder of per-rank traces; so does this. A folder may
hold other files (a PyTorch execution trace beside the Kineto ones, a README): each is skipped
with a one-line reason. A file named explicitly must be a trace.

A trace's rank is its ``distributedInfo`` (``rank``, ``world_size``, ``backend``: PyTorch's
profiler writes it for every process of a ``torch.distributed`` job), else a number in its file
name (``rank3``, ``worker3``, ``rank-3``), else the job is refused: without a rank there is no
telling which collective on one trace meets which on another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from .bundle import is_bundle
from .diagnostics import plural
from .kineto import KinetoTrace, TraceError
from .load import load_trace

_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
_TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class RankTrace:
    """One rank's trace and who it is in the job."""

    rank: int
    trace: KinetoTrace
    world_size: Optional[int] = None  # None: the trace does not say
    backend: str = ""
    rank_from: str = "distributedInfo"  # or "file name"

    @property
    def path(self) -> str:
        return self.trace.path


@dataclass
class JobTraces:
    """The ranks of a job, in rank order, and the files passed over while finding them."""

    ranks: list[RankTrace]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def is_job(paths: Sequence[Union[str, Path]]) -> bool:
    """Whether ``paths`` name a multi-rank job (several traces, or a folder that is not a capture
    bundle) rather than one trace."""
    paths = [Path(p) for p in paths]
    return len(paths) > 1 or (len(paths) == 1 and paths[0].is_dir() and not is_bundle(paths[0]))


def _not_a_trace(path: Path) -> Optional[str]:
    """Why a job's reader passes over ``path`` of a folder without reading it (None: it tries it)."""
    if path.is_dir() and not is_bundle(path):
        return "a folder, not a trace"
    if path.is_file() and not path.name.lower().endswith(_TRACE_SUFFIXES):
        return "not a .json or .json.gz file"
    return None


def folder_traces(folder: Union[str, Path]) -> list[Path]:
    """What in ``folder`` a job's reader would try as a rank's trace (its ``.json`` and
    ``.json.gz`` files and capture bundles, hidden ones left out), without reading any: a folder
    with fewer than two is no job, whatever they hold."""
    return [path for path in sorted(Path(folder).iterdir()) if not path.name.startswith(".") and not _not_a_trace(path)]


def one_trace(name: str) -> str:
    """What is said of a folder holding one trace, ``name``, where a job's are wanted."""
    return f"holds one trace, {name}, and a multi-rank job needs two or more: give that file to study it alone"


def load_traces(paths_or_folder: Union[str, Path, Sequence[Union[str, Path]]]) -> JobTraces:
    """Read a job's per-rank traces: a folder of them, or the files (or bundles) given.

    Raises :class:`TraceError` with a one-line reason when a file given is not a trace, a rank
    cannot be told, two traces claim one rank, the traces disagree on the world size, or ranks
    are missing.
    """
    if isinstance(paths_or_folder, (str, Path)):
        paths_or_folder = [paths_or_folder]
    paths = [Path(p) for p in paths_or_folder]
    ranks, skipped = [], []
    for path in paths:
        if path.is_dir() and not is_bundle(path):
            found, passed = _read_folder(path)
            ranks += found
            skipped += passed
        else:
            ranks.append(_identify(load_trace(path)))
    where = paths[0] if len(paths) == 1 else ", ".join(str(p) for p in paths)
    if not ranks and not skipped and len(paths) == 1:
        raise TraceError(where, "neither a trace file nor a trace bundle (no bundle.json), and no rank traces in it")
    if len(ranks) < 2:
        raise TraceError(
            where,
            f"a multi-rank job needs two or more rank traces, found {len(ranks)} (one trace: give its file; "
            "a capture bundle is a folder with a bundle.json)",
        )
    _check_ranks(ranks, where)
    return JobTraces(sorted(ranks, key=lambda r: r.rank), skipped)


def _read_folder(folder: Path) -> tuple[list[RankTrace], list[tuple[str, str]]]:
    loaded, skipped = [], []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        why = _not_a_trace(path)
        if why:
            skipped.append((str(path), why))
            continue
        try:
            loaded.append(load_trace(path))
        except TraceError as err:
            skipped.append((str(path), err.problem.split("; ")[0]))
    ranks, unranked = [], []  # the traces that name their rank, and the errors of those that do not
    for trace in loaded:
        try:
            ranks.append(_identify(trace))
        except TraceError as err:
            unranked.append(err)
    if unranked and len(loaded) == 1:  # one trace that names no rank: the folder is no job, whatever it says
        raise TraceError(folder, one_trace(Path(loaded[0].path).name))
    if unranked and not ranks:  # a folder of separate runs' traces, not one job's
        raise TraceError(folder, f"none of its {len(loaded)} traces names its rank (no distributedInfo, no rankN or "
                                 "workerN in the file name), so they are not one job's: give one trace's file to "
                                 "study it alone")
    if unranked:
        raise unranked[0]  # its own one-line error, naming the file
    return ranks, skipped


def _identify(trace: KinetoTrace) -> RankTrace:
    info = trace.distributed_info if isinstance(trace.distributed_info, dict) else {}
    rank = info.get("rank")
    world = info.get("world_size")
    world = int(world) if isinstance(world, int) and world > 0 else None
    backend = str(info.get("backend", ""))
    if isinstance(rank, int) and rank >= 0:
        return RankTrace(rank, trace, world, backend)
    match = _RANK_IN_NAME.search(Path(trace.path).name)
    if match is None:
        raise TraceError(
            trace.path,
            "cannot tell its rank: the trace has no distributedInfo and its file name no rank "
            "(name the file rankN or workerN)",
        )
    return RankTrace(int(match.group(1)), trace, world, backend, rank_from="file name")


def _check_ranks(ranks: list[RankTrace], where) -> None:
    worlds = {r.world_size for r in ranks if r.world_size is not None}
    if len(worlds) > 1:
        first = next(r for r in ranks if r.world_size is not None)
        other = next(r for r in ranks if r.world_size not in (None, first.world_size))
        raise TraceError(
            other.path,
            f"is from a job of {plural(other.world_size, 'rank')} but {first.path} from one of {first.world_size}: "
            "the traces are not of one job",
        )
    by_rank: dict[int, RankTrace] = {}
    for r in ranks:
        if r.rank in by_rank:
            raise TraceError(r.path, f"is rank {r.rank} (from its {r.rank_from}), and so is {by_rank[r.rank].path}")
        by_rank[r.rank] = r
    world = worlds.pop() if worlds else len(ranks)
    missing = sorted(set(range(world)) - set(by_rank))
    extra = sorted(set(by_rank) - set(range(world)))
    if extra:
        raise TraceError(by_rank[extra[0]].path, f"is rank {extra[0]}, outside a job of {plural(world, 'rank')}")
    if missing:
        shown = ", ".join(str(m) for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise TraceError(where, f"a job of {plural(world, 'rank')}, but no trace of rank {shown}: every rank's trace is needed to join the collectives")
