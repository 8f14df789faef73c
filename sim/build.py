"""Building the dependency graph of a training process from its Kineto trace.

CPU threads: nested events (annotations > operators > runtime calls) are cut into leaf segments,
each owned by the innermost event that covers it, and the time between events becomes GAP tasks,
so a thread's tasks tile its timeline. GPU streams: kernels, memcpys and memsets in stream order.

Edges are Daydream's dependency kinds plus what real CUDA traces need:
- CPU -> GPU launch, by correlation id;
- GPU stream order;
- GPU -> CPU synchronisation: cudaDeviceSynchronize / cudaStreamSynchronize /
  cudaEventSynchronize (using Kineto's ``cuda_sync`` records of which stream and event were
  waited on when present, else every stream's last task launched before the call), and
  synchronous copies (``.item()``, pageable device-to-host copies) whose copy ended inside the
  call;
- GPU -> GPU, cudaEventRecord on one stream followed by cudaStreamWaitEvent on another;
- CPU thread -> CPU thread: a thread idle for a while (the autograd thread before backward, the
  main thread during it) resumes after another thread went idle; the gap becomes a WAIT task
  that starts when the waking thread signalled.

Every edge gets a lag, the latency the trace shows between the two tasks. For each task one
edge is *binding* (the one that explains when the task started) and takes the exact measured
latency; the others take the smaller of their measured slack and the typical latency of their
kind. Replaying the unmodified graph therefore reproduces the trace, and a transformation moves
each task only as far as its causes move.

The graph also carries what passes need from the trace (``sim/workload.py``): the operator
table (names, threads, times, recorded shapes, types and scalar arguments, message sizes) and
the job's record from a capture bundle. Nothing after this module reads the trace.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from whatif.collectors.bundle import BundledTrace
from whatif.collectors.diagnostics import plural, warn
from whatif.collectors.gcpause import gc_paused
from whatif.collectors.kineto import CPU_KINDS, GPU_KINDS, EventKind, KinetoTrace, categorical_of, element_bytes

from .graph import EdgeKind, GraphError, TaskGraph, TaskKind
from .workload import (
    GRADIENT_READY_COLUMNS,
    LAYER_COLUMNS,
    LAYER_INTERVAL_COLUMNS,
    OPERATOR_KINDS,
    PARAMETER_COLUMNS,
    Workload,
)

#: A thread that was idle this long was waiting for something, not computing (microseconds).
IDLE_GAP_US = 50.0
#: Clock rounding between the CPU and GPU timelines that is still "at the same time".
TOLERANCE_US = 1.0
#: Launches the CUDA driver lets a process have outstanding (launched, not finished) before a
#: launch call blocks. Measured on the shared V100 traces as 1022 pending at every blocked
#: launch's return; a trace that fills its queue gives its own value.
DEFAULT_LAUNCH_QUEUE_DEPTH = 1023
_BLOCKED_LAUNCH_US = 100.0  # a launch call this long waited for something
_MIN_QUEUE_DEPTH = 64  # fewer outstanding launches than this is not a full queue

_BLOCKING_CALLS = {
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaMemset",
    "cudaFree",
}
_COMM_MARKERS = ("nccl", "gloo", "allreduce", "all_reduce", "sendrecv")
_KIND_PRIORITY = {  # how to nest events that start at the same instant: outermost first
    int(EventKind.ANNOTATION): 0,
    int(EventKind.PYTHON): 1,
    int(EventKind.CPU_OP): 2,
    int(EventKind.RUNTIME): 3,
}


class _Segments:
    """The leaf segments of all CPU threads, as parallel lists, and their interned contexts.

    A context is the chain of events enclosing a segment, outermost first; chains are interned
    as a trie (parent context, event name, event kind) so each distinct stack is stored once
    (by ``_cut_thread``).
    """

    def __init__(self, names: list[str], kinds: list[int], labels: int):
        self.names = names
        self.kinds = kinds
        self.labels = labels  # how many (name, kind) labels ``_cut_thread`` numbers events by
        # a segment starts where the one before it on its thread ended (the first at 0): only
        # the ends are kept (``_Builder._cpu_tasks`` makes the starts)
        self.end: list[float] = []
        self.owner: list[int] = []  # event row, -1 for gaps
        self.ctx: list[int] = []
        self.thread: list[int] = []
        self.ctx_ids: dict[int, int] = {}  # (parent context + 1) x labels + label -> context
        self.ctx_parent: list[int] = []
        self.ctx_event: list[int] = []

    def first_and_last_segment(self, events: int) -> tuple[np.ndarray, np.ndarray]:
        """For every event row (of ``events``), its first and its last segment, -1 where it owns
        none; one more entry, -1, for the row -1 (no event)."""
        owner = np.asarray(self.owner, dtype=np.int64)
        named = np.flatnonzero(owner >= 0)
        first = np.full(events + 1, np.iinfo(np.int64).max)
        last = np.full(events + 1, -1, dtype=np.int64)
        np.minimum.at(first, owner[named], named)
        np.maximum.at(last, owner[named], named)
        first[last < 0] = -1
        return first, last


def _cut_thread(seg: _Segments, thread: int, rows: list, ts: list, end: list, label: list) -> None:
    """Cut one thread's nested events into leaf segments and gaps (from time 0 on). ``label``
    numbers each event's name and kind (``_Segments.labels`` of them), so that a context is
    interned by one number: (its parent's context + 1) x labels + its event's label."""
    stack: list[tuple[float, int, int]] = []  # (end, row, ctx)
    push, pop = stack.append, stack.pop
    cursor = 0.0
    runtime, python, annotation = int(EventKind.RUNTIME), int(EventKind.PYTHON), int(EventKind.ANNOTATION)
    kinds, labels = seg.kinds, seg.labels
    out_end, out_owner, out_ctx = seg.end.append, seg.owner.append, seg.ctx.append
    ctx_ids, ctx_parent, ctx_event = seg.ctx_ids, seg.ctx_parent, seg.ctx_event  # seg.context, inlined
    emitted_before = len(seg.end)
    for row in rows:
        s = ts[row]
        while stack and stack[-1][0] <= s:
            top_end, top_row, top_ctx = pop()
            if top_end > cursor or kinds[top_row] == runtime:
                if top_end < cursor:
                    top_end = cursor
                out_end(top_end); out_owner(top_row); out_ctx(top_ctx)
                cursor = top_end
        e = end[row]
        if stack:
            parent_end, parent_row, parent_ctx = stack[-1]
            if s > cursor:
                out_end(s); out_owner(parent_row); out_ctx(parent_ctx)
                cursor = s
            if e > parent_end and kinds[row] == annotation and kinds[parent_row] == python:
                # a range opened inside Python frames that return before it closes: the tracer's
                # frames of record_function's enter (``_record_function_enter_new``). They end
                # where the range begins, and what the range holds nests in it, not in them.
                while stack and stack[-1][0] < e and kinds[stack[-1][1]] == python:
                    pop()
                parent_end, parent_row, parent_ctx = stack[-1] if stack else (float("inf"), -1, -1)
            if e > parent_end:
                e = parent_end
        else:
            parent_ctx = -1
            if s > cursor:
                out_end(s); out_owner(-1); out_ctx(-1)
                cursor = s
        key = (parent_ctx + 1) * labels + label[row]
        ctx = ctx_ids.get(key)
        if ctx is None:
            ctx = ctx_ids[key] = len(ctx_parent)
            ctx_parent.append(parent_ctx)
            ctx_event.append(row)
        push((e, row, ctx))
    while stack:
        top_end, top_row, top_ctx = pop()
        if top_end > cursor or kinds[top_row] == runtime:
            if top_end < cursor:
                top_end = cursor
            out_end(top_end); out_owner(top_row); out_ctx(top_ctx)
            cursor = top_end
    seg.thread.extend([thread] * (len(seg.end) - emitted_before))


def _context_tables(seg: _Segments, names: list[str], kinds: np.ndarray) -> tuple[list, list, list]:
    """For each interned context: its text, outermost operator and innermost layer."""
    n = len(seg.ctx_parent)
    text = [""] * n
    operator = [""] * n
    layer = [""] * n
    op_kind = int(EventKind.CPU_OP)
    layer_kinds = (int(EventKind.ANNOTATION), int(EventKind.PYTHON))
    for c in range(n):  # parents are always interned before their children
        row = seg.ctx_event[c]
        name = names[row]
        p = seg.ctx_parent[c]
        if p < 0:
            text[c] = name
            operator[c] = name if kinds[row] == op_kind else ""
            layer[c] = name if _is_layer(name, kinds[row], layer_kinds) else ""
        else:
            text[c] = text[p] + " > " + name
            operator[c] = operator[p] or (name if kinds[row] == op_kind else "")
            layer[c] = name if _is_layer(name, kinds[row], layer_kinds) else layer[p]
    return text, operator, layer


def _is_layer(name: str, kind: int, layer_kinds: tuple) -> bool:
    if kind not in layer_kinds:
        return False
    if kind == int(EventKind.PYTHON):
        return name.startswith("nn.Module:")
    return not name.startswith("ProfilerStep#")


def _verb(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


@gc_paused()
def build_graph(trace: KinetoTrace) -> TaskGraph:
    """The dependency graph of everything in ``trace``."""
    return _Builder(trace).graph()


class _Builder:
    """One pass over a trace: tasks first (CPU segments, then GPU tasks), then each kind of
    dependency, then timing. Task ids are CPU segments in thread order followed by GPU tasks in
    stream order."""

    def __init__(self, trace: KinetoTrace):
        self.trace = trace
        ev = trace.events
        self.ev = ev
        self.kinds = ev["kind"].to_numpy()
        self.ts = ev["ts_us"].to_numpy()
        self.end = self.ts + ev["dur_us"].to_numpy()
        self.name_labels = ev["name"].cat.categories.to_numpy(dtype=object)
        self.name_codes = ev["name"].cat.codes.to_numpy().astype(np.int64)
        self.names = self.name_labels[self.name_codes].tolist()
        self.thread_codes = ev["thread"].cat.codes.to_numpy()
        self.thread_labels = list(ev["thread"].cat.categories)
        self.correlation = ev["correlation"].to_numpy()
        self.edges: list[tuple[np.ndarray, np.ndarray, int]] = []

    def add(self, src, dst, kind: EdgeKind) -> None:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        ok = (src >= 0) & (dst >= 0)
        self.edges.append((src[ok], dst[ok], int(kind)))

    def graph(self) -> TaskGraph:
        self._cpu_tasks()
        self._gpu_tasks()
        if self.n_cpu + self.n_gpu == 0:
            raise GraphError(f"{self.trace.path}: no CPU or GPU activity to build a graph from")
        worked = np.isin(self.kinds, [int(EventKind.CPU_OP), int(EventKind.RUNTIME), *map(int, GPU_KINDS)])
        if not worked.any():  # annotations (and Python frames) alone: a replay of their spans, nothing to change
            warn(self.trace.path, 1, "has no operator, runtime call or GPU task, only annotations: its steps replay "
                                     "as their spans and no what-if changes them (was the profiler's window empty?)")
        self.add(self.gpu_id[self.same_stream], self.gpu_id[self.same_stream + 1], EdgeKind.GPU_SEQ)
        waiting_calls = self._sync_edges()
        self._launch_edges(waiting_calls)
        self._stream_wait_edges()
        self.add(*_launch_queue_edges(self.gpu_id, self.gpu_corr, self.launching_seg, self.finish, self.seg_start, self.seg_end), EdgeKind.QUEUE)
        self._thread_wake_edges()
        return self._table()

    # -- tasks ----------------------------------------------------------------------------------

    def _without_bystanders(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` less the events of threads that ran nothing but Python frames: no operator,
        no runtime call, no annotation, so no edge can join them to the rest (a launch, a
        synchronisation and a flow all start at one of those). Such a thread (the Python
        tracer's view of tqdm's monitor or a multiprocessing queue's feeder, a frame blocked in
        ``threading.py: wait`` for the whole trace) delays nothing; kept, its frames would hold
        every simulated step as long as they lasted, whatever the what-if. Counted in a warning."""
        codes = self.thread_codes[rows].astype(np.int64)
        python = self.kinds[rows] == int(EventKind.PYTHON)
        n = len(self.thread_labels) + 1
        idle = np.flatnonzero((np.bincount(codes + 1, minlength=n) > 0)
                              & (np.bincount(codes[~python] + 1, minlength=n) == 0)) - 1
        if not len(idle):
            return rows
        gone = np.isin(codes, idle)
        names = list(dict.fromkeys(self.names[r] for r in rows[gone][:50]))
        warn(self.trace.path, int(gone.sum()),
             f"left out {plural(int(gone.sum()), 'Python frame')} of {plural(len(idle), 'thread')} that ran "
             f"no operator and that nothing waits for ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''}): "
             "they hold up no step")
        return rows[~gone]

    def _cpu_tasks(self) -> None:
        kinds, ts, end, codes = self.kinds, self.ts, self.end, self.thread_codes
        seg = _Segments(self.names, kinds.tolist(), len(self.name_labels) * len(EventKind))
        label = (self.name_codes * len(EventKind) + kinds).tolist()  # an event's name and kind, one number
        rows = np.flatnonzero(np.isin(kinds, [int(k) for k in CPU_KINDS]))
        rows = self._without_bystanders(rows)
        priority = np.array([_KIND_PRIORITY.get(k, 2) for k in range(len(EventKind))])[kinds[rows]]
        rows = rows[np.lexsort((priority, -(end[rows] - ts[rows]), ts[rows], codes[rows]))]
        self.cpu_threads = set()
        ts_list, end_list = ts.tolist(), end.tolist()
        for thread_rows in np.split(rows, np.flatnonzero(np.diff(codes[rows])) + 1):
            if len(thread_rows):
                self.cpu_threads.add(int(codes[thread_rows[0]]))
                _cut_thread(seg, int(codes[thread_rows[0]]), thread_rows.tolist(), ts_list, end_list, label)
        self.seg = seg
        self.first_seg, self.last_seg = seg.first_and_last_segment(len(kinds))
        self.n_cpu = len(seg.end)
        self.seg_end = np.asarray(seg.end, dtype=np.float64)
        self.seg_thread = np.asarray(seg.thread, dtype=np.int64)
        self.seg_start = np.zeros(self.n_cpu)
        if self.n_cpu:
            follows = self.seg_thread[1:] == self.seg_thread[:-1]
            self.seg_start[1:][follows] = self.seg_end[:-1][follows]
        self.owner = np.asarray(seg.owner, dtype=np.int64)
        owner_kind = np.where(self.owner >= 0, kinds[np.maximum(self.owner, 0)], -1)
        # the self time of an annotation (ProfilerStep#N, a record_function range) is time no event
        # names, like a gap between events: a thread blocked in backward() shows only its step range
        self.unnamed = (self.owner < 0) | (owner_kind == int(EventKind.ANNOTATION))
        self.cpu_kind = np.where(self.unnamed, int(TaskKind.GAP), int(TaskKind.CPU))
        self.cpu_kind[owner_kind == int(EventKind.RUNTIME)] = int(TaskKind.RUNTIME)

    def _gpu_tasks(self) -> None:
        kinds, codes = self.kinds, self.thread_codes
        rows = np.flatnonzero(np.isin(kinds, [int(EventKind.KERNEL), int(EventKind.MEMCPY), int(EventKind.MEMSET)]))
        rows = rows[np.lexsort((self.ts[rows], codes[rows]))]
        self.gpu_rows = rows
        self.n_gpu = len(rows)
        self.gpu_id = self.n_cpu + np.arange(self.n_gpu)
        kind = np.select(
            [kinds[rows] == int(EventKind.MEMCPY), kinds[rows] == int(EventKind.MEMSET)],
            [int(TaskKind.MEMCPY), int(TaskKind.MEMSET)],
            int(TaskKind.KERNEL),
        )
        comm_name = np.array([any(m in nm.lower() for m in _COMM_MARKERS) for nm in self.name_labels.tolist()], dtype=bool)
        kind[comm_name[self.name_codes[rows]]] = int(TaskKind.COMM)
        self.gpu_kind = kind
        self.gpu_threads = codes[rows]
        self.same_stream = np.flatnonzero(self.gpu_threads[1:] == self.gpu_threads[:-1])
        self.start = np.concatenate([self.seg_start, self.ts[rows]])
        self.finish = np.concatenate([self.seg_end, self.end[rows]])
        self.resource_code = np.concatenate([self.seg_thread, self.gpu_threads])

        # the runtime call that launched each GPU task, by correlation id
        runtime_rows = np.flatnonzero(kinds == int(EventKind.RUNTIME))
        self.runtime_rows = runtime_rows
        by_corr = pd.Series(runtime_rows, index=self.correlation[runtime_rows])
        by_corr = by_corr[~by_corr.index.duplicated(keep="first") & (by_corr.index >= 0)]
        self.gpu_corr = self.correlation[rows]
        self.launching_row = by_corr.reindex(self.gpu_corr).fillna(-1).to_numpy(dtype=np.int64)
        self.launching_seg = self.last_seg[self.launching_row]  # row -1: the last entry, -1
        self._check_launches(runtime_rows, rows)

        # per stream: its tasks in order and the running maximum of their launch correlation, to
        # find "the last task launched on stream S before call C"
        self.stream_tasks: dict[int, np.ndarray] = {}
        self.stream_corr: dict[int, np.ndarray] = {}
        self.streams_numbered: dict[int, list] = {}
        for code in np.unique(self.gpu_threads).tolist():
            idx = np.flatnonzero(self.gpu_threads == code)
            self.stream_tasks[code] = self.gpu_id[idx]
            self.stream_corr[code] = np.maximum.accumulate(np.maximum(self.gpu_corr[idx], -1))
            number = int(self.thread_labels[code].rsplit("stream ", 1)[-1])
            self.streams_numbered.setdefault(number, []).append(code)

    def _check_launches(self, runtime_rows: np.ndarray, rows: np.ndarray) -> None:
        """A warning for each kind of launch the trace does not tie up: runtime calls sharing a
        correlation id (their GPU tasks are taken as the first call's), GPU tasks whose launching
        call is not in the trace (no launch edge: they start when the trace says), and GPU tasks
        that start before the call that launched them (the replay delays them), or run after a task
        launched later on their stream."""
        path, corr = self.trace.path, self.correlation[runtime_rows]
        duplicated = int((pd.Series(corr[corr >= 0]).duplicated()).sum())
        warn(path, duplicated, f"{plural(duplicated, 'runtime call')} {_verb(duplicated, 'shares', 'share')} a correlation id with an earlier call; "
                               "their GPU tasks are taken as launched by the first")
        dangling = int((self.launching_row < 0).sum())
        warn(path, dangling, f"{plural(dangling, 'GPU task')} {_verb(dangling, 'has', 'have')} no launching call in the trace (correlation id "
                             "missing or unknown); without a launch dependency, each starts when the trace says")
        launched = self.launching_row >= 0
        one_launch = np.array(["Graph" not in self.names[r] for r in self.launching_row[launched].tolist()], dtype=bool)
        shared = int(pd.Series(self.gpu_corr[launched][one_launch]).duplicated().sum())
        warn(path, shared, f"{plural(shared, 'GPU task')} {_verb(shared, 'shares', 'share')} a launching call with another "
                           "(correlation ids duplicated; a call launches one task, a graph launch several); each is "
                           "taken as launched by it")
        early = int((self.ts[rows[launched]] < self.ts[self.launching_row[launched]] - TOLERANCE_US).sum())
        warn(path, early, f"{plural(early, 'GPU task')} {_verb(early, 'starts', 'start')} before the call that launched them (correlation ids "
                          "out of order or clocks skewed); the replay starts each after its call")
        behind = 0  # on a stream, in order of start: a launch's correlation id below one before it
        for code in np.unique(self.gpu_threads).tolist():
            ids = self.gpu_corr[(self.gpu_threads == code) & launched]
            behind += int((ids[1:] < np.maximum.accumulate(ids)[:-1]).sum()) if len(ids) > 1 else 0
        warn(path, behind, f"{plural(behind, 'GPU task')} {_verb(behind, 'runs', 'run')} on {_verb(behind, 'its', 'their')} "
                           "stream after a task launched later (correlation ids out of order); a synchronisation "
                           "waits for the latest launch before it")

    def _last_launched_before(self, stream_code: int, corr: int) -> int:
        pos = int(np.searchsorted(self.stream_corr[stream_code], corr, side="left")) - 1
        return int(self.stream_tasks[stream_code][pos]) if pos >= 0 else -1

    # -- dependencies ---------------------------------------------------------------------------

    def _sync_records(self) -> np.ndarray:
        return np.flatnonzero(self.kinds == int(EventKind.CUDA_SYNC))

    def _sync_edges(self) -> set:
        """GPU -> CPU: blocking synchronisation calls and synchronous copies. Returns the calls
        that waited."""
        names, corr = self.names, self.correlation
        records = self._sync_records()
        record_of_call = {}
        for r in records.tolist():
            record_of_call.setdefault(int(corr[r]), r)
        record_kind = self.ev["sync_kind"].astype(str).to_numpy()
        wait_stream = self.ev["wait_on_stream"].to_numpy()
        wait_record = self.ev["wait_on_record_correlation"].to_numpy()
        stream_col = self.ev["stream"].to_numpy()
        src, dst = [], []
        last_seg = self.last_seg.tolist()
        for r in self.runtime_rows.tolist():
            if names[r] not in _BLOCKING_CALLS:
                continue
            call_seg = last_seg[r]
            if call_seg < 0:
                continue
            limit = int(corr[r])
            targets = list(self.stream_tasks)
            info = record_of_call.get(limit)
            if info is not None:
                kind = record_kind[info]
                if kind == "Stream Sync" and stream_col[info] in self.streams_numbered:
                    targets = self.streams_numbered[int(stream_col[info])]
                elif kind == "Event Sync" and wait_stream[info] in self.streams_numbered:
                    targets = self.streams_numbered[int(wait_stream[info])]
                    if wait_record[info] >= 0:
                        limit = int(wait_record[info])
            for code in targets:
                t = self._last_launched_before(code, limit)
                if t >= 0 and self.finish[t] <= self.end[r] + TOLERANCE_US:
                    src.append(t)
                    dst.append(call_seg)
        # synchronous copies: the copy ended before the call that issued it returned
        memcpy = np.flatnonzero((self.gpu_kind == int(TaskKind.MEMCPY)) & (self.launching_seg >= 0))
        copy_end = self.finish[self.gpu_id[memcpy]]
        calls = self.launching_row[memcpy]
        blocking = (copy_end <= self.end[calls] + TOLERANCE_US) & (copy_end > self.ts[calls] + TOLERANCE_US)
        src += self.gpu_id[memcpy[blocking]].tolist()
        dst += self.launching_seg[memcpy[blocking]].tolist()
        self.add(src, dst, EdgeKind.SYNC)
        return set(dst)

    def _launch_edges(self, waiting_calls: set) -> None:
        """CPU -> GPU launch. A call that waits for the GPU cannot also be where its own copy was
        launched from: that launch edge comes from the thread position just before the call."""
        src = self.launching_seg.copy()
        if waiting_calls:
            for i in np.flatnonzero(np.isin(src, list(waiting_calls))).tolist():
                first = int(self.first_seg[self.launching_row[i]])
                first = first if first >= 0 else int(src[i])
                before = first - 1
                same_thread = before >= 0 and self.seg_thread[before] == self.seg_thread[first]
                src[i] = before if same_thread else -1
        self.add(src, self.gpu_id, EdgeKind.LAUNCH)

    def _stream_wait_edges(self) -> None:
        """GPU -> GPU: cudaStreamWaitEvent, where Kineto recorded which event it waited for."""
        records = self._sync_records()
        record_kind = self.ev["sync_kind"].astype(str).to_numpy()
        wait_stream = self.ev["wait_on_stream"].to_numpy()
        wait_record = self.ev["wait_on_record_correlation"].to_numpy()
        stream_col = self.ev["stream"].to_numpy()
        src, dst = [], []
        for r in records[record_kind[records] == "Stream Wait Event"].tolist():
            waited = self.streams_numbered.get(int(wait_stream[r]), [])
            waiting = self.streams_numbered.get(int(stream_col[r]), [])
            if not waited or not waiting or wait_record[r] < 0:
                continue
            before = self._last_launched_before(waited[0], int(wait_record[r]))
            pos = int(np.searchsorted(self.stream_corr[waiting[0]], int(self.correlation[r]), side="right"))
            if before >= 0 and pos < len(self.stream_tasks[waiting[0]]):
                src.append(before)
                dst.append(int(self.stream_tasks[waiting[0]][pos]))
        self.add(src, dst, EdgeKind.STREAM_WAIT)

    def _thread_wake_edges(self) -> None:
        """CPU thread -> CPU thread: an idle stretch of one thread ends after another thread went
        idle (or ended); the stretch becomes a WAIT task."""
        start, end, thread = self.seg_start, self.seg_end, self.seg_thread
        idle = self.unnamed & ((end - start >= IDLE_GAP_US) | (start == 0.0))
        next_same = np.r_[thread[1:] == thread[:-1], False]
        followed_by_idle = next_same & np.r_[idle[1:], False]
        signals = np.flatnonzero((followed_by_idle | ~next_same) & ~self.unnamed)
        signals = signals[np.argsort(end[signals], kind="stable")]
        signal_time = end[signals]
        src, dst = [], []
        for g in np.flatnonzero(idle).tolist():
            pos = int(np.searchsorted(signal_time, end[g], side="right")) - 1
            while pos >= 0 and signal_time[pos] >= start[g]:
                x = int(signals[pos])
                if thread[x] != thread[g]:
                    src.append(x)
                    dst.append(g)
                    break
                pos -= 1
        self.add(src, dst, EdgeKind.THREAD)
        self.woken = dst

    # -- timing and the table -------------------------------------------------------------------

    def _table(self) -> TaskGraph:
        src = np.concatenate([e[0] for e in self.edges])
        dst = np.concatenate([e[1] for e in self.edges])
        ekind = np.concatenate([np.full(len(e[0]), e[2], dtype=np.int8) for e in self.edges])
        start, finish = self.start, self.finish

        # a task that waited for another resource starts, in effect, when it was released
        effective_start = start.copy()
        waits = np.isin(ekind, [int(EdgeKind.SYNC), int(EdgeKind.THREAD), int(EdgeKind.QUEUE)])
        if waits.any():
            latest = pd.Series(finish[src[waits]]).groupby(dst[waits]).max()
            idx = latest.index.to_numpy()
            effective_start[idx] = np.clip(latest.to_numpy(), start[idx], finish[idx])
        _start_after_stream_predecessor(effective_start, finish, self.gpu_id, self.gpu_threads)
        duration = np.maximum(finish - effective_start, 0.0)
        lag = _lags(src, dst, ekind, effective_start, finish, self.resource_code)

        task_kind = np.concatenate([self.cpu_kind, self.gpu_kind]).astype(np.int8)
        task_kind[np.asarray(self.woken, dtype=np.int64)] = int(TaskKind.WAIT)
        ctx_text, ctx_operator, ctx_layer = _context_tables(self.seg, self.names, self.kinds)
        ctx_of_seg = np.asarray(self.seg.ctx, dtype=np.int64)
        gpu_ctx = ctx_of_seg[self.launching_seg] if self.n_cpu else np.full(self.n_gpu, -1)
        gpu_ctx = np.where(self.launching_seg >= 0, gpu_ctx, -1)
        ctx = np.concatenate([ctx_of_seg, gpu_ctx])  # -1 picks the trailing "" below
        ctx_text = np.asarray(ctx_text + [""], dtype=object)
        operator = np.asarray(ctx_operator + [""], dtype=object)
        layer = np.asarray(ctx_layer + [""], dtype=object)
        gap = len(self.name_labels)  # the code of the name "cpu gap", after the events' names
        cpu_name = np.where(self.unnamed, gap, self.name_codes[np.maximum(self.owner, 0)])
        name = np.concatenate([cpu_name, self.name_codes[self.gpu_rows]])
        resource_label = np.asarray(
            [("cpu " + label) if c in self.cpu_threads else label for c, label in enumerate(self.thread_labels)],
            dtype=object,
        )
        tasks = pd.DataFrame(
            {
                "name": categorical_of(np.append(self.name_labels, "cpu gap"), name),
                "kind": task_kind,
                "resource": categorical_of(resource_label, self.resource_code),
                "duration_us": duration,
                "release_us": np.full(len(start), -np.inf),
                "order_key": start.copy(),
                "measured_start_us": start,
                "measured_end_us": finish,
                "context": categorical_of(ctx_text, ctx),
                "operator": categorical_of(operator, ctx),
                "layer": categorical_of(layer, ctx),
                "event": np.concatenate([self.owner, self.gpu_rows]),
            }
        )
        edges = pd.DataFrame({"src": src, "dst": dst, "lag_us": lag, "kind": ekind})
        graph = TaskGraph(tasks, edges, _operator_table(self.trace, resource_label), _workload(self.trace))
        # the first task of a resource that no edge explains is released when it started in the
        # trace; one with an edge (a stream's first kernel, a thread woken by another) follows it
        firsts = np.array([seq[0] for seq in graph.resource_order()], dtype=np.int64)
        firsts = firsts[~np.isin(firsts, dst)]
        tasks.iloc[firsts, tasks.columns.get_loc("release_us")] = effective_start[firsts]
        return graph


def _operator_table(trace: KinetoTrace, resource_label: np.ndarray) -> pd.DataFrame:
    """The operators, annotations and Python frames of the trace (``sim/workload.py``)."""
    ev = trace.events
    kinds = [EventKind.CPU_OP, EventKind.ANNOTATION, EventKind.PYTHON]
    rows = np.flatnonzero(ev["kind"].isin([int(k) for k in kinds]).to_numpy())
    kind_name = np.empty(len(EventKind), dtype=object)
    kind_name[[int(k) for k in kinds]] = OPERATOR_KINDS
    elements = ev["message_elements"].to_numpy()[rows]
    sized = np.flatnonzero(elements > 0)
    message_bytes = np.full(len(rows), np.nan)
    dtypes = ev["message_dtype"].to_numpy()[rows[sized]]
    message_bytes[sized] = elements[sized].astype(float) * np.array([element_bytes(d) for d in dtypes], dtype=float)
    recorded = [_in_row_order(inputs, rows) for inputs in (trace.input_dims, trace.input_types, trace.concrete_inputs)]
    thread = ev["thread"].cat.codes.to_numpy()[rows]
    return pd.DataFrame(
        {
            "name": categorical_of(ev["name"].cat.categories.to_numpy(dtype=object), ev["name"].cat.codes.to_numpy()[rows]),
            "kind": pd.Categorical(kind_name[ev["kind"].to_numpy()[rows]], categories=OPERATOR_KINDS),
            "thread": categorical_of(resource_label, thread),
            "start_us": ev["ts_us"].to_numpy()[rows],
            "dur_us": ev["dur_us"].to_numpy()[rows],
            "input_dims": recorded[0],
            "input_types": recorded[1],
            "concrete_inputs": recorded[2],
            "message_bytes": message_bytes,
            "sequence_nr": ev["sequence_nr"].to_numpy()[rows],
        },
        index=pd.Index(rows, dtype=np.int64),
    )


def _in_row_order(inputs: dict, rows: np.ndarray) -> list:
    """``inputs`` (event row -> raw JSON) as bytes in the order of ``rows`` (sorted), None for
    a row it does not hold; looked up for the rows it holds, not for every row."""
    out = [None] * len(rows)
    if inputs:
        keys = np.fromiter(inputs, dtype=np.int64, count=len(inputs))
        at = np.minimum(np.searchsorted(rows, keys), max(len(rows) - 1, 0))
        held = (rows[at] == keys) if len(rows) else np.zeros(len(keys), dtype=bool)
        for i, raw, hit in zip(at.tolist(), inputs.values(), held.tolist()):
            if hit:
                out[i] = bytes(raw)
    return out


def _workload(trace: KinetoTrace) -> Workload:
    """The job's record: from the trace, and from the capture bundle it came in, if it did."""
    has_gpu = trace.has_gpu
    if not isinstance(trace, BundledTrace):
        return Workload(trace.path, has_gpu)
    bundle = trace.bundle
    ready = bundle.ready
    gradient_ready = pd.DataFrame(
        {
            "step": ready["step"].to_numpy(),
            "parameter": ready["parameter"].to_numpy(),
            "at_us": ready["ts_us"].to_numpy(dtype=np.float64) - trace.origin_us,
            "thread": [f"cpu {bundle.pid}/{tid}" for tid in ready["tid"].tolist()],
        },
        columns=GRADIENT_READY_COLUMNS,
    )
    parameters = bundle.parameters if len(bundle.parameters.columns) else pd.DataFrame(columns=PARAMETER_COLUMNS)
    intervals = bundle.intervals
    layer_intervals = pd.DataFrame(
        {
            "step": intervals["step"].to_numpy(),
            "layer": intervals["layer"].to_numpy(),
            "pass": intervals["pass"].to_numpy(),
            "start_us": intervals["start_us"].to_numpy(dtype=np.float64) - trace.origin_us,
            "end_us": intervals["end_us"].to_numpy(dtype=np.float64) - trace.origin_us,
            "thread": [f"cpu {bundle.pid}/{tid}" for tid in intervals["tid"].tolist()],
        },
        columns=LAYER_INTERVAL_COLUMNS,
    )
    layers = bundle.layers if len(bundle.layers.columns) else pd.DataFrame(columns=LAYER_COLUMNS)
    return Workload(trace.path, has_gpu, parameters, gradient_ready, dict(bundle.environment), bundle.unprofiled_step_ms,
                    bundle.process_unprofiled_ms, layers, layer_intervals)


def _launch_queue_edges(gpu_id, gpu_corr, launching_seg, finish, seg_start, seg_end) -> tuple[np.ndarray, np.ndarray]:
    """Edges from the GPU task ``depth`` launches back to each launch call.

    CUDA queues a bounded number of launches; once that many are outstanding a launch call
    blocks until the oldest finishes. GPU-bound traces are full of such calls (ResNet-50 on a
    V100: 449 launches of 0.2-1 ms, each returning when the 1023rd-oldest kernel ended), and a
    faster GPU frees them sooner. The depth is read from the trace where its queue filled up
    (the most tasks ever outstanding at a launch's return, plus one), else the driver default.
    """
    launched = launching_seg >= 0
    order = np.argsort(np.where(launched, gpu_corr, np.iinfo(np.int64).max), kind="stable")[: int(launched.sum())]
    tasks = gpu_id[order]
    calls = launching_seg[order]
    call_end = seg_end[calls]
    task_end = finish[tasks]
    depth = DEFAULT_LAUNCH_QUEUE_DEPTH
    blocked = np.flatnonzero(call_end - seg_start[calls] > _BLOCKED_LAUNCH_US)[:2000]
    if len(blocked):
        outstanding = max(int(np.sum(task_end[:i] > call_end[i] + TOLERANCE_US)) for i in blocked.tolist())
        if outstanding >= _MIN_QUEUE_DEPTH:
            depth = outstanding + 1
    if len(tasks) <= depth:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    src = tasks[:-depth]
    dst = calls[depth:]
    honoured = finish[src] <= call_end[depth:] + TOLERANCE_US
    return src[honoured], dst[honoured]


def _start_after_stream_predecessor(effective_start, finish, gpu_id, gpu_threads) -> None:
    """Kernels on one stream that overlap a little in the trace (clock skew, or programmatic
    dependent launch on Hopper) start when their predecessor ends, keeping their end time."""
    if len(gpu_id) < 2:
        return
    prev_end = np.full(len(gpu_id), -np.inf)
    prev_end[1:] = finish[gpu_id[:-1]]
    prev_end[1:][gpu_threads[1:] != gpu_threads[:-1]] = -np.inf
    # a running maximum within each stream, in case a task ends before its predecessor did
    stream_start = np.r_[True, gpu_threads[1:] != gpu_threads[:-1]]
    group = np.cumsum(stream_start)
    prev_end = pd.Series(prev_end).groupby(group).cummax().to_numpy()
    effective_start[gpu_id] = np.minimum(np.maximum(effective_start[gpu_id], prev_end), np.maximum(finish[gpu_id], prev_end))


def _lags(src, dst, ekind, effective_start, finish, resource) -> np.ndarray:
    """Edge lags: exact for the edge that explains each task's start, typical for the others."""
    slack = effective_start[dst] - finish[src]
    typical = np.zeros(len(EdgeKind))
    launch = ekind == int(EdgeKind.LAUNCH)
    seq = ekind == int(EdgeKind.GPU_SEQ)
    if launch.any():
        # launch latency where the stream was idle: the kernel waited for nothing but its launch
        pred_end = pd.Series(finish[src[seq]], index=dst[seq]).reindex(dst[launch]).to_numpy()
        idle = ~(pred_end > finish[src[launch]])
        if idle.any():
            typical[int(EdgeKind.LAUNCH)] = float(np.median(slack[launch][idle]))
        if seq.any():
            busy = pd.Series(finish[src[launch]], index=dst[launch]).reindex(dst[seq]).to_numpy()
            queued = busy < finish[src[seq]]
            if queued.any():
                typical[int(EdgeKind.GPU_SEQ)] = float(np.clip(np.median(slack[seq][queued]), 0, None))
    candidate = finish[src] + typical[ekind]
    lag = np.minimum(slack, typical[ekind])
    if len(src):
        frame = pd.DataFrame({"dst": dst, "candidate": candidate})
        binding = frame.groupby("dst", sort=False)["candidate"].idxmax().to_numpy()
        # on a CPU thread the task before on the thread may be what explains the start instead
        thread_prev_end = _previous_end_on_resource(effective_start, finish, resource)
        explained_by_thread = thread_prev_end[dst[binding]] >= effective_start[dst[binding]] - 1e-9
        explained_by_thread &= candidate[binding] <= effective_start[dst[binding]] + 1e-9
        explained_by_thread &= ekind[binding] != int(EdgeKind.GPU_SEQ)
        exact = binding[~explained_by_thread | (slack[binding] < lag[binding])]
        lag[exact] = slack[exact]
    return lag


def _previous_end_on_resource(start, finish, resource) -> np.ndarray:
    """End of the task just before each task on its resource, where the two abut.

    Task ids follow resource order (segments are emitted thread by thread, GPU tasks stream by
    stream), so the previous id is the previous task on the resource when the resources agree.
    """
    prev = np.full(len(start), -np.inf)
    abut = (resource[1:] == resource[:-1]) & np.isclose(finish[:-1], start[1:], rtol=0, atol=1e-6)
    prev[1:] = np.where(abut, finish[:-1], -np.inf)
    return prev
