"""Tensor parallelism, with or without sequence parallelism: one rank's graph of a Megatron block.

Megatron-LM (Shoeybi et al., "Megatron-LM: training multi-billion parameter language models
using model parallelism", 2019) splits each transformer block's linear layers in pairs over the
``t`` ranks of a tensor-parallel group: the first of a pair (attention's QKV projection, the
MLP's first layer) by columns, the second (attention's output projection, the MLP's second
layer) by rows, so that everything between them (attention's heads, the MLP's activation)
works on a 1/t shard and one all-reduce of the pair's output completes it. Forward
all-reduces after each row-parallel layer (the ``g`` operator), backward after each
column-parallel layer's input gradient (the ``f`` operator): 2 + 2 per block and iteration, each
of the block's activation, ``batch x sequence x hidden x dtype`` bytes. Sequence parallelism
(Korthikanti et al., "Reducing activation recomputation in large transformer models", 2022)
splits the rest of the block (norms, dropout, residual adds) along the sequence and replaces
each all-reduce by a reduce-scatter and an all-gather of the same total bytes: forward
all-gathers before each column-parallel layer and reduce-scatters after each row-parallel one;
backward reduce-scatters after each column-parallel layer's input gradient and all-gathers the
output gradient before each row-parallel layer's backward (8 per block and iteration). The
parameters that stay replicated but now see only a sequence shard get partial gradients on each
rank, which are all-reduced over the tensor group after backward and before the optimizer step:
as one flat all-reduce of them all (``sequence_parallel_grads: coalesced``, Megatron-LM's
``finalize_model_grads``: each norm's weight and bias and each row-parallel layer's bias, which
Megatron adds after the reduce-scatter) or one per parameter (``per_parameter``, as DTensor's
``SequenceParallel`` leaves them: the norms' alone, since DTensor adds a row-parallel bias before
the reduce-scatter and its gradient comes whole from the gathered output gradient; the lab's CPU
workers wait for each at the step, 16 a step for its 4 blocks' norms). The norms are a unit's
outermost forward ``layer_norm``, ``rms_norm`` and ``group_norm`` calls, their parameters the
traced 1-D operands of parameter shape; the biases are the row-parallel calls' 1-D operands.
Where the residual stream leaves the units it is gathered whole for what runs replicated
(one all-gather after the last unit's forward and one after the first unit's backward, per
iteration; :func:`_gather_at_the_ends`).

**Where the pairs are.** In each unit (``units.py``) and iteration, the forward linear calls
(``aten::linear``, or an ``aten::addmm`` / ``aten::mm`` / ``aten::matmul`` outside one, with a
parameter-shaped operand) pair up in order: the 1st with the 2nd, the 3rd with the 4th. In a
mixture-of-experts unit (one holding the ``moe.dispatch`` range of ``examples/moe.py``) only
the calls before the dispatch pair up: the experts are the expert pass's (``expert.py``) and
the router, left unpaired, stays replicated, as an unpaired last call does anywhere. Backward
visits the unit's linears in reverse: its linear-backward nodes (``AddmmBackward0``,
``MmBackward0``) are matched to the forward calls from the last; where their counts differ the
unit's backward is left as traced and the note says so.

**What shrinks.** The compute of a pair's span (from the column-parallel call's start to the
row-parallel call's end, in backward from the row-parallel layer's backward node to the
column-parallel one's), GEMMs, attention and the element-wise kernels between them, all acting
on the 1/t shard, shrinks; with sequence parallelism the element-wise, normalisation and
reduction work of the rest of the unit (outside a mixture of experts) does too. Compute is, on a
GPU trace, every kernel, copy and memset those spans launched; on a CPU trace, the self time of
the modelled operators there (``perfmodels.families``) other than views and the composite
wrappers whose self time is dispatch (``aten::linear``, ``aten::matmul``,
``aten::scaled_dot_product_attention``). By how much: given operator models of the traced CPU
(the optional ``models``), each call's roofline ratio between its shard's shapes and its traced
ones, as the batch-size pass rescales a batch (:class:`Shrink`); else, and on a GPU trace (whose
kernels would need models of that GPU), the stated rule: 1/t. The rule overstates the gain of
small, memory-bound shards. CPU dispatch and Python time stay as traced: every rank still
launches every operator.

**Where the collectives go.** Each is a COMM task on the rank's ``network tensor`` resource (the
communication stream, one collective at a time), priced by ``topology.collective_cost(cluster,
op, nbytes, ranks=ranks_of["tensor"])``, after the call (or backward node) it follows, and
before the task that came next on that call's resource: the compute stream on a GPU trace, the
thread on a CPU trace (Gloo blocks it), so tensor-parallel communication is on the critical path
as it is in Megatron. An all-gather before a call waits for the task before the call on its
resource. Bytes follow nccl-tests' convention (``docs/communication.md``): the whole tensor for
all three operations. The replicated gradients' all-reduces wait for the task before the
iteration's first optimizer task (its first kernel on a GPU trace) on that task's resource (the
last backward task there) and hold that optimizer task; where an iteration traced no optimizer
step, they follow its last backward task. Under sequence parallelism the residual stream is
scattered into the first unit (a local slice) and gathered after the last: an all-gather after
the last unit's last forward task, and one after the first unit's last backward task for the
gradient the replicated embeddings take (a replicated head's gradient enters as a slice).

**The library's own host time** (``tensor_dispatch``, per pair: forward, backward, step). A
tensor-parallel library runs on the host what a plain trace does not hold: DTensor converts each
parallelized layer's inputs and outputs, propagates shardings for every operator of the layer
in Python, in forward and in backward, and routes each sharded parameter's update through the
same dispatch at the optimizer step. Where given, each pair's forward adds its ``forward`` time
to the row-parallel call's last CPU task (before the all-reduce it issues), each pair's backward
its ``backward`` time to the column-parallel layer's backward node's last CPU task, and each
iteration's optimizer step ``step`` times its pairs to its first CPU optimizer task; on a GPU
trace the host is late by as much, the kernels only where it holds them up. The lab measures the
three on its CPU (``lab/parallel.py``'s ``measure_tensor_dispatch``): the example transformer
under its tensor-parallel plan on a one-rank mesh (no communication, every operator at full
size) against the plain model, the phases' difference over the pairs.

A one-rank mesh skips each collective, and with it what the library does on the host to issue
and complete one: DTensor's functional collectives, their c10d call and the wait on their
result (0.6 to 1.1 ms of the training thread's CPU each on the lab's two ranks, against 0.25 to
0.3 on a mesh of one and 0.2 for a plain ``dist.all_reduce``, whose time the links' price holds). Where ``tensor_dispatch.collective``
is given, each collective the pass inserts adds it to the CPU task that issues it: the task the
collective follows on a thread, the one that launched that kernel on a stream. The lab
measures it (``lab/probes/tp_collectives.py``): the training thread's CPU time per
redistribution of the activation on two ranks, less the same on a mesh of one and less a plain
all-reduce's issue.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Optional

import numpy as np
import pandas as pd

from whatif.collectors.kineto import element_bytes
from whatif.topology import collective_cost

from ..graph import GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks
from ..passes.batch_size import parameter_shapes
from ..perfmodels.families import FAMILY_OF, VIEW_OPS
from ..perfmodels.models import PerfModels
from ..perfmodels.shapes import operator_units
from ..workload import decode_inputs
from . import PASSES, Parallelism
from .units import PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, Units

GROUP = "tensor"
LINEAR_CALLS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")
NORM_CALLS = ("aten::layer_norm", "aten::rms_norm", "aten::group_norm")
LINEAR_BACKWARD = re.compile(r"^autograd::engine::evaluate_function: (Addmm|Mm|Linear)Backward\d*$")
DISPATCH = "moe.dispatch"  # examples/moe.py's seam: where a mixture of experts sends its tokens
COMPOSITE = frozenset({"aten::linear", "aten::matmul", "aten::scaled_dot_product_attention"})
SEQUENCE_FAMILIES = frozenset({"elementwise", "norm", "reduction"})
COLLECTIVE_COLUMNS = ["task", "op", "nbytes", "group", "algorithm", "protocol", "time_us", "unit", "phase", "iteration"]


@dataclass
class TensorParallelChange:
    """What :func:`apply_tensor` did: the collectives it inserted (one row each) and the
    tasks it shrank."""

    tensor: int
    sequence_parallel: bool
    ranks: tuple
    sequence_parallel_grads: str = "coalesced"
    replicated_parameters: int = 0  # per iteration: the norms' and row-parallel biases' partial gradients
    pairs: int = 0  # column/row pairs found, over all units and iterations
    scaled_tasks: int = 0
    unmatched_backward: int = 0  # unit-iterations whose backward linears did not match forward
    dispatch_us: float = 0.0  # the library's host time added over all iterations (tensor_dispatch)
    issue_us: float = 0.0  # the library's host time for its collectives over all iterations (its collective key)
    collectives: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COLLECTIVE_COLUMNS))
    rule: str = "compute of the sharded spans x 1/t (no operator models)"

    def describe(self) -> str:
        per_op = self.collectives.groupby("op")["nbytes"].agg(["size", "sum"])
        ops = ", ".join(f"{int(n)} {op} ({total / 1e6:.3g} MB)" for op, (n, total) in per_op.iterrows()) or "none"
        text = (f"tensor parallel over {self.tensor} ranks{' with sequence parallelism' if self.sequence_parallel else ''}: "
                f"{self.pairs} column/row pairs, {self.scaled_tasks} tasks shrunk ({self.rule}); collectives: {ops}")
        if self.replicated_parameters:
            text += (f"; the {self.replicated_parameters} replicated parameters' gradients all-reduced before the step"
                     f" ({self.sequence_parallel_grads.replace('_', ' ')})")
        if self.dispatch_us:
            text += f"; the library's host time added: {self.dispatch_us / 1e3:.3g} ms"
        if self.issue_us:
            text += f"; issuing its collectives: {self.issue_us / 1e3:.3g} ms"
        if self.unmatched_backward:
            text += f"; {self.unmatched_backward} unit backwards left as traced (linears unmatched)"
        return text


# -- finding calls on the graph -------------------------------------------------------------------


class Calls:
    """The traced operators (rows of ``graph.ops``) and the tasks inside each, by time: a CPU
    task is inside an operator when it starts in the operator's span on its thread, a GPU task
    when the CPU task that launched it is."""

    def __init__(self, graph: TaskGraph, units: Units):
        self.graph, self.units = graph, units
        tasks = graph.tasks
        self.kind = tasks["kind"].to_numpy()
        self.gpu = np.isin(self.kind, [int(k) for k in GPU_TASK_KINDS])
        self.start = tasks["measured_start_us"].to_numpy(dtype=float)
        self.resource = tasks["resource"].astype(str).to_numpy()
        launch = graph.edges[graph.edges["kind"] == int(EdgeKind.LAUNCH)]
        self.launched: dict[int, list] = {}
        self.launcher: dict[int, int] = {}
        for s, d in zip(launch["src"].to_numpy().tolist(), launch["dst"].to_numpy().tolist()):
            self.launched.setdefault(s, []).append(d)
            self.launcher[d] = s
        self.by_thread: dict[str, tuple] = {}
        cpu = np.flatnonzero(~self.gpu & np.isfinite(self.start))
        for thread in np.unique(self.resource[cpu]):
            ids = cpu[self.resource[cpu] == thread]
            ids = ids[np.argsort(self.start[ids], kind="stable")]
            self.by_thread[thread] = (ids, self.start[ids])
        order = graph.resource_order()
        self.next_on = {}
        self.prev_on = {}
        for seq in order:
            seq = seq.tolist()
            for a, b in zip(seq, seq[1:]):
                self.next_on[a] = b
                self.prev_on[b] = a
        ops = graph.ops
        self.op_name = ops["name"].astype(str)
        self.op_start = ops["start_us"].to_numpy(dtype=float)
        self.op_end = self.op_start + ops["dur_us"].to_numpy(dtype=float)
        self.op_thread = ops["thread"].astype(str).to_numpy()
        steps = ops[self.op_name.str.match(r"^ProfilerStep#\d+$").to_numpy()]
        self.steps = sorted(zip(steps["start_us"].to_numpy(dtype=float),
                                (steps["start_us"] + steps["dur_us"]).to_numpy(dtype=float)))

    @cached_property
    def _ops_by_thread(self) -> dict:
        """Per thread, its operators (rows) in start order and their starts."""
        order = np.argsort(self.op_start, kind="stable")
        threads = self.op_thread[order]
        return {thread: (order[threads == thread], self.op_start[order[threads == thread]])
                for thread in np.unique(threads).tolist()}

    def ops_from(self, thread: str, start: float) -> np.ndarray:
        """The operators of ``thread`` that start at or after ``start``, in start order."""
        rows, starts = self._ops_by_thread.get(thread, (np.zeros(0, dtype=np.int64), np.zeros(0)))
        return rows[np.searchsorted(starts, start, side="left"):]

    def cpu_tasks(self, row: int) -> np.ndarray:
        """The CPU tasks inside operator ``row``, in time order."""
        thread = self.op_thread[row]
        if thread not in self.by_thread:
            return np.zeros(0, dtype=np.int64)
        ids, starts = self.by_thread[thread]
        lo, hi = np.searchsorted(starts, [self.op_start[row], self.op_end[row]], side="left")
        return ids[lo:hi]

    def span_tasks(self, thread: str, start: float, end: float) -> np.ndarray:
        ids, starts = self.by_thread.get(thread, (np.zeros(0, dtype=np.int64), np.zeros(0)))
        lo, hi = np.searchsorted(starts, [start, end], side="left")
        return ids[lo:hi]

    def unit_phase(self, row: int) -> tuple[int, int]:
        inside = self.cpu_tasks(row)
        if not len(inside):
            return -1, 0
        return int(self.units.task_unit[inside[0]]), int(self.units.task_phase[inside[0]])

    def in_step(self, it: int, n: int) -> np.ndarray:
        """Which of the first ``n`` tasks start inside iteration ``it``'s ``ProfilerStep`` (every
        timed task where the trace marks no such step)."""
        lo, hi = self.steps[it] if it < len(self.steps) else (-np.inf, np.inf)
        start = self.start[:n]
        return np.isfinite(start) & (start >= lo) & (start < hi)

    def iteration(self, row: int) -> int:
        for i, (lo, hi) in enumerate(self.steps):
            if lo <= self.op_start[row] < hi:
                return i
        return 0

    def last_task(self, row: int) -> Optional[int]:
        """The task that ends operator ``row``'s work: its last GPU task if it launched any,
        else its last CPU task."""
        return self.ending(self.cpu_tasks(row))

    def ending(self, cpu: np.ndarray) -> Optional[int]:
        """The task that ends the work of CPU tasks ``cpu`` (in time order): the last to end of
        the GPU tasks they launched, if any, else the last of them; None where ``cpu`` is empty."""
        if not len(cpu):
            return None
        gpu = [d for c in cpu.tolist() for d in self.launched.get(c, ())]
        if gpu:
            return max(gpu, key=lambda d: self.graph.tasks["measured_end_us"].iat[d])
        return int(cpu[-1])

    def first_task(self, row: int) -> Optional[int]:
        inside = self.cpu_tasks(row)
        if not len(inside):
            return None
        gpu = [d for c in inside.tolist() for d in self.launched.get(c, ())]
        return min(gpu, key=lambda d: self.start[d]) if gpu else int(inside[0])

    def rows_named(self, names) -> np.ndarray:
        if isinstance(names, re.Pattern):
            return np.flatnonzero(self.op_name.str.match(names).to_numpy())
        return np.flatnonzero(self.op_name.isin(names).to_numpy())

    def outermost(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` without those inside another of them (on the same thread)."""
        rows = rows[np.argsort(self.op_start[rows], kind="stable")]
        kept, end_of = [], {}
        for r in rows.tolist():
            thread = self.op_thread[r]
            if end_of.get(thread, -np.inf) > self.op_start[r]:
                continue
            kept.append(r)
            end_of[thread] = self.op_end[r]
        return np.asarray(kept, dtype=np.int64)


