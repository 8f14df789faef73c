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
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from whatif.collectors.kineto import CPU_KINDS, EventKind, KinetoTrace

from .graph import EdgeKind, GraphError, TaskGraph, TaskKind

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
    as a trie (parent context, event name, event kind) so each distinct stack is stored once.
    """

    def __init__(self, names: list[str], kinds: list[int]):
        self.names = names
        self.kinds = kinds
        self.start: list[float] = []
        self.end: list[float] = []
        self.owner: list[int] = []  # event row, -1 for gaps
        self.ctx: list[int] = []
        self.thread: list[int] = []
        self.ctx_ids: dict[tuple, int] = {}
        self.ctx_parent: list[int] = []
        self.ctx_event: list[int] = []

    def context(self, parent: int, row: int) -> int:
        key = (parent, self.names[row], self.kinds[row])
        ctx = self.ctx_ids.get(key)
        if ctx is None:
            ctx = len(self.ctx_parent)
            self.ctx_ids[key] = ctx
            self.ctx_parent.append(parent)
            self.ctx_event.append(row)
        return ctx

    def first_and_last_segment(self) -> tuple[dict, dict]:
        """For every event that owns segments: its first and its last segment."""
        owner = np.asarray(self.owner, dtype=np.int64)
        named = np.flatnonzero(owner >= 0)
        rows, first = np.unique(owner[named], return_index=True)
        _, last_from_end = np.unique(owner[named][::-1], return_index=True)
        last = len(named) - 1 - last_from_end
        return (
            dict(zip(rows.tolist(), named[first].tolist())),
            dict(zip(rows.tolist(), named[last].tolist())),
        )


def _cut_thread(seg: _Segments, thread: int, rows: list, ts: list, end: list) -> None:
    """Cut one thread's nested events into leaf segments and gaps (from time 0 on)."""
    stack: list[tuple[float, int, int]] = []  # (end, row, ctx)
    cursor = 0.0
    runtime = int(EventKind.RUNTIME)
    kinds = seg.kinds
    out_start, out_end, out_owner, out_ctx = seg.start, seg.end, seg.owner, seg.ctx
    emitted_before = len(out_start)
    for row in rows:
        s = ts[row]
        e = end[row]
        while stack and stack[-1][0] <= s:
            top_end, top_row, top_ctx = stack.pop()
            if top_end > cursor or kinds[top_row] == runtime:
                if top_end < cursor:
                    top_end = cursor
                out_start.append(cursor); out_end.append(top_end); out_owner.append(top_row); out_ctx.append(top_ctx)
                cursor = top_end
        if s > cursor:
            if stack:
                _, top_row, top_ctx = stack[-1]
            else:
                top_row, top_ctx = -1, -1
            out_start.append(cursor); out_end.append(s); out_owner.append(top_row); out_ctx.append(top_ctx)
            cursor = s
        parent_ctx = -1
        if stack:
            parent_end = stack[-1][0]
            if e > parent_end:
                e = parent_end
            parent_ctx = stack[-1][2]
        stack.append((e, row, seg.context(parent_ctx, row)))
    while stack:
        top_end, top_row, top_ctx = stack.pop()
        if top_end > cursor or kinds[top_row] == runtime:
            if top_end < cursor:
                top_end = cursor
            out_start.append(cursor); out_end.append(top_end); out_owner.append(top_row); out_ctx.append(top_ctx)
            cursor = top_end
    seg.thread.extend([thread] * (len(out_start) - emitted_before))


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


