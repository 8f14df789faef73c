"""Where a worker graph waits for communication: the frameworks' synchronisation points.

The frameworks wait for their messages at one of three places in each iteration
(``Framework.waiter``): the optimizer step on the training thread (``optimizer.step()``, which
Horovod's ``DistributedOptimizer`` blocks until its all-reduces are done), the optimizer's first
GPU kernel (DDP's reducer makes the CUDA stream wait, not the CPU), or, layer by layer, the
next forward use of a layer (a parameter server's pulls, P3's slices). A zero-length barrier
task closes the last iteration for communication that nothing else awaits.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import pandas as pd

from ..graph import EdgeKind, GraphError, TaskGraph, TaskKind
from ..passes.optimizations import OPTIMIZER_STEP

_WEIGHT_OPS = re.compile(
    r"^aten::(conv\w*|_convolution|cudnn_convolution|linear|addmm|matmul|mm|bmm|batch_norm|layer_norm|"
    r"embedding\w*|lstm|gru|rnn_\w+)$"
)


def iteration_thread(worker: TaskGraph, iterations: pd.DataFrame) -> str:
    """The CPU resource that runs the training loop: the thread of the iterations' annotations,
    else the busiest CPU thread."""
    threads = [t for t in iterations["thread"] if t is not None]
    if threads:
        return f"cpu {threads[0]}"
    cpu = worker.tasks.loc[worker.tasks["resource"].astype(str).str.startswith("cpu "), "resource"]
    if cpu.empty:
        raise GraphError("the trace has no CPU thread to attach communication to")
    return str(cpu.astype(str).value_counts().index[0])


class SyncPoints:
    """What can wait for communication in each iteration of the worker graph."""

    def __init__(self, worker: TaskGraph, iterations: pd.DataFrame, thread: str):
        self.worker = worker
        self.iterations = iterations
        tasks = worker.tasks
        self.start = tasks["measured_start_us"].to_numpy()
        self.on_thread = (tasks["resource"].astype(str) == thread).to_numpy()
        self.in_optimizer = worker.match(OPTIMIZER_STEP)
        self.kinds = tasks["kind"].to_numpy()
        self.cache: dict = {}

    def _span(self, it: int) -> np.ndarray:
        row = self.iterations.iloc[it]
        return (self.start >= row.start_us) & (self.start < row.end_us)

    def first_of_iteration(self, it: int) -> Optional[int]:
        if it >= len(self.iterations):
            return None
        ids = np.flatnonzero(self._span(it) & self.on_thread)
        return int(ids[np.argmin(self.start[ids])]) if len(ids) else None

    def optimizer(self, it: int, on_gpu: bool) -> Optional[int]:
        """The first task of iteration ``it``'s optimizer step on the training thread, or its
        first kernel (``on_gpu``); the next iteration's first task where there is no step."""
        key = ("optimizer", it, on_gpu)
        if key not in self.cache:
            cpu = np.flatnonzero(self._span(it) & self.on_thread & self.in_optimizer)
            found = int(cpu[np.argmin(self.start[cpu])]) if len(cpu) else None
            if found is not None and on_gpu:
                gpu = np.flatnonzero(self.in_optimizer & np.isin(self.kinds, [int(TaskKind.KERNEL)]))
                gpu = gpu[self.start[gpu] >= self.start[found]]
                if not len(gpu):
                    gpu = self._launched_after(found, it)
                found = int(gpu[np.argmin(self.start[gpu])]) if len(gpu) else found
            self.cache[key] = found if found is not None else self.first_of_iteration(it + 1)
        return self.cache[key]

    def _launched_after(self, first: int, it: int) -> np.ndarray:
        """The kernels the training thread launched in iteration ``it`` from ``first`` on: the
        optimizer's, where no kernel carries the optimizer's annotation (a range the profiler
        closed early, or an optimizer that is no ``Optimizer.step``: the step is then what the
        thread launched from the first task found on). The stream waits, not the thread: the
        thread may have launched the step long before the GPU reaches it (VGG-13's H100 trace:
        at 35 ms, run from 349 ms)."""
        edges = self.worker.edges
        launch = edges[edges["kind"].to_numpy() == int(EdgeKind.LAUNCH)]
        src, dst = launch["src"].to_numpy(dtype=np.int64), launch["dst"].to_numpy(dtype=np.int64)
        ok = self.on_thread[src] & (self.start[src] >= self.start[first]) & self._span(it)[src]
        ok &= self.kinds[dst] == int(TaskKind.KERNEL)
        return dst[ok]

    def forward_ops(self, it: int) -> np.ndarray:
        """First task of each weight-using operator of iteration ``it``'s forward pass, in order."""
        key = ("forward", it)
        if key not in self.cache:
            tasks = self.worker.tasks
            names = tasks["name"].astype(str).to_numpy()
            outer = tasks["operator"].astype(str).to_numpy()
            span = self._span(it) & self.on_thread
            candidates = np.flatnonzero(span & (names == outer))
            weight = [t for t in candidates.tolist() if _WEIGHT_OPS.match(names[t])]
            event = tasks["event"].to_numpy()
            firsts, seen = [], set()
            for t in sorted(weight, key=lambda t: self.start[t]):
                if event[t] not in seen:
                    seen.add(event[t])
                    firsts.append(t)
            self.cache[key] = np.asarray(firsts, dtype=np.int64)
        return self.cache[key]

    def next_forward_use(self, it: int, message, layers: int) -> Optional[int]:
        """The task of the next forward pass that needs ``message`` of iteration ``it`` (None:
        the end barrier, after the last iteration).

        The gradient at forward position ``p`` of ``layers`` is needed by the weight operator at
        the same relative position of the next forward pass.
        """
        if it + 1 >= len(self.iterations):
            return None
        ops = self.forward_ops(it + 1)
        if not len(ops):
            return self.first_of_iteration(it + 1)
        position = min(message.layers) if message.layers else message.priority
        return int(ops[min(position * len(ops) // max(layers, 1), len(ops) - 1)])

    def barrier(self, graph: TaskGraph) -> tuple[int, dict]:
        """A zero-length task closing the last iteration, for communication nothing else awaits:
        the task it follows, and its row (``TaskGraph.inserted_row``, measured at the
        iteration's end), which the caller adds to ``graph`` with an edge from that task."""
        last = self.iterations.iloc[-1]
        ids = np.flatnonzero(self.on_thread & (self.start < last.end_us))
        after = int(ids[np.argmax(self.start[ids])])
        row = graph.inserted_row(after, "end of training step", 0.0)
        row.update(measured_start_us=last.end_us, measured_end_us=last.end_us)
        return after, row
