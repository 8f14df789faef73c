"""Memory per GPU of a parallel training job: model state and activations, and whether it fits.

**Model state** (Rajbhandari et al., "ZeRO", SC'20, section 3.1). With Psi parameters of ``e``
bytes each (the trace's parameter dtype): parameters ``e Psi``, gradients ``e Psi`` and
optimizer state ``K Psi``. Mixed precision (``e = 2``) keeps an fp32 master copy, so Adam's
``K = 4 + 4 + 4 = 12`` (the paper's 2 + 2 + 12 = 16 bytes per parameter) and SGD with
momentum's ``K = 8``; in fp32 (``e = 4``) the parameters are the master copy: Adam ``K = 8``,
SGD with momentum ``K = 4``, plain SGD ``K = 0``. Sharding, per GPU:

* tensor parallel divides the units' parameters (Megatron's column/row-parallel GEMMs; the few
  replicated norm weights are counted divided too, a stated approximation) and the bundle's
  ``Embedding`` layers (vocabulary-parallel); other parameters outside units are replicated;
* pipeline parallel keeps a stage's units (``partition``: as given, else an even split by count,
  the first stages taking one more) and the parameters outside units on the stage next to them
  (before the first unit: stage 0; after the last: the last stage); the breakdown is the
  stage with the most;
* expert parallel divides the parameters whose name holds ``expert`` by ``expert``;
* ZeRO over the ``data`` ranks: stage 1 divides optimizer state, 2 also gradients, 3 (FSDP)
  also parameters. FSDP also holds one unit's parameters gathered whole while it computes and
  the next one's prefetched (FSDP2), and stage 2 and 3 a unit's whole gradient before its
  reduce-scatter: ``gathered`` in the breakdown.

**Activations** (Korthikanti et al., "Reducing activation recomputation in large transformer
models", MLSys 2023, table 2), per transformer block and microbatch, ``sbh`` the block's output
elements (its ``activation_bytes`` over ``e``), ``a s^2 b`` the attention scores' elements, at
``e = 2`` bytes: ``sbh (34 + 5 a s / h)`` without parallelism; ``sbh (10 + 24 / t + 5 a s /
(h t))`` with tensor parallel ``t``; ``sbh (34 + 5 a s / h) / t`` with sequence parallelism;
the ``5 a s^2 b`` term is dropped by selective recompute, and by a fused attention kernel
(``scaled_dot_product_attention``, flash attention), which keeps no scores; full recompute keeps
only each block's input, ``2 sbh`` (``/ t`` with sequence parallelism). Other ``e`` scale it by
``e / 2``. A unit without attention (a convolution block) keeps what its forward operators
read, the sum of their first inputs' bytes as traced (divided by ``t`` under tensor
parallelism), its input alone under full recompute; operators outside units likewise, once,
on the first stage. A rank computes the traced batch per step, ``1 / microbatches`` of it at a
time; a pipeline stage holds several microbatches at once: GPipe all ``m``, 1F1B ``p`` on the
first stage, interleaved ``p (1 + (p - 1) / (p v))`` (Narayanan et al., SC'21).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from whatif.sim.graph import TaskGraph
from whatif.sim.workload import decode_inputs, first_input_bytes_of

from . import Parallelism, ParallelismError
from .units import PHASE_FORWARD, Units

#: Bytes of optimizer state per parameter beyond the parameters: (fp32 training, mixed precision).
OPTIMIZER_STATE_BYTES = {"adam": (8, 12), "adamw": (8, 12), "sgd": (4, 8), "sgd-plain": (0, 4)}
_ATTENTION_FUSED = re.compile(r"scaled_dot_product|flash_attention|efficient_attention")
_SOFTMAX = re.compile(r"^aten::_?softmax$")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU, on the most loaded pipeline stage."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP's gathered and prefetched units, ZeRO-2/3's unreduced unit gradient
    activations: float
    stage: int = 0  # the pipeline stage these are of

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    @property
    def total_gb(self) -> float:
        return self.total / 1e9


def fits(breakdown: MemoryBreakdown, gpu_memory_bytes: Optional[float]) -> Optional[bool]:
    """Whether the breakdown fits a GPU of that memory (None: the memory is unknown)."""
    if gpu_memory_bytes is None:
        return None
    return breakdown.total <= gpu_memory_bytes


def gpu_memory_bytes(cluster) -> Optional[float]:
    """The memory of the cluster's GPUs, from its fabric's GPU model (None: not known)."""
    fabric = getattr(cluster, "fabric", None)
    if fabric is None:
        return None
    return fabric.gpu.memory_bytes


def memory_per_gpu(graph: TaskGraph, units: Units, par: Parallelism, optimizer: str = "adam",
                   dtype_bytes: Optional[int] = None, parameter_bytes: Optional[float] = None) -> MemoryBreakdown:
    """Memory per GPU of ``graph``'s job under ``par`` (formulas in the module's docstring).
    ``dtype_bytes``: the parameters' element size (None: the bundle's, else 4);
    ``parameter_bytes``: the model's parameters as traced where no bundle lists them (a
    data-parallel job's gradient bytes per step), counted outside units and replicated."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ParallelismError("optimizer", f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZER_STATE_BYTES)})")
    e = dtype_bytes or _parameter_dtype_bytes(graph)
    state_bytes = OPTIMIZER_STATE_BYTES[optimizer][0 if e >= 4 else 1]
    stages = stage_units(len(units), par)
    unit_params, unit_experts, before, after = (a.copy() for a in _facts(graph, units).parameters)
    if parameter_bytes is not None and not len(graph.workload.parameters):
        before[0] += max(parameter_bytes / _parameter_dtype_bytes(graph) - unit_params.sum(), 0.0)
    # per unit: tensor parallel divides it, expert parallel its experts
    unit_share = (unit_params - unit_experts * (1 - 1 / par.expert)) / par.tensor
    outside = lambda at: at[0] + at[1] / par.tensor + at[2] / par.expert  # noqa: E731
    dp = par.data
    breakdowns = []
    for stage, members in enumerate(stages):
        first, last = stage == 0, stage == len(stages) - 1
        psi = float(unit_share[members].sum()) + (outside(before) if first else 0.0) + (outside(after) if last else 0.0)
        largest = float(unit_share[members].max()) if len(members) else 0.0
        breakdowns.append(MemoryBreakdown(
            parameters=e * psi / (dp if par.zero >= 3 else 1),
            gradients=e * psi / (dp if par.zero >= 2 else 1),
            optimizer=state_bytes * psi / (dp if par.zero >= 1 else 1),
            gathered=(2 * e * largest if par.zero >= 3 else 0.0) + (e * largest if par.zero >= 2 else 0.0),
            activations=_activations(graph, units, par, e, members, stage),
            stage=stage,
        ))
    return max(breakdowns, key=lambda b: b.total)


