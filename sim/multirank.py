"""A distributed job from the traces of all its ranks: one graph per rank, joined at the collectives.

Each rank's trace becomes its own dependency graph (``sim/build.py``). A collective kernel on a
rank's GPU stream lasts, in the trace, from the moment that rank reached it to the moment the
data arrived: the first ranks to get there spin in the kernel until the last one does, then all
of them move the data together (in the 8-rank DLRM traces the kernels end within a few
microseconds of each other on every rank while they start up to 7.6 ms apart). The join says
exactly that, with the engine's primitives:

* each rank's collective kernel becomes an **arrival** (the kernel's start: the task keeps the
  kernel's place, its launch and stream-order edges, and takes no time) followed on the same
  stream by a **completion** (the transfer), which takes over the kernel's outgoing edges
  (stream order, synchronisations, the launch queue);
* one **rendezvous** per collective, a task of no duration on a resource of its process group
  (``collectives GROUP``, where the group's collectives run in order, as on an NCCL
  communicator), waits for every member's arrival, and every member's completion waits for it.

So a collective cannot complete on any rank before every rank has arrived, and then takes its
transfer time. The transfer of rank ``r`` is what the trace measured after the last arrival:
``end_r - max_q start_q``; replaying the joined graph therefore reproduces every rank's kernels,
waits and iterations as measured, and the transfer is what a what-if on the collectives reprices
(:meth:`Job.with_collectives`).

Collectives are matched across ranks by process group and sequence number where the trace
records them (c10d's ``Process Group Name`` and ``Seq``), else by their order in the group, or,
where no group is recorded (the 2023 DLRM traces), by their order on each rank's NCCL stream
(``sim/matching.py``). Each rank's graph first gets the stream waits its trace did not record
(``sim/passes/stream_waits.py``), so that a collective's delay reaches the compute stream that
waits for it.

The ranks' clocks: Kineto stamps events with the host's clock, so ranks of one machine share it
and ranks of several differ by what NTP left. Each rank's clock is shifted so that its
collectives end, in the median, when the same collectives end on the ranks it was aligned to
(the kernels of one collective end together: the last data arrives everywhere at once);
:attr:`Job.clock_offsets_us` says how far each clock was moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pandas as pd

from whatif.collectors.collectives import find_collectives
from whatif.collectors.iterations import find_iterations
from whatif.collectors.ranks import JobTraces, RankTrace
from whatif.topology import Cluster, collective_cost

from .build import build_graph
from .engine import Schedule, simulate
from .graph import EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks
from .matching import match_collectives
from .passes.stream_waits import infer_stream_waits
from .workload import Workload

#: What an arrival's name adds to its kernel's (the completion keeps the kernel's name).
ARRIVAL_SUFFIX = " (arrival)"


@dataclass
class RankInJob:
    """Where a rank is in the joined graph: its resources are named ``prefix + resource``, and
    its times there are its trace's plus ``shift_us``."""

    rank: int
    path: str
    prefix: str
    shift_us: float
    iterations: pd.DataFrame


