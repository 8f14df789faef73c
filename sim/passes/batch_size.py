"""What if the batch were B instead of B0: the traced iteration rebuilt at another batch size.

Following the DLRM performance model (``shared/seeds/002``), an iteration is operator compute
plus CPU overheads around it, and only the compute depends on shapes. So every operator whose
recorded input shapes carry the batch dimension keeps its measured time, scaled by
``model(new shapes) / model(old shapes)`` from the operator performance models
(``sim/perfmodels/``): the ratio carries the measured calibration of that very call (its
cache state, its allocator, the profiler's share) to the new shapes, which a model's absolute
prediction would not. Everything else, the Python and dispatch time between operators, the
autograd engine's bookkeeping, the optimizer's per-parameter work, is kept as measured.

The ratio is the roofline's, without the family's learned correction. That correction is what
the roofline misses at one shape, and the traced call has already measured it at the old shape;
what the ratio needs is how the time moves between two shapes, and a tree ensemble's correction
jumps from one leaf to the next where the roofline is smooth. The wide MLP's weight-gradient
GEMMs (``[2048, B] x [B, 2048]``) took 0.59 and 1.84 times their batch-64 time at 32 and 128
in one round's traces; the roofline's ratios are 0.61 and 1.78, with the correction 0.54 and
1.97, and with it the predicted steps were 3 to 4 % short at 32 and over at 128 in the
batch-size records. Against the traces at the other batch sizes, over five records
(``bench/batch_size_ratios.py``), roofline ratios were the closer for GEMMs (6.3 against 12.0 %
mean error per family and point), attention (5.7 against 7.1) and reductions (11.7 against
14.8), a point or two worse for element-wise work and norms, and on a par for convolutions and
pooling.

Which dimensions are the batch: the outermost operator of a modelled family on the stack (the
unit a model times, see ``operator_units``) is rescaled input by input. A tensor input whose
shape is a parameter's (from the bundle, else from the trace's ``AccumulateGrad`` shapes, either
orientation) is a weight and keeps its shape; any other tensor whose leading dimension is a
multiple of the old batch size has it scaled (activations ``[B, ...]``, flattened tokens
``[B * L, D]``, attention heads ``[B * H, L, d]``). A GEMM whose output is parameter-shaped is
a weight gradient, and there the batch is the inner dimension ``K``; a vector added by
``addmm`` is a bias. Inside a unit, helper
operators that carry the batch (a copy of the output) scale with it; views and helpers without
the batch (transposing a weight, zeroing an embedding's gradient table) keep their time. The
model's ratio is for the unit's whole time, helpers included, as a microbenchmark of the call
times it: so the unit takes ``ratio`` times its traced time in all, and what its fixed helpers
keep, the parts that scale make up. Scaling only those parts by the ratio counted the helpers'
fixed cost twice (once kept, once inside the model's ratio, which it pulls towards 1): with the
transformer's weight transposes (``aten::t`` inside ``linear``) kept, its prediction at twice
its batch came out 2.8 ms a step (1 %) short. A unit whose fixed helpers alone take longer than
the ratio allows keeps just them: the transformer's embedding backward is nearly all the zeroing
of its gradient table, which does not shrink with the batch, whatever the family's model says.

Data loading scales linearly with the batch: a map-style ``DataLoader`` fetches and collates
samples one by one in Python.

On a CPU-only trace an operator's CPU time is its compute. GPU traces are refused for now: there
the kernels would have to be rescaled with models measured on that GPU.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from ..gradients import ACCUMULATE_GRAD
from ..graph import GraphError, TaskGraph, TaskKind
from .optimizations import DATA_LOADING
from ..perfmodels.families import FAMILY_OF, VIEW_OPS
from ..perfmodels.models import PerfModels
from ..perfmodels.shapes import operator_units
from .shared_memory import MEMORY_BYTES
from ..workload import decode_inputs

_OUTSIDE_MODEL = re.compile(DATA_LOADING + r"|Optimizer\.|whatif\.capture")


@dataclass
class BatchSizeChange:
    """What :func:`change_batch_size` did, for the user to check."""

    from_batch: int
    to_batch: int
    batch_source: str  # where the old batch size came from
    scaled_units: int = 0  # operator calls rescaled by their family's model
    unmodelled: Counter = field(default_factory=Counter)  # batch-carrying operators kept as measured
    data_loading_tasks: int = 0

    def describe(self) -> str:
        text = (
            f"batch size {self.from_batch} ({self.batch_source}) -> {self.to_batch}: "
            f"{self.scaled_units} operator calls rescaled by their performance models, "
            f"{self.data_loading_tasks} data-loading tasks scaled by {self.to_batch / self.from_batch:g}"
        )
        if self.unmodelled:
            names = ", ".join(f"{op} x{n}" for op, n in self.unmodelled.most_common(4))
            text += f"; kept as measured (no model): {names}" + (" ..." if len(self.unmodelled) > 4 else "")
        return text


def parameter_shapes(graph: TaskGraph) -> set[tuple]:
    """Every parameter's shape, and each matrix's transpose (a GEMM sees ``weight.t()``)."""
    shapes: set[tuple] = set()
    parameters = graph.workload.parameters
    if len(parameters):
        shapes |= {tuple(int(v) for v in s) for s in parameters["shape"]}
    ops = graph.ops
    for text in ops.loc[(ops["name"] == ACCUMULATE_GRAD).to_numpy(), "input_dims"]:
        dims = decode_inputs(text)
        if dims and isinstance(dims[0], list) and dims[0]:
            shapes.add(tuple(int(v) for v in dims[0]))
    return shapes | {s[::-1] for s in shapes if len(s) == 2}


def _is_shape(d) -> bool:
    return isinstance(d, list) and bool(d) and all(isinstance(v, int) for v in d)


def rescale_dims(op: str, dims: list, old: int, new: int, parameters: set) -> list:
    """``dims`` with the batch dimension changed from ``old`` to ``new`` (see the module doc)."""
    def scaled(d, axis=0):
        if not _is_shape(d) or tuple(d) in parameters or d[axis] % old:
            return d
        return d[:axis] + [d[axis] // old * new] + d[axis + 1:]

    if op in ("aten::mm", "aten::addmm"):
        first = 1 if op == "aten::addmm" else 0
        a, b = (dims + [None, None, None])[first:first + 2]
        if _is_shape(a) and _is_shape(b) and len(a) == 2 and len(b) == 2 and (a[0], b[1]) in parameters:
            if a[1] % old == 0 and a[1] == b[0]:
                out = list(dims)
                out[first], out[first + 1] = [a[0], a[1] // old * new], [b[0] // old * new, b[1]]
                return out
            return dims
        if op == "aten::addmm" and _is_shape(dims[0]) and len(dims[0]) == 1:  # a bias broadcast over rows
            return dims[:1] + rescale_dims("aten::mm", dims[1:], old, new, parameters)
    out = []
    for d in dims:
        if isinstance(d, list) and d and all(_is_shape(x) for x in d):
            out.append([scaled(x) for x in d])
        else:
            out.append(scaled(d))
    return out


def infer_batch_size(graph: TaskGraph, parameters: set) -> tuple[int, str]:
    """The old batch size: the bundle's record of it, else the leading dimension of the first
    non-parameter tensor that the model's first operator takes (outside data loading)."""
    if graph.workload.batch_size:
        return graph.workload.batch_size, "the bundle's environment"
    ops = graph.ops
    units = operator_units(ops).sort_values("row")
    outside = ops[ops["name"].astype(str).str.contains(_OUTSIDE_MODEL).to_numpy()]
    spans = list(zip(outside["thread"], outside["start_us"], outside["start_us"] + outside["dur_us"]))
    for row, op, dims in zip(units["row"], units["op"], units["dims"]):
        if not op.startswith("aten::") or op in VIEW_OPS:
            continue
        ts, thread = ops.at[row, "start_us"], ops.at[row, "thread"]
        if any(t == thread and lo <= ts < hi for t, lo, hi in spans):
            continue
        for d in dims:
            if _is_shape(d) and d[0] > 0 and tuple(d) not in parameters:  # not a factory's empty out=
                return int(d[0]), f"the first input of the first layer, {op} {d}"
    raise GraphError(f"{graph.workload.source}: cannot tell the batch size it was traced at; give it (--from-batch-size)")


