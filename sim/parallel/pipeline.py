"""Pipeline parallelism: the traced iteration cut into stages and run as a schedule of microbatches.

A pipeline of ``p`` stages (``v`` virtual stages each when interleaved) splits the model's units
(``sim/parallel/units.py``: the repeated blocks, in model order) into ``p * v`` contiguous
**virtual stages**, and the batch into ``m`` **microbatches**. Device ``d`` holds virtual stages
``d, d + p, d + 2p, ...`` (its *chunks*, as Megatron-LM places them). The pass builds one graph
holding every device, whose resources are named ``stage D: <the traced resource>``:

* **What a microbatch costs.** One traced iteration is taken (the one of median length; an
  iteration ends with the last backward or optimizer task on a CPU thread before the next
  forward). Each device gets, for every microbatch and chunk, a copy of that iteration's forward
  and backward tasks of the chunk's units, with the edges between them. Their durations are those
  of the traced batch at a microbatch (``batch / m``), by the first rule that applies:

  1. **a microbatch trace** (``microbatch``: the graph of a run at the microbatch, the
     scenario's ``parallelism.pipeline.microbatch_trace``): each unit's forward and its backward
     take what they took there. In its iteration of median length, the time of the unit's tasks
     in that phase (CPU-side and GPU-side apart; the forward and backward tasks outside every
     unit as one more group per phase) over the same in the traced iteration is the factor of
     every task of the group: a measured microbatch, fixed per-operator costs included (a CPU
     operator's time is not linear in its batch: the example transformer's whole step takes 67
     ms at a microbatch of 2 where a quarter of its batch-8 step is 45 ms). A group the
     microbatch trace lacks, or whose traced time is zero, falls to the next rule;
  2. the operator performance models, when ``models`` are given and the trace is CPU-only
     (``passes/batch_size.py``, the same rule as ``--batch-size``);
  3. linearly: GPU tasks take ``1/m`` of their time, CPU operators too on a CPU-only trace;
     runtime calls, the gaps between operators and every CPU task of a GPU trace keep their
     traced time (a launch costs what it costs whatever the batch).
* **Which units make a stage**: contiguous spans, balanced (the largest span's forward and
  backward time as small as it goes, the non-unit work at the ends counted) or as many units per
  virtual stage as ``partition`` lists.
* **Which tasks belong to a stage.** A task of a unit goes with the unit. A forward or backward
  task outside every unit (an embedding, the head, the loss) goes with the unit task before it on
  the CPU timeline in its phase; before any, the first virtual stage in forward and the last in
  backward (the loss's backward precedes the last block's). A GPU task goes with the CPU task
  that launched it; one with no launch (a transfer an earlier pass inserted) with a task it waits
  for. A slot the trace gives no task (a stage whose backward no unit holds) is a task of no time
  on the training loop's thread, so the schedule's dependencies still pass through it. The rest of the iteration (data loading, ``zero_grad``: phase "other") runs
  once on every device before its first microbatch, as the lab's ranks each load the batch; the
  optimizer step once on every device after its last backward, its tasks scaled by the device's
  share of the units' parameter bytes.
* **Gradients accumulate across microbatches.** The traced iteration's backward writes each
  gradient once; in a pipeline every later backward of a chunk adds into it. Where the traced
  ``AccumulateGrad`` keeps the incoming tensor (``zero_grad(set_to_none=True)``), each copy of it
  in a chunk's backward after its first pays an in-place add over the gradient's bytes: on a CPU
  trace at the rate its optimizer updates in place, on a GPU trace as a kernel at the rate of the
  trace's own element-wise kernels (``accumulation.py`` has the rule). On the lab's transformer
  (2 stages, 4 microbatches) the first stage's three accumulations measured 6.3 ms a step more
  than its first backward's (``aten::add_``, ``lab/probes/parallel_profile.py``). Where the traced
  one already adds (a zeroed gradient), its copies hold the add and nothing is added; nor to a
  microbatch trace's backward, whose backward is a first one too. Under tensor parallelism a
  rank adds 1/t of each unit's gradient bytes (its shard) and all of a replicated one's.
* **The schedule** orders each device's (forward|backward, microbatch, chunk) slots, and every
  resource of the device runs its copies in slot order (its traced order inside a slot):
  GPipe (all forwards, then all backwards, Huang et al. 2019); 1F1B (PipeDream-flush, Narayanan
  et al. 2021: ``min(p - 1 - d, m)`` warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards); interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's
  ``forward_backward_pipelining_with_interleaving``: forwards in groups of ``p`` microbatches per
  chunk, ``(p - d - 1) * 2 + (v - 1) * p`` warm-up forwards, backwards through the chunks in
  reverse; ``m`` must be a multiple of ``p``).
* **Activations between stages.** After a virtual stage's forward of a microbatch, its boundary
  activation (the last unit's ``activation_bytes`` over ``m``) goes to the next virtual stage, and
  after the backward the gradient of the same size goes back: one COMM task (``send_recv``,
  priced by ``topology.collective_cost(cluster, "send_recv", nbytes, ranks=(a, b))`` between the
  two devices' GPUs) on the sender's ``network send next`` / ``network send prev`` resource, which waits for the
  slot's last task on every resource and which the receiving slot's first task on every resource
  waits for. ``2 * (p * v - 1) * m`` transfers a step. Each goes one way, so where the links
  carry figures calibrated for a one-way ``send``, those price it (:func:`one_way`).

Devices share no resource, so the engine runs them in parallel; the only waits between them are
the transfers. With equal stages and free transfers the bubble is the closed form's: ``(p - 1) /
(m + p - 1)`` of the step for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved (the
paper's ``(1 / v) (p - 1) / m`` of the ideal time). :func:`bubbles` measures it on a schedule.

What this does not model: the memory a schedule holds (``memory.py``), recomputation, a recv
posted late (a transfer starts when the sender is ready), the tensors' split and concatenation
around the microbatches, non-unit parameters in the optimizer's split, and a GPU trace's
gradient accumulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from whatif.topology import CollectiveCost, collective_cost

from ..engine import Schedule
from ..graph import GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks
from ..passes.batch_size import change_batch_size, infer_batch_size, parameter_shapes
from . import PASSES
from .accumulation import accumulation
from .expert import ExpertParallelChange
from .units import Units, find_units

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = 1, 2  # the phases of Units.task_phase
OTHER, OPTIMIZER = 0, 3
SEND_NEXT, SEND_PREV = "network send next", "network send prev"


@dataclass(frozen=True)
class Slot:
    """One step of a device's schedule: the forward or backward of a microbatch on a chunk."""

    phase: int  # FORWARD or BACKWARD
    microbatch: int
    chunk: int  # the device's chunk: virtual stage chunk * p + device