@dataclass
class Job:
    """The joined graph of a job's ranks.

    ``collectives``: one row per collective (index: its id): group, seq, op, nbytes (NaN where no
    record gives it), algorithm and protocol (NCCL's, from the kernel's name; "" where it does not
    say), ranks (its members), name (the kernel's), rendezvous (task id), transfer_us (as
    measured: the last-arriving rank's kernel time) and last_rank. ``members``: one row per rank
    of each collective: collective, rank, arrival and completion (task ids). Task ids are those of
    :attr:`graph` and of copies of it that change durations only (:meth:`with_collectives`,
    ``graph.scale``); a removal renumbers tasks.
    """

    graph: TaskGraph
    ranks: list[RankInJob]
    collectives: pd.DataFrame
    members: pd.DataFrame
    clock_offsets_us: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)  # (path, why): files of the folder passed over

    def replay(self) -> Schedule:
        return simulate(self.graph)

    def simulate(self, graph: TaskGraph) -> Schedule:
        """Simulate a graph transformed from the job's (``WhatIf.apply``, :meth:`with_collectives`).

        Ranks depend on each other only through a collective's rendezvous. Removing a collective
        (its kernels and rendezvous, ``--remove nccl``) would, by the remove primitive's rule,
        join every rank's predecessors of it to every rank's successors, a barrier of no
        duration; without the collective the ranks have nothing to wait for, so those bypass
        edges between two ranks are dropped.
        """
        rank_of = rank_of_tasks(graph)
        edges = graph.edges
        src_rank = rank_of[edges["src"].to_numpy()]
        dst_rank = rank_of[edges["dst"].to_numpy()]
        across = (edges["kind"].to_numpy() == int(EdgeKind.BYPASS)) & (src_rank >= 0) & (dst_rank >= 0) & (src_rank != dst_rank)
        if across.any():
            graph = graph.copy()
            graph.edges = edges[~across].reset_index(drop=True)
        return simulate(graph)

    def with_collectives(
        self, transfer_us: Callable[[pd.Series], float], skew_us: Optional[Callable[[pd.Series], float]] = None,
        graph: Optional[TaskGraph] = None,
    ) -> TaskGraph:
        """A copy of the joined graph (or of ``graph``, one transformed from it that keeps its
        task ids) with every collective repriced: its completions last ``transfer_us(row)``
        (``row``: the collective's row of :attr:`collectives`), and, given ``skew_us``, its
        rendezvous lasts ``skew_us(row)``: the collective then completes that long after the last
        of the job's ranks arrived, as if a rank the job does not hold (a straggler known only by
        how long the others waited for it) arrived then."""
        graph = (graph if graph is not None else self.graph).copy()
        duration = graph.tasks.columns.get_loc("duration_us")
        transfers = _times(self.collectives, transfer_us, "transfer")
        graph.tasks.iloc[self.members["completion"].to_numpy(), duration] = transfers[self.members["collective"].to_numpy()]
        if skew_us is not None:
            graph.tasks.iloc[self.collectives["rendezvous"].to_numpy(), duration] = _times(self.collectives, skew_us, "skew")
        return graph

    def entering(self, offsets_us: Optional[dict] = None, graph: Optional[TaskGraph] = None) -> TaskGraph:
        """A copy of ``graph`` (the job's, by default) in which rank ``r`` starts its first
        iteration ``offsets_us[r]`` after the last rank started its own in the traces (0 where not
        given: every rank enters together). That removes the skew with which the ranks entered
        the traced steps (a profiler that started on each rank at another moment, a previous step
        that ended apart), or sets one: a negative offset makes a rank come early."""
        offsets_us = offsets_us or {}
        unknown = set(offsets_us) - {r.rank for r in self.ranks}
        if unknown:
            raise GraphError(f"no rank {sorted(unknown)[0]} in this job")
        graph = (graph if graph is not None else self.graph).copy()
        starts = {r.rank: float(r.iterations["start_us"].min()) + r.shift_us for r in self.ranks}
        # the simulation starts at 0: an early rank makes the others later instead
        latest = max(starts.values()) - min([0.0] + [float(v) for v in offsets_us.values()])
        rank_of = rank_of_tasks(graph)
        release = graph.tasks["release_us"].to_numpy().copy()
        for rank, start in starts.items():
            mine = (rank_of == rank) & np.isfinite(release)
            release[mine] += latest + float(offsets_us.get(rank, 0.0)) - start
        graph.tasks["release_us"] = release
        return graph

    def rank_schedule(self, schedule: Schedule, rank: int) -> Schedule:
        """One rank's part of a schedule of the joined graph (or of a graph transformed from it),
        on the rank's own clock and resource names, as ``simulate`` would give it for that rank
        alone: what the per-iteration reports read."""
        where = next((r for r in self.ranks if r.rank == rank), None)
        if where is None:
            raise GraphError(f"no rank {rank} in this job")
        tasks = schedule.graph.tasks
        resource = tasks["resource"].astype(str)
        ids = np.flatnonzero(resource.str.startswith(where.prefix).to_numpy())
        remap = np.full(len(tasks), -1, dtype=np.int64)
        remap[ids] = np.arange(len(ids))
        mine = tasks.iloc[ids].reset_index(drop=True)
        mine["resource"] = pd.Categorical(resource.iloc[ids].str.slice(len(where.prefix)).to_numpy())
        for column in ("measured_start_us", "measured_end_us", "release_us", "order_key"):
            mine[column] = mine[column] - where.shift_us
        edges = schedule.graph.edges
        inside = (remap[edges["src"].to_numpy()] >= 0) & (remap[edges["dst"].to_numpy()] >= 0)
        edges = edges[inside].copy()
        edges["src"] = remap[edges["src"].to_numpy()]
        edges["dst"] = remap[edges["dst"].to_numpy()]
        graph = TaskGraph(mine, edges.reset_index(drop=True), schedule.graph.ops, schedule.graph.workload)
        return Schedule(
            graph,
            schedule.start_us[ids] - where.shift_us,
            schedule.end_us[ids] - where.shift_us,
            schedule.simpy_events,
            schedule.wall_s,
        )