def linear_calls(calls: Calls, parameters: set) -> np.ndarray:
    """The forward calls of linear layers: the outermost GEMM calls with a parameter-shaped
    operand (a weight, or its transpose)."""
    rows = calls.outermost(calls.rows_named(LINEAR_CALLS))
    ops = calls.graph.ops
    keep = []
    for r in rows.tolist():
        dims = decode_inputs(ops.at[r, "input_dims"])
        if any(_is_shape(d) and len(d) == 2 and tuple(d) in parameters for d in dims):
            keep.append(r)
    return np.asarray(keep, dtype=np.int64)


def by_unit_iteration(calls: Calls, rows: np.ndarray, phase: int) -> dict[tuple, list]:
    """``rows`` of ``phase`` grouped by (unit, iteration), each group in time order."""
    out: dict[tuple, list] = {}
    for r in rows[np.argsort(calls.op_start[rows], kind="stable")].tolist():
        unit, got = calls.unit_phase(r)
        if unit >= 0 and got == phase:
            out.setdefault((unit, calls.iteration(r)), []).append(r)
    return out


def linear_shapes(ops: pd.DataFrame, row: int) -> tuple[float, float, float]:
    """A linear call's (input elements, output elements, element bytes) from its traced shapes:
    ``linear(x [..., in], W [out, in])``, ``addmm(bias, x [M, K], W [K, N])``, ``mm(x, W)``."""
    dims = decode_inputs(ops.at[row, "input_dims"])
    types = decode_inputs(ops.at[row, "input_types"])
    name = str(ops.at[row, "name"])
    first = 1 if name == "aten::addmm" else 0
    x, w = dims[first], dims[first + 1]
    size = element_bytes(types[first]) if len(types) > first else 4
    rows = float(np.prod(x[:-1])) if len(x) > 1 else 1.0
    out_features = w[0] if name == "aten::linear" else w[-1]
    return rows * x[-1], rows * out_features, float(size)