def stage_units(n_units: int, par: Parallelism) -> list[np.ndarray]:
    """The units of each pipeline stage: ``partition`` as given, else an even split by count
    (the first stages one more)."""
    p = par.pipeline
    if isinstance(par.partition, tuple):
        counts = list(par.partition)
        if sum(counts) != n_units:
            raise ParallelismError("parallelism.pipeline.partition",
                                   f"the stages' units add up to {sum(counts)}, but the model has {n_units}")
    else:
        if n_units < p:
            raise ParallelismError("parallelism.pipeline", f"{p} stages for a model of {n_units} units")
        counts = [n_units // p + (1 if s < n_units % p else 0) for s in range(p)]
    bounds = np.cumsum([0] + counts)
    return [np.arange(bounds[s], bounds[s + 1]) for s in range(p)]


def in_flight_microbatches(par: Parallelism, stage: int = 0) -> float:
    """Microbatches whose activations ``stage`` holds at once: GPipe all of them; 1F1B ``p -
    stage`` (the warm-up's forwards); interleaved ``p (1 + (p - 1) / (p v)) - stage``."""
    p, m, v = par.pipeline, par.microbatches, par.virtual_stages
    if p == 1:
        return 1.0
    if par.schedule == "gpipe":
        return float(m)
    if par.schedule == "interleaved":
        return min(float(m), p * (1 + (p - 1) / (p * v)) - stage)
    return float(min(p - stage, m))


# -- parameters -----------------------------------------------------------------------------------


def _parameter_dtype_bytes(graph: TaskGraph) -> int:
    parameters = graph.workload.parameters
    if len(parameters) and "element_size" in parameters:
        return int(parameters["element_size"].max())
    return 4


def _parameter_elements(graph: TaskGraph, units: Units):
    """Parameter elements: per unit, and outside units before the first unit and after the last,
    each split into (replicated, vocabulary-parallel, expert) elements."""
    unit_params = units.table["param_bytes"].to_numpy(dtype=float) / _parameter_dtype_bytes(graph)
    unit_experts = np.zeros(len(units))
    before, after = np.zeros(3), np.zeros(3)
    parameters = graph.workload.parameters
    if not len(parameters):
        return unit_params, unit_experts, before, after
    layers = graph.workload.layers
    layer_order = {name: i for i, name in enumerate(layers["name"].astype(str))} if len(layers) else {}
    embedding = set(layers.loc[layers["type"] == "Embedding", "name"].astype(str)) if len(layers) else set()
    unit_layers = [i for name, i in layer_order.items() if any(_in_unit(name, u) for u in units.names)]
    first_unit_layer = min(unit_layers) if unit_layers else 0
    for name, layer, numel in zip(parameters["name"].astype(str), parameters["layer"].astype(str),
                                  parameters["numel"].to_numpy(dtype=float)):
        owner = next((i for i, u in enumerate(units.names) if _in_unit(name, u)), None)
        expert = "expert" in name
        if owner is not None:
            unit_experts[owner] += numel if expert else 0.0
            continue
        place = before if layer_order.get(layer, 0) < first_unit_layer else after
        place[2 if expert else 1 if layer in embedding else 0] += numel
    return unit_params, unit_experts, before, after


def expert_parameter_bytes(graph: TaskGraph, units: Units) -> tuple[np.ndarray, float]:
    """The bytes of the parameters whose name holds ``expert`` (the count's rule above): per
    unit, and outside the units."""
    _, unit_experts, before, after = _parameter_elements(graph, units)
    e = _parameter_dtype_bytes(graph)
    return unit_experts * e, float(before[2] + after[2]) * e


def _in_unit(name: str, unit: str) -> bool:
    return f".{unit}." in f".{name}."


# -- activations ----------------------------------------------------------------------------------


def _activations(graph: TaskGraph, units: Units, par: Parallelism, e: int, members: np.ndarray,
                 stage: int) -> float:
    """Activation bytes ``stage`` holds at its peak: its units' per microbatch times the
    microbatches in flight (and, on the first stage, the operators outside units, once). Without
    pipeline stages the step runs the traced batch whole: its microbatches, which only a
    pipeline's schedule splits it into, do not divide it (the time would not show them either)."""
    scale = 1.0 / par.microbatches if par.pipeline > 1 else 1.0
    facts = _facts(graph, units)
    per_microbatch = sum(_unit_activation(facts, par, e, int(u)) for u in members) * scale
    outside = 0.0
    if stage == 0:
        outside = facts.outside_saved
        outside *= scale * (e / facts.traced) / (par.tensor if par.sequence_parallel else 1)
    return per_microbatch * in_flight_microbatches(par, stage) + outside


@dataclass(frozen=True)
class _UnitFacts:
    """What the activation count reads of a graph's units, whatever the parallelism: the
    activations' element size as traced, and per unit its ``s b h`` elements, whether its
    attention is fused, its attention scores' elements and its forward's saved inputs (bytes),
    and the saved inputs of the forward outside units."""

    traced: int
    sbh: tuple
    fused: tuple
    scores: tuple
    saved: tuple
    outside_saved: float
    parameters: tuple  # _parameter_elements' arrays (copy them before changing one)


#: Facts of the last graphs' units, by the identity of what they were read from (the tasks,
#: operators, parameters, layers and units objects, kept so that an id is never reused while
#: listed).
_FACTS: dict = {}
_FACTS_KEPT = 8


def _facts(graph: TaskGraph, units: Units) -> _UnitFacts:
    """The :class:`_UnitFacts` of ``units`` on ``graph``, read once per graph and units: a grid
    counts the memory of every point from the same ones. They read the tasks' contexts and
    events, the operators, the parameters and the layers, which no pass changes in place."""
    sources = (graph.tasks, graph.ops, graph.workload.parameters, graph.workload.layers, units)
    key = tuple(id(x) for x in sources)
    kept = _FACTS.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], sources)):
        return kept[1]
    traced = _parameter_dtype_bytes(graph)
    forwards = [units.tasks_of(u, PHASE_FORWARD) for u in range(len(units))]
    names = [_operator_names(graph, forward) for forward in forwards]
    facts = _UnitFacts(
        traced=traced,
        sbh=tuple(float(units.table["activation_bytes"].iat[u]) / traced for u in range(len(units))),
        fused=tuple(any(_ATTENTION_FUSED.search(n) for n in unit_names) for unit_names in names),
        scores=tuple(_softmax_elements(graph, forward) for forward in forwards),
        saved=tuple(_saved_inputs(graph, forward) for forward in forwards),
        outside_saved=_saved_inputs(graph, np.flatnonzero((units.task_unit < 0) & (units.task_phase == PHASE_FORWARD))),
        parameters=_parameter_elements(graph, units),
    )
    while len(_FACTS) >= _FACTS_KEPT:
        _FACTS.pop(next(iter(_FACTS)))
    _FACTS[key] = (sources, facts)
    return facts