def schedule_order(schedule: str, p: int, m: int, device: int, v: int = 1) -> list[Slot]:
    """The order in which ``device`` of ``p`` runs its slots (see the module doc)."""
    if schedule not in SCHEDULES:
        raise GraphError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if not (0 <= device < p) or m < 1 or v < 1:
        raise GraphError(f"a pipeline needs 0 <= device < stages and microbatches, virtual stages >= 1 (got {device}, {p}, {m}, {v})")
    if schedule != "interleaved" and v != 1:
        raise GraphError(f"virtual_stages: {v} needs schedule: interleaved, not {schedule}")
    if schedule == "gpipe":
        return [Slot(FORWARD, j, 0) for j in range(m)] + [Slot(BACKWARD, j, 0) for j in range(m)]
    if schedule == "1f1b":
        warmup = min(p - 1 - device, m)
        order = [Slot(FORWARD, j, 0) for j in range(warmup)]
        for i in range(m - warmup):
            order += [Slot(FORWARD, warmup + i, 0), Slot(BACKWARD, i, 0)]
        return order + [Slot(BACKWARD, j, 0) for j in range(m - warmup, m)]
    if m % p:
        raise GraphError(f"the interleaved schedule needs microbatches a multiple of the stages ({m} is not of {p})")
    total = m * v

    def slot(k: int, phase: int) -> Slot:
        group = (k // p) % v
        return Slot(phase, (k // (p * v)) * p + k % p, group if phase == FORWARD else v - 1 - group)

    warmup = min((p - device - 1) * 2 + (v - 1) * p, total)
    order = [slot(k, FORWARD) for k in range(warmup)]
    for i in range(total - warmup):
        order += [slot(warmup + i, FORWARD), slot(i, BACKWARD)]
    return order + [slot(k, BACKWARD) for k in range(total - warmup, total)]


def partition_units(costs: Sequence[float], parts: int, partition="balanced") -> list[range]:
    """Contiguous spans of units, one per virtual stage: ``balanced`` minimises the largest span's
    cost (exact, by dynamic programming), a sequence of counts gives each span's number of units.
    :func:`apply_pipeline` costs a unit by its microbatch's forward and backward task time, the
    first unit with the embedding's and the last with the head's and loss's."""
    n = len(costs)
    if parts > n:
        raise GraphError(f"{n} units cannot fill {parts} pipeline stages (stages x virtual stages)")
    if not isinstance(partition, str):
        counts = [int(c) for c in partition]
        if len(counts) != parts or sum(counts) != n or min(counts) < 1:
            raise GraphError(f"partition {list(partition)} must give {parts} positive unit counts summing to {n}")
        starts = np.cumsum([0] + counts)
        return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
    if partition != "balanced":
        raise GraphError(f"partition must be 'balanced' or a list of unit counts per stage, not {partition!r}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                value = max(best[k - 1, start], prefix[end] - prefix[start])
                if value < best[k, end] - 1e-12:
                    best[k, end], cut[k, end] = value, start
    spans, end = [], n
    for k in range(parts, 0, -1):
        spans.append(range(int(cut[k, end]), end))
        end = int(cut[k, end])
    return spans[::-1]


@dataclass
class PipelineSchedule:
    """What :func:`apply_pipeline` built, for :func:`bubbles` and the report.

    ``stages``: one row per virtual stage: stage (virtual), device, chunk, first_unit, last_unit,
    forward_us and backward_us (a microbatch's task time there), activation_bytes (what it sends
    on per microbatch). ``transfers``: one row per activation or gradient sent: task, microbatch,
    from_stage, to_stage (virtual), from_device, to_device, nbytes, time_us, algorithm, protocol.
    ``task_device``, ``task_microbatch`` (-1 outside), ``task_phase`` and ``task_source`` (the
    traced task it copies, -1 for a transfer) are per task of the graph built (until a later pass
    renumbers its tasks); ``units`` are that graph's :class:`~.units.Units` (a copy keeps its
    traced task's unit, a transfer or an empty slot has none; the table is the traced one).
    """

    schedule: str
    stages_count: int
    microbatches: int
    virtual_stages: int
    scaling: str
    iteration_us: tuple
    stages: pd.DataFrame
    transfers: pd.DataFrame
    task_device: np.ndarray = field(repr=False)
    task_microbatch: np.ndarray = field(repr=False)
    task_phase: np.ndarray = field(repr=False)
    task_source: np.ndarray = field(repr=False)
    units: Optional[Units] = field(default=None, repr=False)
    accumulation: str = ""  # how the later backwards' gradient adds were priced (sim/parallel/accumulation.py)

    def describe(self) -> str:
        v = f", {self.virtual_stages} virtual stages each" if self.virtual_stages > 1 else ""
        return (
            f"pipeline: {self.stages_count} stages{v}, {self.microbatches} microbatches, {self.schedule}; "
            f"units per virtual stage {self.stages['last_unit'].sub(self.stages['first_unit']).add(1).tolist()}; "
            f"{len(self.transfers)} activation/gradient transfers; microbatch times {self.scaling}"
            + (f"; gradients accumulated: {self.accumulation}" if self.accumulation else "")
        )


def apply_pipeline(graph: TaskGraph, units, par, cluster, ranks_of: dict, *, models=None,
                   microbatch: Optional[TaskGraph] = None) -> TaskGraph:
    """The traced iteration as a pipeline of ``par.pipeline`` stages (see the module doc).

    ``units``: :class:`~.units.Units` of ``graph``; ``par``: the :class:`~.Parallelism` (its
    ``pipeline``, ``microbatches``, ``schedule``, ``virtual_stages``, ``partition``);
    ``ranks_of["pipeline"]``: the GPU of each stage (default ``0 .. p-1``), for pricing the
    transfers on ``cluster`` (None: transfers take no time); ``models``: operator performance models to scale a CPU-only trace
    to a microbatch; ``microbatch``: the graph of the same model traced at the microbatch (its
    units found with ``par.units``), whose measured unit times a microbatch takes. Returns one graph with every device (``stage D: ...`` resources); its last
    note is a :class:`PipelineSchedule`.
    """
    p, m, v = int(par.pipeline), int(par.microbatches), int(par.virtual_stages)
    schedule = str(par.schedule)
    orders = [schedule_order(schedule, p, m, d, v) for d in range(p)]
    gpus = tuple(ranks_of.get("pipeline") or range(p))
    if len(gpus) != p:
        raise GraphError(f"the pipeline group has {len(gpus)} GPUs for {p} stages")
    table = units.table.reset_index(drop=True)
    phase = np.asarray(units.task_phase)
    in_iteration, window = _one_iteration(graph, units)
    duration, scaling = _microbatch_durations(graph, units, m, models)
    if microbatch is not None and m > 1:
        duration, scaling = _measured_microbatch(graph, units, in_iteration, microbatch, par.units, duration, scaling)
    # a unit's cost: its microbatch's forward and backward with what goes with it (the
    # embedding with the first unit, the head and loss with the last); GPU time on a GPU trace
    n = len(table)
    unit_of = _stage_of_tasks(graph, units, np.arange(n), in_iteration, n)
    counted = ~_cpu_side(graph) if graph.workload.has_gpu else _cpu_side(graph)
    pick = counted & (unit_of >= 0) & np.isin(phase, [FORWARD, BACKWARD])
    costs = np.bincount(unit_of[pick], weights=duration[pick], minlength=n)
    spans = partition_units(costs, p * v, par.partition)
    stage_of_unit = np.empty(n, dtype=np.int64)
    for k, span in enumerate(spans):
        stage_of_unit[list(span)] = k
    stage = _stage_of_tasks(graph, units, stage_of_unit, in_iteration, p * v)
    param_bytes = table["param_bytes"].fillna(0.0).to_numpy(dtype=float)
    device_of_stage = np.arange(p * v) % p
    share = np.array([param_bytes[device_of_stage[stage_of_unit] == d].sum() for d in range(p)])
    share = share / share.sum() if share.sum() > 0 else np.full(p, 1.0 / p)

    # a tensor-parallel rank holds 1/t of each unit's parameters (memory.py's count), so adds 1/t of their gradients
    shards = np.where(np.asarray(units.task_unit) >= 0, int(par.tensor), 1) if int(par.tensor) > 1 else None
    # an expert-parallel rank adds into its own experts' gradients only
    held = np.ones(len(graph.tasks), dtype=bool)
    experts = graph.last_note(ExpertParallelChange)
    if experts is not None:
        held[experts.elsewhere] = False
    added = accumulation(graph, in_iteration & (phase == BACKWARD) & held, stage, shards) if m > 1 else None
    accumulate = added.extra_us if added is not None else None
    builder = _Builder(graph, duration, window[0], _main_thread(graph, in_iteration))
    for d in range(p):
        slots = orders[d]
        builder.copy(d, np.flatnonzero(in_iteration & (phase == OTHER)), slot_index=-1, microbatch=-1, phase=OTHER)
        written = set()  # the chunks whose gradients a backward has written: later ones add into them
        for i, s in enumerate(slots):
            k = s.chunk * p + d
            ids = np.flatnonzero(in_iteration & (phase == s.phase) & (stage == k))
            adds = accumulate if s.phase == BACKWARD and k in written else None
            builder.copy(d, ids, slot_index=i, microbatch=s.microbatch, phase=s.phase, group=(k, s.microbatch),
                         extra_us=adds)
            if s.phase == BACKWARD:
                written.add(k)
        optimizer = np.flatnonzero(in_iteration & (phase == OPTIMIZER))
        builder.copy(d, optimizer, slot_index=len(slots), microbatch=-1, phase=OPTIMIZER, factor=share[d])

    boundary = table["activation_bytes"].fillna(0.0).to_numpy(dtype=float)
    stage_rows, transfers = [], []
    for k, span in enumerate(spans):
        d = int(device_of_stage[k])
        nbytes = float(boundary[span[-1]]) / m if k < p * v - 1 else 0.0
        fwd = builder.copied_us.get((k, 0, FORWARD), 0.0)
        bwd = builder.copied_us.get((k, 0, BACKWARD), 0.0)
        stage_rows.append({"stage": k, "device": d, "chunk": k // p, "first_unit": span[0], "last_unit": span[-1],
                           "forward_us": fwd, "backward_us": bwd, "activation_bytes": nbytes})
    for d in range(p):
        for i, s in enumerate(orders[d]):
            k = s.chunk * p + d
            to = k + 1 if s.phase == FORWARD else k - 1
            if not 0 <= to < p * v:
                continue
            nbytes = stage_rows[min(k, to)]["activation_bytes"]
            cost = _transfer(cluster, nbytes, gpus[d], gpus[int(device_of_stage[to])])
            what = "activation" if s.phase == FORWARD else "gradient"
            task = builder.send(d, i, (k, s.microbatch, s.phase), (to, s.microbatch, s.phase),
                                SEND_NEXT if s.phase == FORWARD else SEND_PREV,
                                f"send_recv pipeline {nbytes / 1e6:.6g}MB {what} stage {k}->{to} "
                                f"microbatch {s.microbatch}", cost.time_us)
            transfers.append({"task": task, "microbatch": s.microbatch, "from_stage": k, "to_stage": to,
                              "from_device": d, "to_device": int(device_of_stage[to]), "nbytes": nbytes,
                              "time_us": cost.time_us, "algorithm": cost.algorithm, "protocol": cost.protocol})
    out = builder.graph()
    source = np.concatenate(builder.source_id)
    task_unit = np.where(source >= 0, np.asarray(units.task_unit)[np.maximum(source, 0)], -1)
    task_phase = np.concatenate(builder.phase)
    out.notes.append(PipelineSchedule(
        schedule, p, m, v, scaling, window, pd.DataFrame(stage_rows),
        pd.DataFrame(transfers, columns=["task", "microbatch", "from_stage", "to_stage", "from_device", "to_device",
                                         "nbytes", "time_us", "algorithm", "protocol"]),
        np.concatenate(builder.device), np.concatenate(builder.microbatch),
        task_phase, source, Units(units.pattern, task_unit, task_phase, units.table),
        added.rule if added is not None else "",
    ))
    return out


def _pipeline_pass(graph: TaskGraph, units, par, cluster, ranks_of: dict, microbatch: Optional[TaskGraph] = None) -> tuple:
    """:func:`apply_pipeline` as ``parallelize`` calls a pass: the graph with its units."""
    built = apply_pipeline(graph, units, par, cluster, ranks_of, microbatch=microbatch)
    return built, built.last_note(PipelineSchedule).units


PASSES["pipeline"] = _pipeline_pass


def _transfer(cluster, nbytes: float, a: int, b: int) -> CollectiveCost:
    """One activation's send from GPU ``a`` to ``b``; free without a cluster (the schedule's
    compute alone) or between chunks of one GPU (they share its memory). Priced as a one-way
    send where the links carry figures calibrated for one (:func:`one_way`)."""
    if cluster is None or a == b:
        return CollectiveCost("send_recv", nbytes, 0.0, "none" if cluster is None else "local", "", 0)
    return collective_cost(one_way(cluster), "send_recv", nbytes, ranks=(a, b))


def one_way(cluster):
    """``cluster`` with each link's ``send`` figures (one rank sends, its peer receives: a
    stage's activation or gradient) standing for its ``send_recv`` ones (both ranks at once:
    what ``send_recv`` means to a link, and to a link file calibrated before ``send`` was timed,
    which prices the transfer as before). On the lab's loopback Gloo moved 128 kB one way in
    0.3 to 0.7 ms where the exchange took 1.3 to 2.6 ms (``lab/probes/tp_collectives.py``): a
    pipeline's transfers go one way at a time between two stages."""
    def as_send_recv(link):
        figures = {op: rest for op, *rest in link.collectives}
        if "send" not in figures:
            return link
        kept = tuple(entry for entry in link.collectives if entry[0] not in ("send", "send_recv"))
        floors = tuple(entry for entry in link.floors_us if entry[0] != "send_recv")
        floors += tuple(("send_recv", floor) for op, floor in link.floors_us if op == "send")
        return dataclasses.replace(link, collectives=kept + (("send_recv", *figures["send"]),), floors_us=floors)

    if getattr(cluster, "fabric", None) is not None:  # NCCL's own model of a point-to-point send
        return cluster
    intra, inter = as_send_recv(cluster.intra_node), as_send_recv(cluster.inter_node)
    if intra is cluster.intra_node and inter is cluster.inter_node:
        return cluster
    return dataclasses.replace(cluster, intra_node=intra, inter_node=inter)


def bubbles(schedule: Schedule) -> pd.DataFrame:
    """Per device of a simulated pipeline (a graph :func:`apply_pipeline` built): busy_us (the
    union of the times its GPU runs kernels and copies; on a CPU-only trace, its threads' tasks
    other than waits), step_us (the pipeline's
    step: first start to last end over every device) and bubble (``1 - busy / step``, the
    fraction of the step it is idle); ``bubbles(s)["bubble"].max()`` is the worst stage's.

    The idle splits in two: ``imbalance`` (``(max busy - busy) / step``: what the busiest device
    worked beyond this one) and ``fill_drain`` (``(step - max busy) / step``, the same on every
    device: the busiest device's idle, the schedule's own bubble, ``(p - 1) / (m + p - 1)`` with
    equal stages under GPipe and 1F1B)."""
    note = schedule.graph.last_note(PipelineSchedule)
    if note is None or len(note.task_device) != len(schedule.graph.tasks):
        raise GraphError("bubbles() needs the schedule of a graph apply_pipeline built (and no pass after it that renumbered tasks)")
    kind = schedule.graph.tasks["kind"].to_numpy()
    if schedule.graph.workload.has_gpu:  # a stage is its GPU: kernels and copies keep it busy
        work = np.isin(kind, [int(k) for k in GPU_TASK_KINDS if k != TaskKind.COMM])
    else:  # a CPU worker: its threads' tasks, but for waits
        work = _cpu_side(schedule.graph) & (kind != int(TaskKind.WAIT))
    step_start, step_end = float(np.min(schedule.start_us)), float(np.max(schedule.end_us))
    rows, step = [], step_end - step_start
    for d in range(note.stages_count):
        mine = (note.task_device == d) & work
        busy = _union_length(schedule.start_us[mine], schedule.end_us[mine])
        rows.append({"device": d, "busy_us": busy, "step_us": step})
    table = pd.DataFrame(rows)
    step = table["step_us"].where(table["step_us"] > 0, np.inf)
    table["bubble"] = 1.0 - table["busy_us"] / step
    table["imbalance"] = (table["busy_us"].max() - table["busy_us"]) / step
    table["fill_drain"] = table["bubble"] - table["imbalance"]
    return table


def _union_length(start: np.ndarray, end: np.ndarray) -> float:
    keep = end > start
    if not keep.any():
        return 0.0
    order = np.argsort(start[keep], kind="stable")
    s, e = start[keep][order], end[keep][order]
    reach = np.maximum.accumulate(e)
    gaps = np.maximum(s[1:] - reach[:-1], 0.0)
    return float(reach[-1] - s[0] - gaps.sum())


def _cpu_side(graph: TaskGraph) -> np.ndarray:
    """The tasks that are not GPU work: a CPU thread's (or a hand-made graph's) own tasks."""
    return ~np.isin(graph.tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])


def _clock(graph: TaskGraph) -> tuple[np.ndarray, np.ndarray]:
    """Each task's measured start and end; a graph built by hand has its order keys for a clock."""
    t = graph.tasks
    start = t["measured_start_us"].to_numpy(dtype=float)
    end = t["measured_end_us"].to_numpy(dtype=float)
    if not np.isfinite(start).all():
        start = t["order_key"].to_numpy(dtype=float)
        end = start + t["duration_us"].to_numpy(dtype=float)
    return start, end


def _one_iteration(graph: TaskGraph, units) -> tuple[np.ndarray, tuple]:
    """The tasks of the traced iteration of median length, and its (start, end) on the trace's
    clock. Iterations end with the last backward or optimizer task on a CPU thread before a
    forward task; a GPU task belongs to the iteration of the CPU task that launched it."""
    t = graph.tasks
    phase = np.asarray(units.task_phase)
    start, end = _clock(graph)
    cpu = _cpu_side(graph)
    work = np.flatnonzero(cpu & (phase > OTHER))
    if not len(work):
        raise GraphError("no forward or backward tasks in the units: nothing to pipeline")
    order = work[np.argsort(start[work], kind="stable")]
    ph = phase[order]
    # an iteration's last backward/optimizer task: followed by a forward task
    ends_at = np.flatnonzero((ph[:-1] != FORWARD) & (ph[1:] == FORWARD))
    cuts = [-np.inf] + [float(end[order[i]]) for i in ends_at] + [float(end[order[-1]])]
    windows = list(zip(cuts[:-1], cuts[1:]))
    inner = windows[1:] if len(windows) > 1 else windows  # the first one reaches back to the trace's start
    lengths = [b - a for a, b in inner]
    chosen = inner[int(np.argsort(lengths, kind="stable")[(len(lengths) - 1) // 2])]
    mask = cpu & (start >= chosen[0]) & (start < chosen[1]) if np.isfinite(chosen[0]) else cpu & (start < chosen[1])
    if chosen is windows[-1]:
        mask |= cpu & (start == chosen[1])
    mask = _to_gpu_side(graph, np.where(cpu, mask.astype(np.int64), -1), cpu) == 1
    first = chosen[0] if np.isfinite(chosen[0]) else float(np.min(start[mask]))
    return mask, (first, chosen[1])


def _microbatch_durations(graph: TaskGraph, units, m: int, models) -> tuple[np.ndarray, str]:
    """Every task's duration at a microbatch (forward and backward tasks only; see the module doc)."""
    t = graph.tasks
    traced = t["duration_us"].to_numpy(dtype=float)
    phase = np.asarray(units.task_phase)
    in_pass = np.isin(phase, [FORWARD, BACKWARD])
    if m == 1:
        return traced.copy(), "as traced (one microbatch)"
    if models is not None and not graph.workload.has_gpu:
        batch, _ = infer_batch_size(graph, parameter_shapes(graph))
        if batch % m == 0:
            scaled = change_batch_size(graph, models, batch // m, from_batch=batch)
            if len(scaled.tasks) == len(t):
                return np.where(in_pass, scaled.tasks["duration_us"].to_numpy(dtype=float), traced), (
                    f"from batch {batch} to {batch // m} by the operator performance models")
    kind = t["kind"].to_numpy()
    gpu = np.isin(kind, [int(k) for k in (TaskKind.KERNEL, TaskKind.MEMCPY, TaskKind.MEMSET)])
    linear = gpu | ((kind == int(TaskKind.CPU)) & (not graph.workload.has_gpu))
    rule = "GPU tasks" if graph.workload.has_gpu else "CPU operators"
    return np.where(in_pass & linear, traced / m, traced), f"linear in the batch: {rule} at 1/{m}, the rest as traced"


def _measured_microbatch(graph: TaskGraph, units, in_iteration: np.ndarray, microbatch: TaskGraph, pattern,
                         fallback: np.ndarray, fallback_rule: str) -> tuple[np.ndarray, str]:
    """Every forward and backward task's duration at a microbatch, from a trace of the microbatch
    (rule 1 of the module doc); the groups it does not measure keep ``fallback``."""
    micro_units = find_units(microbatch, pattern)
    if len(micro_units.table) != len(units.table):
        raise GraphError(f"the microbatch trace has {len(micro_units.table)} units where the trace has "
                         f"{len(units.table)}: it must be the same model")
    micro_iteration, _ = _one_iteration(microbatch, micro_units)
    step_key, step_time = _phase_groups(graph, units, in_iteration)
    _, micro_time = _phase_groups(microbatch, micro_units, micro_iteration)
    factor = {key: micro_time[key] / time for key, time in step_time.items() if time > 0 and key in micro_time}
    per_task = np.array([factor.get(key, np.nan) for key in step_key.tolist()]) if len(step_key) else np.zeros(0)
    measured = np.isfinite(per_task)
    traced = graph.tasks["duration_us"].to_numpy(dtype=float)
    rule = f"from the microbatch trace ({len(factor)} of {len(step_time)} unit phases measured"
    rule += ")" if len(factor) == len(step_time) else f"; the rest {fallback_rule})"
    return np.where(measured, traced * np.nan_to_num(per_task), fallback), rule


def _phase_groups(graph: TaskGraph, units, among: np.ndarray) -> tuple[np.ndarray, dict]:
    """Each task's group (unit, phase and side: -1 for a task not in a forward or backward of
    ``among``), and each group's task time in ``among``."""
    phase = np.asarray(units.task_phase)
    unit = np.asarray(units.task_unit)
    in_pass = among & np.isin(phase, [FORWARD, BACKWARD])
    key = np.where(in_pass, (unit + 1) * 8 + phase * 2 + (~_cpu_side(graph)).astype(np.int64), -1)
    duration = graph.tasks["duration_us"].to_numpy(dtype=float)
    totals = np.bincount(key[in_pass], weights=duration[in_pass]) if in_pass.any() else np.zeros(0)
    present = np.unique(key[in_pass])
    return key, {int(k): float(totals[k]) for k in present}


def _stage_of_tasks(graph: TaskGraph, units, stage_of_unit: np.ndarray, in_iteration: np.ndarray, stages: int) -> np.ndarray:
    """Each forward or backward task's virtual stage (-1 elsewhere; see the module doc)."""
    t = graph.tasks
    unit = np.asarray(units.task_unit)
    phase = np.asarray(units.task_phase)
    stage = np.full(len(t), -1, dtype=np.int64)
    labelled = unit >= 0
    stage[labelled] = stage_of_unit[unit[labelled]]
    start, _ = _clock(graph)
    cpu = _cpu_side(graph)
    for ph, before_any in ((FORWARD, 0), (BACKWARD, stages - 1)):
        ids = np.flatnonzero(in_iteration & cpu & (phase == ph))
        ids = ids[np.argsort(start[ids], kind="stable")]
        current = before_any
        for i in ids.tolist():
            if stage[i] >= 0:
                current = stage[i]
            else:
                stage[i] = current
    return _to_gpu_side(graph, stage, cpu)


def _main_thread(graph: TaskGraph, in_iteration: np.ndarray) -> int:
    """A task of the iteration on the CPU resource that runs the most of its tasks."""
    ids = np.flatnonzero(in_iteration & _cpu_side(graph))
    codes = graph.tasks["resource"].cat.codes.to_numpy()[ids]
    return int(ids[np.flatnonzero(codes == np.bincount(codes).argmax())[0]])


def _to_gpu_side(graph: TaskGraph, value: np.ndarray, cpu: np.ndarray) -> np.ndarray:
    """``value`` (-1: unknown) given to the GPU-side tasks that lack one: a launched task takes
    its launch call's; a task with no launch (a transfer a pass inserted) takes that of a task it
    waits for, other than the one before it on its stream."""
    value = value.copy()
    edges = graph.edges
    src, dst, kind = edges["src"].to_numpy(), edges["dst"].to_numpy(), edges["kind"].to_numpy()
    gpu = ~cpu
    launch = kind == int(EdgeKind.LAUNCH)
    take = launch & gpu[dst] & (value[dst] < 0) & (value[src] >= 0)
    value[dst[take]] = value[src[take]]
    launched = np.zeros(len(value), dtype=bool)
    launched[dst[launch]] = True
    follows = ~launch & (kind != int(EdgeKind.GPU_SEQ)) & gpu[dst] & ~launched[dst]
    for _ in range(len(value)):
        take = follows & (value[dst] < 0) & (value[src] >= 0)
        if not take.any():
            break
        value[dst[take]] = value[src[take]]
    return value


def _prefixed_by_device(column: pd.Series, device: np.ndarray) -> pd.Series:
    """``"stage D: "`` before each value of a column, ``D`` the row's ``device``: a categorical
    column's categories are the values used (sorted), each written once rather than each row;
    the same strings as ``"stage D: " + value`` where no value is missing."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes = column.cat.codes.to_numpy().astype(np.int64)
        if not (codes < 0).any():
            names = column.cat.categories
            pairs, inverse = np.unique(device * len(names) + codes, return_inverse=True)
            labels = [f"stage {pair // len(names)}: {names[pair % len(names)]}" for pair in pairs.tolist()]
            categories = pd.Index(np.array(labels, dtype=object))
            rank = np.argsort(np.argsort(categories.to_numpy(), kind="stable"), kind="stable")
            return pd.Series(pd.Categorical.from_codes(rank[inverse.ravel()], categories=categories.sort_values()),
                             index=column.index)
    values = column.astype(str).to_numpy()
    return pd.Series(np.array([f"stage {d}: {v}" for d, v in zip(device.tolist(), values)], dtype=object),
                     index=column.index)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``start, start + 1, ..., end - 1`` for each pair, one after another."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(total)


class _Builder:
    """Accumulates the copies of tasks and edges that make the pipeline's graph. A copy is
    recorded as the source rows it takes and what changes in them; the task table is cut from
    the source once, in :meth:`graph`, rather than once per slot."""

    def __init__(self, graph: TaskGraph, duration: np.ndarray, origin_us: float, main: int):
        self.source = graph
        self.main = main  # a task on the thread that runs the training loop: where empty slots go
        self.duration = duration
        keys = graph.tasks["order_key"].to_numpy(dtype=float)
        self.keys = keys - (origin_us if np.isfinite(origin_us) else 0.0)
        self.span = float(np.nanmax(np.abs(self.keys))) * 2.0 + 1.0
        self.resource = graph.tasks["resource"].astype(str).to_numpy()
        self.copies: list = []  # (device, first new id, source ids, durations, order keys)
        self.empties: list = []  # (new id, device, name, order key)
        self.sends: list = []  # the transfer tasks' rows
        self.edges: list = []  # (src, dst, lag_us, kind) arrays, in the order they were added
        # each new task's device, microbatch, phase and source task (-1: none), as arrays per call
        self.device, self.microbatch, self.phase, self.source_id = [], [], [], []
        self.count = 0
        self.slot_tasks: dict = {}  # (stage, microbatch, phase) -> {resource: (first id, last id)}
        self.copied_us: dict = {}  # (stage, microbatch, phase) -> task time
        self.group_of: dict = {}  # (device, stage, microbatch) -> new id of each source task (-1: none)
        src, dst = graph.edges["src"].to_numpy(), graph.edges["dst"].to_numpy()
        self.edge_src, self.edge_dst = src, dst
        self.edge_lag = graph.edges["lag_us"].to_numpy(dtype=float)
        self.edge_kind = graph.edges["kind"].to_numpy()
        n = len(graph.tasks)  # each task's edges, out and in, as index ranges into two sorted orders
        self.by_src, self.by_dst = np.argsort(src, kind="stable"), np.argsort(dst, kind="stable")
        self.src_at = np.searchsorted(src[self.by_src], np.arange(n + 1))
        self.dst_at = np.searchsorted(dst[self.by_dst], np.arange(n + 1))

    def _edges_of(self, ids: np.ndarray) -> np.ndarray:
        """The source edges with an end among ``ids``, in the source's order, each once."""
        parts = [order[_ranges(at[ids], at[ids + 1])] for order, at in ((self.by_src, self.src_at),
                                                                           (self.by_dst, self.dst_at))]
        return np.unique(np.concatenate(parts)).astype(np.int64)

    def copy(self, device: int, ids: np.ndarray, slot_index: int, microbatch: int, phase: int,
             group=None, factor: float = 1.0, extra_us: Optional[np.ndarray] = None) -> None:
        """Copies of tasks ``ids`` on ``device`` at ``slot_index`` of its schedule, each
        ``factor`` times its duration plus ``extra_us`` of it (per source task, where given);
        edges join them to the tasks copied before into the same ``group`` (a stage's
        microbatch: its forward and backward), or among themselves."""
        if not len(ids):
            if group is not None:
                self._empty_slot(device, slot_index, group, phase)
            return
        ids = np.asarray(ids, dtype=np.int64)
        new = self.count + np.arange(len(ids))
        durations = self.duration[ids] * factor
        if extra_us is not None:
            durations = durations + extra_us[ids]
        keys = (slot_index + 1) * self.span + self.keys[ids]
        self.copies.append((device, self.count, ids, durations, keys))
        self.count += len(ids)
        self.device.append(np.full(len(ids), device, dtype=np.int64))
        self.microbatch.append(np.full(len(ids), microbatch, dtype=np.int64))
        self.phase.append(np.full(len(ids), phase, dtype=np.int64))
        self.source_id.append(ids)
        key = (device, group) if group is not None else (device, slot_index)
        remap = self.group_of.get(key)
        if remap is None:
            remap = self.group_of[key] = np.full(len(self.source.tasks), -1, dtype=np.int64)
        remap[ids] = new
        touching = self._edges_of(ids)
        s, d = remap[self.edge_src[touching]], remap[self.edge_dst[touching]]
        inside = (s >= 0) & (d >= 0) & ((s >= new[0]) | (d >= new[0]))  # edges touching the new copies
        chosen = touching[inside]
        self.edges.append((s[inside], d[inside], self.edge_lag[chosen], self.edge_kind[chosen]))
        if group is not None:
            k, j = group
            resources = self.resource[ids]
            ends = {}
            for r in np.unique(resources):
                on = np.flatnonzero(resources == r)
                ends[f"stage {device}: {r}"] = (int(new[on[np.argmin(keys[on])]]), int(new[on[np.argmax(keys[on])]]))
            self.slot_tasks[(k, j, phase)] = ends
            self.copied_us[(k, j, phase)] = float(durations.sum())

    def _empty_slot(self, device: int, slot_index: int, group: tuple, phase: int) -> None:
        """A slot with nothing to run (no task of the trace was attributed to it) still passes
        the schedule's dependencies on: a task of no time on the training loop's thread."""
        what = "forward" if phase == FORWARD else "backward"
        task = self.count
        self.empties.append((task, device, f"empty {what} of stage {group[0]} microbatch {group[1]}",
                             (slot_index + 1) * self.span))
        self.count += 1
        self.device.append(np.array([device], dtype=np.int64))
        self.microbatch.append(np.array([group[1]], dtype=np.int64))
        self.phase.append(np.array([phase], dtype=np.int64))
        self.source_id.append(np.array([-1], dtype=np.int64))
        resource = f"stage {device}: {self.resource[self.main]}"
        self.slot_tasks[(group[0], group[1], phase)] = {resource: (task, task)}

    def send(self, device: int, slot_index: int, source: tuple, target: tuple, resource: str, name: str,
             time_us: float) -> int:
        """A transfer task after slot ``source`` (its last task on every resource) that slot
        ``target``'s first task on every resource waits for."""
        task = self.count
        self.sends.append({"name": name, "kind": int(TaskKind.COMM), "resource": f"stage {device}: {resource}",
                           "duration_us": float(time_us), "release_us": -np.inf,
                           "order_key": (slot_index + 1) * self.span, "measured_start_us": np.nan,
                           "measured_end_us": np.nan, "context": "", "operator": "", "layer": "", "event": -1})
        self.count += 1
        self.device.append(np.array([device], dtype=np.int64))
        self.microbatch.append(np.array([source[1]], dtype=np.int64))
        self.phase.append(np.array([source[2]], dtype=np.int64))
        self.source_id.append(np.array([-1], dtype=np.int64))
        edges = [(last, task) for _, last in self.slot_tasks.get(source, {}).values()]
        edges += [(task, first) for first, _ in self.slot_tasks.get(target, {}).values()]
        pairs = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
        self.edges.append((pairs[:, 0], pairs[:, 1], np.zeros(len(pairs)), np.full(len(pairs), int(EdgeKind.USER))))
        return task

    def graph(self) -> TaskGraph:
        """The pipeline's graph: the copies cut from the source's table at once, the empty slots
        and the transfers after them, every row in the order its id was given."""
        source = self.source.tasks
        frames, order = [], []
        if self.copies:
            ids = np.concatenate([c[2] for c in self.copies])
            copied = source.iloc[ids].copy()
            device = np.concatenate([np.full(len(c[2]), c[0], dtype=np.int64) for c in self.copies])
            copied["resource"] = _prefixed_by_device(copied["resource"], device)
            copied["duration_us"] = np.concatenate([c[3] for c in self.copies])
            copied["release_us"] = -np.inf
            copied["order_key"] = np.concatenate([c[4] for c in self.copies])
            frames.append(copied)
            order.append(np.concatenate([c[1] + np.arange(len(c[2])) for c in self.copies]))
        if self.empties:
            rows = source.iloc[[self.main] * len(self.empties)].copy()
            main_resource = str(self.resource[self.main])
            rows["name"] = [e[2] for e in self.empties]
            rows["kind"] = int(TaskKind.INSERTED)
            rows["resource"] = [f"stage {e[1]}: {main_resource}" for e in self.empties]
            rows["duration_us"], rows["release_us"] = 0.0, -np.inf
            rows["order_key"] = [e[3] for e in self.empties]
            rows["event"] = -1
            frames.append(rows)
            order.append(np.array([e[0] for e in self.empties], dtype=np.int64))
        if self.sends:
            frames.append(pd.DataFrame(self.sends))
            order.append(self.count - len(self.sends) + np.arange(len(self.sends)))
        categorical = [c for c in source.columns if isinstance(source[c].dtype, pd.CategoricalDtype)]
        tasks = concat_tasks(frames, categorical).astype({"kind": source["kind"].dtype})
        position = np.concatenate(order)
        if not np.array_equal(position, np.arange(len(position))):  # empty slots among the copies
            tasks = tasks.iloc[np.argsort(position, kind="stable")].reset_index(drop=True)
        src, dst, lag, kind = (np.concatenate([e[i] for e in self.edges]) if self.edges else np.zeros(0)
                               for i in range(4))
        edges = pd.DataFrame({"src": src.astype(np.int64), "dst": dst.astype(np.int64), "lag_us": lag,
                              "kind": kind}).astype(self.source.edges.dtypes.to_dict())
        return TaskGraph(tasks, edges, self.source.ops, self.source.workload, list(self.source.notes))
