"""Reading nccl-tests output: the tables ``all_reduce_perf`` and its siblings print.

A table row is ``size count type [redop [root]] time algbw busbw #wrong`` for the out-of-place
run, usually followed by the same four for in-place (``src/util.cu``, ``writeBenchmarkLine*``;
nccl-tests before 2.11 printed no root, before 2.0 no redop, and ``error`` instead of
``#wrong``). Sizes are bytes, times microseconds, bandwidths GB/s (1e9 bytes/s). We keep the
out-of-place time: it is what ``whatif collective`` predicts; the in-place time, where printed,
is kept beside it as the twin run that says whether a row was disturbed (``calibrate.disturbed``).

Everything else in a file is context or noise: ``#`` lines (the header with ``# Collective test
starting: all_reduce_perf``, ``#  Rank  3 Group 0 Pid ... on HOST device 3 [...] NVIDIA H100``
lines that say how many ranks and hosts, ``nThread 1 nGpus 8`` that says how many GPUs one
host thread drives), MPI's ``[1,0]<stdout>:`` prefixes, NCCL's own log lines. A line whose first fields are a size, a count and a type is a row and must be whole; a
file with no rows is an error. Errors name the file and line.

Which operation a table is: its header, else ``op`` if given, else its file name
(``..._allgather_...``). How many ranks: the ratio of bus to algorithm bandwidth in its largest
row (nccl-tests' own factor, ``2(n-1)/n`` for all-reduce), else the ``Rank`` lines (which
posted logs often elide); how many hosts: the ``Rank`` lines, when all of them are there.
Launchers' prefixes (``[1,0]<stdout>:``, ``0: ``) are dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .nccl.tuning import OPS
from .units import TopologyError

TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16",
         "f8e4m3", "f8e5m2", "fp8_e4m3", "fp8_e5m2", "float16", "float32", "float64", "int", "char")
REDOPS = ("sum", "prod", "max", "min", "avg", "mulsum", "none")
_PREFIX = re.compile(r"^((\s*\[[^\]]*\](<std(out|err)>)?:?)|(\s*\d+:\s))+")
_PROGRAM = re.compile(r"Collective test starting:\s*(\w+?)(_perf)?(_mpi)?\s*$")
_RANK = re.compile(r"#\s*Rank\s+(\d+).*?\son\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.*)$")
_THREADS = re.compile(r"nThread\s+(\d+)\s+nGpus\s+(\d+)")
_FILE_OPS = (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
             ("alltoall", "all_to_all"), ("sendrecv", "send_recv"), ("broadcast", "broadcast"), ("reduce", "reduce"))
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def bus_factor(op: str, n_ranks: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``n_ranks`` (doc/PERFORMANCE.md)."""
    return _BUS_FACTOR[op](n_ranks) if op in _BUS_FACTOR else 1.0


@dataclass(frozen=True)
class Row:
    """One size of a table: the out-of-place time and bandwidths, and where it was read."""

    size_bytes: float
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    line: int
    in_place_us: Optional[float] = None  # the in-place run's time where printed (not N/A)


@dataclass(frozen=True)
class Table:
    """One nccl-tests run: ``op`` on ``n_ranks`` ranks (``hosts`` machines, if said), its rows."""

    path: str
    op: str
    rows: tuple
    n_ranks: Optional[int] = None
    hosts: Optional[int] = None
    gpu: str = ""
    gpus_per_thread: int = 1  # the header's nGpus: GPUs one host thread drives (-g)


def _op_name(text: str) -> Optional[str]:
    name = text.lower().replace("-", "_")
    if name in OPS:
        return name
    flat = name.replace("_", "")
    return next((op for key, op in _FILE_OPS if flat == key), None)


def _op_from_file(path: str) -> Optional[str]:
    flat = Path(path).name.lower().replace("_", "").replace("-", "")
    return next((op for key, op in _FILE_OPS if key in flat), None)


