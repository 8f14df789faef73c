"""Reading nccl-tests output: the tables ``all_reduce_perf`` and its siblings print.

A table row is ``size count type [redop [root]] time algbw busbw #wrong`` for the out-of-place
run, usually followed by the same four for in-place (``src/util.cu``, ``writeBenchmarkLine*``;
nccl-tests before 2.11 printed no root, before 2.0 no redop, and ``error`` instead of
``#wrong``). Since 2.17 a run with ``-I 1`` adds four per-iteration columns (``i_min i_max i_p99
i_cv%``) after each half, and ``-T 1`` ends a row with its date and time; both are read past.
nccl-tests' JSON output (``-J FILE.json``, 2.17 and later: ``results`` of ``size``, ``count``,
``type``, ``out_of_place`` and ``in_place`` with ``time``, ``alg_bw``, ``bus_bw``) is read too
(:func:`parse_json`), and says more than the text: the program, every process's host and GPU,
the NCCL release, and the environment, so an ``NCCL_ALGO`` or ``NCCL_PROTO`` the run was forced
to. Sizes are bytes, times microseconds, bandwidths GB/s (1e9 bytes/s). We keep the
out-of-place time: it is what ``whatif collective`` predicts; the in-place time, where printed,
is kept beside it as the twin run that says whether a row was disturbed (``calibrate.disturbed``).

Everything else in a file is context or noise: ``#`` lines (the header with ``# Collective test
starting: all_reduce_perf``, ``#  Rank  3 Group 0 Pid ... on HOST device 3 [...] NVIDIA H100``
lines that say how many ranks and hosts, ``nThread 1 nGpus 8`` that says how many GPUs one
host thread drives), MPI's ``[1,0]<stdout>:`` prefixes, NCCL's own log lines. A line whose first fields are a size, a count and a type is a row and must be whole; a
file with no rows is an error. Errors name the file and line.

Which operation a table is: its header, else ``op`` if given, else its file name
(``..._allgather_...``). Which NCCL release ran it: ``NCCL version 2.26.6+cuda12.8`` (NCCL's
own log line) or the header's ``nccl-library=22602``, where printed. How many ranks: the ratio of bus to algorithm bandwidth in its largest
row (nccl-tests' own factor, ``2(n-1)/n`` for all-reduce), else the ``Rank`` lines (which
posted logs often elide); how many hosts: the ``Rank`` lines, when all of them are there.
Launchers' prefixes (``[1,0]<stdout>:``, ``0: ``) are dropped.
"""

from __future__ import annotations

import json
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
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)|nccl-library=(\d+)")
_FORCED = re.compile(r"(NCCL_ALGO|NCCL_PROTO) set by environment to\s+(\S+)")
_STAMP = re.compile(r"\d{4}-\d\d-\d\d$"), re.compile(r"\d\d:\d\d:\d\d$")
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
    nccl_version: Optional[str] = None  # the NCCL release that ran it, where the output says
    algorithm: Optional[str] = None  # NCCL_ALGO the run was forced to, where the output says
    protocol: Optional[str] = None  # NCCL_PROTO likewise

    def repeated_sizes(self) -> int:
        """Rows whose size an earlier row had: a run of several data types or reduction ops
        (``-d all``, ``-o all``) prints each size once for each."""
        return len(self.rows) - len({r.size_bytes for r in self.rows})


def _op_name(text: str) -> Optional[str]:
    """The operation ``text`` names (``all_reduce``; as nccl-tests spells it too: ``allreduce``,
    ``alltoall``, ``sendrecv``, ``all_reduce_perf``), or None."""
    name = text.lower().replace("-", "_").removesuffix("_perf")
    if name in OPS:
        return name
    flat = name.replace("_", "")
    return next((op for key, op in _FILE_OPS if flat == key), None)


