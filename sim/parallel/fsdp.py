"""FSDP2 and ZeRO on one data-parallel rank: parameters gathered, gradients reduced, shards stepped.

:func:`apply_fsdp` turns the graph of one training process into the graph of one rank of a
``d``-way sharded data-parallel job; every rank runs the same graph, so one is simulated (the
data-parallel fast path). ZeRO's stages are those of Rajbhandari et al. (SC 2020); stage 3 is
modelled as PyTorch's FSDP2 runs it (``torch.distributed.fsdp.fully_shard``, the design
torchtitan uses; Zhao et al., VLDB 2023 for FSDP), with every unit of ``units.py`` a
``fully_shard`` unit and the root (the parameters outside every unit: embeddings, final norm,
head) wrapped last, as ``examples/parallel.py`` does.

The rules, for ``zero = 3``:

* **All-gathers.** A unit's parameters (its ``param_bytes``) are all-gathered before its forward
  and, when ``reshard_after_forward`` (FSDP2's default), again before its backward; the root's
  once per iteration, before the forward, since FSDP2 keeps the root unsharded after forward.
  They run one at a time in the order they are issued on a queue of their own (FSDP2's
  all-gather stream), ``network data: all_gather``.
* **Prefetch, one unit ahead.** In forward the order is the root, then the units; the root's
  all-gather is issued where the iteration's forward starts (after the previous step's
  optimizer updated the shards), and the next one's where the previous one's compute starts
  (its first task could start: its resource's previous task is done). In backward the order is
  the root, then the units reversed: FSDP2's implicit backward prefetch, a unit's pre-backward
  hook issuing the all-gather of the next unit in backward order.
* **Waits.** On each compute resource (the GPU streams on a GPU trace, the CPU threads on a CPU
  one) the first task of a unit's forward (of its backward) waits for that unit's all-gather,
  as FSDP2 makes the compute stream wait for the all-gather's event.
* **Reduce-scatters.** A unit's gradients (the same bytes) are reduce-scattered after its last
  backward task, on a queue of their own (FSDP2's reduce-scatter stream), overlapping the
  backward of the units before it; the root's after the iteration's last backward task (FSDP2's
  final callback). The first optimizer task on each compute resource waits for the iteration's
  reduce-scatters, as the final callback makes the compute stream wait for them.
* **Optimizer.** Each rank steps its 1/d of the parameters: every task of the optimizer phase is
  scaled by 1/d. Per-element work shrinks so; the per-operator launch costs of a sharded
  optimizer do not (each rank still steps a shard of every parameter), so on a CPU-bound
  optimizer this is a lower bound.

**On CPU workers** (a trace whose compute is CPU threads) FSDP2 runs none of this beside the
compute: the streams it issues its collectives on are no-ops on CPU and it asks for synchronous
collectives (``async_op=False``, ``torch.distributed.fsdp._fully_shard._fsdp_collectives``), so
the thread that issues one waits for it, as Gloo runs it. Each collective is then a COMM task on
that thread, where it is issued: a unit's forward all-gather before the unit's forward (no
prefetch), a unit's backward all-gather in the pre-backward hook of the unit before it in
backward order (the implicit prefetch, still blocking), each reduce-scatter right after its
unit's backward; a step is its compute plus every collective, end to end.

**FSDP2's own work on the host.** Two parts a plain trace does not hold, on CPU workers both on
the thread that issues the collectives:

* *The copies around each all-gather* (measured in a profile of the lab's two-rank FSDP2 run:
  ``fsdp::all_gather_copy_in`` of the rank's shard into the gather's input, then
  ``fsdp::split_with_sizes_copy`` of the gathered unit into its parameters): a CPU task after
  each all-gather of ``nbytes / d + nbytes``, priced at the rate the trace's optimizer updates
  memory (``frameworks/copies.py``'s rule for DDP's and Horovod's copies, an upper bound: the
  profile ran them at 3 to 7 GB/s where that rate is 10), which the unit's tasks wait for. On a
  GPU they are kernels at the memory's bandwidth, microseconds a megabyte, and are left out.
* *The library's dispatch* (``fsdp_dispatch``, per unit, the root counted as one: forward,
  backward, step), which a world of one shows: FSDP2's pre- and post-hooks in Python, its
  gradients packed for the reduce-scatter (``fsdp::chunk_cat``) and copied into the sharded
  gradients, each sharded parameter's update. Where given, each unit's first CPU task of
  forward (the root's: the iteration's first) is longer by ``forward``, its last CPU task of
  backward (the root's: the iteration's last) by ``backward``, and each iteration's first CPU
  optimizer task by ``step`` times the units. ``lab/parallel.py``'s ``measure_fsdp_dispatch``
  measures it: the model under ``fully_shard`` in a world of one (which gathers nothing)
  against the plain model, alternating, each phase's median difference over the units.

For ``zero = 1`` and ``2`` (DeepSpeed's stages, gradients bucketed as the units): each unit's
gradients are all-reduced (1: each rank then keeps its shard) or reduce-scattered (2) after its
backward, the root's after the iteration's backward, on ``network data: all_reduce`` or
``reduce_scatter``; the optimizer, on 1/d, waits for them; then one all-gather of all the
parameters after the optimizer's last task, which ``optimizer.step()`` waits for before it
returns, as DeepSpeed's step gathers the updated partitions before returning (a zero-length task
after the step's last CPU task waits for it). Where a trace has no optimizer step, the
iteration's last CPU task is followed by such a task waiting for the gradients' reductions.
``zero = 0`` beside tensor, expert or pipeline parallelism is DDP inside a model-parallel job:
each unit's gradients all-reduced over the data group as its backward ends (the unit as DDP's
bucket), the optimizer step whole. Plain ``zero = 0`` returns the graph untouched: data
parallelism alone without sharding is DDP's path
(``sim/frameworks/ddp.py``), and so is a group of one rank.

Every collective is priced by ``topology.collective_cost(cluster, op, nbytes, ranks=the data
group)``, on the NIC's share that the group gets beside the other data groups crossing it at
the same time (``placement.nic_sharing``: half of it for each of the lab's 2 x 2 FSDP+TP data
groups; where the rank's collectives of another queue are in flight at once, the two share it
too: ``job.with_nic_sharing``), ``nbytes`` in nccl-tests' convention (``docs/communication.md``: d times a rank's
shard for all-gather and reduce-scatter, which is the unit's parameter bytes; the whole buffer
for all-reduce). Each inserted task is a COMM task whose name says its op, bytes, group and
unit; the pass's note (:class:`ShardedDataParallel`) lists them with the algorithm and protocol
chosen, so reports can split exposed communication by kind.

Iterations are told apart by the units' phases: in measured order, a forward task after a
backward or optimizer one starts the next (on the GPU tasks and on the CPU tasks apart, since
the GPU runs behind). A unit with no backward task found (a plain trace names the modules of
forward only) has its gradients reduced with the root's. Under tensor parallelism a rank holds
and gathers 1/tensor of each unit's parameters and the whole root (embeddings and head
replicated, as ``examples/parallel.py`` runs them); the units' table is the whole model's.
Under expert parallelism a rank holds 1/expert of the experts (the parameters whose name holds
``expert``, as ``memory.py`` counts them): the data group reduces (shards, gathers) the other
parameters, and a rank's own experts go, with the same collectives, over the ranks that hold
the same experts (``expert_data``: data / expert of them, Megatron-LM's expert-data-parallel
group), not at all where that group is one rank (the lab's DDP leaves the experts out); a
replicated optimizer steps the rank's own experts only. The experts' collectives share the data
group's queue and are reported with it.

Not modelled: FSDP2's copy kernels on a GPU, the Gloo reduce-scatter's copy of its input
(about 13 ms for the lab's 17 MB root on one core; the calibration's reduce-scatter holds it
where it times the call), the ranks' skew at each blocking collective (the rank that arrives
first waits for the other: the lab's root all-gather took 111 ms on one rank and 88 on the
other in one step at 1000 Mbps), the padding of shards to a multiple of d, a mixed-precision
reduce dtype, and FSDP2's memory rate limit beyond the one-unit prefetch; and, on CPU workers whose cores drive the link
(Gloo), the CPU time the collectives take from compute (``sim/cpu_contention.py`` models it for
the data-parallel frameworks, not here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Optional

import numpy as np
import pandas as pd

from whatif.topology import collective_cost

from ..frameworks.copies import pass_rate_bytes_per_us
from ..graph import EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks, label_mask
from . import PASSES, Parallelism
from .units import PHASE_BACKWARD as BACKWARD
from .units import PHASE_FORWARD as FORWARD
from .units import PHASE_OPTIMIZER as OPTIMIZER
from .memory import expert_parameter_bytes
from .placement import nic_sharing, with_nic_shared
from .units import Units

ROOT = -1
GROUP = "data"
EXPERT_GROUP = "expert_data"  # the ranks that hold the same experts (placement.py)
#: what a COMM task's name says of its group: the experts' reduction is the data-parallel one
#: (``job.comm_dimension`` reads ``data``)
_NAMED = {GROUP: "data", EXPERT_GROUP: "data experts"}
_GPU_COMPUTE = (int(TaskKind.KERNEL), int(TaskKind.MEMCPY), int(TaskKind.MEMSET))
_CPU_COMPUTE = (int(TaskKind.CPU), int(TaskKind.RUNTIME), int(TaskKind.GAP))
COLLECTIVE_COLUMNS = ["task", "iteration", "unit", "phase", "op", "nbytes", "group", "time_us", "algorithm", "protocol"]


@dataclass(frozen=True)
class ShardedDataParallel:
    """What :func:`apply_fsdp` inserted: one row per collective task (``collectives``, columns
    :data:`COLLECTIVE_COLUMNS`; ``unit`` -1 is the root, ``phase`` ``forward``, ``backward`` or
    ``optimizer``), and the factor the optimizer's tasks were scaled by."""

    zero: int
    ranks: int
    reshard_after_forward: bool
    optimizer_scale: float
    collectives: pd.DataFrame
    waits: dict  # the zero-length tasks that wait for a collective where the step does: id -> the task it follows
    host_us: float = 0.0  # FSDP2's host time added over all iterations: its copies and hooks (fsdp_dispatch)

    def units_after(self, units: Units, graph: TaskGraph) -> Units:
        """``units`` (found on the graph the pass was given) for the pass's output ``graph``:
        each collective in the unit and phase it serves (the root's, -1, for the root's and
        ZeRO's whole-model ones), each zero-length wait in those of the task it follows."""
        unit = np.full(len(graph.tasks), -1, dtype=np.int64)
        phase = np.zeros(len(graph.tasks), dtype=np.asarray(units.task_phase).dtype)
        n = len(units.task_unit)
        unit[:n], phase[:n] = units.task_unit, units.task_phase
        for wait, after in self.waits.items():
            unit[wait], phase[wait] = unit[after], phase[after]
        tasks = self.collectives["task"].to_numpy()
        unit[tasks] = self.collectives["unit"].to_numpy()
        phase[tasks] = self.collectives["phase"].map(_PHASE_NUMBERS).to_numpy()
        return replace(units, task_unit=unit, task_phase=phase)

    def per_iteration(self) -> pd.DataFrame:
        """Count, bytes and time of each op per iteration (medians over iterations)."""
        c = self.collectives
        if c.empty:
            return pd.DataFrame(columns=["op", "count", "nbytes", "time_us"])
        per = c.groupby(["iteration", "op"]).agg(count=("task", "size"), nbytes=("nbytes", "sum"),
                                                  time_us=("time_us", "sum"))
        return per.groupby("op").median().reset_index()

    def describe(self) -> str:
        name = {3: "FSDP2 (ZeRO-3)", 0: "DDP's all-reduce beside model parallelism"}.get(self.zero, f"ZeRO-{self.zero}")
        parts = [f"{int(r.count)} {r.op} ({r.nbytes / 1e6:.1f} MB, {r.time_us / 1e3:.2f} ms)"
                 for r in self.per_iteration().itertuples()]
        reshard = ""
        if self.zero == 3:
            reshard = ", resharded after forward" if self.reshard_after_forward else ", kept after forward"
        host = f"; FSDP2's host time added: {self.host_us / 1e3:.3g} ms" if self.host_us else ""
        return (f"{name} over {self.ranks} ranks{reshard}: per iteration {', '.join(parts) or 'no collectives'}; "
                f"optimizer on 1/{self.ranks} of the parameters (its tasks x {self.optimizer_scale:.3g}){host}")


