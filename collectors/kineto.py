"""Reading PyTorch-profiler (Kineto) Chrome-trace JSON into one columnar event table.

This module is the one place that knows the trace schema. Two generations of Kineto output are
in the wild: the 2021 schema (categories ``Operator``, ``Runtime``, ``Kernel``, ``Memcpy``,
``Memset``; flows ``async``) and the current one (``cpu_op``, ``cuda_runtime``, ``kernel``,
``gpu_memcpy``, ``cuda_sync`` ...). Both are mapped onto the same small set of event kinds, so
nothing downstream ever looks at a category string.

Large traces (200k+ events) are decoded with msgspec into typed structs that keep only the
fields the simulator needs; everything else in ``args`` (call stacks, memory counters) is skipped
by the decoder instead of becoming Python dicts. The result is a pandas frame of numbers with
names interned as categoricals, as Holistic Trace Analysis does.
"""

from __future__ import annotations

import enum
import pickle
import re
import threading
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Optional, Union

import msgspec
import numpy as np
import pandas as pd

from .diagnostics import plural, warn
from .gcpause import gc_paused
from .tracefile import TraceError, read_bytes


class EventKind(enum.IntEnum):
    """What an event is, independent of the schema generation that wrote it."""

    CPU_OP = 0
    ANNOTATION = 1  # user_annotation / record_function ranges, ProfilerStep#N
    PYTHON = 2  # python_function stack frames (with_stack=True or with_modules=True)
    RUNTIME = 3  # CUDA runtime or driver API call on a CPU thread
    KERNEL = 4
    MEMCPY = 5
    MEMSET = 6
    GPU_ANNOTATION = 7
    CUDA_SYNC = 8  # Kineto's description of what a sync call waited for; not time on a resource


CPU_KINDS = (EventKind.CPU_OP, EventKind.ANNOTATION, EventKind.PYTHON, EventKind.RUNTIME)
GPU_KINDS = (EventKind.KERNEL, EventKind.MEMCPY, EventKind.MEMSET)

_KIND_OF_CATEGORY = {
    "operator": EventKind.CPU_OP,
    "cpu_op": EventKind.CPU_OP,
    "user_annotation": EventKind.ANNOTATION,
    "python_function": EventKind.PYTHON,
    "runtime": EventKind.RUNTIME,
    "cuda_runtime": EventKind.RUNTIME,
    "cuda_driver": EventKind.RUNTIME,
    "kernel": EventKind.KERNEL,
    "memcpy": EventKind.MEMCPY,
    "gpu_memcpy": EventKind.MEMCPY,
    "memset": EventKind.MEMSET,
    "gpu_memset": EventKind.MEMSET,
    "gpu_user_annotation": EventKind.GPU_ANNOTATION,
    "cuda_sync": EventKind.CUDA_SYNC,
}
_IGNORED_CATEGORIES = {"trace", "", "cpu_instant_event"}


class _Args(msgspec.Struct, gc=False):
    correlation: int = -1
    external_id: int = msgspec.field(name="External id", default=-1)
    stream: int = -1
    device: int = -1
    bytes: int = -1
    sync_kind: str = msgspec.field(name="cuda_sync_kind", default="")
    wait_on_stream: int = -1
    wait_on_record_correlation: int = msgspec.field(name="wait_on_cuda_event_record_corr_id", default=-1)
    input_dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw())
    input_types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw())
    concrete_inputs: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw())
    message_elements: int = msgspec.field(name="In msg nelems", default=-1)
    message_dtype: str = msgspec.field(name="dtype", default="")
    sequence_nr: int = msgspec.field(name="Sequence number", default=-1)
    # a collective, as c10d records it on record_param_comms and on its NCCL kernel (torch 2.x)
    collective_name: str = msgspec.field(name="Collective name", default="")
    out_elements: int = msgspec.field(name="Out msg nelems", default=-1)
    process_group: msgspec.Raw = msgspec.field(name="Process Group Name", default=msgspec.Raw())
    group_ranks: msgspec.Raw = msgspec.field(name="Process Group Ranks", default=msgspec.Raw())
    collective_seq: int = msgspec.field(name="Seq", default=-1)


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: Union[int, str, None] = None
    tid: Union[int, str, None] = None
    ts: float = float("nan")  # NaN: absent
    dur: float = float("nan")
    args: Optional[_Args] = None


