"""The microbenchmark sweep that operator performance models are fitted from.

Each operator family (``sim/perfmodels/families.py``) is timed at many shapes on the device at
hand, the way our traces run it: one torch intra-op thread (``examples/profiled_training.py``), fresh
outputs allocated by every call, the caches emptied before every call but for the operator's
own code (:class:`_ColdCaches`), the fastest of a few repeats after one untimed warm-up call.

On a CPU a call is timed by the calling thread's CPU time, not the wall clock: with one
intra-op thread the operator runs on that thread, so its CPU time is what the call costs when
nothing else competes for the core. The sweep runs on the CPU only: no GPU was at hand to check
a GPU sweep against.

This machine's two cores are shared with other virtual machines, and a core's speed drifts over
tens of milliseconds: a 512 x 512 GEMM's fastest of five calls took 2.7 to 4.4 ms from one
second to the next. So the sweep draws its shapes once and times them all in several passes,
a shape's time being its fastest over the passes, which lie tens of seconds apart. Timed cold,
an operator reads its inputs from memory, whose speed on a shared host also depends on the
neighbours: two sweeps of three passes (five calls a pass) timed the same shapes 5 to 21 %
apart (geometric mean by family), and models fitted on the fastest of both sweeps' six passes
were closer on held-out shapes than models fitted on either sweep in seven families of eight,
by up to 5.6 points (attention: 4.9 against 4.8 and 5.4 %). Calls back to back share the
core's state of the moment and passes do not, so the default sweep times ten passes of three
calls: against the fastest of the first five passes of the same sweep, ten lowered every
family's held-out error, by 0.4 to 2.3 points (``bench/perfmodel_accuracy.py --first-passes``).

While it sweeps, glibc is told to keep the memory it frees (no ``mmap`` for large blocks, no
trimming), so an output lands in pages that are already mapped. Left to its defaults, glibc
returns a large freed tensor's pages to the kernel and the next call page-faults them in again,
at a cost that varied twofold between two timings of the same call (a [1552, 19] x [19, 1956]
GEMM: 4.4 and 7.8 ms) and that depends on what the heap held before, not on the operator. The
models therefore describe an operator's compute; how a training step's allocator behaves is
the trace's to tell (``sim/passes/batch_size.py`` rescales each traced call by a ratio of rooflines,
which keeps that call's own allocator cost), and a run that should match them is run with
``capture.STEADY_ALLOCATOR``. (The sweep used to trim glibc's free memory before every call so
that outputs page-faulted as in a step; two such sweeps differed by 14 to 61 % by family.)

Shapes are drawn by :mod:`~whatif.sim.perfmodels.sweep_cases`, log-uniformly from ranges that
cover the example models from batch 4 to 256, and any draw whose estimated time exceeds the
budget of a call is dropped, so the default sweep takes about half an hour on two cores (1996 s
here) and ``quick`` under a minute (38 s; 3 minutes on a machine whose cache is hundreds of
megabytes, see :class:`_ColdCaches`). The device's peak compute (a large single-precision
GEMM) and memory bandwidth (a large copy into a preallocated buffer, read plus write) are
measured alongside: the rooflines are drawn against them.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from .device import current_device
from .sweep_cases import SWEEP_OPS, draw_case
from .work import work


@dataclass(frozen=True)
class SweepSize:
    shapes_per_op: int
    repeats: int  # calls timed back to back, in each pass
    passes: int  # times every shape is timed, a whole pass apart
    budget_ms: float  # the longest a single call may be estimated to take
    # how many times ``shapes_per_op`` each family draws: the trees learn what the rooflines
    # miss from these, and a family with few operators or irregular kernels needs more of them
    more: tuple = (("gemm", 9), ("conv", 10), ("elementwise", 2), ("norm", 4), ("reduction", 5),
                   ("pooling", 5), ("embedding", 4), ("attention", 3))


DEFAULT = SweepSize(shapes_per_op=40, repeats=3, passes=10, budget_ms=25.0)
# The quick sweep's budget reaches the bundled convnet's convolutions at twice its batch: at 4 ms
# its convolution models extrapolated, and predicted those calls 1.7 to 3.1 times as long at
# batch 64 as at 32 (four quick fits); at 12 ms, 1.7 to 2.3 times (three).
# Norms and reductions get three times as many: each of their kernel paths needs shapes of its own.
QUICK = SweepSize(shapes_per_op=10, repeats=3, passes=2, budget_ms=12.0,
                  more=(("gemm", 3), ("conv", 5), ("norm", 3), ("reduction", 3)))
_EST_FLOPS_PER_S = 60e9  # rough single-core rates, only to keep draws within the budget
_EST_BYTES_PER_S = 6e9


def _estimated_ms(op: str, dims, types) -> float:
    flops, bytes_, _ = work(op, dims, types)
    return 1e3 * (flops / _EST_FLOPS_PER_S + bytes_ / _EST_BYTES_PER_S)


class _HeldMemory:
    """While open, glibc keeps the memory the process frees (large blocks from the heap rather
    than ``mmap``, no trimming), so a fresh output reuses pages already mapped. On leaving, the
    two settings get glibc's default values again; glibc cannot say what they were before, so a
    ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_MAX_`` from the environment is not restored, and
    the mmap threshold stays where it is instead of adapting. Does nothing where the C library
    is not glibc."""

    _M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
    _DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}

    def __init__(self):
        try:
            self.mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        except (OSError, AttributeError):
            self.mallopt = None

    def __enter__(self):
        if self.mallopt:
            self.mallopt(self._M_TRIM_THRESHOLD, 2**31 - 1)
            self.mallopt(self._M_MMAP_MAX, 0)
        return self

    def __exit__(self, *exc):
        if self.mallopt:
            for option, value in self._DEFAULTS.items():
                self.mallopt(option, value)


class _ColdCaches:
    """Evicts the CPU's caches, by writing a buffer twice the size of the largest of them, then
    calls ``then``: the operator to be timed, on other tensors of the same shape.

    A training step's working set (every layer's activations, the weights, their gradients)
    is far larger than the last-level cache, so an operator finds its inputs in memory, not in
    the cache. Timed back to back on the same tensors, it finds them in the cache up to the
    cache's size and not beyond: a [32, 32, 32, 32] ``threshold_backward`` took 171 us hot and
    548 us cold, twice that shape 638 and 1004 us. The hot ratio (3.7) is a cliff no training
    step has; the cold one (1.8) is what its profiled steps showed between those batch sizes.

    Its code, though, a step keeps hot: the same operators run again and again. Writing the
    buffer evicts the code too, and PyTorch's dispatch path fetched from memory made operators
    under 30 us a median 7 to 8 times slower than hot (120 shapes, two draws), against 2.1 to
    2.8 times when the operator has just run on other tensors.

    The buffer is at most :data:`EVICT_MAX_BYTES`: a server's last-level cache can be hundreds
    of megabytes (Linux reports 480 MiB on a 2-core Xeon VM whose host socket shares it), and
    writing twice that before every call, at the 3 GB/s one core wrote there, made the quick
    sweep take 587 s instead of under a minute."""

    def __init__(self, torch):
        self.buffer = torch.empty(eviction_bytes() // 4)

    def __call__(self, then: Callable[[], object]):
        self.buffer.fill_(1.0)
        then()


#: The largest buffer written to evict the caches. On the Xeon VM above (480 MiB of L3), models
#: fitted on quick sweeps that wrote 256 MiB and 960 MiB predicted the three example models'
#: traced operator calls alike (their summed time 0.909, 0.985 and 0.758 of the traces' against
#: 0.914, 0.977 and 0.780), in 182 s instead of 587; at 64 MiB the inputs stayed in the cache and
#: the models came out 20 to 27 % fast (0.799, 0.798, 0.573), GEMMs a median 22 % fast.
EVICT_MAX_BYTES = 256 * 2**20


def eviction_bytes() -> int:
    """How much :class:`_ColdCaches` writes: twice the largest cache, at most :data:`EVICT_MAX_BYTES`."""
    return min(2 * _largest_cache_bytes(), EVICT_MAX_BYTES)


def _largest_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache Linux reports (``/sys/devices/system/cpu/cpu0/cache``), else 32 MiB."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]])
    return max(sizes, default=default)


def fastest_call_us(call, repeats: int, before=None) -> float:
    """The fastest of ``repeats`` calls after an untimed one, in thread CPU time; ``before`` (not
    timed) runs ahead of each call."""
    call()
    times = []
    for _ in range(repeats):
        if before:
            before()
        start = time.thread_time_ns()
        call()
        times.append((time.thread_time_ns() - start) / 1e3)
    return min(times)


def measure_device(torch, quick: bool = False) -> dict:
    """Peak single-precision compute (GFLOP/s, a square GEMM) and memory bandwidth (GB/s, a copy
    between preallocated buffers counted as read plus write), best of a few runs: the roof."""
    n = 512 if quick else 1024
    a, b, out = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
    gemm_us = min(fastest_call_us(lambda: torch.mm(a, b, out=out), 3) for _ in range(2))
    elements = (8 if quick else 32) * 2**20
    src, dst = torch.rand(elements), torch.empty(elements)
    copy_us = min(fastest_call_us(lambda: dst.copy_(src), 3) for _ in range(2))
    return {
        "peak_gflops": round(2.0 * n**3 / gemm_us / 1e3, 2),
        "bandwidth_gbps": round(2.0 * 4 * elements / copy_us / 1e3, 2),
    }


def run_sweep(quick: bool = False, threads: int = 1, seed: int = 0,
              progress: Optional[Callable[[str], None]] = None,
              passes: Optional[int] = None) -> tuple[pd.DataFrame, dict]:
    """Time every operator of :data:`SWEEP_OPS` at many shapes; the samples (op, dims, types,
    duration_us, source, and pass_us: the shape's fastest call in each pass, whose minimum is
    duration_us) and the device (type, name, torch, threads, peak_gflops, bandwidth_gbps).
    ``passes`` overrides the sweep size's number of passes."""
    import torch

    size = QUICK if quick else DEFAULT
    if passes is not None:
        size = replace(size, passes=passes)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), _HeldMemory():
            described = {**current_device(), "torch": torch.__version__, "threads": threads,
                         **measure_device(torch, quick)}
            cold = _ColdCaches(torch)
            timed = [_sweep_pass(torch, size, seed, cold, progress if p == 0 else None) for p in range(size.passes)]
    finally:
        torch.set_num_threads(previous_threads)
    source = "sweep quick" if quick else "sweep"
    frame = pd.DataFrame(timed[0], columns=["op", "dims", "types", "args", "duration_us"]).assign(source=source)
    per_pass = np.array([[row["duration_us"] for row in rows] for rows in timed]).T
    frame["duration_us"] = per_pass.min(axis=1)
    frame["pass_us"] = per_pass.tolist()
    return frame, described