def _unit_activation(facts: _UnitFacts, par: Parallelism, e: int, unit: int) -> float:
    """One unit's activations for the traced batch (Korthikanti et al.'s table 2, or what its
    operators read where it has no attention)."""
    t, sp = par.tensor, par.sequence_parallel
    traced = facts.traced  # the activations' element size as traced
    sbh = facts.sbh[unit]
    fused = facts.fused[unit]
    scores = facts.scores[unit]
    if not (fused or scores):  # not a transformer block: what its operators keep
        kept = facts.saved[unit] * (e / traced) / t
        if par.recompute == "full":  # its input alone, which is among what it keeps: a single
            # convolution's (VGG's units) is all it keeps, and its output can be far larger
            return min(sbh * e / (t if sp else 1), kept)
        return kept
    if par.recompute == "full":
        return 2 * sbh * (e / 2) / (t if sp else 1)
    linear = 34 / t if sp else 10 + 24 / t
    quadratic = 0.0 if (fused or par.recompute == "selective") else 5 * scores / t
    return (linear * sbh + quadratic) * (e / 2)


def _operator_names(graph: TaskGraph, ids: np.ndarray) -> set:
    event = graph.tasks["event"].to_numpy()[ids]
    ops = graph.ops
    if not ops.index.is_unique:  # each row looked up alone
        rows = [int(r) for r in event if r >= 0 and r in ops.index]
        return set(ops.loc[rows, "name"].astype(str)) if rows else set()
    at = ops.index.get_indexer(event[event >= 0])
    return {str(name) for name in ops["name"].to_numpy()[at[at >= 0]]}