def apply_fsdp(graph: TaskGraph, units: Units, par: Parallelism, cluster, ranks_of: dict) -> TaskGraph:
    """One rank of ``par``'s sharded data parallelism (``par.zero`` 1, 2 or 3; for 3,
    ``par.reshard_after_forward``) on ``graph``, as the module's docstring states; ``units`` is
    ``find_units(graph)``, ``ranks_of["data"]`` the GPUs of this rank's data-parallel group.
    Returns a new graph whose last note is a :class:`ShardedDataParallel`; ``zero = 0`` or a
    group of one rank returns ``graph`` itself."""
    zero = par.zero
    ranks = tuple(ranks_of.get(GROUP, ()))
    if len(ranks) <= 1 or "fsdp" not in par.families():
        return graph
    reshard_after_forward = par.reshard_after_forward
    d = len(ranks)
    unit_of = np.asarray(units.task_unit, dtype=np.int64)
    phase = np.asarray(units.task_phase, dtype=np.int64)
    if len(unit_of) != len(graph.tasks) or len(phase) != len(graph.tasks):
        raise GraphError("the units were found on another graph: run find_units on the graph given to apply_fsdp")
    plan = _Plan(graph, unit_of, phase, d)
    nbytes = _unit_bytes(graph, units.table, par.tensor)
    experts = _expert_bytes(graph, units, par.tensor) if par.expert > 1 else {}
    nbytes = {u: b - experts.get(u, 0.0) for u, b in nbytes.items()}
    groups = {GROUP: ranks, EXPERT_GROUP: tuple(ranks_of.get(EXPERT_GROUP, ()))}

    def plan_for(sizes: dict) -> None:
        if zero == 3:
            plan.fully_sharded(sizes, reshard_after_forward)
        elif zero == 0:
            plan.replicated(sizes)
        else:
            plan.sharded_optimizer(sizes, "all_reduce" if zero == 1 else "reduce_scatter")

    plan_for(nbytes)
    if any(experts.values()) and len(groups[EXPERT_GROUP]) > 1:  # a rank's own experts, over their replicas
        plan.group, plan.ranks = EXPERT_GROUP, len(groups[EXPERT_GROUP])
        plan_for({u: b / par.expert for u, b in experts.items()})

    priced_on = {group: with_nic_shared(cluster, nic_sharing(cluster, on)) if cluster is not None else None
                 for group, on in groups.items()}

    @lru_cache(maxsize=None)
    def price(op: str, size: float, group: str = GROUP):
        return collective_cost(priced_on[group], op, size, ranks=groups[group])

    out = graph.copy()
    # the optimizer's own work: not a wait, nor a collective a pass before this one put there
    optimizer = np.flatnonzero((phase == OPTIMIZER) & ~np.isin(graph.tasks["kind"].to_numpy(),
                                                                [int(TaskKind.WAIT), int(TaskKind.COMM)]))
    share = 1.0 / d if zero else 1.0  # DDP keeps the whole optimizer step on every rank
    others, own = sum(nbytes.values()), sum(experts.values())
    if own and not zero:  # of the experts, a rank steps its own
        share = (others + own / par.expert) / (others + own)
    out.scale(optimizer, share)
    if zero == 3:
        plan.host_us += _add_dispatch(out, plan, nbytes, par.fsdp_dispatch)
    table, waits = plan.insert(out, price)
    out.notes.append(ShardedDataParallel(zero, d, bool(reshard_after_forward), share, table, waits, plan.host_us))
    return out