class _TraceFile(msgspec.Struct):
    traceEvents: Optional[list[_Event]] = None
    deviceProperties: msgspec.Raw = msgspec.Raw()
    distributedInfo: msgspec.Raw = msgspec.Raw()
    schemaVersion: msgspec.Raw = msgspec.Raw()
    baseTimeNanoseconds: msgspec.Raw = msgspec.Raw()
    nodes: msgspec.Raw = msgspec.Raw()  # present in execution traces, never in Kineto ones


@dataclass
class KinetoTrace:
    """A loaded trace: timed events as a columnar table, plus the file's metadata.

    ``events`` columns: kind (EventKind), name (categorical), thread (categorical "pid/tid" for
    CPU events, "device/stream" for GPU events), ts_us and dur_us (relative to the first event,
    so float64 keeps sub-microsecond precision), correlation, external_id, stream, device, bytes,
    the cuda_sync fields (sync_kind, wait_on_stream, wait_on_record_correlation), and the message
    of a collective kernel (message_elements, message_dtype: NCCL's "In msg nelems", "dtype"),
    and the autograd sequence number (sequence_nr: the same on a forward operator and on the
    backward node it created; -1 where there is none). A collective's record (c10d's
    ``record_param_comms`` and, from torch 2.1, its NCCL kernel) adds collective_name (c10d's
    name: ``allreduce``, ``all_to_all``...), out_elements ("Out msg nelems"), process_group (the
    group's name), group_ranks (its global ranks, as text: ``[0, 1]``) and collective_seq (the
    collective's sequence number in its group, torch 2.5 on); "" or -1 where absent.

    ``input_dims`` and ``input_types`` hold the recorded inputs of operators, and of the
    ``nccl:*`` annotations c10d wraps each collective in (their input is the message).
    """

    path: str
    events: pd.DataFrame
    origin_us: float
    device_properties: list = field(default_factory=list)
    distributed_info: dict = field(default_factory=dict)
    input_dims: dict = field(default_factory=dict)  # event row -> raw JSON of "Input Dims"
    input_types: dict = field(default_factory=dict)  # event row -> raw JSON of "Input type"
    # event row -> raw JSON of "Concrete Inputs": the values of scalar arguments (a convolution's
    # stride, the dimensions a sum reduces), recorded by torch 2.1 and later
    concrete_inputs: dict = field(default_factory=dict)
    base_time_ns: Optional[int] = None  # an event's ts (us) + this / 1000 is Unix time; newer torch only

    @property
    def has_gpu(self) -> bool:
        return bool(self.events["kind"].isin([int(k) for k in GPU_KINDS]).any())

    # Pickled (the graph cache keeps traces so), the recorded inputs travel as one blob, unpacked
    # the first time one of them is read: a later command on a cached trace seldom reads them,
    # and unpickling their entries one by one (50,000 on the ResNet-50 trace) took 8 ms of each.

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if all(name in state for name in _PACKED_INPUTS):
            inputs = tuple(state.pop(name) for name in _PACKED_INPUTS)
            state["_packed_inputs"] = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)
        return state

    def __getattr__(self, name: str):
        state = self.__dict__
        if name in _PACKED_INPUTS:
            with _UNPACKING:  # one thread unpacks; another waits and finds them unpacked
                packed = state.pop("_packed_inputs", None)
                if packed is not None:
                    state.update(zip(_PACKED_INPUTS, pickle.loads(packed)))
            if name in state:
                return state[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


#: the fields of :class:`KinetoTrace` pickled as one blob, and the lock of their unpacking
_PACKED_INPUTS = ("input_dims", "input_types", "concrete_inputs")
_UNPACKING = threading.Lock()


#: the whitespace ``bytes.lstrip`` strips, matched rather than stripped (a copy of the whole text)
_LEADING_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]*")