def _is_shape(d) -> bool:
    return isinstance(d, list) and bool(d) and all(isinstance(v, int) for v in d)


# -- inserting collectives ------------------------------------------------------------------------


class Collectives:
    """COMM tasks to add to a graph on one communication resource, priced on a group's GPUs."""

    def __init__(self, graph: TaskGraph, calls: Calls, cluster, group: str, ranks, resource: str):
        self.graph, self.calls, self.cluster, self.group = graph, calls, cluster, group
        self.ranks, self.resource = tuple(ranks), resource
        self.rows, self.edges, self.records = [], [], []
        self.issuers: list[int] = []  # per collective, the CPU task that issues it (where known)

        @lru_cache(maxsize=None)
        def price(op: str, nbytes: float):
            return collective_cost(cluster, op, nbytes, ranks=self.ranks)

        self.price = price

    def after(self, task: Optional[int], op: str, nbytes: float, unit: int, phase: int, iteration: int) -> None:
        """A collective that starts once ``task`` ended and that the task after it on its
        resource waits for."""
        if task is None:
            return
        self._add(task, self.calls.next_on.get(task), op, nbytes, unit, phase, iteration)

    def before(self, task: Optional[int], op: str, nbytes: float, unit: int, phase: int, iteration: int) -> None:
        """A collective that ``task`` waits for, started once the task before it on its resource ended."""
        if task is None:
            return
        self._add(self.calls.prev_on.get(task), task, op, nbytes, unit, phase, iteration)

    def _add(self, src, dst, op, nbytes, unit, phase, iteration) -> None:
        cost = self.price(op, float(nbytes))
        tid = len(self.graph.tasks) + len(self.rows)
        anchor = src if src is not None else dst
        t = self.graph.tasks
        when = t["measured_end_us"].iat[src] if src is not None else t["measured_start_us"].iat[dst]
        self.rows.append({
            "name": f"{op.replace('_', '-')} {self.group} {int(nbytes)} B",
            "kind": int(TaskKind.COMM), "resource": self.resource, "duration_us": float(cost.time_us),
            "release_us": -np.inf, "order_key": float(when) if np.isfinite(when) else float(len(self.rows)),
            "measured_start_us": np.nan, "measured_end_us": np.nan,
            "context": t["context"].iat[anchor], "operator": t["operator"].iat[anchor], "layer": t["layer"].iat[anchor],
            "event": -1,
        })
        issuer = self.issuer(src)
        if issuer is not None:
            self.issuers.append(issuer)
        if src is not None:
            self.edges.append((int(src), tid, 0.0, int(EdgeKind.USER)))
        if dst is not None:
            self.edges.append((tid, int(dst), 0.0, int(EdgeKind.USER)))
        self.records.append((tid, op, float(nbytes), self.group, cost.algorithm, cost.protocol, float(cost.time_us),
                             unit, phase, iteration))

    def issuer(self, task: Optional[int]) -> Optional[int]:
        """The CPU task that issues a collective starting after ``task``: ``task`` itself on a
        thread, the CPU task that launched it on a stream (None where neither is known)."""
        if task is None or task >= len(self.calls.gpu):
            return None
        if not self.calls.gpu[task]:
            return int(task)
        return self.calls.launcher.get(int(task))

    def commit(self) -> pd.DataFrame:
        """Add the tasks and edges to the graph; their records, one row each."""
        if self.rows:
            tasks = self.graph.tasks
            self.graph.tasks = concat_tasks([tasks, pd.DataFrame(self.rows).reindex(columns=tasks.columns)])
            self.graph.add_edges(self.edges)
        return pd.DataFrame(self.records, columns=COLLECTIVE_COLUMNS)


