"""The repeated blocks of a model on its graph: what the parallelism passes split, shard and stage.

A *unit* is one repeated block (a transformer block, an FSDP wrap unit, a pipeline-partition
atom): the tasks of its forward and of its backward in each iteration, the parameters it owns
and the activation at its boundary. :func:`find_units` finds them, in this order:

1. A capture bundle's layers (``graph.workload.layers`` and ``layer_intervals``, written by the
   module hooks; ``collectors/bundle.py``): the leaf modules are grouped into blocks by the
   container they sit in, ``blocks.3.attention.qkv`` in ``blocks.3``. With ``pattern`` the
   blocks are what it matches in the leaf names; without, the container with the most leaf
   modules under numbered children (``blocks.N``, ``features.N``, ``layers.N``, at least two
   of them). A task belongs to a unit in a step when, on the same CPU thread, it starts inside
   the span from the first to the last call of the unit's leaf modules in that step's forward
   (or backward) pass; tasks outside every unit keep their phase (forward, backward) by the
   step's whole forward and backward spans.
2. Without a bundle, the names on the tasks: the ``layer`` and ``context`` columns (module
   annotations, ``record_function`` ranges) searched with ``pattern``, by default
   :data:`DEFAULT_PATTERN` (``layers.N``, ``blocks.N``, ``h.N``, ``layer.N``), else the
   modules ``torch.profiler`` names with ``with_modules=True`` (``nn.Module: LlamaDecoderLayer_3``):
   the class of at least two instances, alike (their forward tasks within a factor of two of each
   other), whose instances hold the most forward tasks (:func:`_repeated_module_class`). A plain
   trace records no module around backward operators: a backward task belongs to the unit of the
   forward operator whose autograd sequence number its ``evaluate_function`` carries (the same
   number on both, Kineto's ``Sequence number``), and an ``AccumulateGrad`` (which has none) to
   the unit of the backward node that ran before it on its thread, the one that produced its
   gradient.
3. Else a one-line :class:`UnitsError` saying to give ``parallelism.units``.

Without a bundle's parameter record, :func:`parameters_from_shapes` reads the parameters off the
traced forward operators' recorded inputs (``record_shapes=True``): the weight and bias of
``aten::linear``, the convolutions, the norms and the embeddings (:data:`WEIGHT_INPUTS`), once per
operator call of the first step, named under the unit they ran in (or under no unit: the root);
the pipeline gives a parallel job's graph that record (``whatif/pipeline.py``'s ``_job_graph``).

GPU tasks belong to the unit and phase of the CPU task that launched them. The optimizer's
tasks (inside ``Optimizer.step``) are phase 3 wherever they are found. A unit's
``activation_bytes`` is its output: the first tensor that the first forward operator after it
reads (the next unit's input, or the head's), as traced (the traced batch); ``param_bytes`` the
bundle's parameters under the unit's name (0 without a bundle); ``forward_us`` and
``backward_us`` the median over steps of the unit's GPU time in that phase, or its CPU time
where the trace ran no GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind
from whatif.sim.workload import first_input_bytes

#: Where no pattern is given and no bundle says: the block names of common model code.
DEFAULT_PATTERN = r"(?<![\w])(?:layers|blocks|h|layer)\.\d+(?![\w])"
PHASE_OTHER, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER = 0, 1, 2, 3
TABLE_COLUMNS = ["unit", "name", "param_bytes", "activation_bytes", "forward_us", "backward_us"]
_OPTIMIZER = re.compile(r"Optimizer\.step#")
#: How ``torch.profiler`` (``with_modules=True``) names a module's call: class, then instance.
_KINETO_MODULE = re.compile(r"^nn\.Module: (\w+)_(\d+)$")
#: The positional inputs of an operator that are parameters (weight, bias), by operator: read
#: to size a plain trace's parameters (:func:`parameters_from_shapes`).
WEIGHT_INPUTS = {
    "aten::linear": (1, 2), "aten::bilinear": (2, 3),
    "aten::conv1d": (1, 2), "aten::conv2d": (1, 2), "aten::conv3d": (1, 2),
    "aten::conv_transpose1d": (1, 2), "aten::conv_transpose2d": (1, 2), "aten::conv_transpose3d": (1, 2),
    "aten::layer_norm": (2, 3), "aten::group_norm": (2, 3), "aten::rms_norm": (2,),
    "aten::batch_norm": (1, 2), "aten::instance_norm": (1, 2),
    "aten::embedding": (0,), "aten::embedding_bag": (0,), "aten::prelu": (1,),
}
_EVALUATE = "autograd::engine::evaluate_function"
_STEP = re.compile(r"^(ProfilerStep#\d+)")


class UnitsError(GraphError):
    """No repeated blocks could be found; the message says which key to give."""


@dataclass(frozen=True)
class Units:
    """The units of one graph (see the module's docstring)."""

    pattern: str  # what matched: "bundle layers: blocks\.\d+", or the regular expression
    task_unit: np.ndarray  # per task: the unit index (0.. in model order), -1 none
    task_phase: np.ndarray  # per task: 0 other, 1 forward, 2 backward, 3 optimizer
    table: pd.DataFrame  # TABLE_COLUMNS, one row per unit in model order

    def __len__(self) -> int:
        return len(self.table)

    @property
    def names(self) -> list[str]:
        return self.table["name"].tolist()

    def tasks_of(self, unit: int, phase: Optional[int] = None) -> np.ndarray:
        """Ids of the tasks of ``unit`` (in ``phase``, if given)."""
        mask = self.task_unit == unit
        if phase is not None:
            mask &= self.task_phase == phase
        return np.flatnonzero(mask)


def find_units(graph: TaskGraph, pattern: Optional[str] = None) -> Units:
    """The units of ``graph``: from its bundle's layers, else its task names (``pattern``,
    default :data:`DEFAULT_PATTERN`); :class:`UnitsError` when none are found."""
    regex = _compile(pattern) if pattern is not None else None
    workload = graph.workload
    if len(workload.layers) and len(workload.layer_intervals):
        return _from_bundle(graph, regex)
    if regex is not None:
        return _from_names(graph, regex)
    try:
        return _from_names(graph, re.compile(DEFAULT_PATTERN))
    except UnitsError:
        kineto = _repeated_module_class(graph)
        if kineto is None:
            raise
        return _from_names(graph, kineto)


def no_units(graph: TaskGraph) -> Units:
    """Units of a graph in which none were found: every task outside every unit (what plain
    data parallelism's memory count needs where a model's blocks are not named)."""
    n = len(graph.tasks)
    return Units("", np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int8), pd.DataFrame(columns=TABLE_COLUMNS))


