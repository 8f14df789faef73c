"""Built-in what-ifs, each a short pass on the transformation primitives of ``sim.graph``.

They follow the estimates of the Daydream paper (Zhu et al., ATC'20, section 5): what an
optimization does to the tasks it touches, not a re-measurement. Each takes a graph and returns
the transformed copy. Daydream's other recipes are in ``recipes.py``; ``registry.py`` names them
all for ``--optimization NAME`` and a scenario's ``optimizations:``.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..graph import CPU_WORK_KINDS, GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind, names_matching

#: Kernels that run on Tensor Cores under mixed precision: GEMMs and convolutions (cuDNN, CUTLASS,
#: cuBLAS naming), including the data- and weight-gradient convolutions of the backward pass and
#: the transforms of a Winograd convolution. Not every cuDNN kernel: its batch norm
#: (``cudnn::bn_fw_tr_1C11_kernel_NCHW``, ``bn_bw_1C11_kernel_new``), pooling, softmax and layout
#: transposes (``cudnn::ops::nchwToNhwcKernel``) read and write memory, so half the bytes make
#: them twice as fast, as any other kernel; nor PyTorch's depthwise convolutions
#: (``conv_depthwise2d_forward_kernel``, memory-bound: no Tensor Core kernel), nor FBGEMM's
#: kernels by their library's name alone (``fbgemm_gpu::permute_indices_weights_kernel``).
TENSOR_CORE_ELIGIBLE = re.compile(
    r"(?<!fb)gemm|conv(?!ert|_depthwise)|cutlass|xmma|wgrad|dgrad|fprop|scudnn|hcudnn|winograd|s884|s1688|h884|h1688",
    re.IGNORECASE,
)
#: Of those, the ones on Tensor Cores already in TF32 (an Ampere or later GPU running fp32 convolutions,
#: as cuDNN does by default in PyTorch): half precision doubles their rate (A100: 156 against 312
#: dense TFLOPS; H100 SXM: 495 against 989), not triples it.
TF32 = re.compile(r"tf32", re.IGNORECASE)
OPTIMIZER_STEP = r"Optimizer\.step|optimizer\.step|## optimizer ##"
DATA_LOADING = r"DataLoader|## wait_for_batch ##|## copy_batch_to_gpu ##"


def automatic_mixed_precision(graph: TaskGraph) -> TaskGraph:
    """AMP (Daydream, section 5): Tensor-Core-eligible kernels 3x faster, every other kernel 2x
    (half the bytes). Where a kernel runs on Tensor Cores in TF32 already (its name says
    ``tf32``), 2x: Daydream's 3x was measured on a V100, whose fp32 kernels had no Tensor Cores.

    Communication kernels and copies are left alone: under AMP gradients are still all-reduced
    in the precision the optimizer keeps, and host-device copies move the same input batch.
    """
    graph = graph.copy()
    kernels = graph.select(kinds=[TaskKind.KERNEL])
    names = graph.tasks["name"]
    eligible = names_matching(names, TENSOR_CORE_ELIGIBLE.search)[kernels]
    tf32 = names_matching(names, TF32.search)[kernels]
    graph.scale(kernels[eligible & ~tf32], 1 / 3)
    graph.scale(kernels[~eligible | tf32], 1 / 2)
    return graph


def fused_optimizer(graph: TaskGraph) -> TaskGraph:
    """FusedAdam-style fusion (Daydream's fused optimizer, section 5): each optimizer step's
    per-parameter kernels become one kernel per stream, and the CPU work that launched them
    (Python, aten dispatch, launch calls) goes.

    The fused kernel does the same memory traffic as the kernels it replaces, so its duration is
    their sum; what disappears is the launch overhead and the gaps between the small kernels.
    One launch call is kept to start it. A step that launched no kernel (an optimizer on the host)
    keeps its CPU work, which is the update itself; a trace none of whose steps launched one is
    refused (a CPU-only trace: removing the step's work would drop the update, and with it the
    wait for the gradients' all-reduce that a data-parallel step hangs on).
    """
    in_step = graph.match(OPTIMIZER_STEP)
    if not in_step.any():
        raise GraphError("fused optimizer: the trace has no optimizer step (no 'Optimizer.step' annotation)")
    graph = graph.copy()
    tasks = graph.tasks
    kinds = tasks["kind"].to_numpy()
    cpu = np.isin(kinds, [int(TaskKind.CPU), int(TaskKind.RUNTIME), int(TaskKind.GAP)]) & in_step
    steps = _contiguous_runs(cpu, tasks["resource"].cat.codes.to_numpy())
    step_of = np.full(len(tasks), -1)
    for number, ids in enumerate(steps):
        step_of[ids] = number
    launches = graph.edges[graph.edges["kind"] == int(EdgeKind.LAUNCH)]
    launch_of = pd.Series(launches["src"].to_numpy(), index=launches["dst"].to_numpy())
    launch_of = launch_of[~launch_of.index.duplicated()]
    kernels = np.flatnonzero((kinds == int(TaskKind.KERNEL)) & in_step)
    kernel_launch = launch_of.reindex(kernels).fillna(-1).to_numpy(dtype=np.int64)
    kernel_step = np.where(kernel_launch >= 0, step_of[np.maximum(kernel_launch, 0)], -1)
    fused_steps = np.unique(kernel_step[kernel_step >= 0])
    if not len(fused_steps):
        raise GraphError("fused optimizer: the optimizer step launches no GPU kernels (a CPU-only trace, or an "
                         "optimizer on the host): its CPU work is the update's arithmetic, not kernel launches, "
                         "and fusing kernels would change nothing of it")
    remove = cpu & np.isin(step_of, fused_steps)  # a step that launched nothing keeps its work
    duration = tasks.columns.get_loc("duration_us")
    frame = pd.DataFrame({"kernel": kernels, "step": kernel_step, "stream": tasks["resource"].cat.codes.to_numpy()[kernels]})
    for (step, _), group in frame[frame["step"] >= 0].groupby(["step", "stream"], sort=False):
        first = int(group["kernel"].iloc[0])
        tasks.iat[first, duration] = float(tasks["duration_us"].to_numpy()[group["kernel"].to_numpy()].sum())
        remove[group["kernel"].to_numpy()[1:]] = True
        remove[int(kernel_launch[group.index[0]])] = False  # the launch of the fused kernel stays
    graph.remove(np.flatnonzero(remove))
    return graph


def _contiguous_runs(mask: np.ndarray, resource_codes: np.ndarray) -> list[np.ndarray]:
    """Runs of consecutive selected tasks on one CPU thread (one optimizer step each)."""
    ids = np.flatnonzero(mask)
    if not len(ids):
        return []
    breaks = np.flatnonzero((np.diff(ids) != 1) | (np.diff(resource_codes[ids]) != 0)) + 1
    return np.split(ids, breaks)


def faster_gpu(graph: TaskGraph, speedup: float = 2.0) -> TaskGraph:
    """A GPU ``speedup`` times faster (Daydream's scale primitive on the GPU's tasks): every
    kernel, copy and memset takes 1/speedup as long.

    Communication kernels keep their duration: they are bound by the interconnect, not the GPU.
    """
    if speedup <= 0:
        raise GraphError(f"faster GPU: speed-up must be positive, got {speedup}")
    graph = graph.copy()
    gpu = graph.select(kinds=[k for k in GPU_TASK_KINDS if k != TaskKind.COMM])
    graph.scale(gpu, 1.0 / speedup)
    return graph


def faster_cpu(graph: TaskGraph, speedup: float = 2.0) -> TaskGraph:
    """A host CPU ``speedup`` times faster (Daydream's scale primitive on the threads' work):
    every operator's self time, runtime call and untraced gap on a CPU thread takes 1/speedup
    as long. Waits keep theirs (a thread idle until another signals it is as fast as what it
    waits for), and so do communication and the GPU's tasks. On a CPU worker's trace this is
    the whole compute; on a GPU trace, the launch work that keeps the GPU fed."""
    if speedup <= 0:
        raise GraphError(f"faster CPU: speed-up must be positive, got {speedup}")
    graph = graph.copy()
    graph.scale(graph.select(kinds=[TaskKind(k) for k in CPU_WORK_KINDS]), 1.0 / speedup)
    return graph


def no_data_loading(graph: TaskGraph) -> TaskGraph:
    """Input data that is always ready (Daydream's remove primitive): data loading and everything
    it launched go, their predecessors joined to their successors."""
    loading = graph.select(pattern=DATA_LOADING)
    if not len(loading):
        raise GraphError("no-dataloader: the trace has no data loading (no DataLoader, wait_for_batch or "
                         "copy_batch_to_gpu annotation) to remove")
    graph = graph.copy()
    graph.remove(loading)
    return graph