def _decode(path: Path, raw: bytes) -> tuple[_TraceFile, list[_Event]]:
    at = _LEADING_SPACE.match(raw).end()
    first = raw[at:at + 1]
    if not first:
        raise TraceError(path, "is empty")
    try:
        if first == b"[":
            events = msgspec.json.decode(raw, type=list[_Event])
            return _TraceFile(traceEvents=events), events
        doc = msgspec.json.decode(raw, type=_TraceFile)
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None
    except RecursionError:
        raise TraceError(path, "JSON nested deeper than Python's recursion limit: no trace nests so deep") from None
    except msgspec.ValidationError as err:
        raise TraceError(path, f"JSON is not a Chrome trace ({err})") from None
    except msgspec.DecodeError as err:
        if "UTF-8" in str(err):  # msgspec 0.23 on says only that a string is not: which byte, the stdlib finds
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise _not_utf8(path, bad) from None
        if first not in (b"{", b"["):
            raise TraceError(path, "is not JSON") from None
        at = re.search(r"\(byte (\d+)\)", str(err))
        word = re.match(rb"-?(?:NaN|Infinity)", raw[int(at.group(1)):int(at.group(1)) + 9]) if at else None
        if word:
            raise TraceError(path, f"holds {word.group().decode()} at byte {at.group(1)}, which JSON has no number for "
                                   "(a duration or timestamp that is not a number?)") from None
        raise TraceError(path, f"not valid JSON, truncated or corrupt ({err})") from None
    if doc.traceEvents is None:
        if len(doc.nodes):
            raise TraceError(
                path,
                "is a PyTorch execution trace (an operator graph without timings), not a Kineto "
                "profiler trace; pass the matching *.pt.trace.json instead",
            )
        raise TraceError(path, "JSON has no 'traceEvents' list, so it is not a Chrome/Kineto trace")
    return doc, doc.traceEvents


def _not_utf8(path: Path, err: UnicodeDecodeError) -> TraceError:
    return TraceError(path, f"is not UTF-8 text (a string holds the byte {err.object[err.start]:#04x})")


#: A duration beyond this (a day), or a start this far from the trace's median, is no profiler's
#: measurement: such events are dropped, with a warning, as are those with a negative duration
#: or none, and those with no timestamp.
MAX_SPAN_US = 86_400e6

_KIND_NOUN = {
    EventKind.CPU_OP: "CPU operator", EventKind.ANNOTATION: "annotation", EventKind.PYTHON: "Python frame",
    EventKind.RUNTIME: "runtime call", EventKind.KERNEL: "kernel", EventKind.MEMCPY: "memcpy",
    EventKind.MEMSET: "memset", EventKind.GPU_ANNOTATION: "GPU annotation", EventKind.CUDA_SYNC: "sync record",
}


def _timed_events(path: Path, decoded: list) -> tuple[list, np.ndarray, list, np.ndarray, np.ndarray]:
    """The complete ('X') events worth keeping, their kinds (int8), names, starts and durations.
    Those whose time cannot be used are dropped, a warning per problem and kind saying how many.

    The events are classified in one pass, by their phase and category (each pair looked at
    once), and only those kept are read further; where any would be dropped,
    :func:`_timed_events_one_by_one` says why, event by event."""
    n = len(decoded)
    if not n:
        return [], np.zeros(0, dtype=np.int8), [], np.zeros(0), np.zeros(0)
    kind_of = _KindOfPhaseAndCategory()
    kinds = np.fromiter(map(kind_of.__getitem__, map(attrgetter("ph", "cat"), decoded)), dtype=np.int8, count=n)
    rows = np.flatnonzero(kinds >= 0)
    kinds = kinds[rows]
    kept = list(map(decoded.__getitem__, rows.tolist()))
    names = list(map(attrgetter("name"), kept))
    if ("X", "Operator") in kind_of:  # the 2021 schema's record_function ranges (_looks_like_annotation)
        annotation = {v: _looks_like_annotation(v) for v in dict.fromkeys(names)}
        relabel = np.fromiter(map("Operator".__eq__, map(attrgetter("cat"), kept)), dtype=bool, count=len(kept))
        relabel &= np.fromiter(map(annotation.__getitem__, names), dtype=bool, count=len(kept))
        kinds[relabel & (kinds == int(EventKind.CPU_OP))] = int(EventKind.ANNOTATION)
    ts, dur = (np.fromiter(map(attrgetter(a), kept), dtype=np.float64, count=len(kept)) for a in ("ts", "dur"))
    with np.errstate(invalid="ignore"):
        usable = (dur >= 0) & (dur <= MAX_SPAN_US) & np.isfinite(ts)
        if len(ts) and usable.all() and not (np.abs(ts - np.median(ts)) > MAX_SPAN_US).any():
            return kept, kinds, names, ts, dur
    kept, kind_list = _timed_events_one_by_one(path, decoded)
    ts, dur = (np.fromiter(map(attrgetter(a), kept), dtype=np.float64, count=len(kept)) for a in ("ts", "dur"))
    return kept, np.asarray(kind_list, dtype=np.int8), list(map(attrgetter("name"), kept)), ts, dur