def compute_tasks(calls: Calls, cpu: np.ndarray, families=None) -> np.ndarray:
    """The tasks that compute among CPU tasks ``cpu`` and what they launched: every GPU task;
    on a CPU trace, the self time of modelled operators (of ``families``, if given) other than
    views and composite wrappers."""
    names = calls.graph.tasks["name"].astype(str).to_numpy()
    gpu = [d for c in cpu.tolist() for d in calls.launched.get(c, ())]
    if gpu:
        return np.asarray(gpu, dtype=np.int64)
    keep = [c for c in cpu.tolist() if names[c] in FAMILY_OF and names[c] not in VIEW_OPS and names[c] not in COMPOSITE
            and (families is None or FAMILY_OF[names[c]] in families)]
    return np.asarray(keep, dtype=np.int64)


def with_collectives(units: Units, graph: TaskGraph, collectives: pd.DataFrame) -> Units:
    """``units`` for ``graph``, which a pass made by appending tasks to the graph ``units``
    describe: the appended tasks get the unit and phase of the collectives they are (rows of a
    note's ``collectives``), other appended tasks none."""
    extra = len(graph.tasks) - len(units.task_unit)
    task_unit = np.concatenate([units.task_unit, np.full(extra, -1, dtype=units.task_unit.dtype)])
    task_phase = np.concatenate([units.task_phase, np.zeros(extra, dtype=units.task_phase.dtype)])
    if len(collectives):
        ids = collectives["task"].to_numpy(dtype=np.int64)
        task_unit[ids] = collectives["unit"].to_numpy()
        task_phase[ids] = collectives["phase"].to_numpy()
    return dataclasses.replace(units, task_unit=task_unit, task_phase=task_phase)


