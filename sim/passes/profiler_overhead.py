"""Taking the profiler's own cost out of a profiled trace.

A profiled step is slower than the same step run plainly: the profiler records every operator
(its enter and exit callbacks, the input shapes) and the capture's module hooks run Python for
every layer. The jobs we predict run without either, so a prediction made from the trace as it
is inherits their cost: on our CPU examples a tenth of the step for the small convnet, whose
operators are short, and a few percent for the larger models.

A capture bundle also times warm-up steps run with neither profiler nor hooks (XSP's least
intrusive level; ``collectors/capture.py``). The profiled iterations' steady-state median minus
theirs is the overhead to remove. The profiler pays it per recorded event, at the boundaries of operators, and
the CPU tasks of the graph are exactly the stretches between consecutive boundaries on a thread.
So every CPU task of an iteration gives up the same amount of time (all of it, if it is
shorter), the amount chosen so that the iteration's tasks give up the measured overhead in
total: a long convolution loses a few microseconds, not a share of its length. Where the GPU,
not the CPU, bounds the step, the measured overhead is small and so is what is removed; the
overhead the GPU hid stays in the trace (a conservative correction).

The profiled steps can also be the faster ones. On CPU, a large tensor's pages come back from
the kernel (and page-fault on first touch) or not depending on what the heap holds at the end
of a step, and the profiler's own buffers change that: the VGG example's profiled steps ran 3 to
5 % faster than its plain warm-up steps in every capture, and its plain runs took what the
warm-up steps took, not what the trace shows; leveled profiling saw DLRM-large take 100 ms a
step plainly and 55 ms after a profiler had run. Then the plain job is the slower one, and the
time it pays is spread over its operators (where the faults land) rather than paid per event:
every CPU task of the iteration is stretched by the same factor, so that the iteration grows
by the measured difference.

The same faults can land in the profiled steps instead, and then the difference is not the
profiler's alone. The profiler costs a CPU task a few microseconds (:data:`PROFILER_COST_CAP_US`);
the wide MLP's trace in one round of the batch-size validation was 15.3 ms a step slower than
its plain steps, which per event would have been 283 us taken from each of its 1557 CPU tasks,
most of them whole, while its weight-gradient GEMMs, which had page-faulted their 16 MB outputs
(9 ms instead of 4 ms, in some steps), kept their extra time. So each task gives up at most
that cap per event, and what is left of the difference shrinks every CPU task by the same
factor, as where the plain job is the slower one: then the time that scales with the batch
loses its share and the operators that scale keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from whatif.report.iterations import steady_median

from ..graph import CPU_WORK_KINDS, TaskGraph

_TOLERANCE_US = 1e-6
#: The most the profiler is taken to cost one CPU task. The water level of the overhead came to
#: 4.7 and 14.3 us on MLPs of tiny operators captured here (8 x Linear(32) and 16 x Linear(256)
#: at batch 8, 861 and 1677 tasks a step: the profiler's worst case, nearly all of the step its
#: callbacks), and to 0.2 to 20 us on the example models' captures of the batch-size validation.
PROFILER_COST_CAP_US = 30.0


@dataclass(frozen=True)
class ProfilerOverhead:
    """What the correction found and took out, per iteration."""

    profiled_ms: float  # steady-state median profiled iteration, as the trace measured it
    unprofiled_ms: float  # steady-state median unprofiled warm-up step
    removed_ms: float  # taken out of every iteration; negative: added, the profiled steps were the faster
    per_task_us: float  # the largest amount one CPU task gave up (median over iterations)
    stretch: float = 1.0  # the factor CPU tasks were stretched by: over 1 where time was added, under 1 past the cap

    def describe(self) -> str:
        measured = f"profiled median {self.profiled_ms:.2f} ms, unprofiled {self.unprofiled_ms:.2f} ms"
        if self.removed_ms < 0:
            return (
                f"profiled steps ran faster than plain ones: {-self.removed_ms:.2f} ms per iteration added "
                f"({measured}; CPU tasks stretched by {100 * (self.stretch - 1):.1f} %)"
            )
        shrunk = f", then every CPU task shrunk by {100 * (1 - self.stretch):.1f} %" if self.stretch < 1 else ""
        return (
            f"profiler overhead removed: {self.removed_ms:.2f} ms per iteration ({measured}; "
            f"up to {self.per_task_us:.1f} us per CPU task{shrunk})"
        )


def remove_profiler_overhead(graph: TaskGraph, iterations: pd.DataFrame, unprofiled_ms: Sequence[float]) -> TaskGraph:
    """``graph`` with the CPU tasks of every iteration shortened by the measured overhead: per
    event up to :data:`PROFILER_COST_CAP_US`, the rest by one factor; where the profiled steps
    were the faster ones, that factor stretches them instead. What was taken out is the new
    graph's last note, a :class:`ProfilerOverhead`."""
    # both summarised as predictions and runs are (steady_median), so that the 1x1 prediction is
    # the plain step a run is held to
    profiled_ms = steady_median((iterations["end_us"] - iterations["start_us"]) / 1e3)
    plain_ms = steady_median(pd.Series(unprofiled_ms, dtype=float))
    overhead_us = (profiled_ms - plain_ms) * 1e3
    graph = graph.copy()
    if overhead_us == 0.0:
        graph.notes.append(ProfilerOverhead(profiled_ms, plain_ms, 0.0, 0.0))
        return graph
    duration = graph.tasks["duration_us"].to_numpy(dtype=float).copy()
    levels, factors = [], []
    for ids in _iteration_cpu_work(graph, iterations):  # iterations hold disjoint tasks
        # the profiler's part per event (none where the plain steps were the slower), the rest by one factor
        level = min(water_level(duration[ids], overhead_us), PROFILER_COST_CAP_US) if overhead_us > 0 else 0.0
        given = np.minimum(duration[ids], level)
        duration[ids] -= given
        left, held = overhead_us - given.sum(), duration[ids].sum()
        if held > 0:
            factors.append(max(0.0, 1.0 - left / held) if abs(left) > _TOLERANCE_US else 1.0)
            duration[ids] *= factors[-1]
        levels.append(level)
    graph.tasks["duration_us"] = duration
    corrected = ProfilerOverhead(profiled_ms, plain_ms, overhead_us / 1e3, float(np.median(levels)) if levels else 0.0,
                                 float(np.median(factors)) if factors else 1.0)
    graph.notes.append(corrected)
    return graph