def transfer_on(cluster: Cluster, as_traced: bool = True) -> Callable[[pd.Series], float]:
    """The time of a collective (a row of :attr:`Job.collectives`) on ``cluster``, by
    ``topology.collective_cost``: its op and message among its ranks (rank ``k`` on the
    cluster's GPU ``k``), with the algorithm and protocol its kernel's name says NCCL chose
    (``as_traced``; else the ones NCCL's tuner would choose on ``cluster``, for a job moved to
    another cluster); for :meth:`Job.with_collectives`."""

    def time_us(row: pd.Series) -> float:
        if not np.isfinite(row["nbytes"]):
            raise GraphError(f"collective #{row.name} ({row['op'] or row['name'][:40]}) has no recorded message size to price")
        ranks = None if len(row["ranks"]) == cluster.n_gpus else list(row["ranks"])
        return collective_cost(
            cluster, row["op"], float(row["nbytes"]), ranks=ranks,
            algorithm=(row["algorithm"] or None) if as_traced else None,
            protocol=(row["protocol"] or None) if as_traced else None,
        ).time_us

    return time_us


def _times(collectives: pd.DataFrame, time_us: Callable[[pd.Series], float], what: str) -> np.ndarray:
    times = np.array([float(time_us(row)) for _, row in collectives.iterrows()], dtype=np.float64)
    if not (np.isfinite(times).all() and (times >= 0).all()):
        raise GraphError(f"a collective's {what} time must be a finite number of microseconds >= 0")
    return times


def rank_of_tasks(graph: TaskGraph) -> np.ndarray:
    """Each task's rank, read from its resource's name (``rank 3: cpu 12/34``); -1 for the
    rendezvous and anything else no rank owns."""
    labels = graph.tasks["resource"].cat.categories
    of_label = np.array([_rank_in_label(str(label)) for label in labels] + [-1], dtype=np.int64)
    return of_label[graph.tasks["resource"].cat.codes.to_numpy()]


def _rank_in_label(label: str) -> int:
    head, sep, _ = label.partition(": ")
    if sep and head.startswith("rank ") and head[5:].isdigit():
        return int(head[5:])
    return -1


def build_job(job: JobTraces, iteration: Optional[str] = None) -> Job:
    """Build every rank's graph, match their collectives and join them (see the module)."""
    graphs, tables, built = {}, {}, {}
    for r in job.ranks:
        if id(r.trace) not in built:  # ranks that are copies of one trace share its graph
            built[id(r.trace)] = _rank_graph(r.trace)
        graphs[r.rank], tables[r.rank] = built[id(r.trace)]
    paths = {r.rank: r.path for r in job.ranks}
    members = match_collectives(tables, paths)
    origin = min(r.trace.origin_us for r in job.ranks)
    shift = {r.rank: r.trace.origin_us - origin for r in job.ranks}
    offsets = _clock_offsets(members, shift)
    shift = {rank: s + offsets[rank] for rank, s in shift.items()}
    iterations = {r.rank: find_iterations(r.trace, iteration) for r in job.ranks}
    return _join(job, graphs, members, shift, offsets, iterations)


def replicate_rank(rank: RankTrace, copies: int, iteration: Optional[str] = None) -> Job:
    """A job of ``copies`` identical ranks, each running ``rank``'s trace: what one rank's trace
    says of the whole job. Identical ranks compute identical schedules, so one copy gives the
    answer of all of them (as the data-parallel predictions do); more show it. Each collective
    first lasts as the rank measured it, waits included (:meth:`Job.with_collectives`
    reprices it)."""
    if copies < 1:
        raise GraphError(f"a job needs one rank or more, not {copies}")
    ranks = [RankTrace(k, rank.trace, rank.world_size, rank.backend, rank.rank_from) for k in range(copies)]
    return build_job(JobTraces(ranks), iteration)