class _KindOfPhaseAndCategory(dict):
    """(phase, category) -> the kind (an int) of the events kept, -1 for the others: those of
    another phase than complete ('X') or of a category not kept; each pair worked out the first
    time it is asked for."""

    def __missing__(self, key: tuple) -> int:
        ph, cat = key
        kind = _category_kind(cat) if ph == "X" else None
        value = self[key] = -1 if kind is None else int(kind)
        return value


def _category_kind(cat: str) -> Optional[EventKind]:
    """The kind of an event of category ``cat``; None: not kept (an unknown CPU-side category
    is still CPU time)."""
    cat = cat.lower()
    return None if cat in _IGNORED_CATEGORIES else _KIND_OF_CATEGORY.get(cat, EventKind.CPU_OP)


def _timed_events_one_by_one(path: Path, decoded: list) -> tuple[list, list]:
    """:func:`_timed_events`, an event at a time, with the warnings for those dropped."""
    kind_by_category: dict[str, Optional[EventKind]] = {}
    kept, kinds = [], []
    dropped: dict[tuple[str, int], int] = {}
    for ev in decoded:
        if ev.ph != "X":
            continue
        kind = kind_by_category.get(ev.cat, ...)
        if kind is ...:
            kind = kind_by_category[ev.cat] = _category_kind(ev.cat)
        if kind is None:
            continue
        if kind == EventKind.CPU_OP and ev.cat == "Operator" and _looks_like_annotation(ev.name):
            kind = EventKind.ANNOTATION
        dur, ts = ev.dur, ev.ts
        if not (0 <= dur <= MAX_SPAN_US) or ts != ts or abs(ts) == float("inf"):
            problem = ("no timestamp (ts)" if ts != ts else "an infinite timestamp (ts)" if abs(ts) == float("inf")
                       else "no duration (dur)" if dur != dur else "negative duration (dur)" if dur < 0
                       else "an absurd duration (dur over 24 h)")
            dropped[problem, int(kind)] = dropped.get((problem, int(kind)), 0) + 1
            continue
        kept.append(ev)
        kinds.append(int(kind))
    if kept:  # starts a day or more from the others': an absurd timestamp
        ts = np.fromiter((ev.ts for ev in kept), dtype=np.float64, count=len(kept))
        far = np.abs(ts - np.median(ts)) > MAX_SPAN_US
        if far.any():
            for k in np.asarray(kinds)[far].tolist():
                key = ("an absurd timestamp (ts over 24 h from the trace's median)", k)
                dropped[key] = dropped.get(key, 0) + 1
            kept = [ev for ev, f in zip(kept, far.tolist()) if not f]
            kinds = [k for k, f in zip(kinds, far.tolist()) if not f]
    for (problem, kind), n in dropped.items():
        warn(path, n, f"dropped {plural(n, _KIND_NOUN[EventKind(kind)])} with {problem}")
    return kept, kinds