def build_graph(trace: KinetoTrace) -> TaskGraph:
    """The dependency graph of everything in ``trace``."""
    ev = trace.events
    kinds = ev["kind"].to_numpy()
    ts = ev["ts_us"].to_numpy()
    end = ts + ev["dur_us"].to_numpy()
    names = ev["name"].cat.categories.to_numpy(dtype=object)[ev["name"].cat.codes.to_numpy()].tolist()
    thread_codes = ev["thread"].cat.codes.to_numpy()
    thread_labels = list(ev["thread"].cat.categories)

    # -- CPU threads --------------------------------------------------------------------------
    seg = _Segments(names, kinds.tolist())
    cpu_rows = np.flatnonzero(np.isin(kinds, [int(k) for k in CPU_KINDS]))
    priority = np.array([_KIND_PRIORITY.get(int(k), 2) for k in range(9)])[kinds[cpu_rows]]
    order = np.lexsort((priority, -(end[cpu_rows] - ts[cpu_rows]), ts[cpu_rows], thread_codes[cpu_rows]))
    cpu_rows = cpu_rows[order]
    bounds = np.flatnonzero(np.diff(thread_codes[cpu_rows])) + 1
    cpu_threads = []
    ts_list, end_list = ts.tolist(), end.tolist()
    for rows in np.split(cpu_rows, bounds):
        if len(rows):
            cpu_threads.append(thread_codes[rows[0]])
            _cut_thread(seg, int(thread_codes[rows[0]]), rows.tolist(), ts_list, end_list)
    first_seg, last_seg = seg.first_and_last_segment()
    ctx_text, ctx_operator, ctx_layer = _context_tables(seg, names, kinds)

    n_cpu = len(seg.start)
    owner = np.asarray(seg.owner, dtype=np.int64)
    owner_kind = np.where(owner >= 0, kinds[np.maximum(owner, 0)], -1)
    # the self time of an annotation (ProfilerStep#N, a record_function range) is time no event
    # names, like a gap between events: a thread blocked in backward() shows only its step range
    unnamed = (owner < 0) | (owner_kind == int(EventKind.ANNOTATION))
    cpu_kind = np.where(unnamed, int(TaskKind.GAP), int(TaskKind.CPU))
    cpu_kind[owner_kind == int(EventKind.RUNTIME)] = int(TaskKind.RUNTIME)

    # -- GPU streams ----------------------------------------------------------------------------
    gpu_rows = np.flatnonzero(np.isin(kinds, [int(EventKind.KERNEL), int(EventKind.MEMCPY), int(EventKind.MEMSET)]))
    gpu_rows = gpu_rows[np.lexsort((ts[gpu_rows], thread_codes[gpu_rows]))]
    n_gpu = len(gpu_rows)
    gpu_kind = np.select(
        [kinds[gpu_rows] == int(EventKind.MEMCPY), kinds[gpu_rows] == int(EventKind.MEMSET)],
        [int(TaskKind.MEMCPY), int(TaskKind.MEMSET)],
        int(TaskKind.KERNEL),
    )
    gpu_names = [names[r] for r in gpu_rows.tolist()]
    is_comm = np.array([any(m in nm.lower() for m in _COMM_MARKERS) for nm in gpu_names], dtype=bool)
    gpu_kind[is_comm] = int(TaskKind.COMM)

    # task ids: CPU segments first, then GPU tasks
    gpu_id = n_cpu + np.arange(n_gpu)
    correlation = ev["correlation"].to_numpy()
    runtime_rows = np.flatnonzero(kinds == int(EventKind.RUNTIME))
    launch_row_of_corr = pd.Series(runtime_rows, index=correlation[runtime_rows])
    launch_row_of_corr = launch_row_of_corr[~launch_row_of_corr.index.duplicated(keep="first")]
    launch_row_of_corr = launch_row_of_corr[launch_row_of_corr.index >= 0]
    gpu_corr = correlation[gpu_rows]
    launching_row = launch_row_of_corr.reindex(gpu_corr).to_numpy()
    launching_seg = np.array(
        [last_seg.get(int(r), -1) if r == r else -1 for r in launching_row], dtype=np.int64
    )

    seg_start = np.asarray(seg.start)
    seg_end = np.asarray(seg.end)
    start = np.concatenate([seg_start, ts[gpu_rows]])
    finish = np.concatenate([seg_end, end[gpu_rows]])
    thread_of_task = np.concatenate([np.asarray(seg.thread, dtype=np.int64), thread_codes[gpu_rows]])

    edges_src: list[np.ndarray] = []
    edges_dst: list[np.ndarray] = []
    edges_kind: list[int] = []

    def add(src, dst, kind):
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        ok = (src >= 0) & (dst >= 0)
        edges_src.append(src[ok])
        edges_dst.append(dst[ok])
        edges_kind.append((int(kind), int(ok.sum())))

    # GPU stream order
    gpu_threads = thread_codes[gpu_rows]
    same_stream = np.flatnonzero(gpu_threads[1:] == gpu_threads[:-1]) if n_gpu > 1 else np.zeros(0, np.int64)
    add(gpu_id[same_stream], gpu_id[same_stream + 1], EdgeKind.GPU_SEQ)

    # per stream: tasks in order and the running maximum of their launch correlation
    stream_tasks: dict[int, np.ndarray] = {}
    stream_corr: dict[int, np.ndarray] = {}
    stream_label: dict[int, str] = {}
    for code in np.unique(gpu_threads).tolist():
        idx = np.flatnonzero(gpu_threads == code)
        stream_tasks[code] = gpu_id[idx]
        stream_corr[code] = np.maximum.accumulate(np.where(gpu_corr[idx] >= 0, gpu_corr[idx], -1))
        stream_label[code] = thread_labels[code]
    stream_by_number = {}
    for code, label in stream_label.items():
        stream_by_number.setdefault(int(label.rsplit("stream ", 1)[-1]), []).append(code)

    def last_launched_before(code: int, corr: int) -> int:
        pos = int(np.searchsorted(stream_corr[code], corr, side="left")) - 1
        return int(stream_tasks[code][pos]) if pos >= 0 else -1

    # GPU -> CPU synchronisation
    sync_rows = np.flatnonzero(kinds == int(EventKind.CUDA_SYNC))
    sync_info = {}
    for r in sync_rows.tolist():
        sync_info.setdefault(int(correlation[r]), r)
    sync_kind_col = ev["sync_kind"].astype(str).to_numpy() if len(sync_rows) else None
    wait_stream = ev["wait_on_stream"].to_numpy()
    wait_record = ev["wait_on_record_correlation"].to_numpy()
    stream_col = ev["stream"].to_numpy()

    sync_src, sync_dst = [], []
    waiting_calls = set()
    for r in runtime_rows.tolist():
        if names[r] not in _BLOCKING_CALLS:
            continue
        call_seg = last_seg.get(r, -1)
        if call_seg < 0:
            continue
        corr = int(correlation[r])
        limit = corr
        targets = list(stream_tasks)
        info = sync_info.get(corr)
        if info is not None:
            kind = sync_kind_col[info]
            if kind == "Stream Sync" and stream_col[info] in stream_by_number:
                targets = stream_by_number[int(stream_col[info])]
            elif kind == "Event Sync" and wait_stream[info] in stream_by_number:
                targets = stream_by_number[int(wait_stream[info])]
                if wait_record[info] >= 0:
                    limit = int(wait_record[info])
        for code in targets:
            t = last_launched_before(code, limit)
            if t >= 0 and finish[t] <= end[r] + TOLERANCE_US:
                sync_src.append(t)
                sync_dst.append(call_seg)
                waiting_calls.add(call_seg)
    # synchronous copies: the copy ended before the call that issued it returned
    memcpy = np.flatnonzero((gpu_kind == int(TaskKind.MEMCPY)) & (launching_seg >= 0))
    copy_end = finish[gpu_id[memcpy]]
    call_rows = launching_row[memcpy].astype(np.int64)
    blocking = (copy_end <= end[call_rows] + TOLERANCE_US) & (copy_end > ts[call_rows] + TOLERANCE_US)
    for i in memcpy[blocking].tolist():
        sync_src.append(int(gpu_id[i]))
        sync_dst.append(int(launching_seg[i]))
        waiting_calls.add(int(launching_seg[i]))
    add(sync_src, sync_dst, EdgeKind.SYNC)

    # a call that waits for the GPU cannot also be where its own copy was launched from: the
    # launch edge comes from the thread position just before the call
    launch_src = launching_seg.copy()
    if waiting_calls:
        for i in np.flatnonzero(np.isin(launching_seg, list(waiting_calls))).tolist():
            first = first_seg.get(int(launching_row[i]), int(launching_seg[i]))
            same_thread_before = first - 1
            ok = same_thread_before >= 0 and seg.thread[same_thread_before] == seg.thread[first]
            launch_src[i] = same_thread_before if ok else -1
    add(launch_src, gpu_id, EdgeKind.LAUNCH)

    # GPU -> GPU: cudaStreamWaitEvent, when Kineto recorded which event it waited for
    sw_src, sw_dst = [], []
    if len(sync_rows):
        for r in sync_rows[sync_kind_col[sync_rows] == "Stream Wait Event"].tolist():
            waited = stream_by_number.get(int(wait_stream[r]), [])
            waiting = stream_by_number.get(int(stream_col[r]), [])
            if not waited or not waiting or wait_record[r] < 0:
                continue
            src = last_launched_before(waited[0], int(wait_record[r]))
            pos = int(np.searchsorted(stream_corr[waiting[0]], int(correlation[r]), side="right"))
            if src >= 0 and pos < len(stream_tasks[waiting[0]]):
                sw_src.append(src)
                sw_dst.append(int(stream_tasks[waiting[0]][pos]))
    add(sw_src, sw_dst, EdgeKind.STREAM_WAIT)

    # GPU -> CPU back-pressure: a launch returns only once the launch queue has a free slot
    queue_src, queue_dst = _launch_queue_edges(gpu_id, gpu_corr, launching_seg, finish, seg_start, seg_end)
    add(queue_src, queue_dst, EdgeKind.QUEUE)

    # CPU thread -> CPU thread: an idle stretch ends after another thread went idle
    seg_thread = np.asarray(seg.thread, dtype=np.int64)
    is_gap = unnamed
    gap_len = seg_end - seg_start
    idle = is_gap & ((gap_len >= IDLE_GAP_US) | (seg_start == 0.0))
    next_same = np.zeros(n_cpu, dtype=bool)
    if n_cpu > 1:
        next_same[:-1] = seg_thread[1:] == seg_thread[:-1]
    followed_by_idle = np.zeros(n_cpu, dtype=bool)
    followed_by_idle[:-1] = next_same[:-1] & idle[1:]
    last_of_thread = ~next_same
    signals = np.flatnonzero((followed_by_idle | last_of_thread) & ~is_gap)
    sig_order = np.argsort(seg_end[signals], kind="stable")
    signals = signals[sig_order]
    signal_time = seg_end[signals]
    wait_src, wait_dst = [], []
    for g in np.flatnonzero(idle).tolist():
        a, b = seg_start[g], seg_end[g]
        pos = int(np.searchsorted(signal_time, b, side="right")) - 1
        while pos >= 0 and signal_time[pos] >= a:
            x = int(signals[pos])
            if seg_thread[x] != seg_thread[g]:
                wait_src.append(x)
                wait_dst.append(g)
                break
            pos -= 1
    add(wait_src, wait_dst, EdgeKind.THREAD)
    task_kind = np.concatenate([cpu_kind, gpu_kind]).astype(np.int8)
    if wait_dst:
        task_kind[np.asarray(wait_dst)] = int(TaskKind.WAIT)

    src = np.concatenate(edges_src) if edges_src else np.zeros(0, np.int64)
    dst = np.concatenate(edges_dst) if edges_dst else np.zeros(0, np.int64)
    ekind = np.concatenate([np.full(n, k, dtype=np.int8) for k, n in edges_kind]) if edges_kind else np.zeros(0, np.int8)

    # -- effective starts, durations and lags -------------------------------------------------
    n = n_cpu + n_gpu
    effective_start = start.copy()
    waits_for_others = np.isin(ekind, [int(EdgeKind.SYNC), int(EdgeKind.THREAD), int(EdgeKind.QUEUE)])
    if waits_for_others.any():
        latest = pd.Series(finish[src[waits_for_others]]).groupby(dst[waits_for_others]).max()
        idx = latest.index.to_numpy()
        effective_start[idx] = np.clip(latest.to_numpy(), start[idx], finish[idx])
    _start_after_stream_predecessor(effective_start, finish, gpu_id, gpu_threads)
    duration = np.maximum(finish - effective_start, 0.0)
    lag = _lags(src, dst, ekind, effective_start, finish, start, thread_of_task)

    # -- the task table -------------------------------------------------------------------------
    ctx_of_seg = np.asarray(seg.ctx, dtype=np.int64)
    owner_name = [names[o] if not gap else "cpu gap" for o, gap in zip(owner.tolist(), unnamed.tolist())]
    task_name = owner_name + gpu_names
    gpu_ctx = np.where(launching_seg >= 0, ctx_of_seg[np.maximum(launching_seg, 0)] if n_cpu else -1, -1)
    ctx_all = np.concatenate([ctx_of_seg, gpu_ctx]) if n_cpu else gpu_ctx
    ctx_text = np.asarray(ctx_text + [""], dtype=object)
    operator = np.asarray(ctx_operator + [""], dtype=object)
    layer = np.asarray(ctx_layer + [""], dtype=object)
    cpu_codes = set(int(c) for c in cpu_threads)
    resource_label = np.asarray(
        [("cpu " + label) if c in cpu_codes else label for c, label in enumerate(thread_labels)], dtype=object
    )
    resources = resource_label[thread_of_task]
    release = np.full(n, -np.inf)
    order_key = start.copy()
    tasks = pd.DataFrame(
        {
            "name": pd.Categorical(task_name),
            "kind": task_kind,
            "resource": pd.Categorical(resources),
            "duration_us": duration,
            "release_us": release,
            "order_key": order_key,
            "measured_start_us": start,
            "measured_end_us": finish,
            "context": pd.Categorical(ctx_text[ctx_all]),
            "operator": pd.Categorical(operator[ctx_all]),
            "layer": pd.Categorical(layer[ctx_all]),
        }
    )
    # the first task of every resource is released when it started in the trace
    graph = TaskGraph(tasks, pd.DataFrame({"src": src, "dst": dst, "lag_us": lag, "kind": ekind}), trace.path)
    for seq in graph.resource_order():
        tasks.iat[int(seq[0]), tasks.columns.get_loc("release_us")] = effective_start[seq[0]]
    if n == 0:
        raise GraphError(f"{trace.path}: no CPU or GPU activity to build a graph from")
    return graph


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


def _lags(src, dst, ekind, effective_start, finish, start, resource) -> np.ndarray:
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