def _softmax_elements(graph: TaskGraph, ids: np.ndarray) -> float:
    """Elements of the attention scores a softmax read in these tasks, per iteration."""
    ops = graph.ops
    total = 0.0
    for row in _softmax_rows(graph, ids):
        dims = decode_inputs(ops.at[row, "input_dims"])
        if dims and isinstance(dims[0], list) and len(dims[0]) == 4:
            total += float(np.prod(dims[0]))
    return total / max(1, _iterations(graph, ids))


def _softmax_rows(graph: TaskGraph, ids: np.ndarray) -> list:
    """The operator rows these tasks belong to that are a softmax, each once, in the order the
    tasks first name them."""
    ops = graph.ops
    events = graph.tasks["event"].to_numpy()[ids]
    if not ops.index.is_unique:  # each row looked up alone, as .at would
        rows, seen = [], set()
        for row in events:
            row = int(row)
            if row < 0 or row in seen or row not in ops.index or not _SOFTMAX.match(str(ops.at[row, "name"])):
                continue
            seen.add(row)
            rows.append(row)
        return rows
    rows = pd.unique(events)
    rows = rows[(rows >= 0) & np.isin(rows, ops.index.to_numpy())]
    names = ops["name"].reindex(rows).astype(str).to_numpy() if len(rows) else []
    return [int(row) for row, name in zip(rows, names) if _SOFTMAX.match(name)]