def _thread_labels(path: Path, kinds: np.ndarray, kept: list, args: list) -> tuple[list, np.ndarray]:
    """Every event's thread as the distinct labels and each event's code into them: "pid/tid"
    for CPU threads and "gpu D/stream S" for GPU streams. A GPU event needs a stream
    (``args.stream``, else a numeric ``tid``); a CPU event a ``tid``.

    The labels are in the order their threads first appear; a CPU event's thread is found by
    numbers (its pid's and its tid's codes), not by hashing a key per event."""
    pid, tid = list(map(attrgetter("pid"), kept)), list(map(attrgetter("tid"), kept))
    pid_codes, pids = _codes(pid)
    tid_codes, tids = _codes(tid)
    keys = pid_codes * len(tids) + tid_codes  # a CPU thread: its (pid, tid) as one number
    gpu = np.flatnonzero(np.isin(kinds, _GPU_THREAD_KINDS))
    gpu_keys: list = []
    if len(gpu):
        at = gpu.tolist()
        on_gpu = list(map(args.__getitem__, at))
        device, stream = list(map(attrgetter("device"), on_gpu)), list(map(attrgetter("stream"), on_gpu))
        if min(device) < 0 or min(stream) < 0:  # the process and thread ids stand in
            device = [d if d >= 0 else pid[i] for i, d in zip(at, device)]
            stream = [s if s >= 0 else tid[i] for i, s in zip(at, stream)]
        gpu_codes, gpu_keys = _codes(list(zip(device, stream)))
        keys[gpu] = len(pids) * len(tids) + gpu_codes  # a GPU stream: numbered after every CPU key
    distinct, first, codes = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)  # the threads in the order they first appear
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    labels = []
    for key, i in zip(distinct[order].tolist(), first[order].tolist()):
        if key < len(pids) * len(tids):
            thread = tids[key % len(tids)]
            if thread is None or isinstance(thread, bool):
                _refuse_thread(path, i, kinds, kept, "has no tid")
            labels.append(f"{pids[key // len(tids)]}/{thread}")
            continue
        device, stream = gpu_keys[key - len(pids) * len(tids)]
        if stream is None or isinstance(stream, bool):
            _refuse_thread(path, i, kinds, kept, "has no stream (args.stream) nor tid")
        number = str(stream).replace("stream ", "").strip()
        if not number.lstrip("-").isdigit():
            _refuse_thread(path, i, kinds, kept, f"has no stream (args.stream) and its tid {stream!r} is not a stream number")
        labels.append(f"gpu {device}/stream {number}")
    return labels, rank[codes.reshape(-1)]


_GPU_THREAD_KINDS = [int(k) for k in GPU_KINDS] + [int(EventKind.GPU_ANNOTATION)]


def _refuse_thread(path: Path, i: int, kinds: np.ndarray, kept: list, problem: str):
    """The error for event ``i``, the first on its thread."""
    ev = kept[i]
    raise TraceError(path, f"a {_KIND_NOUN[EventKind(int(kinds[i]))]} ({ev.name!r} at ts {ev.ts}) {problem}")


