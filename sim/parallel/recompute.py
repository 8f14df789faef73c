"""Activation recomputation's time: a unit's forward run again in its backward.

``memory.py`` counts what recomputation saves; this pass charges what it costs, on the graph of
one rank, before the data-parallel and pipeline passes read the units' times:

* ``full`` (Megatron's full recomputation, PyTorch's ``checkpoint`` around each unit): in every
  iteration, each unit's forward runs again just before its backward. Its forward's CPU time
  (every CPU thread's: the host work and the launches) lengthens the first CPU task of the
  unit's backward, and its forward's GPU time on each stream the first GPU task of the unit's
  backward on that stream (on the backward's first GPU task where that stream runs none of it).
* ``selective`` (Korthikanti et al., MLSys 2023, section 5: the attention core): the unit's
  forward tasks of its attention scores, their softmax and dropout (the operators ``bmm``,
  ``baddbmm``, ``softmax``, ``dropout``, ``masked_fill`` and their variants, where the task or
  what it runs inside is one: a kernel by the operator that launched it) run again the same
  way. A unit that runs such operators outside its attention has them charged too. A unit
  whose attention is fused (``scaled_dot_product_attention``, flash attention) keeps no
  scores, and its fused kernel's backward already recomputes them (it is in the trace):
  nothing more is charged, as ``memory.py`` saves nothing more for it.

Departures: the recomputed forward is charged as lengthened tasks, not as tasks of its own, so
it cannot overlap anything its unit's backward could not; its duration is the traced forward's
(after the tensor and expert passes shrank it), and the launches run on the thread of the
backward, as PyTorch's checkpoint replays the forward there. A unit's forward in an iteration
with no backward task of that unit (a trace cut short) is charged nowhere.
"""

from __future__ import annotations

import re

import numpy as np

from ..graph import TaskGraph
from . import Parallelism
# the compute task kinds FSDP's plan reads, and its iterations (a forward task after another
# phase's starts one)
from .fsdp import _CPU_COMPUTE, _GPU_COMPUTE, _iterations
from .memory import _facts
from .units import PHASE_BACKWARD, PHASE_FORWARD, Units

#: The operators of an unfused attention core (scores, their softmax and dropout).
ATTENTION_CORE = re.compile(r"\b(aten::)?(bmm|baddbmm|_?softmax|_?log_softmax|native_dropout|dropout|masked_fill_?)\b")


def apply_recompute(graph: TaskGraph, units: Units, par: Parallelism) -> TaskGraph:
    """A copy of ``graph`` with each unit's recomputed forward charged to its backward, as the
    module says; ``graph`` itself where ``par.recompute`` is ``none`` or nothing is charged."""
    charged = recompute_us(graph, units, par)
    if not charged.any():
        return graph
    out = graph.copy()
    out.lengthen(charged)
    return out


def recompute_us(graph: TaskGraph, units: Units, par: Parallelism) -> np.ndarray:
    """Per task of ``graph``, the recomputed forward's time charged to it (microseconds)."""
    tasks = graph.tasks
    charged = np.zeros(len(tasks))
    if par.recompute == "none" or not len(units):
        return charged
    kind = tasks["kind"].to_numpy()
    resource = tasks["resource"].astype(str).to_numpy()
    duration = tasks["duration_us"].to_numpy(dtype=float)
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    phase, unit = units.task_phase, units.task_unit
    gpu = np.isin(kind, _GPU_COMPUTE)
    cpu = np.isin(kind, _CPU_COMPUTE) & np.char.startswith(resource.astype(str), "cpu ")
    again = (phase == PHASE_FORWARD) & (unit >= 0)
    if par.recompute == "selective":
        context = tasks["context"].astype(str).to_numpy()  # a kernel's is its launch's: aten::matmul > aten::bmm > ...
        names = tasks["name"].astype(str).to_numpy()
        fused = np.flatnonzero(_facts(graph, units).fused)  # the units memory.py counts as fused attention
        core = np.array([bool(ATTENTION_CORE.search(c) or ATTENTION_CORE.search(n)) for c, n in zip(context, names)])
        again &= core & ~np.isin(unit, fused)
    for among in (cpu, gpu):
        iteration = _iterations(phase, start, among & (phase > 0))
        run_again, run_backward = again & among, among & (phase == PHASE_BACKWARD)
        for u in np.unique(unit[run_again]):
            in_unit, back_in_unit = run_again & (unit == u), run_backward & (unit == u)
            for it in np.unique(iteration[in_unit]):
                forward = np.flatnonzero(in_unit & (iteration == it))
                backward = np.flatnonzero(back_in_unit & (iteration == it))
                if not len(backward):
                    continue
                backward = backward[np.argsort(start[backward], kind="stable")]
                if among is cpu:
                    charged[backward[0]] += duration[forward].sum()
                    continue
                for stream in np.unique(resource[forward]):
                    on_stream = backward[resource[backward] == stream]
                    target = on_stream[0] if len(on_stream) else backward[0]
                    charged[target] += duration[forward[resource[forward] == stream]].sum()
    return charged