def _rank_graph(trace) -> tuple[TaskGraph, pd.DataFrame]:
    """A rank's graph and its collectives, each with its task in the graph."""
    graph = infer_stream_waits(build_graph(trace))
    table = find_collectives(trace)
    gpu = graph.tasks["kind"].isin([int(k) for k in (TaskKind.KERNEL, TaskKind.COMM)]).to_numpy()
    task_of_event = pd.Series(np.flatnonzero(gpu), index=graph.tasks["event"].to_numpy()[gpu])
    table["task"] = task_of_event.reindex(table["event"].to_numpy()).to_numpy()
    return graph, table


def _clock_offsets(members: pd.DataFrame, shift: dict) -> dict:
    """How far to move each rank's clock so that its collectives end, in the median, with the
    ranks already aligned (breadth first from the lowest rank)."""
    ends = members.assign(end=members["end_us"] + members["rank"].map(shift)).pivot(
        index="collective", columns="rank", values="end"
    )
    ranks = list(ends.columns)
    offsets = {ranks[0]: 0.0}
    frontier = [ranks[0]]
    while frontier:
        base = frontier.pop(0)
        for rank in ranks:
            if rank in offsets:
                continue
            shared = ends[[base, rank]].dropna()
            if len(shared):
                offsets[rank] = float(np.median(shared[base] + offsets[base] - shared[rank]))
                frontier.append(rank)
    for rank in ranks:
        offsets.setdefault(rank, 0.0)  # shares no collective with the others: keep its clock
    for rank in shift:
        offsets.setdefault(rank, 0.0)
    return offsets


def _join(job: JobTraces, graphs: dict, members: pd.DataFrame, shift: dict, offsets: dict, iterations: dict) -> Job:
    task_frames, edge_frames, op_frames = [], [], []
    placed = []
    base = 0
    event_base = 0
    arrival, completion = {}, {}
    effective = {}
    for r in job.ranks:
        graph = graphs[r.rank]
        mine = members[members["rank"] == r.rank]
        split, completions = _split_collectives(graph, mine["task"].to_numpy(dtype=np.int64))
        tasks = split.tasks.copy()
        prefix = f"rank {r.rank}: "
        tasks["resource"] = tasks["resource"].cat.rename_categories(lambda name, p=prefix: p + name)
        for column in ("measured_start_us", "measured_end_us", "release_us", "order_key"):
            tasks[column] = tasks[column] + shift[r.rank]
        tasks["event"] = np.where(tasks["event"] >= 0, tasks["event"] + event_base, -1)
        edges = split.edges.copy()
        edges["src"] += base
        edges["dst"] += base
        ops = graph.ops.copy()
        ops.index = ops.index + event_base
        ops["thread"] = ops["thread"].cat.rename_categories(lambda name, p=prefix: p + name)
        for key, kernel, done in zip(mine["collective"].tolist(), mine["task"].tolist(), completions.tolist()):
            arrival[(key, r.rank)] = base + int(kernel)
            completion[(key, r.rank)] = base + int(done)
            effective[(key, r.rank)] = float(tasks["measured_end_us"].iat[int(kernel)])  # arrivals end where they start
        task_frames.append(tasks)
        edge_frames.append(edges)
        op_frames.append(ops)
        placed.append(RankInJob(r.rank, r.path, prefix, shift[r.rank], iterations[r.rank]))
        base += len(tasks)
        event_base += len(r.trace.events)
    tasks = concat_tasks(task_frames)
    measured_end = tasks["measured_end_us"].to_numpy()
    rows, edges, collectives, member_rows = [], [], [], []
    for key, group in members.groupby("collective", sort=True):
        ranks = group["rank"].tolist()
        starts = np.array([effective[(key, q)] for q in ranks])
        last = float(starts.max())
        last_rank = int(ranks[int(np.argmax(starts))])
        rendezvous = base + len(rows)
        first = group.iloc[0]
        rows.append(_rendezvous_row(first, last, tasks["context"].iat[arrival[(key, ranks[0])]]))
        for q in ranks:
            edges.append((arrival[(key, q)], rendezvous))
            edges.append((rendezvous, completion[(key, q)]))
            done = completion[(key, q)]
            tasks.iat[done, tasks.columns.get_loc("duration_us")] = max(measured_end[done] - last, 0.0)
            tasks.iat[done, tasks.columns.get_loc("measured_start_us")] = min(last, measured_end[done])
            member_rows.append((key, q, arrival[(key, q)], done))
        collectives.append({
            "group": first["group"], "seq": int(first["seq"]), "op": first["op"], "nbytes": float(group["nbytes"].max()),
            "algorithm": first["algorithm"], "protocol": first["protocol"], "ranks": tuple(ranks),
            "name": first["name"], "rendezvous": rendezvous,
            "transfer_us": float(max(measured_end[completion[(key, last_rank)]] - last, 0.0)), "last_rank": last_rank,
        })
    tasks = concat_tasks([tasks, pd.DataFrame(rows)])
    joined_edges = pd.concat(
        edge_frames + [pd.DataFrame([(s, d, 0.0, int(EdgeKind.USER)) for s, d in edges], columns=["src", "dst", "lag_us", "kind"])],
        ignore_index=True,
    ).astype(edge_frames[0].dtypes.to_dict())
    ops = pd.concat(op_frames)
    sources = ", ".join(p.path for p in placed[:2]) + (" ..." if len(placed) > 2 else "")
    workload = Workload(f"{len(placed)} ranks ({sources})", any(g.workload.has_gpu for g in graphs.values()))
    graph = TaskGraph(tasks, joined_edges, ops, workload)
    return Job(
        graph,
        placed,
        pd.DataFrame(collectives),
        pd.DataFrame(member_rows, columns=["collective", "rank", "arrival", "completion"]),
        offsets,
        list(job.skipped),
    )