@gc_paused()
def read_kineto(path: Union[str, Path]) -> KinetoTrace:
    """Read a Kineto trace file (plain or gzipped JSON) into a :class:`KinetoTrace`
    (``collectors/load.py`` also reads capture bundles).

    Raises :class:`TraceError` with a one-line reason for anything that is not a usable trace.
    """
    path = Path(path)
    raw = read_bytes(path)
    doc, decoded = _decode(path, raw)

    kept, kinds, names, ts_arr, dur = _timed_events(path, decoded)
    if not (kinds != EventKind.CUDA_SYNC).any():
        raise TraceError(path, "has no timed events (no complete 'X' events with a duration)")
    no_args = _Args()
    args = [no_args if a is None else a for a in map(attrgetter("args"), kept)]
    thread_labels, thread_codes = _thread_labels(path, kinds, kept, args)
    name_codes, name_labels = _codes(names)
    # whose recorded inputs are kept: operators', and those of the ``nccl:*`` annotation around a
    # collective (c10d's record of its message)
    nccl = np.fromiter((v.startswith("nccl:") for v in name_labels), dtype=bool, count=len(name_labels))
    operator = kinds == EventKind.CPU_OP
    has_inputs = operator | ((kinds == EventKind.ANNOTATION) & nccl[name_codes])
    columns = _ArgsColumns(args)
    input_dims = columns.recorded("input_dims", has_inputs)
    input_types = columns.recorded("input_types", has_inputs)
    concrete_inputs = columns.recorded("concrete_inputs", operator)
    ids = columns.integers(path)
    base_time = _json_or(doc.baseTimeNanoseconds, None)
    origin = float(ts_arr.min())
    events = pd.DataFrame(
        {
            "kind": kinds,
            "name": categorical_of(np.array(name_labels, dtype=object), name_codes),
            "thread": categorical_of(np.array(thread_labels, dtype=object), thread_codes),
            "ts_us": ts_arr - origin,
            "dur_us": dur,
            "correlation": ids["correlation"],
            "external_id": ids["external_id"],
            "stream": ids["stream"],
            "device": ids["device"],
            "bytes": ids["bytes"],
            "sync_kind": columns.categorical("sync_kind"),
            "wait_on_stream": ids["wait_on_stream"],
            "wait_on_record_correlation": ids["wait_on_record_correlation"],
            "message_elements": ids["message_elements"],
            "message_dtype": columns.categorical("message_dtype"),
            "sequence_nr": ids["sequence_nr"],
            "collective_name": columns.categorical("collective_name"),
            "out_elements": ids["out_elements"],
            "process_group": columns.categorical("process_group", _text),
            "group_ranks": columns.categorical("group_ranks", _text),
            "collective_seq": ids["collective_seq"],
        }
    )
    return KinetoTrace(
        path=str(path),
        events=events,
        origin_us=origin,
        device_properties=_json_or(doc.deviceProperties, []),
        distributed_info=_json_or(doc.distributedInfo, {}),
        input_dims=input_dims,
        input_types=input_types,
        concrete_inputs=concrete_inputs,
        base_time_ns=base_time if isinstance(base_time, int) else None,
    )


#: The integer fields of ``args`` kept as int64 columns
_INT_ARGS = ("correlation", "external_id", "stream", "device", "bytes", "wait_on_stream", "wait_on_record_correlation",
             "message_elements", "sequence_nr", "out_elements", "collective_seq")
#: The fields of ``args`` that most events have, the first of :class:`_Args`: a launch's
#: correlation id and an operator's external id; most events leave every other field out
_COMMON_ARGS = _Args.__struct_fields__[:2]
_NO_ARGS = _Args()


class _ArgsColumns:
    """The fields of every event's ``args``, a column at a time. The :data:`_COMMON_ARGS` are
    read from every event; the others only from the events that have any of them (a kernel's
    stream, a memcpy's bytes, a collective's message), found in one pass that holds all of an
    event's other fields at once against their defaults (as a tuple, past the common ones): on
    the largest shared trace, 24k of 123k events."""

    def __init__(self, args: list):
        self.args = args
        rest = itemgetter(slice(len(_COMMON_ARGS), None))
        defaults = rest(msgspec.structs.astuple(_NO_ARGS))
        plain = np.fromiter(map(defaults.__eq__, map(rest, map(msgspec.structs.astuple, args))), dtype=bool, count=len(args))
        self.rows = np.flatnonzero(~plain)
        self.some = list(map(args.__getitem__, self.rows.tolist()))

    def _values(self, field_name: str) -> list:
        """``field_name`` of the events :attr:`rows` names (every event's where it is common)."""
        return list(map(attrgetter(field_name), self.args if field_name in _COMMON_ARGS else self.some))

    def integers(self, path: Path) -> dict:
        """Each of the :data:`_INT_ARGS`: a column of int64, -1 where absent."""
        columns = {}
        for name in _INT_ARGS:
            values = self._values(name)
            try:
                values = np.fromiter(values, dtype=np.int64, count=len(values))
            except OverflowError:
                big = next(v for v in values if not -(2**63) <= v < 2**63)
                field_name = _Args.__struct_encode_fields__[_Args.__struct_fields__.index(name)]
                raise TraceError(path, f"args[{field_name!r}]: {big} does not fit in 64 bits") from None
            if name not in _COMMON_ARGS:
                values, column = np.full(len(self.args), getattr(_NO_ARGS, name), dtype=np.int64), values
                values[self.rows] = column
            columns[name] = values
        return columns

    def categorical(self, field_name: str, as_text=None) -> pd.Categorical:
        """``field_name`` (a string, or raw JSON ``as_text`` makes one) of every event, its
        default ("") where absent, as ``pd.Categorical`` makes it (its categories sorted), but
        the distinct values interned by a dict rather than by pandas hashing every row."""
        values = self._values(field_name)
        if as_text is not None:  # only where the field is present: most of these events leave it out
            values = [as_text(v) if len(v) else "" for v in values]
        codes, labels = _codes(values)
        column = np.full(len(self.args), len(labels), dtype=np.int64)  # the default, after the others
        column[self.rows] = codes
        return categorical_of(np.array(labels + [""], dtype=object), column)

    def recorded(self, field_name: str, wanted: np.ndarray) -> dict:
        """Event row -> the raw JSON of ``field_name``, for the ``wanted`` rows that have it."""
        raws = self._values(field_name)
        present = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws)) > 0
        keep = np.flatnonzero(present & wanted[self.rows])
        return dict(zip(self.rows[keep].tolist(), map(raws.__getitem__, keep.tolist())))