def _number(token: str, where: str, what: str) -> float:
    try:
        value = float(token)
    except ValueError:
        raise TopologyError(where, f"{what} {token!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TopologyError(where, f"{what} {token!r} must be a finite number >= 0")
    return value


def _row(tokens: list, where: str, number: int) -> Row:
    rest = tokens[3:]
    if rest and rest[0].lower() in REDOPS:
        rest = rest[1:]
    if len(rest) in (5, 9):
        rest = rest[1:]  # root
    if len(rest) not in (4, 8):
        raise TopologyError(where, f"a row needs time, algbw, busbw and #wrong after '{' '.join(tokens[:3])}', "
                                   f"got {len(rest)} fields: {' '.join(tokens)}")
    size = _number(tokens[0], where, "size")
    time_us = _number(rest[0], where, "time")
    if time_us <= 0:
        raise TopologyError(where, f"time {rest[0]!r} must be positive")
    in_place = None
    if len(rest) == 8 and rest[4].upper() != "N/A":
        in_place = _number(rest[4], where, "in-place time") or None
    return Row(size, int(_number(tokens[1], where, "count")), tokens[2], time_us,
               _number(rest[1], where, "algbw"), _number(rest[2], where, "busbw"), number, in_place)


def _ranks_from_bandwidth(op: str, rows: list, listed: int = 0) -> Optional[int]:
    """n from busbw / algbw = bus_factor(op, n): the n consistent with every row's printed
    bandwidths (2 decimals). Large communicators leave several n consistent: then the ``Rank``
    lines' highest rank + 1 (``listed``) if it is one of them, else the one with the most
    factors of two (GPUs come in nodes of 4 and 8). Rank lines that contradict the bandwidths
    (pasted from another run, or elided) do not count."""
    if op not in _BUS_FACTOR:
        return None
    lo, hi = 0.0, math.inf
    for row in rows:
        if row.algbw_gbps >= 1.0:
            lo = max(lo, (row.busbw_gbps - 0.005) / (row.algbw_gbps + 0.005))
            hi = min(hi, (row.busbw_gbps + 0.005) / (row.algbw_gbps - 0.005))
    if lo == 0.0:
        return None
    consistent = [k for k in range(2, 100001) if lo - 1e-9 <= bus_factor(op, k) <= hi + 1e-9]
    if not consistent:  # rounding worse than 2 decimals: the nearest
        best = max(rows, key=lambda r: r.algbw_gbps)
        ratio = best.busbw_gbps / best.algbw_gbps
        n = min(range(2, 4097), key=lambda k: abs(bus_factor(op, k) - ratio))
        return n if abs(bus_factor(op, n) - ratio) < 0.02 else None
    if listed in consistent:
        return listed
    center = (lo + hi) / 2
    return max(consistent, key=lambda k: ((k & -k), -abs(bus_factor(op, k) - center)))


def parse_text(text: str, path: str = "<text>", op: Optional[str] = None) -> Table:
    """The table in nccl-tests output ``text``; errors name ``path`` and the line."""
    header_op, rows, ranks, hosts, gpu, per_thread = None, [], set(), set(), "", 1
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _PREFIX.sub("", raw).strip()
        where = f"{path}:{number}"
        threads = _THREADS.search(line)
        if threads:
            per_thread = max(1, int(threads.group(2)))
            continue
        program = _PROGRAM.search(line)
        if program:
            header_op = _op_name(program.group(1))
            if header_op is None:
                raise TopologyError(where, f"unknown nccl-tests program {program.group(1)!r}")
            continue
        rank = _RANK.search(line)
        if rank:
            ranks.add(int(rank.group(1)))
            hosts.add(rank.group(2))
            gpu = gpu or rank.group(3).strip()
            continue
        if not line or line.startswith("#"):
            continue
        tokens = line.split()
        if len(tokens) >= 3 and tokens[0].isdigit() and tokens[1].isdigit() and tokens[2].lower() in TYPES:
            rows.append(_row(tokens, where, number))
        elif len(tokens) >= 2 and tokens[0].isdigit() and tokens[1].isdigit() and len(tokens) < 6:
            raise TopologyError(where, f"a truncated row: {line!r}")
    if not rows:
        raise TopologyError(path, "no nccl-tests rows (size count type ... time algbw busbw) in it")
    given = _op_name(op) if op else None
    if op and given is None:
        raise TopologyError("--op", f"unknown operation {op!r}; known: {', '.join(OPS)}")
    if header_op and given and header_op != given:
        raise TopologyError(path, f"its header says {header_op}, but --op says {given}")
    found = header_op or given or _op_from_file(path)
    if found is None:
        raise TopologyError(path, f"cannot tell which operation it measured; give --op ({', '.join(OPS)})")
    from_bandwidth = _ranks_from_bandwidth(found, rows, max(ranks) + 1 if ranks else 0)
    n_ranks = from_bandwidth or (len(ranks) if ranks else None)
    complete = bool(ranks) and len(ranks) == n_ranks  # every Rank line printed, none elided
    measured = tuple(r for r in rows if r.size_bytes > 0)
    if not measured:
        raise TopologyError(path, "every row has size 0 (too few elements per rank); nothing was measured")
    return Table(path, found, measured, n_ranks, len(hosts) if complete else None, gpu, per_thread)


def read_table(path: Union[str, Path], op: Optional[str] = None) -> Table:
    """The table in the nccl-tests output file ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise TopologyError(str(path), err.strerror or str(err)) from None
    return parse_text(text, str(path), op)