def _split_collectives(graph: TaskGraph, kernels: np.ndarray) -> tuple[TaskGraph, np.ndarray]:
    """``graph`` with each of ``kernels`` cut into an arrival (the kernel itself, now of no
    duration) and a completion placed right after it on its stream, which takes over the
    kernel's outgoing edges. Returns the new graph and the completions' ids."""
    graph = graph.copy()
    tasks = graph.tasks
    n = len(tasks)
    if not len(kernels):
        return graph, np.zeros(0, dtype=np.int64)
    duration = tasks["duration_us"].to_numpy()
    end = tasks["measured_end_us"].to_numpy()
    order_key = tasks["order_key"].to_numpy()
    next_key = np.full(n, np.inf)
    for seq in graph.resource_order():
        next_key[seq[:-1]] = order_key[seq[1:]]
    completions = n + np.arange(len(kernels))
    new = tasks.iloc[kernels].copy()
    gap = next_key[kernels] - order_key[kernels]
    new["order_key"] = order_key[kernels] + np.where(np.isfinite(gap), gap / 2.0, 1.0)
    new["release_us"] = -np.inf
    new.index = completions
    arrivals = tasks.iloc[kernels]
    names = arrivals["name"].astype(str) + ARRIVAL_SUFFIX
    tasks = concat_tasks([tasks, new])
    name_codes = tasks["name"].astype(str).to_numpy().astype(object)
    name_codes[kernels] = names.to_numpy()
    tasks["name"] = pd.Categorical(name_codes)
    effective_start = end[kernels] - duration[kernels]
    tasks.iloc[kernels, tasks.columns.get_loc("duration_us")] = 0.0
    tasks.iloc[kernels, tasks.columns.get_loc("measured_end_us")] = effective_start
    edges = graph.edges
    src = edges["src"].to_numpy().copy()
    moved = pd.Series(completions, index=kernels)
    out = np.isin(src, kernels)
    src[out] = moved.reindex(src[out]).to_numpy()
    edges = edges.copy()
    edges["src"] = src
    graph.tasks, graph.edges = tasks, edges
    return graph, completions


def _rendezvous_row(first: pd.Series, last_arrival_us: float, context: str) -> dict:
    return {
        "name": f"{first['op'] or 'collective'} #{int(first['seq'])} rendezvous",
        "kind": int(TaskKind.COMM),
        "resource": f"collectives {first['group']}",
        "duration_us": 0.0,
        "release_us": -np.inf,
        "order_key": last_arrival_us,
        "measured_start_us": last_arrival_us,
        "measured_end_us": last_arrival_us,
        "context": f"{context} > {first['name']}" if context else str(first["name"]),
        "operator": "",
        "layer": "",
        "event": -1,
    }

