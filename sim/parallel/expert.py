"""Expert parallelism and sharded embeddings: one rank's graph when layers are split over ranks
and tokens (or lookups) travel to them by all-to-all.

**Mixture of experts** (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021;
Megatron-LM's expert parallelism, whose expert group is carved out of the data-parallel group):
each of the ``ep`` ranks of an expert group keeps ``E / ep`` of a layer's ``E`` experts. Every
rank routes its own tokens, sends each expert's ``capacity x hidden`` slice of its dispatch
buffer to the rank that holds the expert (an all-to-all), runs its local experts on what all
ranks sent it (``ep x capacity`` tokens each), and sends the outputs back (a second all-to-all).
Backward runs the two in reverse: the output gradients travel to the experts' ranks before the
experts' backward, the input gradients back after it. So 4 all-to-alls per MoE layer and
iteration, each of a rank's whole send buffer, ``experts x capacity x hidden x dtype`` bytes
(nccl-tests' size for all-to-all, ``docs/communication.md``), read from the traced expert
calls' shapes. A layer is found as ``examples/moe.py`` marks it: its ``moe.dispatch`` and
``moe.combine`` ranges (empty on one worker), between which the experts run; an expert is the
run of linear calls that starts with the first call's weight shape (its first layer).

**What the experts cost (the stated rule).** A rank runs ``E / ep`` experts on ``ep`` times the
tokens: the traced experts numbered ``0 .. E/ep - 1`` stand for the rank's, their compute
(``tensor.compute_tasks``: kernels on a GPU trace, the modelled operators' self time on a CPU
one) taking ``ep`` times its traced time (a GEMM's time in proportion to its rows: compute
bound), their dispatch overheads as traced; the other experts' tasks, forward and backward, take
no time on this rank. Total expert FLOPs per rank are unchanged; per-call overheads fall by
``ep``. The router stays replicated (every rank routes its own tokens). The experts'
gradients are all-reduced over the ``expert_data`` group, which is the data-parallel pass's
business (``fsdp.py``), not this one's.

**Sharded embeddings** (DLRM, Naumov et al. 2019; the ``param-dlrm-8rank`` traces): where the
graph has no mixture of experts but embedding lookups (``aten::embedding_bag``,
``aten::embedding``), the tables are sharded table-wise over the expert group: each rank looks
up its ``1/ep`` of the tables for ``ep`` times the batch, which keeps the traced lookup work,
and one all-to-all after the iteration's last forward lookup exchanges the pooled outputs
(every lookup's output bytes as traced: ``batch x dim`` per bag, ``indices x dim`` for a plain
embedding), the same again before the first embedding backward for their gradients.

Every all-to-all is a COMM task on the rank's ``network expert`` resource, priced by
``topology.collective_cost(cluster, "all_to_all", nbytes, ranks=ranks_of["expert"])``, which
the tasks after it wait for (``tensor.Collectives``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from whatif.collectors.kineto import element_bytes

from ..gradients import ACCUMULATE_GRAD
from ..graph import GraphError, TaskGraph
from ..passes.batch_size import parameter_shapes
from ..workload import decode_inputs
from . import PASSES, Parallelism
from .tensor import (COLLECTIVE_COLUMNS, DISPATCH, LINEAR_BACKWARD, Calls, Collectives, by_unit_iteration, compute_tasks,
                     linear_calls, linear_shapes, rank_pass)
from .units import PHASE_BACKWARD, PHASE_FORWARD, Units

GROUP = "expert"
#: what the autograd engine runs after a linear's backward to write its parameters' gradients:
#: ``AccumulateGrad`` (with and without its wrapper), and the transpose of the weight's gradient
#: (``TBackward0``) between the bias's and the weight's
_WRITES_GRADIENT = ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", ACCUMULATE_GRAD,
                    "autograd::engine::evaluate_function: TBackward0", "TBackward0")
COMBINE = "moe.combine"
LOOKUPS = ("aten::embedding_bag", "aten::_embedding_bag", "aten::embedding")
LOOKUP_BACKWARD = re.compile(r"^autograd::engine::evaluate_function: Embedding(Bag)?Backward\d*$")


@dataclass
class ExpertParallelChange:
    """What :func:`apply_expert` did: the all-to-alls it inserted (one row each)."""

    expert: int
    ranks: tuple
    kind: str = "moe"  # or "embeddings"
    layers: int = 0  # MoE layers (or embedding exchanges) over all iterations
    experts: int = 0  # experts per layer, as traced
    unmatched_backward: int = 0
    collectives: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COLLECTIVE_COLUMNS))
    #: the tasks of the other ranks' experts, which take no time on this rank (their backward's
    #: gradient writes too: a pipeline adds no later microbatch into them)
    elsewhere: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def describe(self) -> str:
        n, total = len(self.collectives), float(self.collectives["nbytes"].sum()) if len(self.collectives) else 0.0
        if self.kind == "moe":
            text = (f"expert parallel over {self.expert} ranks: {self.layers} MoE layer passes, {self.experts} experts "
                    f"each, {self.experts // self.expert} local; {n} all-to-alls ({total / 1e6:.3g} MB)")
        else:
            text = (f"embeddings sharded over {self.expert} ranks: {self.layers} iterations, "
                    f"{n} all-to-alls ({total / 1e6:.3g} MB)")
        if self.unmatched_backward:
            text += f"; {self.unmatched_backward} backwards left as traced (linears unmatched)"
        return text


def apply_expert(graph: TaskGraph, units: Units, par: Parallelism, cluster, ranks_of: dict) -> TaskGraph:
    """One expert-parallel rank's graph (see the module's docstring); what was done is the new
    graph's last note, an :class:`ExpertParallelChange`. ``expert == 1`` returns ``graph``."""
    ep = par.expert
    if ep == 1:
        return graph
    graph, calls, comm = rank_pass(graph, units, cluster, ranks_of, GROUP, ep)
    change = ExpertParallelChange(ep, comm.ranks)
    factor = np.ones(len(graph.tasks))
    if len(calls.rows_named([DISPATCH])):
        _experts(calls, comm, change, factor, ep)
    elif len(calls.rows_named(LOOKUPS)):
        change.kind = "embeddings"
        _embeddings(calls, comm, change)
    else:
        raise GraphError(f"parallelism.expert: {graph.workload.source} has no mixture-of-experts layer (no "
                         f"{DISPATCH!r} range) and no embedding lookup to shard")
    graph.scale(np.arange(len(graph.tasks)), factor)
    if change.kind == "moe":
        change.elsewhere = np.flatnonzero(factor == 0.0)
    change.collectives = comm.commit()
    graph.notes.append(change)
    return graph