def _add_dispatch(graph: TaskGraph, plan: "_Plan", nbytes: dict, per_unit: tuple) -> float:
    """Lengthen the host tasks where FSDP2's hooks run by its host time per unit (``per_unit``:
    forward, backward and step microseconds; see the module's docstring): each unit's first CPU
    task of forward (the root's: the iteration's first), its last CPU task of backward (the
    root's: the iteration's last), and each iteration's first CPU optimizer task by ``step``
    times the units. Returns the time added in all."""
    fwd_us, bwd_us, step_us = per_unit
    if not (fwd_us or bwd_us or step_us):
        return 0.0
    extra = np.zeros(len(graph.tasks))
    units = list(plan.units) + ([ROOT] if nbytes.get(ROOT, 0.0) > 0 else [])
    for it in range(int(plan.cpu_iteration.max()) + 1):
        in_it = plan.cpu & (plan.cpu_iteration == it)
        for phase, us, pick in ((FORWARD, fwd_us, plan.first), (BACKWARD, bwd_us, plan.last)):
            whole = np.flatnonzero(in_it & (plan.phase == phase))
            for unit in units:
                own = whole if unit == ROOT else whole[plan.unit_of[whole] == unit]
                t = pick(own if len(own) else whole)
                if t is not None and us:
                    extra[t] += us
        optimizer = np.flatnonzero(in_it & (plan.phase == OPTIMIZER))
        t = plan.first(optimizer) if len(optimizer) else plan.last(np.flatnonzero(in_it & (plan.phase == BACKWARD)))
        if t is not None and step_us:
            extra[t] += step_us * len(units)
    if not extra.any():
        return 0.0
    graph.lengthen(extra)
    return float(extra.sum())


