"""PyTorch DistributedDataParallel (Li et al., VLDB 2020).

Messages: gradients go into buckets in the order they become ready (the reverse of parameter
order), 25 MB each except a first bucket of 1 MB; as PyTorch's Reducer, a bucket closes once it
holds at least its cap, keeping the gradient that took it over. A bucket is all-reduced as soon
as its last gradient is ready, on a separate stream that overlaps the rest of backward, in the
order the buckets close (FIFO, as NCCL runs collectives in launch order).

Synchronisation: the optimizer's kernels wait for every bucket (the reducer makes the CUDA
stream wait, not the CPU thread, which blocks rather than polls).

Copies on a CPU worker (``copies.py``): the reducer copies each gradient, scaled by 1/workers,
into its bucket as soon as the gradient is ready, on the thread running backward, and once the
buckets' all-reduces are done copies them back into the gradients before ``backward()``
returns; the optimizer then waits for the copy back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import pandas as pd

from ..gradients import Gradient, Gradients
from ..graph import TaskGraph, TaskKind
from .base import Framework, FrameworkOptions, Message
from .copies import count_streamed_bytes
from .sync_points import SyncPoints


class DDP(Framework):
    name = "ddp"
    optimizer_waits_on_gpu = True

    def split(self, gradients: list[Gradient], forward: dict, options: FrameworkOptions) -> list[Message]:
        buckets: list[list[Gradient]] = [[]]
        cap = options.first_bucket_bytes
        size = 0.0
        for g in gradients:
            buckets[-1].append(g)
            size += g.nbytes
            if size >= cap:
                buckets.append([])
                size = 0.0
                cap = options.bucket_cap_bytes
        buckets = [b for b in buckets if b]
        return [
            Message(
                f"bucket {i}",
                sum(g.nbytes for g in bucket),
                sorted({t for g in bucket for t in g.ready_after}),
                min(forward[id(g)] for g in bucket),
                bucket[0].iteration,
                layers=[forward[id(g)] for g in bucket],
            )
            for i, bucket in enumerate(buckets)
        ]

    def add_copies(self, worker: TaskGraph, gradients: Gradients, sync: SyncPoints, iterations: pd.DataFrame,
                   pass_bytes_per_us: Optional[float], layerwise: bool) -> tuple[TaskGraph, Gradients, dict]:
        if not pass_bytes_per_us or layerwise:
            return worker, gradients, {}
        worker = worker.copy()
        gradients = _copy_into_buckets(worker, gradients, pass_bytes_per_us)
        copy_back = {}
        for it in range(len(iterations)):
            optimizer = sync.optimizer(it, on_gpu=False)
            sent = sum(g.nbytes for g in gradients.of_iteration(it))
            if sent and optimizer is not None:
                back = _copy_back(worker, optimizer, sent, pass_bytes_per_us)
                if back is not None:
                    copy_back[it] = back
        return worker, gradients, copy_back


def _copy_into_buckets(worker: TaskGraph, gradients: Gradients, bytes_per_us: float) -> Gradients:
    """Put DDP's copy of each gradient into its bucket on the thread that made the gradient
    ready, right after it, and hand the gradient over once copied; the copies back are added by
    :func:`_copy_back`."""
    ready = [g.ready_task for g in gradients.gradients]
    copies = worker.insert_many([(r, "DDP: copy gradient into bucket", g.nbytes / bytes_per_us, TaskKind.CPU)
                                 for r, g in zip(ready, gradients.gradients)])
    if copies:  # each handed over when its gradient was: orders the buckets as before
        handed_over = worker.tasks["measured_end_us"].to_numpy()[ready]
        for column in ("measured_start_us", "measured_end_us"):
            worker.tasks.loc[copies, column] = handed_over
    for copy, g in zip(copies, gradients.gradients):
        count_streamed_bytes(worker, copy, g.nbytes)
    return Gradients([replace(g, ready_task=c) for c, g in zip(copies, gradients.gradients)], gradients.source)


def _copy_back(worker: TaskGraph, consumer: int, nbytes: float, bytes_per_us: float) -> Optional[int]:
    """The copy of an iteration's buckets back into its gradients, on the consumer's thread just
    before the consumer (the optimizer), which waits for it; the cluster simulation makes it
    wait for the iteration's all-reduces. None where nothing runs on that thread before the
    consumer."""
    resource = worker.tasks["resource"].astype(str).to_numpy()
    key = worker.tasks["order_key"].to_numpy()
    same = np.flatnonzero((resource == resource[consumer]) & (key < key[consumer]))
    if not len(same):
        return None
    before = int(same[np.argmax(key[same])])
    back = worker.insert(before, consumer, "DDP: copy buckets back into gradients", nbytes / bytes_per_us,
                         resource=resource[consumer], kind=TaskKind.CPU)
    count_streamed_bytes(worker, back, nbytes)
    return back