def _iteration_cpu_work(graph: TaskGraph, iterations: pd.DataFrame):
    tasks = graph.tasks
    m_start = tasks["measured_start_us"].to_numpy()
    m_end = tasks["measured_end_us"].to_numpy()
    cpu_work = np.isin(tasks["kind"].to_numpy(), CPU_WORK_KINDS)
    for it in iterations.itertuples(index=False):
        ids = np.flatnonzero(cpu_work & (m_start >= it.start_us - _TOLERANCE_US) & (m_end <= it.end_us + _TOLERANCE_US))
        if len(ids):
            yield ids


def water_level(durations_us: np.ndarray, total_us: float) -> float:
    """The level ``d`` at which ``sum(min(duration, d)) == total_us``: every task gives up ``d``,
    or all it has. When the tasks hold less than ``total_us`` in all, every task gives up all."""
    x = np.sort(np.asarray(durations_us, dtype=float))
    n = len(x)
    below = np.concatenate([[0.0], np.cumsum(x)[:-1]])  # time held by the tasks shorter than x[k]
    at_level = below + x * (n - np.arange(n))  # what a level of x[k] would take
    k = int(np.searchsorted(at_level, total_us))
    if k == n:
        return float(x[-1]) if n else 0.0
    return float((total_us - below[k]) / (n - k))