def _experts(calls: Calls, comm: Collectives, change: ExpertParallelChange, factor: np.ndarray, ep: int) -> None:
    ops = calls.graph.ops
    forward = by_unit_iteration(calls, linear_calls(calls, parameter_shapes(calls.graph)), PHASE_FORWARD)
    backward = by_unit_iteration(calls, calls.outermost(calls.rows_named(LINEAR_BACKWARD)), PHASE_BACKWARD)
    dispatches = calls.rows_named([DISPATCH])
    combines = calls.rows_named([COMBINE])
    for d in dispatches[np.argsort(calls.op_start[dispatches], kind="stable")].tolist():
        unit, _ = calls.unit_phase(d)
        it = calls.iteration(d)
        after = combines[(calls.op_start[combines] >= calls.op_end[d]) & (calls.op_thread[combines] == calls.op_thread[d])]
        if not len(after):
            continue
        combine = after[np.argmin(calls.op_start[after])]
        fwd = forward.get((unit, it), [])
        inside = [r for r in fwd if calls.op_end[d] <= calls.op_start[r] < calls.op_start[combine]]
        if not inside:
            continue
        weight = _weight_shape(ops, inside[0])
        starts = [i for i, r in enumerate(inside) if _weight_shape(ops, r) == weight]
        experts = [inside[s:e] for s, e in zip(starts, starts[1:] + [len(inside)])]
        n = len(experts)
        if n % ep:
            raise GraphError(f"parallelism.expert: {ep} does not divide the {n} experts of {DISPATCH} in unit {unit}")
        change.layers += 1
        change.experts = n
        local = n // ep
        thread = calls.op_thread[d]
        for e, rows in enumerate(experts):
            span = calls.span_tasks(thread, calls.op_start[rows[0]], calls.op_end[rows[-1]])
            _run_expert(calls, span, factor, e < local, ep)
        send = sum(np.prod(linear_shapes(ops, rows[0])[::2]) for rows in experts)
        back = sum(np.prod(linear_shapes(ops, rows[-1])[1:]) for rows in experts)
        comm.before(calls.first_task(experts[0][0]), "all_to_all", send, unit, PHASE_FORWARD, it)
        comm.after(calls.last_task(experts[-1][-1]), "all_to_all", back, unit, PHASE_FORWARD, it)
        bwd = backward.get((unit, it), [])
        if len(bwd) != len(fwd):
            change.unmatched_backward += 1
            continue
        back_of = dict(zip(fwd, reversed(bwd)))
        for e, rows in enumerate(experts):
            nodes = [back_of[r] for r in rows]
            lo, hi = min(calls.op_start[nodes]), max(calls.op_end[nodes])
            thread = calls.op_thread[nodes[0]]
            if e >= local:  # another rank's expert writes its gradients there too
                hi = _gradients_written(calls, thread, hi)
            _run_expert(calls, calls.span_tasks(thread, lo, hi), factor, e < local, ep)
        nodes = [back_of[r] for rows in experts for r in rows]
        first = min(nodes, key=lambda r: calls.op_start[r])
        last = max(nodes, key=lambda r: calls.op_end[r])
        comm.before(calls.first_task(first), "all_to_all", back, unit, PHASE_BACKWARD, it)
        comm.after(calls.last_task(last), "all_to_all", send, unit, PHASE_BACKWARD, it)