def unit_name_of(name: str, regex: re.Pattern) -> Optional[str]:
    """The unit a module or annotation name belongs to: its text up to the end of the
    pattern's first match (``model.blocks.3`` for ``model.blocks.3.mlp.0``), None if none."""
    match = regex.search(name)
    return name[: match.end()] if match else None


# -- from a bundle's layers -----------------------------------------------------------------------


def _from_bundle(graph: TaskGraph, regex: Optional[re.Pattern]) -> Units:
    workload = graph.workload
    leaves = workload.layers["name"].astype(str).tolist()
    if regex is None:
        regex = _repeated_container(leaves)
    names = [unit_name_of(leaf, regex) for leaf in leaves] if regex is not None else []
    order = list(dict.fromkeys(n for n in names if n is not None))
    if not order:
        raise UnitsError(_not_found("the bundle's layers", regex))
    unit_of_leaf = {leaf: order.index(n) for leaf, n in zip(leaves, names) if n is not None}

    tasks = graph.tasks
    n = len(tasks)
    task_unit = np.full(n, -1, dtype=np.int64)
    task_phase = np.zeros(n, dtype=np.int8)
    task_step = np.full(n, -1, dtype=np.int64)
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    resource = tasks["resource"].astype(str).to_numpy()
    on_cpu = ~np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])

    intervals = workload.layer_intervals
    span_unit = intervals["layer"].map(unit_of_leaf).fillna(-1).to_numpy(dtype=np.int64)
    span_step = pd.factorize(intervals["step"])[0]  # steps in order of first appearance
    span_pass = intervals["pass"].astype(str).to_numpy()
    span_thread = intervals["thread"].astype(str).to_numpy()
    has_thread = intervals["thread"].notna().to_numpy()
    span_start = intervals["start_us"].to_numpy(dtype=float)
    span_end = intervals["end_us"].to_numpy(dtype=float)
    on_thread: dict = {}  # thread -> its CPU tasks by start, and their starts

    def starting(thread: str, lo: float, hi: float) -> np.ndarray:
        """The CPU tasks on ``thread`` that start in ``[lo, hi)``."""
        if thread not in on_thread:
            ids = np.flatnonzero(on_cpu & (resource == thread))
            ids = ids[np.argsort(start[ids], kind="stable")]  # a task with no start sorts last, in no span
            on_thread[thread] = (ids, start[ids])
        ids, starts = on_thread[thread]
        return ids[np.searchsorted(starts, lo, "left"):np.searchsorted(starts, hi, "left")]

    for step_index in range(int(span_step.max()) + 1 if len(span_step) else 0):
        for phase_name, phase in (("forward", PHASE_FORWARD), ("backward", PHASE_BACKWARD)):
            rows = np.flatnonzero((span_step == step_index) & (span_pass == phase_name) & has_thread)
            for thread in dict.fromkeys(span_thread[rows].tolist()):  # in order of first appearance
                spans = rows[span_thread[rows] == thread]
                whole = starting(thread, np.fmin.reduce(span_start[spans]), np.fmax.reduce(span_end[spans]))
                task_phase[whole] = phase
                task_step[whole] = step_index
                for unit in np.unique(span_unit[spans]).tolist():
                    if unit >= 0:
                        of_unit = spans[span_unit[spans] == unit]
                        lo, hi = np.fmin.reduce(span_start[of_unit]), np.fmax.reduce(span_end[of_unit])
                        task_unit[starting(thread, lo, hi)] = unit
    _optimizer_phase(graph, task_phase)
    _to_launched(graph, task_unit, task_phase, task_step)
    param_bytes = _param_bytes(workload.parameters, order)
    activations = _activation_bytes(graph, task_unit, task_phase, task_step, len(order))
    label = regex.pattern
    return Units(f"bundle layers: {label}", task_unit, task_phase,
                 _table(graph, order, param_bytes, activations, task_unit, task_phase, task_step))