def _expert_bytes(graph: TaskGraph, units: Units, tensor: int) -> dict:
    """Of :func:`_unit_bytes`, the experts' (the parameters whose name holds ``expert``, as
    ``memory.py`` counts them), before expert parallelism splits them: by unit index (divided
    by ``tensor`` as the unit is) and the root's (-1)."""
    per_unit, outside = expert_parameter_bytes(graph, units)
    sizes = {int(u): float(b) / tensor for u, b in zip(units.table["unit"], per_unit)}
    sizes[ROOT] = outside
    return sizes


def _unit_bytes(graph: TaskGraph, table: pd.DataFrame, tensor: int) -> dict:
    """This rank's parameter bytes of each unit by unit index, and the root's (-1): every
    parameter the capture recorded that no unit holds; 0 where the graph carries no parameter
    record. Under tensor parallelism a rank holds 1/tensor of each unit (Megatron's split of a
    block; its few replicated norm and bias bytes counted as split too) and the whole root
    (embeddings and head replicated, as ``examples/parallel.py`` runs them)."""
    whole = {int(u): float(b) for u, b in zip(table["unit"], table["param_bytes"])}
    parameters = graph.workload.parameters
    total = 0.0
    if len(parameters):
        total = float((parameters["numel"].astype(float) * parameters["element_size"].astype(float)).sum())
    sizes = {u: b / tensor for u, b in whole.items()}
    sizes[ROOT] = max(total - sum(whole.values()), 0.0)
    return sizes