# -- the pass -------------------------------------------------------------------------------------


def apply_tensor(graph: TaskGraph, units: Units, par: Parallelism, cluster, ranks_of: dict,
                 models: Optional[PerfModels] = None) -> TaskGraph:
    """One tensor-parallel rank's graph (see the module's docstring); what was done is the new
    graph's last note, a :class:`TensorParallelChange`. ``tensor == 1`` returns ``graph``.
    ``models``: operator models of the traced CPU, to shrink its operators by their roofline
    ratio instead of the 1/t rule (:class:`Shrink`)."""
    t = par.tensor
    if t == 1:
        return graph
    graph, calls, comm = rank_pass(graph, units, cluster, ranks_of, GROUP, t)
    change = TensorParallelChange(t, par.sequence_parallel, comm.ranks, par.sequence_parallel_grads)
    forward = by_unit_iteration(calls, linear_calls(calls, parameter_shapes(graph)), PHASE_FORWARD)
    backward = by_unit_iteration(calls, calls.outermost(calls.rows_named(LINEAR_BACKWARD)), PHASE_BACKWARD)
    dispatch = by_unit_iteration(calls, calls.rows_named([DISPATCH]), PHASE_FORWARD)
    ops = graph.ops
    factor = np.ones(len(graph.tasks))
    shrink = Shrink(graph, t, models)
    change.rule = shrink.rule
    sp = par.sequence_parallel
    norms = by_unit_iteration(calls, calls.outermost(calls.rows_named(NORM_CALLS)), PHASE_FORWARD) if sp else {}
    replicated: dict[int, list] = {}  # per iteration: the bytes of each replicated parameter's gradient
    ends: dict[int, list] = {}  # per iteration, with sequence parallelism: (start, unit, activation bytes) of each unit
    for (unit, it), fwd in forward.items():
        if (unit, it) in dispatch:
            first = calls.op_start[dispatch[unit, it][0]]
            fwd_dense = [r for r in fwd if calls.op_start[r] < first]
        else:
            fwd_dense = fwd
        pairs = [(fwd_dense[i], fwd_dense[i + 1]) for i in range(0, len(fwd_dense) - 1, 2)]
        change.pairs += len(pairs)
        paired_until = len(pairs) * 2
        bwd = backward.get((unit, it), [])
        matched = len(bwd) == len(fwd)
        if not matched:
            change.unmatched_backward += 1
        back_of = {f: b for f, b in zip(fwd, reversed(bwd))} if matched else {}
        activation = [np.prod(linear_shapes(ops, col)[::2]) for col, _ in pairs]  # each pair's input bytes
        for (col, row), in_bytes in zip(pairs, activation):
            out_bytes = np.prod(linear_shapes(ops, row)[1:])
            where = (unit, PHASE_FORWARD, it)
            _shard_pair(calls, comm, factor, shrink, sp, col, row, gather_bytes=in_bytes, reduce_bytes=out_bytes, where=where)
            if matched:
                where = (unit, PHASE_BACKWARD, it)
                _shard_pair(calls, comm, factor, shrink, sp, back_of[row], back_of[col], gather_bytes=out_bytes,
                            reduce_bytes=in_bytes, where=where)
        if sp:
            _shard_rest(calls, units, factor, shrink, unit, it, fwd, bwd if matched else [], paired_until)
            biased = [row for _, row in pairs] if par.sequence_parallel_grads == "coalesced" else []
            replicated.setdefault(it, []).extend(_replicated_gradients(ops, norms.get((unit, it), []), biased))
            if pairs:
                ends.setdefault(it, []).append((calls.op_start[pairs[0][0]], unit, activation[0]))
    if not change.pairs:
        raise GraphError(f"parallelism.tensor: no pair of linear layers (column- then row-parallel) found in the "
                         f"forward of the {len(units)} units ({units.pattern}) of {graph.workload.source}")
    for it, sizes in sorted(replicated.items()):
        _reduce_replicated(calls, units, comm, it, sizes, par.sequence_parallel_grads)
    for it, entries in sorted(ends.items()):
        _gather_at_the_ends(calls, units, comm, it, min(entries), max(entries))
    change.replicated_parameters = max((len(v) for v in replicated.values()), default=0)
    change.scaled_tasks = int((factor != 1.0).sum())
    graph.scale(np.arange(len(graph.tasks)), factor)
    change.dispatch_us = _add_dispatch(graph, calls, units, forward, backward, dispatch, par.tensor_dispatch)
    if par.tensor_collective:
        extra = np.zeros(len(graph.tasks))
        np.add.at(extra, np.asarray(comm.issuers, dtype=np.int64), par.tensor_collective)
        graph.lengthen(extra)
        change.issue_us = float(extra.sum())
    change.collectives = comm.commit()
    graph.notes.append(change)
    return graph