def _repeated_container(leaves: list[str]) -> Optional[re.Pattern]:
    """The container whose numbered children (``P.0``, ``P.1``, ...) hold the most leaf
    modules, at least two children: its pattern ``P\\.\\d+``; None if there is none."""
    children: dict[str, set] = {}
    covered: dict[str, int] = {}
    for leaf in leaves:
        parts = leaf.split(".")
        for i, part in enumerate(parts):
            if part.isdigit() and i > 0 and i < len(parts) - 1:
                prefix = ".".join(parts[:i])
                children.setdefault(prefix, set()).add(part)
                covered[prefix] = covered.get(prefix, 0) + 1
    candidates = [p for p, kids in children.items() if len(kids) >= 2]
    if not candidates:
        return None
    best = max(candidates, key=lambda p: (covered[p], len(children[p]), -len(p)))
    return re.compile(r"(?<![\w.])" + re.escape(best) + r"\.\d+(?![\w])")


# -- from the names on the tasks ------------------------------------------------------------------


def _from_names(graph: TaskGraph, regex: re.Pattern) -> Units:
    tasks = graph.tasks
    n = len(tasks)
    task_unit = np.full(n, -1, dtype=np.int64)
    task_phase = np.zeros(n, dtype=np.int8)
    task_step = np.full(n, -1, dtype=np.int64)
    found: dict[str, int] = {}
    for column in ("layer", "context"):  # the innermost module first, else any enclosing frame
        col = tasks[column]
        per_category = [unit_name_of(str(text), regex) if column == "layer" else _innermost(str(text), regex)
                        for text in col.cat.categories]
        codes = col.cat.codes.to_numpy()
        for i in np.flatnonzero(task_unit < 0):
            code = codes[i]
            if code >= 0 and per_category[code] is not None:
                task_unit[i] = found.setdefault(per_category[code], len(found))
    on_cpu = ~np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    if not (task_unit[on_cpu] >= 0).any():
        named = [str(c) for c in tasks["layer"].cat.categories if str(c).strip()]
        hint = (f" (the names it has: {', '.join(repr(n) for n in named[:3])}{', ...' if len(named) > 3 else ''})"
                if named else " (it records no module or annotation names: capture with "
                              "torch.profiler.profile(with_modules=True))")
        raise UnitsError(_not_found("the tasks' module and annotation names", regex) + hint)
    # model order: the order of first appearance in time, not of naming
    first = pd.Series(tasks["measured_start_us"].to_numpy(dtype=float)).groupby(task_unit).min()
    first = first[first.index >= 0].sort_values(kind="stable")
    names_by_index = {index: name for name, index in found.items()}
    order = [names_by_index[i] for i in first.index]
    remap = np.full(len(found) + 1, -1, dtype=np.int64)
    remap[first.index.to_numpy()] = np.arange(len(order))
    task_unit = np.where(task_unit >= 0, remap[np.maximum(task_unit, 0)], -1)
    context = tasks["context"].astype(str).to_numpy()
    backward = np.char.find(context.astype(str), _EVALUATE) >= 0
    task_phase[on_cpu & (task_unit >= 0)] = PHASE_FORWARD
    task_phase[on_cpu & backward] = PHASE_BACKWARD
    task_unit[on_cpu & backward] = -1  # a module frame never encloses a backward task's own work
    task_step[:] = pd.factorize(_step_of(tasks))[0]  # steps numbered in order of first appearance
    task_step[~on_cpu] = -1
    _backward_by_sequence(graph, task_unit, task_phase, on_cpu)
    _forward_around_units(tasks, task_unit, task_phase, task_step, on_cpu)
    _optimizer_phase(graph, task_phase)
    _to_launched(graph, task_unit, task_phase, task_step)
    param_bytes = _param_bytes(graph.workload.parameters, order)
    activations = _activation_bytes(graph, task_unit, task_phase, task_step, len(order))
    return Units(regex.pattern, task_unit, task_phase,
                 _table(graph, order, param_bytes, activations, task_unit, task_phase, task_step))


