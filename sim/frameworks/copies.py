"""The memory passes data-parallel frameworks make over a CPU worker's gradients, and their price.

Neither framework all-reduces a gradient where autograd left it (each framework's module adds
its own passes to the worker graph):

* DDP's reducer copies each gradient, scaled by 1/workers, into its bucket as soon as the
  gradient is ready, on the thread running backward (``torch::distributed::reducer::mul_out``
  in a profile), and once the buckets' all-reduces are done copies them back into the
  gradients before ``backward()`` returns (``copy_bucket_to_grad``).
* Horovod's background thread copies the tensors of a fused all-reduce into its fusion buffer
  and back out (``MEMCPY_IN_FUSION_BUFFER`` / ``MEMCPY_OUT_FUSION_BUFFER`` in its timeline) and
  scales the buffer by 1/workers in between; a lone tensor is reduced in place and only scaled.

On a CPU worker every pass takes the core the training step runs on. In a profiled VGG run on
the lab (two DDP workers on one machine, 29 MB of gradients) the reducer's two passes took
6.7 ms of a 200 ms step; Horovod's timeline of the same model showed about 8 ms of copies.
On a GPU they are kernels at the GPU's memory bandwidth, microseconds per megabyte, and are
left out.

A pass over ``b`` bytes is priced at the rate at which the trace's own optimizer updates
parameter-sized tensors in place (its ``add_``, ``mul_``, ... of at least 256 kB: bytes of
the updated tensor over the operator's time), measured on the machine and thread of the step.
That rate is an upper bound for the frameworks' copies, which write to memory the step has not
just touched: on the VGG run above the optimizer updated 20 GB/s and the reducer copied
9 GB/s, so the passes are priced at about half what they cost there.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..graph import TaskGraph
from ..passes.optimizations import OPTIMIZER_STEP
from ..passes.shared_memory import MEMORY_BYTES
from ..workload import first_inputs_bytes

IN_PLACE_UPDATE = r"^aten::(add|mul|sub|div|addcmul|addcdiv|lerp|copy|_foreach_\w+)_$"
MIN_UPDATE_BYTES = 256e3


def pass_rate_bytes_per_us(graph: TaskGraph) -> Optional[float]:
    """Bytes per microsecond at which the optimizer of a CPU trace's graph updates its
    parameters in place; None for a GPU trace (its updates are kernels) or a trace without such
    updates."""
    if graph.workload.has_gpu:
        return None
    tasks = graph.tasks
    outermost = tasks["name"].astype(str).to_numpy() == tasks["operator"].astype(str).to_numpy()
    update = graph.match(OPTIMIZER_STEP) & graph.match(IN_PLACE_UPDATE) & outermost
    events = np.unique(tasks["event"].to_numpy()[update])
    rows = events[events >= 0].tolist()
    updated_bytes = spent_us = 0.0
    for nbytes, duration_us in zip(first_inputs_bytes(graph.ops, rows), graph.ops["dur_us"].loc[rows].tolist()):
        if nbytes is None or nbytes < MIN_UPDATE_BYTES:
            continue
        updated_bytes += nbytes
        spent_us += float(duration_us)
    return updated_bytes / spent_us if spent_us > 0 else None


def count_streamed_bytes(worker: TaskGraph, copy: int, nbytes: float) -> None:
    """A copy reads and writes its bytes (``sim/passes/shared_memory.py``), where the graph counts them."""
    if MEMORY_BYTES in worker.tasks:
        worker.tasks.at[copy, MEMORY_BYTES] = 2 * nbytes