@dataclass
class _Collective:
    op: str
    nbytes: float
    unit: int
    phase: int
    iteration: int
    after: list  # task ids it waits for
    waiters: list  # task ids that wait for it
    queue: str
    returns_after: Optional[int] = None  # a zero-length task put after this one waits for it
    group: str = GROUP  # or EXPERT_GROUP: an expert-parallel rank's own experts
    ranks: int = 0  # the group's ranks


class _Plan:
    """The collectives of every iteration, where they are issued and what waits for them, found
    on the compute tasks of the unmodified graph."""

    def __init__(self, graph: TaskGraph, unit_of: np.ndarray, phase: np.ndarray, ranks: int):
        self.graph, self.ranks = graph, ranks
        self.group = GROUP  # the group the collectives planned next go over (ranks: its size)
        tasks = graph.tasks
        kind = tasks["kind"].to_numpy()
        # each task's resource as its category's number (one to one with its name), so that
        # resources are told apart without a string per task
        resource = tasks["resource"].cat.codes.to_numpy(dtype=np.int64)
        gpu = np.isin(kind, _GPU_COMPUTE) & (phase > 0)
        cpu = np.isin(kind, _CPU_COMPUTE) & (phase > 0) & label_mask(tasks["resource"], lambda r: r.startswith("cpu "))
        self.compute = gpu if gpu.any() else cpu
        self.on_cpu = not gpu.any()
        self.blocking = False  # FSDP2 on CPU workers: the thread waits for each collective (fully_sharded)
        self.cpu = cpu
        self.unit_of, self.phase, self.resource = unit_of, phase, resource
        self.start = tasks["measured_start_us"].to_numpy(dtype=float)
        self.end = tasks["measured_end_us"].to_numpy(dtype=float)
        self.iteration = _iterations(phase, self.start, self.compute)
        self.cpu_iteration = _iterations(phase, self.start, cpu)
        self.previous = np.full(len(tasks), -1, dtype=np.int64)
        for seq in graph.resource_order():
            self.previous[seq[1:]] = seq[:-1]
        units = np.unique(unit_of[self.compute])
        self.units = units[units >= 0].tolist()
        self.collectives: list[_Collective] = []
        self.host_us = 0.0  # FSDP2's host time added (copies, and the library's dispatch)
        if not self.compute.any():
            raise GraphError("no task of the graph is in a forward, backward or optimizer phase: nothing to shard")

    # -- the spans ---------------------------------------------------------------------------------

    @property
    def iterations(self) -> int:
        return int(self.iteration.max()) + 1

    def tasks_of(self, it: int, phase: int, unit: Optional[int] = None) -> np.ndarray:
        mask = self.compute & (self.iteration == it) & (self.phase == phase)
        if unit is not None:
            mask &= self.unit_of == unit
        return np.flatnonzero(mask)

    def first(self, ids: np.ndarray) -> Optional[int]:
        return int(ids[np.argmin(self.start[ids])]) if len(ids) else None

    def last(self, ids: np.ndarray) -> Optional[int]:
        return int(ids[np.argmax(self.end[ids])]) if len(ids) else None

    def firsts_per_resource(self, ids: np.ndarray) -> list[int]:
        """The first task on each resource among ``ids``: what waits for a collective."""
        ordered = ids[np.argsort(self.start[ids], kind="stable")]
        _, first = np.unique(self.resource[ordered], return_index=True)
        return ordered[np.sort(first)].tolist()  # in the order of their starts

    def issued_at(self, t: Optional[int]) -> list[int]:
        """What a collective issued where task ``t`` starts waits for: the task before ``t`` on
        its resource (nothing where ``t`` is the first)."""
        if t is None or self.previous[t] < 0:
            return []
        return [int(self.previous[t])]

    def span(self, it: int, phase: int, unit: int) -> tuple[Optional[int], list[int]]:
        """The task whose start a unit's phase starts with, and those that wait for its
        parameters; the root's start is the phase's first task."""
        whole = self.tasks_of(it, phase)
        own = self.tasks_of(it, phase, unit)
        if unit == ROOT:
            start = self.first(whole)
            return start, sorted(set(self.firsts_per_resource(own)) | ({start} if start is not None else set()))
        return self.first(own), self.firsts_per_resource(own)

    # -- the rules ---------------------------------------------------------------------------------

    def fully_sharded(self, nbytes: dict, reshard_after_forward: bool) -> None:
        self.blocking = self.on_cpu
        for it in range(self.iterations):
            forward = [ROOT] + self.units
            previous_start = None
            for k, unit in enumerate(forward):
                start, waiters = self.span(it, FORWARD, unit)
                issue = start if k == 0 or self.blocking else previous_start
                self._add("all_gather", nbytes.get(unit, 0.0), unit, FORWARD, it, self.issued_at(issue), waiters)
                previous_start = start if start is not None else previous_start
            backward = [ROOT] + self.units[::-1]
            previous_start, _ = self.span(it, BACKWARD, ROOT)
            for unit in backward[1:]:
                start, waiters = self.span(it, BACKWARD, unit)
                if reshard_after_forward:
                    issued = self.issued_at(previous_start)
                    self._add("all_gather", nbytes.get(unit, 0.0), unit, BACKWARD, it, issued, waiters)
                previous_start = start if start is not None else previous_start
            self._reduce(it, nbytes, "reduce_scatter")

    def replicated(self, nbytes: dict) -> None:
        """DDP beside model parallelism: each unit's gradients all-reduced over the data group
        as its backward ends (the unit as DDP's bucket), the optimizer whole on every rank."""
        for it in range(self.iterations):
            self._reduce(it, nbytes, "all_reduce")

    def sharded_optimizer(self, nbytes: dict, reduce_op: str) -> None:
        total = sum(nbytes.values())
        for it in range(self.iterations):
            self._reduce(it, nbytes, reduce_op)
            stepped = self.last(self.tasks_of(it, OPTIMIZER))
            stepped = stepped if stepped is not None else self.last(self.tasks_of(it, BACKWARD))
            returns = self._last_on_iteration_thread(it, OPTIMIZER)
            self._add("all_gather", total, ROOT, OPTIMIZER, it, [stepped] if stepped is not None else [], [], returns)

    def _reduce(self, it: int, nbytes: dict, op: str) -> None:
        """Each unit's gradients after its backward, in the order they are ready, and the root's
        after the whole backward; the optimizer's first tasks wait for them all (the next
        forward's, or the iteration's end, where the trace has no optimizer step)."""
        ready, unplaced = [], 0.0
        for unit in self.units:
            last = self.last(self.tasks_of(it, BACKWARD, unit))
            if last is not None:
                ready.append((self.end[last], unit, last, nbytes.get(unit, 0.0)))
            else:  # no backward task found for it (a plain trace names forward modules only)
                unplaced += nbytes.get(unit, 0.0)
        ready.sort()
        last_backward = self.last(self.tasks_of(it, BACKWARD))
        if last_backward is not None:
            ready.append((self.end[last_backward], ROOT, last_backward, nbytes.get(ROOT, 0.0) + unplaced))
        ready = [r for r in ready if r[3] > 0]  # the last one sent is the one awaited
        waiters = self.firsts_per_resource(self.tasks_of(it, OPTIMIZER))
        if not waiters and it + 1 < self.iterations:
            waiters = self.firsts_per_resource(self.tasks_of(it + 1, FORWARD))
        end = None if waiters else self._last_on_iteration_thread(it, BACKWARD)
        for k, (_, unit, last, size) in enumerate(ready):
            final = k == len(ready) - 1
            self._add(op, size, unit, BACKWARD, it, [last], waiters if final else [], end if final else None)

    def _last_on_iteration_thread(self, it: int, phase: int) -> Optional[int]:
        """The last CPU task of ``it``'s ``phase`` (else of the whole iteration) on the thread
        that runs most of the iteration."""
        ids = np.flatnonzero(self.cpu & (self.cpu_iteration == it))
        if not len(ids):
            return None
        if (self.phase[ids] == phase).any():
            ids = ids[self.phase[ids] == phase]
        thread = pd.Series(self.resource[ids]).value_counts().index[0]  # a category's number
        ids = ids[self.resource[ids] == thread]
        return int(ids[np.argmax(self.end[ids])])

    def _add(self, op: str, nbytes: float, unit: int, phase: int, it: int, after: list, waiters: list,
             returns_after: Optional[int] = None) -> None:
        if nbytes <= 0:
            return
        queue = f"network {GROUP}: {op}"  # the experts' on the same queue: one data-parallel stream
        self.collectives.append(_Collective(op, float(nbytes), unit, phase, it, list(after), list(waiters), queue,
                                            returns_after, self.group, self.ranks))

    # -- into the graph ----------------------------------------------------------------------------

    def insert(self, graph: TaskGraph, price) -> tuple[pd.DataFrame, dict]:
        """Add the collectives to ``graph`` (a copy of the planned one, same task ids), each a
        COMM task on its queue in the order planned, and the zero-length tasks that wait for
        them where the step itself does (``returns_after``). Returns the collectives' table and
        the zero-length tasks, each with the task it follows."""
        if self.blocking:
            return self._insert_on_thread(graph, price)
        waits = {}  # the task a wait follows -> the wait, inserted in the order first asked for
        for c in self.collectives:
            if c.returns_after is not None and c.returns_after not in waits:
                waits[c.returns_after] = (c.returns_after, f"wait for {c.op} {_NAMED[c.group]}", 0.0,
                                          TaskKind.INSERTED)
        returns = dict(zip(waits, graph.insert_many(list(waits.values()))))
        if returns:
            ends = self.end[np.fromiter(returns, dtype=np.int64, count=len(returns))]
            graph.tasks.loc[list(returns.values()), ["measured_start_us", "measured_end_us"]] = np.c_[ends, ends]
        tasks = graph.tasks
        base = len(tasks)
        keys = {}
        resource = tasks["resource"].astype(str)
        rows, edges, table = [], [], []
        for k, c in enumerate(self.collectives):
            if c.queue not in keys:
                on_queue = tasks["order_key"][resource == c.queue]
                keys[c.queue] = float(on_queue.max()) + 1.0 if len(on_queue) else 0.0
            cost = price(c.op, c.nbytes, c.group)
            tid = base + k
            rows.append(_row(c, cost.time_us, keys[c.queue], tasks))
            keys[c.queue] += 1.0
            waiters = c.waiters + ([returns[c.returns_after]] if c.returns_after is not None else [])
            edges += [(int(a), tid, 0.0, int(EdgeKind.USER)) for a in c.after]
            edges += [(tid, int(w), 0.0, int(EdgeKind.USER)) for w in waiters]
            table.append((tid, c.iteration, c.unit, _PHASES[c.phase], c.op, c.nbytes, c.group, cost.time_us,
                          cost.algorithm, cost.protocol))
        if rows:
            _append(graph, rows)
            graph.add_edges(edges)
        return pd.DataFrame(table, columns=COLLECTIVE_COLUMNS), {int(w): int(a) for a, w in returns.items()}


    def _insert_on_thread(self, graph: TaskGraph, price) -> tuple[pd.DataFrame, dict]:
        """The collectives of a CPU trace, each a COMM task on the thread that issues it, right
        after the task it is issued after (several issued there in the order planned). On CPU
        the streams FSDP2 puts its collectives on are no-ops and it asks Gloo for synchronous
        collectives (``async_op=False``), so the thread waits for each one where it issues it:
        a unit's all-gather in its pre-forward hook, the next unit's (FSDP2's backward prefetch)
        in the pre-backward hook of the one before it, a unit's reduce-scatter in its
        post-backward hook; nothing overlaps the compute. A collective issued before the
        thread's first task stays on its queue."""
        next_id = len(graph.tasks)
        tail: dict = {}
        table = []
        pending, pending_edges = [], []  # the inserts after a task, made together (graph.insert_many)

        def flush():
            graph.insert_many(pending, pending_edges)
            pending.clear(), pending_edges.clear()

        for c in self.collectives:
            cost = price(c.op, c.nbytes, c.group)
            unit = "root" if c.unit == ROOT else f"unit {c.unit}"
            name = f"{c.op} {_NAMED[c.group]} {c.nbytes / 1e6:.3f} MB {unit} {_PHASES[c.phase]}"
            anchor = c.after[0] if c.after else None
            waits = [(int(w), 0.0, int(EdgeKind.USER)) for w in c.waiters]
            copy_us = self.copies_us(c)
            if anchor is None:
                flush()
                tid = len(graph.tasks)
                on_queue = graph.tasks["order_key"][graph.tasks["resource"].astype(str) == c.queue]
                _append(graph, [_row(c, cost.time_us, float(on_queue.max()) + 1.0 if len(on_queue) else 0.0, graph.tasks)])
                graph.add_edges([(tid,) + w for w in waits])
                next_id = len(graph.tasks)
            else:
                tid = next_id  # the id insert_many gives it
                pending.append((tail.get(anchor, anchor), name, cost.time_us, TaskKind.COMM))
                next_id += 1
                if copy_us > 0:  # FSDP2's copies out of the gathered buffer, on the thread, before the unit runs
                    pending_edges.append([])
                    pending.append((tid, f"FSDP2 all-gather copies {c.nbytes / 1e6:.3f} MB {unit} {_PHASES[c.phase]}",
                                    copy_us, TaskKind.CPU))
                    self.host_us += copy_us
                    tail[anchor] = next_id
                    next_id += 1
                else:
                    tail[anchor] = tid
                pending_edges.append([(tail[anchor],) + w for w in waits])
            table.append((tid, c.iteration, c.unit, _PHASES[c.phase], c.op, c.nbytes, c.group, cost.time_us,
                          cost.algorithm, cost.protocol))
        flush()
        assert next_id == len(graph.tasks)
        return pd.DataFrame(table, columns=COLLECTIVE_COLUMNS), {}

    @cached_property
    def copy_rate(self) -> Optional[float]:
        """The host's copy rate, bytes per microsecond: the trace's optimizer's
        (``frameworks/copies.py``); None on a GPU trace or without one."""
        return pass_rate_bytes_per_us(self.graph)

    def copies_us(self, c: _Collective) -> float:
        """FSDP2's copies around all-gather ``c`` on a CPU worker (the thread that issues it;
        only FSDP2 blocks one): its shard copied into the gather's input
        (``fsdp::all_gather_copy_in``: ``nbytes / d``) and the gathered unit out into the
        parameters (``fsdp::split_with_sizes_copy``: ``nbytes``), at :attr:`copy_rate`; 0 for
        other collectives or without a rate."""
        if c.op != "all_gather" or not self.copy_rate:
            return 0.0
        return (c.nbytes / c.ranks + c.nbytes) / self.copy_rate