def _gradients_written(calls: Calls, thread: str, after: float) -> float:
    """The end of the calls that write gradients (:data:`_WRITES_GRADIENT`) that the autograd
    engine runs on ``thread`` right after ``after`` (``after`` itself where none does): the last
    of an expert's gradients is written once its backward has ended, after the span of its
    backward nodes."""
    end = after
    for row in calls.ops_from(thread, after).tolist():
        if calls.op_start[row] < end:
            continue  # inside the call before
        if calls.op_name.iat[row] not in _WRITES_GRADIENT:
            break
        end = calls.op_end[row]
    return end


def _run_expert(calls: Calls, span: np.ndarray, factor: np.ndarray, local: bool, ep: int) -> None:
    """A local expert's compute takes ``ep`` times its time (``ep`` ranks' tokens); another
    rank's expert takes none of this rank's time."""
    if local:
        factor[compute_tasks(calls, span)] = float(ep)
    else:
        gpu = [d for c in span.tolist() for d in calls.launched.get(c, ())]
        factor[span] = 0.0
        factor[np.asarray(gpu, dtype=np.int64)] = 0.0


def _weight_shape(ops: pd.DataFrame, row: int):
    dims = decode_inputs(ops.at[row, "input_dims"])
    first = 1 if str(ops.at[row, "name"]) == "aten::addmm" else 0
    return tuple(dims[first + 1]) if len(dims) > first + 1 and isinstance(dims[first + 1], list) else None


def _embeddings(calls: Calls, comm: Collectives, change: ExpertParallelChange) -> None:
    ops = calls.graph.ops
    lookups = calls.outermost(calls.rows_named(LOOKUPS))
    backward = calls.outermost(calls.rows_named(LOOKUP_BACKWARD))
    per_iteration: dict[int, list] = {}
    for r in lookups.tolist():
        if calls.unit_phase(r)[1] != PHASE_BACKWARD:
            per_iteration.setdefault(calls.iteration(r), []).append(r)
    back_per_iteration: dict[int, list] = {}
    for r in backward.tolist():
        back_per_iteration.setdefault(calls.iteration(r), []).append(r)
    tables = max((len(rows) for rows in per_iteration.values()), default=0)
    if tables < change.expert:  # table-wise sharding: every rank holds at least one table
        raise GraphError(f"parallelism.expert: {calls.graph.workload.source} has no mixture-of-experts layer and "
                         f"{tables} embedding lookup{'s' if tables != 1 else ''} an iteration, fewer tables than "
                         f"the {change.expert} ranks that would each hold some of them (table-wise sharding)")
    for it, rows in sorted(per_iteration.items()):
        nbytes = sum(_lookup_bytes(ops, r) for r in rows)
        if not nbytes:
            raise GraphError(f"parallelism.expert: the trace recorded no shapes for its embedding lookups "
                             f"({ops.at[rows[0], 'name']}); capture with record_shapes=True")
        change.layers += 1
        last = max(rows, key=lambda r: calls.op_end[r])
        comm.after(calls.last_task(last), "all_to_all", nbytes, -1, PHASE_FORWARD, it)
        back = back_per_iteration.get(it, [])
        if back:
            first = min(back, key=lambda r: calls.op_start[r])
            comm.before(calls.first_task(first), "all_to_all", nbytes, -1, PHASE_BACKWARD, it)
        else:
            change.unmatched_backward += 1


def _lookup_bytes(ops: pd.DataFrame, row: int) -> float:
    """Output bytes of one lookup: ``bags x dim`` for an embedding bag (its offsets count the
    bags), ``indices x dim`` for a plain embedding; 0 where no shape was recorded."""
    dims = decode_inputs(ops.at[row, "input_dims"])
    types = decode_inputs(ops.at[row, "input_types"])
    if len(dims) < 2 or not isinstance(dims[0], list) or len(dims[0]) != 2:
        return 0.0
    size = element_bytes(types[0]) if types else 4
    dim = dims[0][1]
    if "bag" in str(ops.at[row, "name"]):
        offsets = dims[2] if len(dims) > 2 and isinstance(dims[2], list) and dims[2] else None
        rows = offsets[0] if offsets else 1
    else:
        rows = int(np.prod(dims[1])) if isinstance(dims[1], list) else 0
    return float(rows * dim * size)


PASSES[GROUP] = apply_expert