def _innermost(context: str, regex: re.Pattern) -> Optional[str]:
    """The unit of the innermost frame of a context (``a > b > c``) that names one."""
    for frame in reversed(context.split(" > ")):
        name = unit_name_of(frame, regex)
        if name is not None:
            return name
    return None


def _step_of(tasks: pd.DataFrame) -> np.ndarray:
    """Each task's profiler step (``ProfilerStep#N``, the outermost frame of its context), ""
    where it is in none; read once per distinct context."""
    context = tasks["context"]
    names = [m.group(1) if (m := _STEP.match(str(c))) else "" for c in context.cat.categories]
    return np.asarray(names + [""], dtype=object)[context.cat.codes.to_numpy()]


def _repeated_module_class(graph: TaskGraph) -> Optional[re.Pattern]:
    """The pattern of the module class whose instances are the model's repeated block, from the
    names ``torch.profiler`` gives module calls (``nn.Module: LlamaDecoderLayer_3``): of the
    classes with at least two instances whose CPU tasks (outside backward) are alike, within a
    factor of two of each other, the one whose instances hold the most of them (a decoder layer
    holds its linears, norms and attention; two ``Sequential`` containers of unlike size are no
    repeated block). None where the trace names no modules so."""
    tasks = graph.tasks
    on_cpu = ~np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    context = tasks["context"]
    counts = np.bincount(context.cat.codes.to_numpy()[on_cpu] + 1, minlength=len(context.cat.categories) + 1)[1:]
    per_instance: dict = {}  # class -> instance -> tasks
    for text, count in zip(context.cat.categories, counts):
        if not count or _EVALUATE in str(text):
            continue
        for frame in dict.fromkeys(str(text).split(" > ")):
            match = _KINETO_MODULE.match(frame)
            if match:
                instances = per_instance.setdefault(match.group(1), {})
                instances[match.group(2)] = instances.get(match.group(2), 0) + int(count)
    best, held = None, 0
    for name, instances in per_instance.items():
        sizes = list(instances.values())
        if len(sizes) >= 2 and max(sizes) <= 2 * min(sizes) and sum(sizes) > held:
            best, held = name, sum(sizes)
    return re.compile(r"(?<![\w])nn\.Module: " + re.escape(best) + r"_\d+(?![\w])") if best else None