def rank_pass(graph: TaskGraph, units: Units, cluster, ranks_of: dict, group: str, size: int):
    """What a pass over one rank's graph starts from: a copy of ``graph``, its :class:`Calls`,
    and the :class:`Collectives` of ``group`` (whose ``ranks_of`` entry must hold ``size`` GPUs)."""
    ranks = tuple(ranks_of.get(group, ()))
    if len(ranks) != size:
        raise GraphError(f"parallelism.{group}: {size} ranks, but this rank's {group} group has {len(ranks)} GPUs")
    graph = graph.copy()
    calls = Calls(graph, units)
    return graph, calls, Collectives(graph, calls, cluster, group, ranks, f"network {group}")


def _shard_pair(calls: Calls, comm: "Collectives", factor: np.ndarray, shrink: "Shrink", sp: bool, first: int, last: int, *,
                gather_bytes: float, reduce_bytes: float, where: tuple) -> None:
    """One column/row pair in one phase (forward: column call then row call; backward: the row
    layer's backward node then the column layer's): its span's compute x 1/t, then an
    all-reduce after it, or with sequence parallelism an all-gather before and a reduce-scatter
    after."""
    inside = calls.span_tasks(calls.op_thread[first], calls.op_start[first], calls.op_end[last])
    chosen = compute_tasks(calls, inside)
    factor[chosen] = shrink(chosen)
    if sp:
        comm.before(calls.first_task(first), "all_gather", gather_bytes, *where)
        comm.after(calls.last_task(last), "reduce_scatter", reduce_bytes, *where)
    else:
        comm.after(calls.last_task(last), "all_reduce", reduce_bytes, *where)


def _add_dispatch(graph: TaskGraph, calls: Calls, units: Units, forward: dict, backward: dict, moe: dict,
                  per_pair: tuple) -> float:
    """Lengthen the host tasks that carry the library's own time (``per_pair``: forward,
    backward and step microseconds per column/row pair; see the module's docstring); the time
    added in all."""
    fwd_us, bwd_us, step_us = per_pair
    if not (fwd_us or bwd_us or step_us):
        return 0.0
    extra = np.zeros(len(graph.tasks))
    pairs_of_iteration: dict[int, int] = {}
    for (unit, it), fwd in forward.items():
        dense = [r for r in fwd if calls.op_start[r] < calls.op_start[moe[unit, it][0]]] if (unit, it) in moe else fwd
        pairs = [(dense[i], dense[i + 1]) for i in range(0, len(dense) - 1, 2)]
        pairs_of_iteration[it] = pairs_of_iteration.get(it, 0) + len(pairs)
        bwd = backward.get((unit, it), [])
        back_of = {f: b for f, b in zip(fwd, reversed(bwd))} if len(bwd) == len(fwd) else {}
        for col, row in pairs:
            _add_to_last(calls, extra, row, fwd_us)
            if col in back_of:
                _add_to_last(calls, extra, back_of[col], bwd_us)
    n = len(units.task_unit)
    start = calls.start[:n]
    for it, pairs in pairs_of_iteration.items():
        optimizer = np.flatnonzero(calls.in_step(it, n) & (units.task_phase == PHASE_OPTIMIZER) & ~calls.gpu[:n])
        if len(optimizer):
            extra[int(optimizer[np.argmin(start[optimizer])])] += step_us * pairs
    graph.lengthen(extra)
    return float(extra.sum())