def named_operation(text: str) -> str:
    """:func:`_op_name` of ``--op``'s value, or a one-line error naming the operations known."""
    found = _op_name(text)
    if found is None:
        raise TopologyError("--op", f"unknown operation {text!r}; known: {', '.join(OPS)}")
    return found


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
    if len(rest) >= 2 and _STAMP[0].match(rest[-2]) and _STAMP[1].match(rest[-1]):
        rest = rest[:-2]  # -T 1: the row's date and time
    if rest and rest[0].lower() in REDOPS:
        rest = rest[1:]
    if len(rest) in (5, 9, 17):
        rest = rest[1:]  # root
    if len(rest) not in (4, 8, 16):
        raise TopologyError(where, f"a row needs time, algbw, busbw and #wrong after '{' '.join(tokens[:3])}', "
                                   f"got {len(rest)} fields: {' '.join(tokens)}")
    size = _number(tokens[0], where, "size")
    time_us = _number(rest[0], where, "time")
    if time_us <= 0:
        raise TopologyError(where, f"time {rest[0]!r} must be positive")
    in_place = None
    twin = rest[len(rest) // 2] if len(rest) > 4 else "N/A"  # -I 1: each half has 8 columns
    if twin.upper() != "N/A":
        in_place = _number(twin, where, "in-place time") or None
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


def _version(match: re.Match) -> str:
    if match.group(1):
        return match.group(1)
    code = int(match.group(2))  # NCCL_VERSION_CODE: 22602 since 2.9, 2708 before
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 10000 else \
        f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def parse_text(text: str, path: str = "<text>", op: Optional[str] = None) -> Table:
    """The table in nccl-tests output ``text``; errors name ``path`` and the line."""
    header_op, rows, ranks, hosts, gpu, per_thread = None, [], set(), set(), "", 1
    version, forced = None, {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _PREFIX.sub("", raw).strip()
        where = f"{path}:{number}"
        threads = _THREADS.search(line)
        if threads:
            per_thread = max(1, int(threads.group(2)))
            continue
        found_version = _VERSION.search(line)
        if found_version:
            version = version or _version(found_version)
        env = _FORCED.search(line)
        if env:
            forced[env.group(1)] = env.group(2)
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
    found = _operation(path, header_op, op)
    from_bandwidth = _ranks_from_bandwidth(found, rows, max(ranks) + 1 if ranks else 0)
    n_ranks = from_bandwidth or (len(ranks) if ranks else None)
    complete = bool(ranks) and len(ranks) == n_ranks  # every Rank line printed, none elided
    return Table(path, found, _measured(rows, path), n_ranks, len(hosts) if complete else None, gpu, per_thread,
                 version, forced.get("NCCL_ALGO"), forced.get("NCCL_PROTO"))


def _operation(path: str, header_op: Optional[str], op: Optional[str]) -> str:
    given = named_operation(op) if op else None
    if header_op and given and header_op != given:
        raise TopologyError(path, f"its header says {header_op}, but --op says {given}")
    found = header_op or given or _op_from_file(path)
    if found is None:
        raise TopologyError(path, f"cannot tell which operation it measured; give --op ({', '.join(OPS)})")
    return found


def _measured(rows: list, path: str) -> tuple:
    measured = tuple(r for r in rows if r.size_bytes > 0)
    if not measured:
        raise TopologyError(path, "every row has size 0 (too few elements per rank); nothing was measured")
    return measured


def _json_number(value, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TopologyError(where, f"{what} {value!r} is not a number")
    return _number(str(value), where, what)


def parse_json(text: str, path: str = "<json>", op: Optional[str] = None) -> Table:
    """The table in nccl-tests' JSON output ``text`` (``-J``; its ``version`` 3 layout, nccl-tests
    2.17 to 2.19: ``src/util.cu``'s ``json*`` writers). Errors name ``path`` and the field, as
    ``results[3].out_of_place.time``. The program (``args[0]``, ``all_reduce_perf``) says the
    operation; the ranks are the ``devices`` (one per process) times ``config``'s ``nthreads`` x
    ``ngpus``; ``env`` says whether ``NCCL_ALGO`` or ``NCCL_PROTO`` was forced."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise TopologyError(path, f"not valid JSON ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise TopologyError(f"{path}: results", "no results list: not nccl-tests' JSON output (-J)")
    args = doc.get("args") if isinstance(doc.get("args"), list) else []
    program = _PROGRAM.search(f"Collective test starting: {Path(str(args[0])).name}") if args else None
    header_op = _op_name(program.group(1)) if program else None
    rows = []
    for i, result in enumerate(doc["results"]):
        where = f"{path}: results[{i}]"
        if not isinstance(result, dict):
            raise TopologyError(where, "expected an object with size, count, type and out_of_place")
        timed = result.get("out_of_place") or result.get("in_place")
        if not isinstance(timed, dict):
            raise TopologyError(f"{where}.out_of_place", "missing: no time for this size")
        half = "out_of_place" if result.get("out_of_place") else "in_place"
        clock = "time" if "time" in timed else "cpu_time"
        time_us = _json_number(timed.get(clock), f"{where}.{half}.{clock}", "time")
        if time_us <= 0:
            raise TopologyError(f"{where}.{half}.{clock}", f"time {time_us!r} must be positive")
        twin = result.get("in_place") if half == "out_of_place" else None
        in_place = None
        if isinstance(twin, dict) and twin.get(clock) is not None:
            in_place = _json_number(twin.get(clock), f"{where}.in_place.{clock}", "in-place time") or None
        rows.append(Row(_json_number(result.get("size"), f"{where}.size", "size"),
                        int(_json_number(result.get("count"), f"{where}.count", "count")), str(result.get("type", "")),
                        time_us, _json_number(timed.get("alg_bw"), f"{where}.{half}.alg_bw", "algbw"),
                        _json_number(timed.get("bus_bw"), f"{where}.{half}.bus_bw", "busbw"), i, in_place))
    if not rows:
        raise TopologyError(f"{path}: results", "empty: nothing was measured")
    found = _operation(path, header_op, op)
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    devices = [d for d in doc.get("devices", []) if isinstance(d, dict)] if isinstance(doc.get("devices"), list) else []
    per_process = int(config.get("nthreads") or 1) * int(config.get("ngpus") or 1)
    listed = len(devices) * per_process
    n_ranks = _ranks_from_bandwidth(found, rows, listed) or listed or None
    hosts = len({d.get("hostname") for d in devices}) if devices and listed == n_ranks else None
    env = dict(str(e).partition("=")[::2] for e in doc.get("env", []) if isinstance(e, str))
    version = None
    if isinstance(doc.get("nccl_version"), int) and doc["nccl_version"] > 0:
        version = _version(_VERSION.search(f"nccl-library={doc['nccl_version']}"))
    gpu = str(devices[0].get("device_info", "")).strip() if devices else ""
    return Table(path, found, _measured(rows, path), n_ranks, hosts, gpu, int(config.get("ngpus") or 1), version,
                 env.get("NCCL_ALGO") or None, env.get("NCCL_PROTO") or None)


def read_table(path: Union[str, Path], op: Optional[str] = None) -> Table:
    """The table in the nccl-tests output file ``path``: its text, or its JSON (``-J``)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise TopologyError(str(path), err.strerror or str(err)) from None
    if text.lstrip().startswith("{"):
        return parse_json(text, str(path), op)
    return parse_text(text, str(path), op)