def change_batch_size(
    graph: TaskGraph,
    models: PerfModels,
    to_batch: int,
    from_batch: Optional[int] = None,
) -> TaskGraph:
    """``graph`` rescaled from its batch size to ``to_batch``; what was done is the new graph's
    last note, a :class:`BatchSizeChange`."""
    if graph.workload.has_gpu:
        raise GraphError(
            f"{graph.workload.source}: has GPU kernels; --batch-size rebuilds CPU-only traces for now "
            "(a GPU trace needs its kernels rescaled by models measured on that GPU)"
        )
    if to_batch < 1:
        raise GraphError(f"batch size must be a positive integer, got {to_batch}")
    parameters = parameter_shapes(graph)
    if from_batch is None:
        from_batch, source = infer_batch_size(graph, parameters)
    else:
        source = "given"
    if from_batch < 1:
        raise GraphError(f"the traced batch size must be a positive integer, got {from_batch}")
    change = BatchSizeChange(from_batch, to_batch, source)
    graph = graph.copy()
    graph.notes.append(change)
    if from_batch == to_batch:
        return graph

    loading = data_loading_tasks(graph)
    loading_events = set(graph.tasks["event"].to_numpy()[loading].tolist())

    units = operator_units(graph.ops)
    ops, dims = units["op"].to_numpy(), units["dims"].tolist()
    new_dims = [rescale_dims(op, d, from_batch, to_batch, parameters) if d else d for op, d in zip(ops, dims)]
    carries = np.array([n != d for n, d in zip(new_dims, dims)])
    is_unit = (units["unit"] == units["row"]).to_numpy() & carries
    is_unit &= ~units["row"].isin(loading_events).to_numpy()
    ratio = np.full(len(units), np.nan)
    picked = np.flatnonzero(is_unit)
    types, args = units["types"].tolist(), units["args"].tolist()
    picked_ops, picked_types, picked_args = [ops[i] for i in picked], [types[i] for i in picked], [args[i] for i in picked]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        before = models.predict_us(picked_ops, [dims[i] for i in picked], picked_types, picked_args, learned=False)
        after = models.predict_us(picked_ops, [new_dims[i] for i in picked], picked_types, picked_args, learned=False)
    ratio[picked] = after / before
    modelled = np.isfinite(ratio) & (ratio > 0)
    change.scaled_units = int(modelled.sum())
    for i in picked[~modelled[picked]]:
        change.unmodelled[str(ops[i])] += 1
    outside = (units["unit"] < 0).to_numpy() & carries & np.array([o.startswith("aten::") and o not in VIEW_OPS for o in ops])
    outside &= ~units["row"].isin(loading_events).to_numpy()
    for i in np.flatnonzero(outside):
        if ops[i] not in FAMILY_OF:
            change.unmodelled[str(ops[i])] += 1

    kinds = graph.tasks["kind"].to_numpy()
    events = graph.tasks["event"].to_numpy()
    cpu = np.isin(kinds, [int(TaskKind.CPU), int(TaskKind.GAP)])
    known = cpu & (events >= 0) & ~loading
    duration = graph.tasks["duration_us"].to_numpy(dtype=float)
    factors = np.ones(len(graph.tasks))
    in_units = _events_in_units(units, ratio, modelled, carries, ops)
    factors[known] = _task_factors(in_units, events[known], duration[known])
    factors[loading] = to_batch / from_batch
    change.data_loading_tasks = int(loading.sum())
    graph.tasks["duration_us"] = duration * factors
    if MEMORY_BYTES in graph.tasks:  # an operator's bytes scale with its time
        graph.tasks[MEMORY_BYTES] = graph.tasks[MEMORY_BYTES].to_numpy() * factors
    return graph