def _append(graph: TaskGraph, rows: list) -> None:
    """``rows`` added to ``graph``'s tasks, its categorical columns kept so."""
    graph.tasks = concat_tasks([graph.tasks, pd.DataFrame(rows)])


_PHASES = {FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer"}
_PHASE_NUMBERS = {name: number for number, name in _PHASES.items()}


def _row(c: _Collective, time_us: float, key: float, tasks: pd.DataFrame) -> dict:
    unit = "root" if c.unit == ROOT else f"unit {c.unit}"
    name = f"{c.op} {_NAMED[c.group]} {c.nbytes / 1e6:.3f} MB {unit} {_PHASES[c.phase]}"
    row = {column: np.nan for column in tasks.columns}
    row.update({
        "name": name,
        "kind": int(TaskKind.COMM),
        "resource": c.queue,
        "duration_us": float(time_us),
        "release_us": -np.inf,
        "order_key": key,
        "context": f"iteration {c.iteration} > {_PHASES[c.phase]} > {unit}",
        "operator": "",
        "layer": "",
        "event": -1,
    })
    return row


def _iterations(phase: np.ndarray, start: np.ndarray, among: np.ndarray) -> np.ndarray:
    """The iteration of each task of ``among`` (-1 for the rest): in measured order, a forward
    task after a backward or optimizer task starts the next one."""
    out = np.full(len(phase), -1, dtype=np.int64)
    ids = np.flatnonzero(among & np.isfinite(start))
    ids = ids[np.argsort(start[ids], kind="stable")]
    seq = phase[ids]
    new = np.zeros(len(ids), dtype=np.int64)
    new[1:] = (seq[1:] == FORWARD) & (seq[:-1] != FORWARD)
    out[ids] = np.cumsum(new)
    return out


PASSES["fsdp"] = apply_fsdp