def _backward_by_sequence(graph: TaskGraph, task_unit: np.ndarray, task_phase: np.ndarray, on_cpu: np.ndarray) -> None:
    """Give backward tasks the unit of their forward: each ``evaluate_function`` task carries
    the autograd sequence number of the forward operator it differentiates; it and the tasks
    inside it on its thread take that operator's unit. An ``AccumulateGrad`` node (no number)
    takes the unit of the node before it on its thread, which produced the gradient it adds."""
    ops = graph.ops
    if "sequence_nr" not in ops.columns or not len(ops):
        return
    tasks = graph.tasks
    event = tasks["event"].to_numpy().astype(np.int64)
    rows = ops.index.to_numpy()
    at = np.clip(np.searchsorted(rows, event), 0, len(rows) - 1)
    has_op = (event >= 0) & (rows[at] == event)
    seq = np.where(has_op, ops["sequence_nr"].to_numpy()[at], -1)
    forward = on_cpu & (task_phase == PHASE_FORWARD) & (task_unit >= 0) & (seq >= 0)
    unit_of_seq = dict(zip(seq[forward][::-1].tolist(), task_unit[forward][::-1].tolist()))  # the first wins
    if not unit_of_seq:
        return
    names = tasks["name"]
    node = np.asarray([str(c).startswith(_EVALUATE) for c in names.cat.categories] + [False])[names.cat.codes.to_numpy()]
    node &= on_cpu & (task_phase == PHASE_BACKWARD)
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    # a node's whole span is its operator's (its tasks are the slices between its children's)
    op_start = np.where(has_op, ops["start_us"].to_numpy(dtype=float)[at], start)
    op_end = op_start + np.where(has_op, ops["dur_us"].to_numpy(dtype=float)[at], 0.0)
    resource = tasks["resource"].cat.codes.to_numpy()
    inside = on_cpu & (task_phase == PHASE_BACKWARD)
    for thread in np.unique(resource[node]).tolist():
        mine = np.flatnonzero(inside & (resource == thread))
        mine = mine[np.argsort(start[mine], kind="stable")]
        starts = start[mine]
        unit, seen = -1, set()
        for i in mine[node[mine]].tolist():
            if event[i] in seen:  # a later slice of a node already placed
                continue
            seen.add(event[i])
            unit = unit_of_seq.get(int(seq[i]), -1) if seq[i] >= 0 else unit
            if unit >= 0:
                lo, hi = np.searchsorted(starts, op_start[i], "left"), np.searchsorted(starts, op_end[i], "right")
                task_unit[mine[lo:hi]] = unit


def _forward_around_units(tasks: pd.DataFrame, task_unit: np.ndarray, task_phase: np.ndarray, task_step: np.ndarray,
                          on_cpu: np.ndarray) -> None:
    """The forward work outside every unit (embeddings, head, loss): as the bundle's path does
    by its forward spans, a step's CPU tasks on a thread that ran the units' forward, from that
    thread's first unit task to the step's first backward task, are forward too."""
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    resource = tasks["resource"].cat.codes.to_numpy()
    for step in np.unique(task_step[on_cpu]).tolist():
        in_step = on_cpu & (task_step == step)
        backward = in_step & (task_phase == PHASE_BACKWARD)
        until = start[backward].min() if backward.any() else np.inf
        units_forward = in_step & (task_unit >= 0) & (task_phase == PHASE_FORWARD)
        for thread in np.unique(resource[units_forward]).tolist():
            mine = in_step & (resource == thread) & (task_phase == PHASE_OTHER)
            lo = start[units_forward & (resource == thread)].min()
            task_phase[mine & (start >= lo) & (start < until)] = PHASE_FORWARD


