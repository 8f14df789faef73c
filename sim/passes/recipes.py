"""Daydream's remaining optimization recipes: each paper's rule, as a pass on the graph.

Daydream (Zhu et al., ATC'20, section 5 and table 3) models an optimization by what it does to
the tasks it touches: select them, scale them, insert tasks, remove tasks. These are the recipes
its table lists beside AMP, FusedAdam and P3 (``optimizations.py``), each written from its own
paper. Every rule reads what it needs from the trace (kernels, their operators' recorded
shapes, the optimizer step) and raises a :class:`GraphError` saying why where the trace has
nothing for it to change, so ``whatif advise`` can list the recipe as not applicable.

Two recipes change what the job communicates rather than, or besides, its kernels. They leave a
:class:`CommunicationChange` among the graph's notes, which the cluster step of the pipeline
(``whatif/pipeline.py``) applies to the framework's messages: gradient compression scales the
bytes sent and adds its encode/decode time; BlueConnect picks the hierarchical all-reduce.

Kernels found by operator: a GPU task belongs to the operator whose call on its CPU thread
contains the runtime call that launched it (``_launched_by``), so a recipe finds "the kernels
of ``aten::relu_``" and that call's recorded input shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from ..graph import EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks
from ..workload import first_input_bytes
from .optimizations import OPTIMIZER_STEP

BATCH_NORM_FORWARD = r"^aten::(?:cudnn|native|miopen)_batch_norm$"
BATCH_NORM_BACKWARD = r"^aten::(?:cudnn|native|miopen)_batch_norm_backward$"
RELU_FORWARD = r"^aten::(?:relu_?|clamp_min_?)$"
RELU_BACKWARD = r"^aten::threshold_backward$"
CONV_FORWARD = r"^aten::(?:cudnn_convolution|convolution)$"
CONV_BACKWARD = r"^aten::(?:cudnn_convolution_backward|convolution_backward)$"
#: element-wise operators a convolution or GEMM can take as its epilogue (MetaFlow's fusions)
EPILOGUE = r"^aten::(?:relu_?|add_?|clamp_min_?|sigmoid_?|hardtanh_?)$"
GEMM_OR_CONV = r"^aten::(?:cudnn_convolution|convolution|_convolution|addmm|mm|bmm|matmul|linear|conv2d)$"
BACKWARD_CONTEXT = re.compile(r"[Bb]ackward")

#: vDNN's transfers: PCIe 3.0 x16 (15.75 GB/s each way) at the ~80 % that copies of pinned
#: memory reach; Rhu et al. measured 12.8 GB/s on their Titan X. Bytes per microsecond.
PCIE_BYTES_PER_US = 12e3
#: 1-bit SGD (Seide et al., Interspeech 2014): one bit per 32-bit gradient element.
DEFAULT_COMPRESSION = 32.0


@dataclass(frozen=True)
class CommunicationChange:
    """What a recipe changed in the gradient communication, applied by the cluster step:
    bytes sent scaled by ``bytes_factor``, ``codec_us_per_iteration`` of encoding and decoding
    spread over the messages in proportion to their bytes, the all-reduce run as ``algorithm``
    (None: unchanged). ``traced_messages`` is how many traced communication kernels the pass
    changed itself (a single worker's trace)."""

    recipe: str
    bytes_factor: float = 1.0
    codec_us_per_iteration: float = 0.0
    algorithm: Optional[str] = None
    traced_messages: int = 0

    def describe(self) -> str:
        if self.algorithm is not None:
            return f"{self.recipe}: the all-reduce decomposed ({self.algorithm})"
        return (f"{self.recipe}: gradients sent at {self.bytes_factor:.4g} of their bytes, "
                f"{self.codec_us_per_iteration / 1e3:.2f} ms of encoding and decoding per iteration")


@dataclass(frozen=True)
class MemorySaved:
    """What a memory recipe (vDNN, Gist) frees on the GPU, over the trace, and how many tensors."""

    recipe: str
    tensors: int
    nbytes: float  # nan: the trace recorded no shapes to count them by

    def describe(self) -> str:
        size = "bytes unknown (no recorded shapes)" if not np.isfinite(self.nbytes) else f"{self.nbytes / 1e6:.1f} MB"
        return f"{self.recipe}: {self.tensors} feature maps kept off the GPU's memory, {size} over the trace"


# -- finding kernels by operator --------------------------------------------------------------------


def _operator_rows(graph: TaskGraph, pattern: str) -> np.ndarray:
    """Rows of ``graph.ops`` whose name matches ``pattern``, in order of start."""
    ops = graph.ops
    names = ops["name"].astype(str)
    rows = ops.index.to_numpy()[names.str.contains(pattern, regex=True).to_numpy()]
    return rows[np.argsort(ops.loc[rows, "start_us"].to_numpy(), kind="stable")]


def _kernels_of(graph: TaskGraph, pattern: str) -> np.ndarray:
    """The GPU tasks launched by the operators matching ``pattern`` (each once, where the
    operators nest: ``aten::relu_`` calls ``aten::clamp_min_``)."""
    return np.unique(np.concatenate(_launched_by(graph, _operator_rows(graph, pattern)) + [np.zeros(0, np.int64)]))


def _launched_by(graph: TaskGraph, rows: np.ndarray) -> list[np.ndarray]:
    """For each operator row, the GPU tasks launched from inside its call (by the runtime calls
    on its thread between its start and end), in launch order."""
    tasks, edges = graph.tasks, graph.edges
    launch = edges[edges["kind"].to_numpy() == int(EdgeKind.LAUNCH)]
    src, dst = launch["src"].to_numpy(), launch["dst"].to_numpy()
    start = tasks["measured_start_us"].to_numpy()[src]
    thread = tasks["resource"].astype(str).to_numpy()[src]
    by_thread = {}
    for name in np.unique(thread):
        on = np.flatnonzero(thread == name)
        on = on[np.argsort(start[on], kind="stable")]
        by_thread[name] = (start[on], dst[on])
    ops = graph.ops
    found = []
    for row, name, s, d in zip(rows.tolist(), ops.loc[rows, "thread"].astype(str), ops.loc[rows, "start_us"],
                               ops.loc[rows, "dur_us"]):
        starts, kernels = by_thread.get(name, (np.zeros(0), np.zeros(0, dtype=np.int64)))
        lo, hi = np.searchsorted(starts, s, "left"), np.searchsorted(starts, s + d, "right")
        found.append(kernels[lo:hi])
    return found


def _outermost(graph: TaskGraph, pattern: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """The operator rows matching ``pattern`` that launched GPU tasks no earlier row did (the
    outer of two that nest), and those tasks."""
    rows = _operator_rows(graph, pattern)
    claimed: set = set()
    kept_rows, kept = [], []
    for row, kernels in zip(rows.tolist(), _launched_by(graph, rows)):
        fresh = [int(k) for k in kernels if int(k) not in claimed]
        if fresh:
            claimed.update(fresh)
            kept_rows.append(row)
            kept.append(np.asarray(fresh, dtype=np.int64))
    return np.asarray(kept_rows, dtype=np.int64), kept


def _stream_neighbours(graph: TaskGraph) -> tuple[np.ndarray, np.ndarray]:
    """For every task, the task before and after it on its resource (-1 where none)."""
    before = np.full(len(graph.tasks), -1, dtype=np.int64)
    after = np.full(len(graph.tasks), -1, dtype=np.int64)
    for seq in graph.resource_order():
        before[seq[1:]] = seq[:-1]
        after[seq[:-1]] = seq[1:]
    return before, after


def _launch_calls(graph: TaskGraph, kernels: np.ndarray) -> np.ndarray:
    """The runtime calls that launched ``kernels``."""
    edges = graph.edges
    launch = edges[(edges["kind"].to_numpy() == int(EdgeKind.LAUNCH)) & np.isin(edges["dst"].to_numpy(), kernels)]
    return np.unique(launch["src"].to_numpy())


def _require_gpu(graph: TaskGraph, recipe: str, why: str) -> None:
    if not graph.workload.has_gpu:
        raise GraphError(f"{recipe}: the trace has no GPU; {why}")


def _add_tasks(graph: TaskGraph, rows: list[dict], edges: list[tuple]) -> np.ndarray:
    """Append tasks (each a row of the task table) and their edges at once; their new ids."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    first = len(graph.tasks)
    graph.tasks = concat_tasks([graph.tasks, pd.DataFrame(rows, columns=graph.tasks.columns)])
    graph.add_edges(edges)
    return np.arange(first, first + len(rows))


def _task_row(graph: TaskGraph, like: int, name: str, duration_us: float, kind: TaskKind, resource: str,
              order_key: float) -> dict:
    """A new task's row, its context, operator and layer those of task ``like``."""
    t = graph.tasks
    row = {c: t[c].iat[like] for c in t.columns}
    row.update(name=name, kind=int(kind), resource=resource, duration_us=float(duration_us), release_us=-np.inf,
               order_key=float(order_key), measured_start_us=np.nan, measured_end_us=np.nan, event=-1)
    return row


def _between_keys(graph: TaskGraph, before: np.ndarray, after: np.ndarray, place: np.ndarray) -> np.ndarray:
    """Order keys for new tasks placed just after ``place`` (``after[place]`` the next task on
    its resource, -1 where none)."""
    key = graph.tasks["order_key"].to_numpy()
    nxt = np.where(after[place] >= 0, key[np.maximum(after[place], 0)], key[place] + 1.0)
    return key[place] + (nxt - key[place]) / 2.0


# -- reconstructing batch normalization ---------------------------------------------------------------


def restructured_batch_norm(graph: TaskGraph) -> TaskGraph:
    """Restructured batch normalization (Jung et al., "Restructuring Batch Normalization to
    Accelerate CNN Training", MLSys 2019), as Daydream models it, by memory passes.

    BN fission-n-fusion splits each BN layer in two: the statistics (a read of the layer's input
    for its mean and variance) are computed by the convolution before it as it writes that
    input, and the normalization is fused with the ReLU after it. Forward, BN makes three
    passes over its activations (read for the statistics, read and write to normalize), of
    which two remain: its kernels take 2/3 of their time, and the ReLU kernel that follows a BN
    kernel on its stream goes, with its launch (its read and write now happen inside BN's).
    Backward, the ReLU's gradient (``threshold_backward``) just before a BN backward kernel on
    its stream is fused into it and goes; BN's backward keeps its time.
    """
    _require_gpu(graph, "restructure-bn", "the rule fuses GPU kernels")
    bn_fw = _kernels_of(graph, BATCH_NORM_FORWARD)
    if not len(bn_fw):
        raise GraphError("restructure-bn: the trace has no batch normalization kernels")
    bn_bw, relu_fw, relu_bw = (_kernels_of(graph, p) for p in (BATCH_NORM_BACKWARD, RELU_FORWARD, RELU_BACKWARD))
    before, after = _stream_neighbours(graph)
    fused = np.concatenate([relu_fw[np.isin(before[relu_fw], bn_fw)], relu_bw[np.isin(after[relu_bw], bn_bw)]])
    graph = graph.copy()
    graph.scale(bn_fw, 2.0 / 3.0)
    graph.remove(np.concatenate([fused, _launch_calls(graph, fused)]))
    return graph


# -- MetaFlow's fusion ---------------------------------------------------------------------------------


def metaflow_fusion(graph: TaskGraph) -> TaskGraph:
    """Fused operator graphs (Jia et al., "Optimizing DNN Computation with Relaxed Graph
    Substitutions", MLSys 2019: MetaFlow), at the substitution its search applies most: an
    element-wise operator (ReLU, bias or residual add, clamp, sigmoid) that consumes a
    convolution or matrix product is fused into it as its epilogue.

    In the forward pass, each kernel of such an operator that runs right after a kernel of a
    convolution or GEMM on its stream is removed, with its launch: the fused kernel writes its
    output once, already transformed, where the pair wrote it, read it back and wrote it again.
    The backward pass keeps its kernels (the ReLU's mask is still needed there).
    """
    _require_gpu(graph, "metaflow-fusion", "the rule fuses GPU kernels")
    producer, consumers = _kernels_of(graph, GEMM_OR_CONV), _kernels_of(graph, EPILOGUE)
    context = graph.tasks["context"].astype(str).to_numpy()
    forward = np.array([not BACKWARD_CONTEXT.search(c) for c in context[consumers]], dtype=bool)
    before, _ = _stream_neighbours(graph)
    fused = consumers[forward & np.isin(before[consumers], producer)]
    if not len(fused):
        raise GraphError("metaflow-fusion: no element-wise kernel runs right after a convolution or GEMM kernel "
                         "in the forward pass: nothing to fuse")
    graph = graph.copy()
    graph.remove(np.concatenate([fused, _launch_calls(graph, fused)]))
    return graph


# -- Gist ------------------------------------------------------------------------------------------------


def gist_encoding(graph: TaskGraph) -> TaskGraph:
    """Gist's encodings of stashed feature maps (Jain et al., "Gist: Efficient Data Encoding for
    Deep Neural Network Training", ISCA 2018), at its lossless Binarize encoding: what the
    backward pass of a ReLU needs of its output is only its sign, one bit per element.

    After each forward ReLU kernel an encode kernel reads the ReLU's output and writes one bit
    per 32-bit element: ``(1 + 1/32) / 2`` of the ReLU's own read-and-write time. Before each
    ReLU backward kernel (``threshold_backward``: reads the gradient and the output, writes the
    gradient) a decode kernel reads the bits and writes the mask: ``(1/32 + 1) / 3`` of that
    kernel's time. Both run on the ReLU's stream, in its order. The memory freed, recorded as a
    :class:`MemorySaved` note, is 31/32 of each ReLU output's bytes (its recorded input shape).
    """
    _require_gpu(graph, "gist", "Gist frees GPU memory")
    fw_rows, fw = _outermost(graph, RELU_FORWARD)
    _, bw = _outermost(graph, RELU_BACKWARD)
    if not any(len(k) for k in fw) or not any(len(k) for k in bw):
        raise GraphError("gist: the trace has no ReLU kernels forward and backward, whose outputs Binarize encodes")
    graph = graph.copy()
    before, after = _stream_neighbours(graph)
    duration = graph.tasks["duration_us"].to_numpy()
    resource = graph.tasks["resource"].astype(str).to_numpy()
    rows, edges = [], []
    encoded = [int(k[-1]) for k in fw if len(k)]
    first = len(graph.tasks)
    keys = _between_keys(graph, before, after, np.asarray(encoded, dtype=np.int64))
    for n, (kernel, key) in enumerate(zip(encoded, keys)):
        rows.append(_task_row(graph, kernel, "gist binarize encode", duration[kernel] * (1 + 1 / 32) / 2,
                              TaskKind.KERNEL, resource[kernel], key))
        edges.append((kernel, first + n, 0.0, int(EdgeKind.USER)))
        if after[kernel] >= 0:
            edges.append((first + n, int(after[kernel]), 0.0, int(EdgeKind.USER)))
    decoded = [int(k[0]) for k in bw if len(k)]
    places = np.asarray([before[k] if before[k] >= 0 else k for k in decoded], dtype=np.int64)
    keys = np.where(before[decoded] >= 0, _between_keys(graph, before, after, places),
                    graph.tasks["order_key"].to_numpy()[decoded] - 0.5)
    for kernel, key in zip(decoded, keys):
        new = first + len(rows)
        rows.append(_task_row(graph, kernel, "gist binarize decode", duration[kernel] * (1 / 32 + 1) / 3,
                              TaskKind.KERNEL, resource[kernel], key))
        edges.append((new, kernel, 0.0, int(EdgeKind.USER)))
        incoming = graph.edges[graph.edges["dst"].to_numpy() == kernel]
        edges += [(int(s), new, float(lag), int(EdgeKind.USER)) for s, lag in zip(incoming["src"], incoming["lag_us"])]
    _add_tasks(graph, rows, edges)
    sizes = [first_input_bytes(graph.ops, int(r)) for r, k in zip(fw_rows.tolist(), fw) if len(k)]
    nbytes = float(sum(s for s in sizes if s is not None)) * 31 / 32 if any(s is not None for s in sizes) else np.nan
    graph.notes.append(MemorySaved("gist", len(encoded), nbytes))
    return graph


# -- vDNN --------------------------------------------------------------------------------------------------


def vdnn_offload(graph: TaskGraph) -> TaskGraph:
    """vDNN (Rhu et al., "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient
    Neural Network Design", MICRO 2016), its ``vDNN_conv`` policy: the input feature map of
    every convolution is offloaded to host memory over PCIe during the forward pass and
    prefetched back during the backward pass.

    Forward: while a convolution runs, a device-to-host copy of its input (its recorded input
    bytes over :data:`PCIE_BYTES_PER_US`) runs on a copy engine of its own, from the moment the
    input is ready (the kernel before the convolution's first ends); the next layer waits for
    it, as vDNN synchronises at the end of each layer before it frees the buffer. Backward: the
    host-to-device copy for a convolution's backward starts when the backward of the layer
    after it starts (the convolutions' backwards pair with their forwards in reverse order), on
    a second copy engine, and that backward waits for it. The memory freed is the offloaded
    bytes (a :class:`MemorySaved` note).
    """
    _require_gpu(graph, "vdnn", "vDNN offloads GPU memory to the host")
    fw_rows = _operator_rows(graph, CONV_FORWARD)
    ops = graph.ops
    names = ops.loc[fw_rows, "name"].astype(str).to_numpy()
    if len(fw_rows) and (names == "aten::cudnn_convolution").any():
        fw_rows = fw_rows[names == "aten::cudnn_convolution"]  # the innermost: its kernels only once
    bw_rows = _operator_rows(graph, CONV_BACKWARD)
    bw_names = ops.loc[bw_rows, "name"].astype(str).to_numpy()
    if len(bw_rows) and (bw_names == "aten::cudnn_convolution_backward").any():
        bw_rows = bw_rows[bw_names == "aten::cudnn_convolution_backward"]
    if not len(fw_rows) or not len(bw_rows):
        raise GraphError("vdnn: the trace has no convolutions forward and backward, whose inputs vDNN offloads")
    sizes = [first_input_bytes(ops, int(r)) for r in fw_rows.tolist()]
    if all(s is None for s in sizes):
        raise GraphError("vdnn: the trace recorded no input shapes (record_shapes=False), so the bytes to offload "
                         "over PCIe are unknown")
    fw, bw = _launched_by(graph, fw_rows), _launched_by(graph, bw_rows)
    graph = graph.copy()
    before, after = _stream_neighbours(graph)
    key = graph.tasks["order_key"].to_numpy()
    device = str(graph.tasks["resource"].astype(str).to_numpy()[next(int(k[0]) for k in fw if len(k))]).split("/")[0]
    rows, edges, stack = [], [], []
    first = len(graph.tasks)
    events = sorted([(float(ops.at[int(r), "start_us"]), 0, i) for i, r in enumerate(fw_rows.tolist())]
                    + [(float(ops.at[int(r), "start_us"]), 1, i) for i, r in enumerate(bw_rows.tolist())])
    previous_backward = None
    offloaded = []
    for _, backward, i in events:
        if not backward:
            kernels, nbytes = fw[i], sizes[i]
            if not len(kernels) or nbytes is None:
                continue
            new = first + len(rows)
            head, tail = int(kernels[0]), int(kernels[-1])
            rows.append(_task_row(graph, head, "vdnn offload DtoH", nbytes / PCIE_BYTES_PER_US, TaskKind.MEMCPY,
                                  f"{device}/vdnn offload", key[head]))
            if before[head] >= 0:
                edges.append((int(before[head]), new, 0.0, int(EdgeKind.USER)))
            if after[tail] >= 0:
                edges.append((new, int(after[tail]), 0.0, int(EdgeKind.USER)))
            stack.append((new, nbytes))
            offloaded.append(nbytes)
            continue
        kernels = bw[i]
        if not len(kernels) or not stack:
            continue
        _, nbytes = stack.pop()
        head = int(kernels[0])
        new = first + len(rows)
        start_after = previous_backward if previous_backward is not None else head
        rows.append(_task_row(graph, head, "vdnn prefetch HtoD", nbytes / PCIE_BYTES_PER_US, TaskKind.MEMCPY,
                              f"{device}/vdnn prefetch", key[start_after]))
        if before[start_after] >= 0:
            edges.append((int(before[start_after]), new, 0.0, int(EdgeKind.USER)))
        edges.append((new, head, 0.0, int(EdgeKind.USER)))
        previous_backward = head
    _add_tasks(graph, rows, edges)
    graph.notes.append(MemorySaved("vdnn", len(offloaded), float(sum(offloaded))))
    return graph


# -- gradient compression ---------------------------------------------------------------------------------


def gradient_compression(graph: TaskGraph, ratio: float = DEFAULT_COMPRESSION) -> TaskGraph:
    """Gradient compression: the gradients sent ``ratio`` times smaller, at the cost of encoding
    and decoding them (1-bit SGD, Seide et al., Interspeech 2014: 32x; deep gradient
    compression, Lin et al., ICLR 2018: 270x to 600x, ``gradient-compression=500``).

    Communication: every traced communication kernel takes ``1/ratio`` of its time (it is bound
    by the bytes it moves), and on a cluster the framework's messages carry ``1/ratio`` of their
    bytes (:class:`CommunicationChange`). Compression: encoding reads the gradient and the
    residual kept for error feedback and writes the residual back (three passes over the
    gradient's bytes), decoding writes the dense gradient (one pass). The trace's own optimizer
    step makes between five (SGD with momentum) and seven (Adam) such passes over the same
    bytes, so the codec costs 4/6 of the optimizer step's time per iteration (its kernels on a
    GPU, its CPU time on a CPU trace). On a single worker's trace an encode kernel runs before
    each communication kernel, on its stream and after what it waited for, and a decode kernel
    after it, sharing that time by the kernels' durations.
    """
    if not (np.isfinite(ratio) and ratio >= 1):
        raise GraphError(f"gradient-compression: the compression ratio must be a number >= 1, got {ratio:g}")
    in_step = graph.match(OPTIMIZER_STEP)
    kinds = graph.tasks["kind"].to_numpy()
    work = [int(TaskKind.KERNEL)] if graph.workload.has_gpu else [int(TaskKind.CPU)]
    step_tasks = in_step & np.isin(kinds, work)
    if not step_tasks.any():
        raise GraphError("gradient-compression: the trace has no optimizer step (no 'Optimizer.step' annotation), "
                         "whose passes over the gradients price the encoding and decoding")
    steps = _optimizer_steps(graph)
    codec_us = float(graph.tasks["duration_us"].to_numpy()[step_tasks].sum()) * 4 / 6 / max(steps, 1)
    graph = graph.copy()
    comm = np.flatnonzero(kinds == int(TaskKind.COMM))
    if len(comm):
        duration = graph.tasks["duration_us"].to_numpy()
        share = duration[comm] / duration[comm].sum() if duration[comm].sum() > 0 else np.full(len(comm), 1 / len(comm))
        codec = codec_us * max(steps, 1) * share
        before, after = _stream_neighbours(graph)
        resource = graph.tasks["resource"].astype(str).to_numpy()
        key = graph.tasks["order_key"].to_numpy()
        first = len(graph.tasks)
        rows, edges = [], []
        for task, cost in zip(comm.tolist(), codec.tolist()):
            encode, decode = first + len(rows), first + len(rows) + 1
            lo = key[before[task]] if before[task] >= 0 else key[task] - 1.0
            hi = key[after[task]] if after[task] >= 0 else key[task] + 1.0
            rows.append(_task_row(graph, task, "gradient compression encode", cost * 3 / 4, TaskKind.KERNEL,
                                  resource[task], (lo + key[task]) / 2))
            rows.append(_task_row(graph, task, "gradient compression decode", cost / 4, TaskKind.KERNEL,
                                  resource[task], (key[task] + hi) / 2))
            incoming = graph.edges[graph.edges["dst"].to_numpy() == task]
            edges += [(int(s), encode, float(lag), int(EdgeKind.USER)) for s, lag in zip(incoming["src"], incoming["lag_us"])]
            edges.append((encode, task, 0.0, int(EdgeKind.USER)))
            edges.append((task, decode, 0.0, int(EdgeKind.USER)))
            outgoing = graph.edges[graph.edges["src"].to_numpy() == task]
            edges += [(decode, int(d), float(lag), int(EdgeKind.USER)) for d, lag in zip(outgoing["dst"], outgoing["lag_us"])]
        graph.scale(comm, 1.0 / ratio)
        _add_tasks(graph, rows, edges)
    graph.notes.append(CommunicationChange("gradient-compression", 1.0 / ratio, codec_us, None, len(comm)))
    return graph


def _optimizer_steps(graph: TaskGraph) -> int:
    """How many optimizer steps the trace has: its ``Optimizer.step`` operators, else its
    ``## optimizer ##`` annotations (a trace may have both, around the same steps), else 1."""
    names = graph.ops["name"].astype(str)
    for pattern in (r"^Optimizer\.step", r"^## optimizer ##"):
        count = int(names.str.contains(pattern, regex=True).sum())
        if count:
            return count
    return 1


# -- BlueConnect -------------------------------------------------------------------------------------------


def blueconnect(graph: TaskGraph) -> TaskGraph:
    """BlueConnect (Cho et al., "BlueConnect: Decomposing All-Reduce for Deep Learning on
    Heterogeneous Network Hierarchy", MLSys 2019): the all-reduce decomposed into a
    reduce-scatter and an all-gather at each level of the network hierarchy, each level's on
    its own links, run at once across the levels' groups: inside each machine a reduce-scatter,
    across machines an all-reduce of each shard among the GPUs of the same local rank, inside
    each machine an all-gather. That is the cluster's ``hierarchical`` all-reduce
    (``topology/collectives.py``), which the cluster step runs instead of the ring
    (:class:`CommunicationChange`): a hierarchy needs several machines of several GPUs each,
    which a single worker's trace does not have.
    """
    graph = graph.copy()
    graph.notes.append(CommunicationChange("blueconnect", algorithm="hierarchical"))
    return graph