def _saved_inputs(graph: TaskGraph, ids: np.ndarray) -> float:
    """Bytes of the first inputs of the outermost operators of these tasks, per iteration:
    what a block's forward keeps for its backward, counted as each operator's first input
    (not where that input is a parameter, as an embedding's table is)."""
    total, seen = 0.0, set()
    ops = graph.ops
    tasks = graph.tasks
    parameter_shapes = {tuple(shape) for shape in graph.workload.parameters.get("shape", [])
                        if isinstance(shape, (list, tuple))}
    context = tasks["context"].to_numpy()[ids]
    events = tasks["event"].to_numpy()[ids]
    at = ops.index.get_indexer(events)  # each event's position in the operator table, -1: none
    kinds, input_dims, input_types = (ops[c].to_numpy() for c in ("kind", "input_dims", "input_types"))
    for where, row, position in zip(context, events.tolist(), at.tolist()):
        if row < 0 or row in seen or position < 0 or kinds[position] != "operator":
            continue
        seen.add(row)
        if sum("::" in frame for frame in str(where).split(" > ")) != 1:
            continue  # an operator inside another: its input is the outer one's
        dims = decode_inputs(input_dims[position])
        flat = dims and isinstance(dims[0], list) and all(isinstance(d, int) for d in dims[0])  # a list of tensors is no shape
        if flat and tuple(dims[0]) in parameter_shapes:
            continue
        total += first_input_bytes_of(input_dims[position], input_types[position]) or 0.0
    return total / max(1, _iterations(graph, ids))


def _iterations(graph: TaskGraph, ids: np.ndarray) -> int:
    """How many iterations the tasks span: the distinct ``ProfilerStep#N`` their contexts open with."""
    context = pd.unique(graph.tasks["context"].to_numpy()[ids])  # each distinct context once
    steps = {str(c).split(" > ", 1)[0] for c in context if str(c).startswith("ProfilerStep#")}
    return max(1, len(steps))


def describe(breakdown: MemoryBreakdown, gpu_bytes: Optional[float] = None) -> str:
    """One line: ``12.3 GB per GPU (parameters 1.0, gradients ..., activations ...) fits 80 GB``."""
    parts = ", ".join(f"{k} {getattr(breakdown, k) / 1e9:.2f}" for k in
                      ("parameters", "gradients", "optimizer", "gathered", "activations"))
    verdict = "" if gpu_bytes is None else (" fits " if fits(breakdown, gpu_bytes) else " does not fit ") + f"{gpu_bytes / 1e9:g} GB"
    return f"{breakdown.total_gb:.2f} GB per GPU ({parts}){verdict}"

