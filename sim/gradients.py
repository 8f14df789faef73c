"""Which gradients a training step produces, how big they are, and after which task each is ready.

Data-parallel training sends every gradient once per iteration; when each can be sent and how
long it takes depend on exactly this. The sources, most precise first:

0. a capture bundle's per-parameter record (``whatif collect``, ``collectors/capture.py``): every
   parameter's exact size and dtype, each gradient ready at the CPU task that was running on the
   hook's thread when its post-accumulate-grad hook fired (the task containing that moment, or
   the last one before it);
1. sizes given by the user (a scenario's ``gradients.sizes``), placed on the trace's
   ``AccumulateGrad`` operators in order;
2. ``AccumulateGrad`` operators with their recorded input shapes (``record_shapes=True``): one
   gradient per parameter, ready when its accumulation ends;
3. the collective messages of a DDP trace (NCCL's ``In msg nelems`` on ``record_param_comms``):
   one per bucket, ready when DDP launched it;
4. a total (a scenario's ``gradients.total``): divided as sources 2 or 3 divide the step where
   the trace has them, else spread evenly over the ``AccumulateGrad`` operators, or over the GPU
   kernels of the iteration's second half when there are none. A total the user gives always
   sets the bytes sent.

A scenario's sizes or total win over the bundle, as over the other sources. The chosen source is
reported with the prediction, so a user knows what it rests on. Everything is read from the
graph: its tasks, its operator table and the capture's record it carries (``sim/workload.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from .graph import EdgeKind, GraphError, TaskGraph, TaskKind
from .workload import first_inputs_bytes

ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
BUNDLE_SOURCE = "capture bundle: per-parameter gradient hooks"


@dataclass(frozen=True)
class Gradient:
    """One tensor to communicate. It can be sent once ``ready_task`` (the CPU task that hands it
    over: its AccumulateGrad, or the step before DDP's launch) has ended and, on a GPU, once
    ``computed_by`` (the last kernel that thread launched before then, which every kernel
    computing the gradient precedes) has ended too; -1 where there is no GPU."""

    name: str
    nbytes: float
    ready_task: int
    iteration: int
    computed_by: int = -1

    @property
    def ready_after(self) -> list[int]:
        return [self.ready_task] + ([self.computed_by] if self.computed_by >= 0 else [])


@dataclass
class Gradients:
    """The gradients of every iteration, in the order they become ready, and where they came from."""

    gradients: list[Gradient]
    source: str

    def of_iteration(self, iteration: int) -> list[Gradient]:
        return [g for g in self.gradients if g.iteration == iteration]

    def bytes_per_iteration(self) -> float:
        per = pd.Series([g.nbytes for g in self.gradients]).groupby([g.iteration for g in self.gradients]).sum()
        return float(per.median()) if len(per) else 0.0


def find_gradients(
    graph: TaskGraph,
    iterations: pd.DataFrame,
    sizes: Optional[Sequence[float]] = None,
    total_bytes: Optional[float] = None,
) -> Gradients:
    """The gradients of each iteration of ``iterations`` (a frame from ``find_iterations``)."""
    tasks = graph.tasks
    event = tasks["event"].to_numpy()
    ops = graph.ops
    accumulate, rows = _last_task_of_events(graph, ops.index.to_numpy()[(ops["name"] == ACCUMULATE_GRAD).to_numpy()])
    span = _iteration_of(tasks, iterations)

    found = _find(graph, iterations, sizes, total_bytes, event, accumulate, rows, span)
    if total_bytes is not None and sizes is None and not found.source.startswith("scenario"):
        found = _scaled_to(found, total_bytes)
    kernel = _last_kernel_launched_before(graph, np.asarray([g.ready_task for g in found.gradients], dtype=np.int64))
    found.gradients = [replace(g, computed_by=int(k)) for g, k in zip(found.gradients, kernel)]
    return found


def _find(graph, iterations, sizes, total_bytes, event, accumulate, rows, span) -> Gradients:
    tasks = graph.tasks
    if sizes is not None:
        return _spread(tasks, span, accumulate, list(sizes), f"scenario: {len(sizes)} sizes")
    bundled = _bundle_gradients(graph, span)
    if bundled is not None:
        return bundled
    if len(accumulate):
        shapes = first_inputs_bytes(graph.ops, rows.tolist())
        known = [b is not None and b > 0 for b in shapes]
        if any(known):
            grads = [
                Gradient(f"grad {i}", float(b), int(t), int(span[t]))
                for i, (t, b, k) in enumerate(zip(accumulate, shapes, known))
                if k and span[t] >= 0
            ]
            missing = len(known) - sum(known)
            note = f" ({missing} without a recorded shape, e.g. sparse embedding gradients, left out)" if missing else ""
            return Gradients(grads, "AccumulateGrad input shapes in the trace" + note)
    messages = _ddp_messages(graph.ops, tasks, event)
    if messages:
        grads = [
            Gradient(f"bucket {i}", nbytes, t, int(span[t])) for i, (t, nbytes) in enumerate(messages) if span[t] >= 0
        ]
        return Gradients(grads, "DDP all-reduce messages in the trace (one per bucket)")
    if total_bytes is not None:
        n = max(len(accumulate) // max(len(iterations), 1), 1) if len(accumulate) else 64
        per = [total_bytes / n] * n
        return _spread(tasks, span, accumulate, per, f"scenario: total {total_bytes / 1e6:.1f} MB spread evenly")
    raise GraphError(
        f"{graph.workload.source}: cannot tell the gradient sizes (no AccumulateGrad shapes, no DDP messages); "
        "give gradients.total or gradients.sizes in the scenario"
    )


def _bundle_gradients(graph: TaskGraph, span: np.ndarray) -> Optional[Gradients]:
    """Source 0: each parameter's gradient, with its exact size, ready at the task its hook fired in."""
    workload = graph.workload
    if workload.gradient_ready.empty:
        return None
    params = workload.parameters.set_index("name")
    ready = workload.gradient_ready.groupby(["step", "parameter"], sort=False).tail(1)  # the last accumulation
    ready = ready[ready["parameter"].isin(params.index)]
    tasks = graph.tasks
    resource = tasks["resource"].astype(str).to_numpy()
    start = tasks["measured_start_us"].to_numpy()
    cpu = np.flatnonzero(tasks["resource"].astype(str).str.startswith("cpu ").to_numpy())
    at = ready["at_us"].to_numpy(dtype=np.float64)
    task = np.full(len(ready), -1, dtype=np.int64)
    threads = ready["thread"].to_numpy()
    for thread in np.unique(threads).tolist():
        ids = _hook_thread_tasks(cpu, resource, thread, tasks)
        ids = ids[np.argsort(start[ids], kind="stable")]
        asking = np.flatnonzero(threads == thread)
        pos = np.searchsorted(start[ids], at[asking] + 1e-6, side="right") - 1
        task[asking] = np.where(pos >= 0, ids[np.maximum(pos, 0)], -1)
    nbytes = (params["numel"] * params["element_size"]).reindex(ready["parameter"]).to_numpy(dtype=np.float64)
    order = np.lexsort((at, np.where(task >= 0, span[np.maximum(task, 0)], -1)))
    grads = [
        Gradient(str(name), float(b), int(t), int(span[t]))
        for name, b, t in zip(ready["parameter"].to_numpy()[order], nbytes[order], task[order])
        if t >= 0 and span[t] >= 0
    ]
    return Gradients(grads, BUNDLE_SOURCE) if grads else None


def _hook_thread_tasks(cpu: np.ndarray, resource: np.ndarray, label: str, tasks: pd.DataFrame) -> np.ndarray:
    """The CPU tasks of the thread a hook ran on; where the trace names its threads otherwise,
    those of the thread that ran the gradient accumulations (else every CPU thread's)."""
    mine = cpu[resource[cpu] == label]
    if len(mine):
        return mine
    accumulating = np.unique(resource[cpu[tasks["name"].astype(str).to_numpy()[cpu] == ACCUMULATE_GRAD]])
    if len(accumulating):
        return cpu[np.isin(resource[cpu], accumulating)]
    return cpu


def _scaled_to(found: Gradients, total_bytes: float) -> Gradients:
    """The trace's gradients, resized so that an iteration sends ``total_bytes``: the user's
    total wins, the trace still says how it divides and when each part is ready."""
    per_iteration = found.bytes_per_iteration()
    factor = total_bytes / per_iteration if per_iteration > 0 else 1.0
    return Gradients(
        [replace(g, nbytes=g.nbytes * factor) for g in found.gradients],
        f"scenario: total {total_bytes / 1e6:.1f} MB, divided as the {found.source}",
    )


def _last_kernel_launched_before(graph: TaskGraph, cpu_tasks: np.ndarray) -> np.ndarray:
    """For each CPU task, the GPU task launched last from its thread before it ended (-1: none)."""
    out = np.full(len(cpu_tasks), -1, dtype=np.int64)
    edges = graph.edges
    launch = edges[edges["kind"] == int(EdgeKind.LAUNCH)]
    if not len(cpu_tasks) or launch.empty:
        return out
    tasks = graph.tasks
    resource = tasks["resource"].cat.codes.to_numpy()
    end = tasks["measured_end_us"].to_numpy()
    src, dst = launch["src"].to_numpy(), launch["dst"].to_numpy()
    for code in np.unique(resource[cpu_tasks]).tolist():
        mine = resource[src] == code
        if not mine.any():
            continue  # a gradient placed on a GPU task, or a thread that launched nothing
        order = np.argsort(end[src[mine]], kind="stable")
        launch_end = end[src[mine]][order]
        launched = dst[mine][order]
        asking = np.flatnonzero(resource[cpu_tasks] == code)
        pos = np.searchsorted(launch_end, end[cpu_tasks[asking]], side="right") - 1
        out[asking] = np.where(pos >= 0, launched[np.maximum(pos, 0)], -1)
    return out


def _last_task_of_events(graph: TaskGraph, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each operator (row of ``graph.ops``), the last task on its thread within its span: the
    operator's own last segment, or its last child's where the children cover all of it. Returns
    the tasks in ascending order and, beside each, the operator it stands for."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tasks = graph.tasks
    ops = graph.ops.loc[rows]
    start = ops["start_us"].to_numpy()
    end = start + ops["dur_us"].to_numpy()
    thread = ops["thread"].astype(str).to_numpy()
    resource = tasks["resource"].astype(str).to_numpy()
    t_start = tasks["measured_start_us"].to_numpy()
    t_end = tasks["measured_end_us"].to_numpy()
    found, of_row = [], []
    for label in np.unique(thread).tolist():
        ids = np.flatnonzero(resource == label)
        ids = ids[np.argsort(t_end[ids], kind="stable")]
        asking = np.flatnonzero(thread == label)
        pos = np.searchsorted(t_end[ids], end[asking] + 1e-6, side="right") - 1
        for i, p, s_ in zip(asking.tolist(), pos.tolist(), start[asking].tolist()):
            if p >= 0 and t_start[ids[p]] >= s_ - 1e-6:
                found.append(int(ids[p]))
                of_row.append(int(rows[i]))
    anchors, first = np.unique(np.asarray(found, dtype=np.int64), return_index=True)
    return anchors, np.asarray(of_row, dtype=np.int64)[first]


def _iteration_of(tasks: pd.DataFrame, iterations: pd.DataFrame) -> np.ndarray:
    """Index of the iteration whose measured span holds each task's end (-1 for none)."""
    end = tasks["measured_end_us"].to_numpy()
    which = np.full(len(end), -1)
    for i, it in enumerate(iterations.itertuples(index=False)):
        which[(end > it.start_us) & (end <= it.end_us)] = i
    return which


def _ddp_messages(ops: pd.DataFrame, tasks: pd.DataFrame, event: np.ndarray) -> list[tuple[int, float]]:
    """DDP all-reduce buckets: (task just before the bucket's launch, bytes)."""
    messages = ops[(ops["message_bytes"].to_numpy() > 0) & (ops["name"] == "record_param_comms").to_numpy()]
    out = []
    context = tasks["context"].astype(str).to_numpy()
    for row, nbytes in zip(messages.index.tolist(), messages["message_bytes"].tolist()):
        ids = np.flatnonzero(event == row)
        if not len(ids) or not re.search(r"all_?reduce", context[ids[0]]):
            continue
        out.append((int(max(ids[0] - 1, 0)), float(nbytes)))
    return out


def _spread(tasks: pd.DataFrame, span: np.ndarray, anchors: np.ndarray, sizes: list, source: str) -> Gradients:
    """Place ``sizes`` (one iteration's gradients, in ready order) on each iteration's anchors."""
    grads = []
    for it in sorted(set(span[span >= 0].tolist())):
        points = anchors[span[anchors] == it] if len(anchors) else np.zeros(0, dtype=np.int64)
        how = "AccumulateGrad operators"
        if not len(points):
            points = _late_kernels(tasks, span, it)
            how = "GPU kernels of the iteration's second half (no AccumulateGrad operators)"
        if not len(points):
            raise GraphError("cannot place gradients: the iteration has neither AccumulateGrad operators nor kernels")
        pick = points[(np.arange(len(sizes)) * len(points)) // len(sizes)]
        grads += [Gradient(f"grad {i}", float(b), int(t), it) for i, (t, b) in enumerate(zip(pick, sizes))]
    return Gradients(grads, f"{source}, placed on {how}")


def _late_kernels(tasks: pd.DataFrame, span: np.ndarray, iteration: int) -> np.ndarray:
    ids = np.flatnonzero((span == iteration) & (tasks["kind"].to_numpy() == int(TaskKind.KERNEL)))
    if not len(ids):
        return ids
    start = tasks["measured_start_us"].to_numpy()[ids]
    middle = (start.min() + start.max()) / 2
    late = ids[start >= middle]
    return late[np.argsort(tasks["measured_end_us"].to_numpy()[late], kind="stable")]