def _add_to_last(calls: Calls, extra: np.ndarray, row: int, us: float) -> None:
    """``us`` more on the last CPU task of operator ``row``."""
    inside = calls.cpu_tasks(row)
    if us and len(inside):
        extra[int(inside[-1])] += us


def _replicated_gradients(ops: pd.DataFrame, norm_rows: list, row_parallel: list) -> list[float]:
    """The bytes of each parameter that sequence parallelism leaves replicated with a partial
    gradient: the 1-D parameter operands of the unit's norm calls (after their input) and of
    its row-parallel calls (their bias), each once."""
    out = []
    for r in list(norm_rows) + list(row_parallel):
        dims, types = decode_inputs(ops.at[r, "input_dims"]), decode_inputs(ops.at[r, "input_types"])
        name = str(ops.at[r, "name"])
        positions = [0] if name == "aten::addmm" else (range(1, len(dims)) if name in NORM_CALLS else [2])
        for i in positions:
            if i < len(dims) and _is_shape(dims[i]) and len(dims[i]) == 1:
                out.append(float(dims[i][0]) * (element_bytes(types[i]) if i < len(types) else 4))
    return out


def _reduce_replicated(calls: Calls, units: Units, comm: "Collectives", it: int, sizes: list, how: str) -> None:
    """Iteration ``it``'s all-reduces of the replicated gradients ``sizes`` (bytes each): one of
    their sum, or one each, held by the iteration's first optimizer task (see the module's docstring)."""
    if not sizes:
        return
    n = len(units.task_unit)
    start = calls.start[:n]
    in_step = calls.in_step(it, n)
    where = (-1, PHASE_OPTIMIZER, it)
    optimizer = np.flatnonzero(in_step & (units.task_phase == PHASE_OPTIMIZER))
    if calls.gpu[optimizer].any():  # on a GPU trace the step's kernels wait, not the host
        optimizer = optimizer[calls.gpu[optimizer]]
    each = [float(sum(sizes))] if how == "coalesced" else sizes
    if len(optimizer):
        first = int(optimizer[np.argmin(start[optimizer])])
        for nbytes in each:
            comm.before(first, "all_reduce", nbytes, *where)
        return
    backward = np.flatnonzero(in_step & (units.task_phase == PHASE_BACKWARD))
    if len(backward):
        last = int(backward[np.argmax(calls.graph.tasks["measured_end_us"].to_numpy()[backward])])
        for nbytes in each:
            comm.after(last, "all_reduce", nbytes, *where)


def _gather_at_the_ends(calls: Calls, units: Units, comm: "Collectives", it: int, first: tuple, last: tuple) -> None:
    """Sequence parallelism's two collectives at the units' boundary in iteration ``it``
    (``first`` and ``last``: (start, unit, activation bytes) of the first and last unit): the
    residual stream leaves the last unit's forward as each rank's sequence shard and is
    all-gathered for what runs replicated after it (a final norm, the head), and the gradient
    leaves the first unit's backward as a shard and is all-gathered for what runs replicated
    before it (the embeddings). Where the units enter, a local slice; where the replicated
    head's full gradient enters them, a local slice again: no collective (DTensor's
    ``PrepareModuleInputOutput`` around the blocks, Megatron-LM's scatter after the embedding)."""
    for (_, unit, nbytes), phase in ((last, PHASE_FORWARD), (first, PHASE_BACKWARD)):
        comm.after(_unit_end(calls, units, unit, phase, it), "all_gather", nbytes, unit, phase, it)


def _unit_end(calls: Calls, units: Units, unit: int, phase: int, it: int) -> Optional[int]:
    """The task that ends ``unit``'s ``phase`` in iteration ``it``: its last CPU task's last GPU
    task where it launched any (the stream's), else that CPU task; None where it has none."""
    n = len(units.task_unit)
    start = calls.start[:n]
    mine = np.flatnonzero((units.task_unit == unit) & (units.task_phase == phase) & ~calls.gpu[:n]
                          & calls.in_step(it, n))
    return calls.ending(mine[np.argsort(start[mine], kind="stable")])