def _sweep_pass(torch, size: SweepSize, seed: int, cold: _ColdCaches, progress) -> list[dict]:
    """One timing of every shape; the shapes are drawn from ``seed``, so every pass draws the same."""
    rng = np.random.default_rng(seed)
    rows = []
    for family, ops in SWEEP_OPS.items():
        started = time.perf_counter()
        wanted = size.shapes_per_op * dict(size.more).get(family, 1)
        for op in ops:
            rows += _sweep_op(torch, op, rng, size, wanted, cold)
        if progress:
            progress(f"{family}: {sum(r['op'] in ops for r in rows)} shapes in {time.perf_counter() - started:.1f} s (a pass)")
    return rows


def _sweep_op(torch, op: str, rng, size: SweepSize, wanted: int, cold: _ColdCaches) -> list[dict]:
    rows, tries = [], 0
    while len(rows) < wanted and tries < 20 * wanted:
        tries += 1
        drawn_from = copy.deepcopy(rng)
        case = draw_case(torch, op, rng)
        if case is None:
            break
        if _estimated_ms(case.op, case.dims, case.types) > size.budget_ms:
            continue
        twin = draw_case(torch, op, drawn_from)  # the same shape, other tensors
        rows.append({"op": case.op, "dims": case.dims, "types": case.types, "args": case.args,
                     "duration_us": fastest_call_us(case.call, size.repeats, before=lambda: cold(then=twin.call))})
    return rows