def data_loading_tasks(graph: TaskGraph) -> np.ndarray:
    """Which tasks load data: they scale with the batch as a whole, not by an operator model."""
    loading = np.zeros(len(graph.tasks), dtype=bool)
    loading[graph.select(pattern=DATA_LOADING)] = True
    return loading


def _task_factors(in_units: pd.DataFrame, events: np.ndarray, duration_us: np.ndarray) -> np.ndarray:
    """Each task's factor (tasks named by their owning event): where its event scales, the
    factor that brings its unit's tasks, together, to the unit's ratio times their time while
    the ones that do not scale keep theirs; 1 elsewhere."""
    mine = in_units.reindex(events)
    inside = mine["unit"].notna().to_numpy()
    scales = mine["scales"].fillna(False).to_numpy(dtype=bool)
    tasks = pd.DataFrame({"unit": mine["unit"].to_numpy()[inside], "ratio": mine["ratio"].to_numpy()[inside],
                          "scaling": np.where(scales[inside], duration_us[inside], 0.0),
                          "fixed": np.where(scales[inside], 0.0, duration_us[inside])})
    per_unit = tasks.groupby("unit").agg(ratio=("ratio", "first"), scaling=("scaling", "sum"), fixed=("fixed", "sum"))
    target = per_unit["ratio"] * (per_unit["scaling"] + per_unit["fixed"])
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(per_unit["scaling"] > 0, (target - per_unit["fixed"]) / per_unit["scaling"], 1.0)
    factor_of_unit = pd.Series(np.maximum(factor, 0.0), index=per_unit.index)
    factors = np.ones(len(events))
    factors[inside & scales] = factor_of_unit.reindex(mine["unit"].to_numpy()[inside & scales]).to_numpy()
    return factors


def _events_in_units(units: pd.DataFrame, ratio: np.ndarray, modelled: np.ndarray, carries: np.ndarray, ops) -> pd.DataFrame:
    """Per event inside a modelled unit (index: its row): the unit's row and ratio, and whether
    the event's time scales (the unit itself, or a batch-carrying non-view helper whose callers
    all scale). Parents precede children."""
    rows = units["row"].to_numpy()
    unit = units["unit"].to_numpy()
    parent = units["parent"].to_numpy()
    position = {int(r): i for i, r in enumerate(rows)}
    inside = np.zeros(len(rows), dtype=bool)
    scaled = np.zeros(len(rows), dtype=bool)
    unit_ratio = np.full(len(rows), np.nan)
    for i in range(len(rows)):
        if unit[i] < 0:
            continue
        u = position[int(unit[i])]
        if not modelled[u]:
            continue
        inside[i] = True
        unit_ratio[i] = ratio[u]
        if u == i:
            scaled[i] = True
        else:
            p = position.get(int(parent[i]))
            scaled[i] = p is not None and scaled[p] and carries[i] and ops[i] not in VIEW_OPS
    return pd.DataFrame({"unit": unit[inside], "ratio": unit_ratio[inside], "scales": scaled[inside]}, index=rows[inside])