def _shard_rest(calls: Calls, units: Units, factor: np.ndarray, shrink: "Shrink", unit: int, it: int, fwd: list,
                bwd: list, paired_until: int) -> None:
    """Sequence parallelism: the unit's other element-wise, norm and reduction work in this
    iteration takes 1/t, outside a mixture of experts (from the first unpaired linear call in
    forward, up to the end of its backward node)."""
    for phase, rows in ((PHASE_FORWARD, fwd), (PHASE_BACKWARD, bwd)):
        if not rows:
            continue
        n = len(units.task_unit)  # tasks a pass appended after ``units`` was found belong to none
        mine = np.flatnonzero((units.task_unit == unit) & (units.task_phase == phase) & ~calls.gpu[:n]
                              & calls.in_step(it, n))
        if paired_until < len(fwd):
            if phase == PHASE_FORWARD:
                mine = mine[calls.start[mine] < calls.op_start[fwd[paired_until]]]
            else:
                unpaired_back = rows[len(fwd) - 1 - paired_until]
                mine = mine[calls.start[mine] >= calls.op_end[unpaired_back]]
        chosen = compute_tasks(calls, mine, SEQUENCE_FAMILIES)
        chosen = chosen[factor[chosen] == 1.0]
        factor[chosen] = shrink(chosen)


class Shrink:
    """The factor of each compute task of a 1/t shard: the rule's 1/t, or on a CPU trace with
    operator models the batch-size pass's method (``passes/batch_size.py``): the roofline ratio
    ``model(shard's shapes) / model(traced shapes)`` of the outermost modelled operator around
    the task, without the learned correction. The shard's shapes (:func:`shard_dims`): a GEMM's
    output columns (``N``) / t, a batched GEMM's batch / t, attention's heads / t, and the
    largest tensors' largest dimension divisible by t for element-wise, norm and reduction work.
    Where a shape does not divide or a family has no model, the rule's 1/t."""

    def __init__(self, graph: TaskGraph, t: int, models: Optional[PerfModels]):
        self.t, self.event = t, graph.tasks["event"].to_numpy()
        self.ratio: dict = {}
        self.rule = "compute of the sharded spans x 1/t (no operator models)"
        if models is None or graph.workload.has_gpu:
            return
        units = operator_units(graph.ops)
        heads = units[(units["unit"] == units["row"]).to_numpy()]
        ops, dims, types, args = (heads[c].tolist() for c in ("op", "dims", "types", "args"))
        sharded = [shard_dims(op, d, t) for op, d in zip(ops, dims)]
        ok = [i for i, d in enumerate(sharded) if d is not None]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pick = lambda values: [values[i] for i in ok]  # noqa: E731
            before = models.predict_us(pick(ops), pick(dims), pick(types), pick(args), learned=False)
            after = models.predict_us(pick(ops), [sharded[i] for i in ok], pick(types), pick(args), learned=False)
        ratio = after / before
        good = np.isfinite(ratio) & (ratio > 0)
        of_head = {int(heads["row"].iat[i]): float(min(r, 1.0)) for i, r, g in zip(ok, ratio, good) if g}
        self.ratio = {int(r): of_head[int(u)] for r, u in zip(units["row"], units["unit"]) if int(u) in of_head}
        self.rule = (f"compute of the sharded spans x its operator's roofline ratio at the 1/t shard "
                     f"({len(of_head)} calls modelled), else x 1/t")

    def __call__(self, tasks: np.ndarray) -> np.ndarray:
        default = 1.0 / self.t
        return np.array([self.ratio.get(int(self.event[i]), default) for i in tasks.tolist()], dtype=float)


def shard_dims(op: str, dims: list, t: int) -> Optional[list]:
    """``dims`` of one call at its 1/t tensor-parallel shard (see :class:`Shrink`); None where
    the shard's dimension does not divide by t or the call recorded no shapes."""
    shapes = [d if _is_shape(d) else None for d in dims]
    out = list(dims)

    def cut(i: int, axis: int) -> bool:
        d = shapes[i] if i < len(shapes) else None
        if d is None or not -len(d) <= axis < len(d) or d[axis] % t:
            return False
        d = list(d)
        d[axis] //= t
        out[i] = d
        return True

    family = FAMILY_OF.get(op)
    if op in ("aten::bmm", "aten::baddbmm"):
        first = 1 if op == "aten::baddbmm" else 0
        return out if cut(first, 0) and cut(first + 1, 0) and (first == 0 or cut(0, 0)) else None
    if family == "gemm":
        if op == "aten::linear":
            ok = cut(1, 0)
            if len(shapes) > 2 and shapes[2] is not None:
                ok &= cut(2, 0)
            return out if ok else None
        first = 1 if op == "aten::addmm" else 0
        ok = cut(first + 1, -1)
        if first and shapes[0] is not None:
            ok &= cut(0, -1)
        return out if ok else None
    if family == "attention":
        four = [i for i, d in enumerate(shapes) if d is not None and len(d) == 4]
        return out if four and all(cut(i, 1) for i in four) else None
    sized = [(int(np.prod(d)), i) for i, d in enumerate(shapes) if d is not None]
    if not sized:
        return None
    biggest = max(n for n, _ in sized)
    for i in [i for n, i in sized if n == biggest]:
        axis = max((a for a, v in enumerate(shapes[i]) if v % t == 0 and v >= t), key=lambda a: shapes[i][a], default=None)
        if axis is None or not cut(i, axis):
            return None
    return out


PASSES[GROUP] = apply_tensor