def _codes(values: list) -> tuple[np.ndarray, list]:
    """Each value's code, and the distinct values in order of first appearance (one pass)."""
    index = _Interned()
    return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values)), list(index)


class _Interned(dict):
    """value -> its code: the number of distinct values asked for before it."""

    def __missing__(self, value) -> int:
        code = self[value] = len(self)
        return code


def categorical_of(labels: np.ndarray, codes: np.ndarray) -> pd.Categorical:
    """``pd.Categorical(labels[codes])`` (``labels`` strings, possibly repeated), made from the
    labels the codes use without building the row-wise array of strings."""
    # the codes used (-1: the last label, as numpy indexes), counted rather than sorted
    used = np.flatnonzero(np.bincount(np.where(codes < 0, codes + len(labels), codes), minlength=len(labels)))
    distinct = sorted(set(labels[used].tolist()))
    position = {label: i for i, label in enumerate(distinct)}
    rank = np.full(len(labels), -1, dtype=np.int64)
    rank[used] = [position[label] for label in labels[used].tolist()]
    return pd.Categorical.from_codes(rank[codes], categories=pd.Index(np.array(distinct, dtype=object)))


def _looks_like_annotation(name: str) -> bool:
    """The 2021 schema files record_function ranges under ``Operator``; their names give them
    away (``ProfilerStep#3``, ``Optimizer.step#SGD.step``, ``## forward ##``)."""
    return "#" in name and "::" not in name


#: Bytes per element of the dtype names profilers and c10d write (``float``, ``Float``, ``c10::Half``,
#: ``long int``), lower-cased
_BYTES_PER_ELEMENT = {
    "float": 4, "float32": 4, "c10::half": 2, "half": 2, "float16": 2, "c10::bfloat16": 2, "bfloat16": 2,
    "double": 8, "float64": 8, "int": 4, "int32": 4, "long int": 8, "long": 8, "int64": 8,
    "bool": 1, "byte": 1, "char": 1, "signed char": 1, "unsigned char": 1, "uint8": 1, "int8": 1,
    "short int": 2, "short": 2, "int16": 2, "c10::complex<float>": 8, "complex64": 8,
    "c10::complex<double>": 16, "complex128": 16,
}


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a profiler's or c10d's dtype name (``float``, ``c10::Half``,
    ``long int``...); 4 where unknown."""
    return _BYTES_PER_ELEMENT.get(str(dtype).strip().lower(), 4)


def is_dtype(name: str) -> bool:
    """Whether ``name`` is one of the dtype names :func:`element_bytes` knows (a profiler's
    ``Input type`` of a tensor, not of a scalar or a list)."""
    return str(name).strip().lower() in _BYTES_PER_ELEMENT


def _text(raw: msgspec.Raw) -> str:
    """A value the profiler writes as a string in one version and a number or list in another
    (a process group's name, its ranks), as text: ``"0"``, ``"[0, 1]"``; "" where absent."""
    if not len(raw):
        return ""
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return ""
    return value if isinstance(value, str) else msgspec.json.encode(value).decode().replace(",", ", ")


def _json_or(raw: msgspec.Raw, default):
    if not len(raw):
        return default
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return default