def parameters_from_shapes(graph: TaskGraph, units: "Units") -> pd.DataFrame:
    """A parameter record (``sim/workload.py``'s ``PARAMETER_COLUMNS``) read off the traced
    operators where no bundle lists the parameters: the inputs :data:`WEIGHT_INPUTS` names of
    every such operator the first step runs outside backward and the optimizer, each call once,
    named ``UNIT.pN`` under the unit it ran in (``root.pN`` outside every unit). Empty where the
    trace recorded no shapes. A parameter used twice in a step (tied weights, a block called
    twice) is counted twice."""
    from whatif.collectors.kineto import element_bytes

    from ..workload import PARAMETER_COLUMNS, decode_inputs

    tasks, ops = graph.tasks, graph.ops
    event = tasks["event"].to_numpy().astype(np.int64)
    names = tasks["name"]
    wanted = np.asarray([str(c) in WEIGHT_INPUTS for c in names.cat.categories] + [False])[names.cat.codes.to_numpy()]
    phase = units.task_phase
    step_of = _step_of(tasks)
    chosen = np.flatnonzero(wanted & (event >= 0) & np.isin(phase, [PHASE_OTHER, PHASE_FORWARD]))
    chosen = chosen[np.isin(event[chosen], ops.index.to_numpy())]
    chosen = chosen[np.unique(event[chosen], return_index=True)[1]]  # an operator's slices: once
    if len(chosen):
        first_step = step_of[chosen[np.argmin(tasks["measured_start_us"].to_numpy(dtype=float)[chosen])]]
        chosen = chosen[step_of[chosen] == first_step]
    unit_names = units.names
    records, counter = [], {}
    for i in chosen.tolist():
        row = int(event[i])
        dims, types = decode_inputs(ops.at[row, "input_dims"]), decode_inputs(ops.at[row, "input_types"])
        owner = unit_names[units.task_unit[i]] if units.task_unit[i] >= 0 else "root"
        for position in WEIGHT_INPUTS[str(names.iloc[i])]:
            shape = dims[position] if position < len(dims) else None
            if not isinstance(shape, list) or not shape or not all(isinstance(d, int) for d in shape):
                continue
            dtype = str(types[position]) if position < len(types) else "float"
            k = counter[owner] = counter.get(owner, -1) + 1
            records.append({"name": f"{owner}.p{k}", "layer": owner if owner != "root" else "", "shape": shape,
                            "numel": int(np.prod(shape)), "dtype": dtype, "element_size": element_bytes(dtype),
                            "requires_grad": True})
    return pd.DataFrame(records, columns=PARAMETER_COLUMNS)


# -- shared steps ---------------------------------------------------------------------------------


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise UnitsError(f"parallelism.units: {pattern!r} is not a valid regular expression ({err})") from None


def _not_found(where: str, regex: Optional[re.Pattern]) -> str:
    tried = f"pattern {regex.pattern!r}" if regex is not None else "numbered blocks (P.0, P.1, ...)"
    return (f"parallelism.units: no repeated blocks found in {where} with {tried}: give parallelism.units, "
            f"a regular expression naming them (e.g. 'blocks\\.\\d+')")


def _optimizer_phase(graph: TaskGraph, task_phase: np.ndarray) -> None:
    context = graph.tasks["context"]
    hit = np.array([bool(_OPTIMIZER.search(str(c))) for c in context.cat.categories] + [False])
    task_phase[hit[context.cat.codes.to_numpy()]] = PHASE_OPTIMIZER


def _to_launched(graph: TaskGraph, task_unit: np.ndarray, task_phase: np.ndarray, task_step: np.ndarray) -> None:
    """GPU tasks take the unit, phase and step of the CPU task that launched them."""
    edges = graph.edges
    launch = edges[edges["kind"] == int(EdgeKind.LAUNCH)]
    src = launch["src"].to_numpy(dtype=np.int64)
    dst = launch["dst"].to_numpy(dtype=np.int64)
    for array in (task_unit, task_phase, task_step):
        array[dst] = array[src]


