"""What a backward costs more when it adds its gradients into ones already written.

The traced iteration's backward writes each gradient once. PyTorch's ``AccumulateGrad`` does it
in one of two ways, and the trace shows which:

* after ``zero_grad(set_to_none=True)`` (PyTorch's default since 2.0) it keeps the incoming
  tensor, which costs next to nothing: no operator runs inside it;
* after ``zero_grad(set_to_none=False)`` (the default before) it adds the incoming tensor into
  the zeroed gradient: an in-place ``aten::add_`` inside it (on a GPU, one kernel).

A pipeline's later backwards of a chunk add into the gradients its first backward wrote. Where
the traced ``AccumulateGrad`` already adds, its copies hold that add and nothing is added. Where
it keeps the tensor, each later copy costs one in-place add over the gradient's bytes (the
operator's recorded input shape):

* **a CPU trace**: those bytes at the rate its optimizer updates parameters in place
  (``frameworks/copies.py``'s ``pass_rate_bytes_per_us``: the same reads and write per byte),
  on the ``AccumulateGrad``;
* **a GPU trace**: a kernel that reads the gradient and the incoming tensor and writes the sum,
  three times the bytes, at the rate the trace's own element-wise kernels move memory: every
  ``aten::add``, ``sub``, ``mul`` or ``div`` (in place or not) with its tensors' shapes recorded
  that launched one kernel moving at least 8 MB (bytes read and written over the kernel's traced
  time; a small kernel's time is mostly its start). The stream runs the add just before the
  next kernel the same thread launches in the same stage, so that kernel takes the add's time;
  the thread pays the operator's dispatch and launch, the median CPU time of those same
  operators, on the ``AccumulateGrad``. On the VGG13 H100 trace (its forward's bias adds) the
  rate is 2.36 TB/s, 70 % of the H100's 3.35 TB/s; on the ResNet-50 V100 trace (its
  ``AccumulateGrad`` 's own adds) 0.82 TB/s, 91 % of the V100's 900 GB/s. A trace without such a
  kernel, or whose ``AccumulateGrad`` shapes were not recorded, gets nothing, and says so.

Under tensor parallelism a rank holds a shard of each unit's parameters (``memory.py``'s count:
1/t of a unit's, the few replicated norm weights counted split too, a stated approximation), so
it adds 1/t of a unit's gradient bytes; a gradient outside the units (embeddings, a head) is
replicated, and all of it is added.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from whatif.collectors.kineto import element_bytes

from ..frameworks.copies import pass_rate_bytes_per_us
from ..gradients import ACCUMULATE_GRAD
from ..graph import TaskGraph, TaskKind, names_matching
from ..workload import first_inputs_bytes, kept_per_texts

#: element-wise binary operators whose kernels give a GPU trace's memory rate
ELEMENTWISE = re.compile(r"^aten::(add|sub|mul|div)_?$")
#: what an ``AccumulateGrad`` that adds into a zeroed gradient runs inside it
ADDS = re.compile(r"^aten::add_?$")
#: bytes a kernel must move to count towards the rate
MIN_RATE_BYTES = 8e6


@dataclass
class Accumulation:
    """Per task of the graph, the time a later backward adds (``extra_us``, None: nothing), and
    how it was priced, in words."""

    extra_us: Optional[np.ndarray]
    rule: str


def accumulation(graph: TaskGraph, among: np.ndarray, stage: Optional[np.ndarray] = None,
                 shards: Optional[np.ndarray] = None) -> Accumulation:
    """What adding a microbatch's gradients costs, per task of ``graph`` (see the module doc):
    the ``AccumulateGrad`` operators among ``among`` (a mask: the traced backward) and, on a GPU
    trace, the kernels that take the adds; ``stage``: each task's pipeline stage (-1: none), so
    that an add lands on a kernel of its own stage; ``shards``: per task, over how many ranks of the
    tensor group its gradient is split (a rank adds only its shard's bytes; None: none is)."""
    priced = _priced(graph, among)
    if isinstance(priced, str):
        return Accumulation(None, priced)
    firsts, nbytes, rate, rule = priced
    split = shards[firsts] if shards is not None else np.ones(len(firsts))
    nbytes = nbytes / split
    extra = np.zeros(len(graph.tasks))
    if not graph.workload.has_gpu:
        extra[firsts] = nbytes / rate
    else:
        bytes_per_us, cpu_us = rate
        kernels = _next_kernels(graph, firsts, among, stage)
        placed = kernels >= 0
        np.add.at(extra, kernels[placed], 3.0 * nbytes[placed] / bytes_per_us)
        extra[firsts[placed]] += cpu_us
        if not placed.all():
            rule += (f" ({int((~placed).sum())} of {len(placed)} AccumulateGrad left without: their thread launches "
                     "no kernel in their stage's backward)")
    if (split > 1).any():
        rule += (f"; {int((split > 1).sum())} of {len(split)} gradients split over the tensor group, each rank adding "
                 "its shard")
    return Accumulation(extra, rule)


def accumulation_rule(graph: TaskGraph) -> str:
    """How :func:`accumulation` prices the adds of ``graph``'s backward, in words (or why it adds
    nothing), without placing them: what a report says of the rule."""
    priced = _priced(graph, np.ones(len(graph.tasks), dtype=bool))
    return priced if isinstance(priced, str) else priced[3]


def _priced(graph: TaskGraph, among: np.ndarray):
    """The ``AccumulateGrad`` tasks among ``among`` that keep the incoming tensor (one per
    operator), their gradients' bytes, the rate that prices them (a CPU trace's in-place update
    rate; a GPU trace's element-wise rate and CPU time) and the rule in words; or, where nothing
    is added, why (a text)."""
    tasks = graph.tasks
    events = tasks["event"].to_numpy()
    chosen = np.flatnonzero(among & (tasks["name"] == ACCUMULATE_GRAD).to_numpy() & (events >= 0))
    if not len(chosen):
        return "no AccumulateGrad in the backward: nothing added"
    firsts = chosen[np.unique(events[chosen], return_index=True)[1]]  # an operator cut into several tasks: once
    adds = already_adds(graph, events[firsts])
    if adds.all():
        return "the trace's AccumulateGrad already adds (zero_grad without set_to_none): nothing added"
    firsts = firsts[~adds]
    nbytes = np.array([b or 0.0 for b in first_inputs_bytes(graph.ops, events[firsts].tolist())], dtype=float)
    if not (nbytes > 0).any():
        return "the AccumulateGrad operators' shapes were not recorded (record_shapes): nothing added"
    if not graph.workload.has_gpu:
        rate = pass_rate_bytes_per_us(graph)
        if not rate:
            return "no in-place update in the trace to price the adds by: nothing added"
        return firsts, nbytes, rate, f"each by an in-place add at the optimizer's {rate / 1e3:.3g} GB/s"
    rate = elementwise_rate(graph)
    if rate is None:
        return "no element-wise kernel of known size in the trace to price the adds by: nothing added"
    bytes_per_us, cpu_us = rate
    return firsts, nbytes, rate, (f"each by an add kernel at the trace's element-wise {bytes_per_us / 1e6:.3g} TB/s "
                                  f"and {cpu_us:.3g} us of CPU")


def already_adds(graph: TaskGraph, events: np.ndarray) -> np.ndarray:
    """Whether each ``AccumulateGrad`` operator (``events``: rows of ``graph.ops``) runs an
    ``aten::add_`` (or, building a graph of the backward, ``aten::add``) inside it on its thread:
    it adds into a gradient that was zeroed. A copy inside it (a gradient whose layout it
    changes) is a first write, not an add."""
    return np.isin(events, _of_trace(graph, "adding", lambda: _adding_accumulations(graph.ops)))


def _adding_accumulations(ops) -> np.ndarray:
    """The ``AccumulateGrad`` operators of the operator table ``ops`` that add (their rows)."""
    names = ops["name"]
    accumulations = np.flatnonzero(names_matching(names, re.compile(re.escape(ACCUMULATE_GRAD) + "$").match))
    update = np.flatnonzero(names_matching(names, ADDS.match))
    if not len(update) or not len(accumulations):
        return np.zeros(0, dtype=ops.index.dtype)
    threads = ops["thread"].cat.codes.to_numpy() if hasattr(ops["thread"], "cat") else \
        np.unique(ops["thread"].astype(str).to_numpy(), return_inverse=True)[1]
    start = ops["start_us"].to_numpy(dtype=float)
    end = start + ops["dur_us"].to_numpy(dtype=float)
    adding = np.zeros(len(accumulations), dtype=bool)
    for thread in np.unique(threads[update]):
        starts = np.sort(start[update[threads[update] == thread]])
        mine = threads[accumulations] == thread
        at = np.searchsorted(starts, start[accumulations[mine]], side="left")
        inside = at < len(starts)
        inside[inside] = starts[at[inside]] <= end[accumulations[mine]][inside]
        adding[mine] = inside
    return ops.index.to_numpy()[accumulations[adding]]


def elementwise_rate(graph: TaskGraph) -> Optional[tuple[float, float]]:
    """Bytes per microsecond the GPU trace's element-wise binary kernels move (their traced
    times), and the median CPU time of their operators (see the module doc); None where the
    trace has none to count. A fact of the trace: found once for every graph made from it."""
    return _of_trace(graph, "elementwise", lambda: _elementwise_rate(graph))


def _elementwise_rate(graph: TaskGraph) -> Optional[tuple[float, float]]:
    ops = graph.ops
    rows = np.flatnonzero(names_matching(ops["name"], ELEMENTWISE.match))
    if not len(rows):
        return None
    tasks = graph.tasks
    src, dst = graph.launch_pairs()
    measured = tasks["measured_start_us"].to_numpy(dtype=float)
    duration = (tasks["measured_end_us"] - tasks["measured_start_us"]).to_numpy(dtype=float)
    resource = tasks["resource"].astype(str).to_numpy()
    threads = ops["thread"].astype(str).to_numpy()
    starts, durs = ops["start_us"].to_numpy(dtype=float), ops["dur_us"].to_numpy(dtype=float)
    kernel = np.full(len(rows), -1, dtype=np.int64)  # each operator's one launched kernel
    for thread in np.unique(threads[rows]):
        on = resource[src] == thread
        order = np.argsort(measured[src[on]], kind="stable")
        at, launched = measured[src[on]][order], dst[on][order]
        mine = np.flatnonzero(threads[rows] == thread)
        first = np.searchsorted(at, starts[rows[mine]], "left")
        last = np.searchsorted(at, starts[rows[mine]] + durs[rows[mine]], "right")
        one = last - first == 1
        kernel[mine[one]] = launched[first[one]]
    names, dims, types = ops["name"].to_numpy(), ops["input_dims"].to_numpy(), ops["input_types"].to_numpy()
    moved = spent = 0.0
    cpu = []
    for k in np.flatnonzero(kernel >= 0).tolist():
        row = rows[k]
        traffic = _bytes_moved(dims[row], types[row], str(names[row]).endswith("_"))
        if traffic is None or traffic < MIN_RATE_BYTES or not duration[kernel[k]] > 0:
            continue
        moved += traffic
        spent += duration[kernel[k]]
        cpu.append(durs[row])
    if not spent:
        return None
    return moved / spent, float(np.median(cpu))


@kept_per_texts
def _bytes_moved(dims_text, types_text, in_place: bool) -> Optional[float]:
    """Bytes an element-wise binary operator reads and writes, from its recorded inputs: its
    tensor operands read, and its output (the first operand in place, else the broadcast of the
    two) written; None where the shapes were not recorded."""
    try:
        dims, types = json.loads(dims_text or "null"), json.loads(types_text or "null")
    except (json.JSONDecodeError, TypeError):
        return None
    if not isinstance(dims, list) or len(dims) < 2 or not isinstance(types, list) or len(types) < 2:
        return None
    a, b = dims[0], dims[1]
    if not isinstance(a, list) or not a or not all(isinstance(x, int) for x in a):
        return None
    size = element_bytes(types[0])
    first = float(np.prod(a)) * size
    if not isinstance(b, list) or not b or not all(isinstance(x, int) for x in b):  # a scalar
        return 2.0 * first
    second = float(np.prod(b)) * element_bytes(types[1])
    out = first if in_place else float(max(np.prod(a), np.prod(b))) * size
    return first + second + out


def _next_kernels(graph: TaskGraph, firsts: np.ndarray, among: np.ndarray, stage: Optional[np.ndarray]) -> np.ndarray:
    """For each ``AccumulateGrad`` task, the kernel its thread launches next among ``among`` in
    its stage (the last one before it where none follows); -1 where its thread launches none."""
    tasks = graph.tasks
    kinds = tasks["kind"].to_numpy()
    src, dst = graph.launch_pairs()
    keep = among[src] & (kinds[dst] == int(TaskKind.KERNEL))
    src, dst = src[keep], dst[keep]
    stage = stage if stage is not None else np.zeros(len(tasks), dtype=np.int64)
    codes = tasks["resource"].cat.codes.to_numpy()
    key = tasks["order_key"].to_numpy(dtype=float)
    out = np.full(len(firsts), -1, dtype=np.int64)
    groups = {}
    for i, t in enumerate(firsts.tolist()):
        group = (int(codes[t]), int(stage[t]))
        if group not in groups:
            mine = np.flatnonzero((codes[src] == group[0]) & (stage[src] == group[1]))
            mine = mine[np.argsort(key[src[mine]], kind="stable")]
            groups[group] = (dst[mine], key[src[mine]])
        kernels, keys = groups[group]
        if not len(kernels):
            continue
        at = np.searchsorted(keys, key[t], side="right")
        out[i] = kernels[min(at, len(kernels) - 1)]
    return out


#: facts of a trace found once for all graphs made from it, by its operator table (which every
#: graph made from a trace shares): (the table, {what: value}), the last few traces
_FACTS: "OrderedDict[int, tuple]" = OrderedDict()
_FACTS_KEPT = 4


def _of_trace(graph: TaskGraph, what: str, find):
    """``find()``, kept for ``graph``'s trace (its operator table) under ``what``."""
    key = id(graph.ops)
    kept = _FACTS.get(key)
    if kept is None or kept[0] is not graph.ops:
        kept = _FACTS[key] = (graph.ops, {})
        while len(_FACTS) > _FACTS_KEPT:
            _FACTS.popitem(last=False)
    _FACTS.move_to_end(key)
    if what not in kept[1]:
        kept[1][what] = find()
    return kept[1][what]