def _param_bytes(parameters: pd.DataFrame, order: list[str]) -> np.ndarray:
    """Bytes of the parameters under each unit's name (``blocks.3.`` prefix)."""
    out = np.zeros(len(order))
    if not len(parameters):
        return out
    names = parameters["name"].astype(str).tolist()
    size = (parameters["numel"].to_numpy(dtype=float) * parameters["element_size"].to_numpy(dtype=float))
    index = {name: i for i, name in enumerate(order)}
    for name, nbytes in zip(names, size):
        for unit_name, i in index.items():
            if _under(name, unit_name):
                out[i] += nbytes
                break
    return out


def _under(parameter: str, unit_name: str) -> bool:
    """Whether a parameter's dotted name has the unit's name as a run of its components
    (``blocks.3`` in ``blocks.3.mlp.0.weight`` or ``model.blocks.3.norm.bias``)."""
    return f".{unit_name}." in f".{parameter}"


def _activation_bytes(graph: TaskGraph, task_unit: np.ndarray, task_phase: np.ndarray,
                      task_step: np.ndarray, n_units: int) -> np.ndarray:
    """Per unit: bytes of the first tensor read by the first forward operator after the unit's
    forward in the first step that has it, on the same thread (the next unit's input, or for
    the last unit what follows it: the head's); 0 where the trace recorded no shape."""
    ops = graph.ops
    tasks = graph.tasks
    event = tasks["event"].to_numpy()
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    resource = tasks["resource"].cat.codes.to_numpy()
    on_cpu = ~np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])  # operators: on CPU threads
    forward = (task_phase == PHASE_FORWARD) & (event >= 0) & np.isfinite(start) & on_cpu
    out = np.zeros(n_units)
    for unit in range(n_units):
        mine = np.flatnonzero(forward & (task_unit == unit))
        if not len(mine):
            continue
        step = task_step[mine].min()
        mine = mine[task_step[mine] == step]
        last = mine[np.argmax(start[mine])]
        after = np.flatnonzero(forward & (task_step == step) & (resource == resource[last]) & (start > start[last])
                               & (task_unit != unit))
        for i in after[np.argsort(start[after], kind="stable")]:
            row = int(event[i])
            nbytes = first_input_bytes(ops, row) if row in ops.index else None
            if nbytes:
                out[unit] = nbytes
                break
    return out


def _table(graph: TaskGraph, order: list[str], param_bytes: np.ndarray, activations: np.ndarray,
           task_unit: np.ndarray, task_phase: np.ndarray, task_step: np.ndarray) -> pd.DataFrame:
    tasks = graph.tasks
    kind = tasks["kind"].to_numpy()
    # a unit's own work: its kernels and copies (not the collectives a pass or the trace puts
    # among them), else, on a trace that ran none, its CPU operators and runtime calls
    on_gpu = np.isin(kind, [int(k) for k in GPU_TASK_KINDS if k != TaskKind.COMM])
    timed = on_gpu if on_gpu.any() else np.isin(kind, [int(TaskKind.CPU), int(TaskKind.RUNTIME)])
    duration = tasks["duration_us"].to_numpy(dtype=float)
    frame = pd.DataFrame({"unit": task_unit, "phase": task_phase, "step": task_step, "us": duration})
    frame = frame[timed & (task_unit >= 0)]
    per_step = frame.groupby(["unit", "phase", "step"])["us"].sum()
    medians = per_step.groupby(level=["unit", "phase"]).median()
    forward = [float(medians.get((u, PHASE_FORWARD), 0.0)) for u in range(len(order))]
    backward = [float(medians.get((u, PHASE_BACKWARD), 0.0)) for u in range(len(order))]
    return pd.DataFrame({
        "unit": np.arange(len(order), dtype=np.int64),
        "name": order,
        "param_bytes": param_bytes,
        "activation_bytes": activations,
        "forward_us": forward,
        "backward_us": backward,
    }, columns=TABLE_COLUMNS)
