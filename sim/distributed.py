"""Data-parallel training on a cluster: worker graphs stitched together by communication tasks.

Every worker runs the single-GPU graph. Each message of the framework (``sim.frameworks``)
becomes a task on the cluster's network queue that starts once its gradients are ready on every
worker and the queue's policy (``sim.policies``) picks it; it lasts as long as its collective
takes on the cluster (``topology``: ring, hierarchical or parameter-server, timed on the links
it crosses); and what the framework makes wait for it (the optimizer step, or the next forward
use of the layer) waits for it on every worker.

Collectives of one queue run one at a time, as NCCL's stream and Horovod's background thread run
them, so an all-reduce takes the time of its plan on otherwise idle links: the closed forms of
``topology.collectives``, which the topology tests hold to the link-sharing simulation. A
parameter server has two queues, push and pull, whose transfers meet on the same NICs (with
servers on the worker machines every NIC pushes and pulls at once), so there each message's plan
runs on ``topology.network``'s shared links, in flight with the others.

Identical workers need not all be simulated: every worker would compute the same schedule, so
one worker graph plus the network gives the same answer (a test compares it with full
replication). Workers that differ (a straggler, a slower GPU on one machine) are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import pandas as pd

import simpy

from whatif.topology import Cluster, Network, Plan, collective_cost, collective_plan

from .engine import Policy, Schedule, simulate
from .frameworks import FrameworkOptions, Message, plan_messages
from .gradients import Gradients
from .graph import GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind, cpu_work
from .framework_copies import add_ddp_copies, add_ddp_copy_back, horovod_copy_us
from .passes.optimizations import OPTIMIZER_STEP
from .policies import Fifo, HorovodCycle, Priority
from .passes.shared_memory import slow_beside_peers

POLICIES = ("fifo", "p3")
_WEIGHT_OPS = re.compile(
    r"^aten::(conv\w*|_convolution|cudnn_convolution|linear|addmm|matmul|mm|bmm|batch_norm|layer_norm|"
    r"embedding\w*|lstm|gru|rnn_\w+)$"
)


@dataclass(frozen=True)
class Straggler:
    """The workers of one machine run slower: all their tasks (``slowdown``) or only their GPU
    tasks (``gpu_slowdown``)."""

    machine: int
    slowdown: float = 1.0
    gpu_slowdown: float = 1.0


@dataclass
class ClusterConfig:
    cluster: Cluster
    framework: str = "horovod"
    policy: str = "fifo"
    algorithm: str = "ring"
    options: FrameworkOptions = field(default_factory=FrameworkOptions)
    stragglers: Sequence[Straggler] = ()
    replicate: Optional[bool] = None  # None: only when workers differ
    # run each collective's plan on links shared with the collectives in flight beside it, or
    # time it by its closed form; None: shared for a parameter server, whose push and pull queues
    # overlap, closed form for all-reduce, whose one queue runs a collective at a time (the two
    # agree there, and the closed form is much faster on large clusters)
    shared_links: Optional[bool] = None
    # how fast the worker's CPU streams gradient bytes (sim/framework_copies.py); None: the
    # frameworks' copies of the gradients are not simulated (a GPU trace, or no rate found)
    pass_bytes_per_us: Optional[float] = None

    @property
    def on_shared_links(self) -> bool:
        return self.framework == "ps" if self.shared_links is None else self.shared_links

    @property
    def workers(self) -> int:
        return self.cluster.n_gpus


@dataclass
class ClusterSchedule:
    """A simulated cluster: the schedule, the task ids of the communication, and worker 0."""

    schedule: Schedule
    comm_tasks: np.ndarray
    worker0: np.ndarray  # mask of worker 0's tasks
    messages_per_iteration: float
    bytes_per_iteration: float


def _message_cost(config: ClusterConfig):
    """Time (us) of one message of ``nbytes`` on the cluster, for each phase of the framework."""
    cluster = config.cluster
    op, algorithm = ("push", None) if config.framework == "ps" else ("all_reduce", config.algorithm)

    @lru_cache(maxsize=None)
    def cost(nbytes: float) -> float:
        return collective_cost(cluster, op, nbytes, algorithm=algorithm).time_us

    return cost


def simulate_cluster(worker: TaskGraph, gradients: Gradients, iterations: pd.DataFrame, config: ClusterConfig) -> ClusterSchedule:
    """Simulate ``config.workers`` copies of ``worker`` training together."""
    if config.workers == 1:
        schedule = simulate(worker)
        return ClusterSchedule(schedule, np.zeros(0, np.int64), np.ones(len(worker.tasks), bool), 0.0, 0.0)
    if config.policy not in POLICIES:
        raise GraphError(f"unknown policy {config.policy!r}; choose from {', '.join(POLICIES)}")
    replicate = config.replicate if config.replicate is not None else bool(config.stragglers)
    copies = config.workers if replicate else 1
    thread = _iteration_thread(worker, iterations)
    sync = _SyncPoints(worker, iterations, thread)
    cost = _message_cost(config)

    sliced = config.policy == "p3"
    layerwise = sliced or config.framework == "ps"
    rate = config.pass_bytes_per_us
    copy_back: dict = {}  # iteration -> DDP's copy of the buckets back into the gradients
    if config.framework == "ddp" and rate and not layerwise:
        worker = worker.copy()
        gradients = add_ddp_copies(worker, gradients, rate)
        for it in range(len(iterations)):
            consumer = sync.optimizer(it, on_gpu=False)
            sent = sum(g.nbytes for g in gradients.of_iteration(it))
            if sent and consumer is not None:
                back = add_ddp_copy_back(worker, consumer, sent, rate)
                if back is not None:
                    copy_back[it] = back
    if config.cluster.workers_sharing_memory > 1:
        worker = slow_beside_peers(worker, config.cluster)
    if config.framework == "horovod":
        worker = _with_horovod_loop(worker, _driving_link(config), config.options.cycle_time_us)
    n = len(worker.tasks)
    graph = _replicate(worker, copies, config)
    rows, edges = [], []
    nbytes, priority, order = [], [], []
    per_iteration = {}
    for it in range(len(iterations)):
        messages = plan_messages(gradients.of_iteration(it), config.framework, config.options, sliced)
        per_iteration[it] = messages
    barrier = sync.barrier(graph) if any(per_iteration.values()) else None
    base = len(graph.tasks)
    measured_end = worker.tasks["measured_end_us"].to_numpy()
    last_iteration = max((it for it, messages in per_iteration.items() if messages), default=-1)
    for it, messages in per_iteration.items():
        first_id = base + len(rows)
        for j, m in enumerate(messages):
            tid = base + len(rows)
            resource = "network" if config.framework != "ps" else f"network {m.phase}"
            ready_us = max((measured_end[t] for t in m.ready_after), default=np.nan)
            rows.append(_comm_row(m, resource, cost(m.nbytes), ready_us))
            nbytes.append(m.nbytes)
            priority.append(m.priority)
            order.append((ready_us if ready_us == ready_us else np.inf, it, j))
            for k in range(copies):
                edges += [(t + k * n, tid, 0.0) for t in m.ready_after]
            if m.follows is not None:
                edges.append((first_id + m.follows, tid, 0.0))
            if m.phase == "push":
                continue
            consumer = copy_back.get(it, sync.consumer(it, m, layerwise, config.framework, len(gradients.of_iteration(it))))
            targets = [consumer + k * n for k in range(copies)] if consumer is not None else []
            if consumer is None or it == last_iteration:
                # the step's end waits for its communication: with a GPU-side wait (DDP) nothing
                # on the CPU would, and the last iteration's span would miss it
                targets.append(barrier)
            edges += [(tid, c, 0.0) for c in targets]
    _add_comm_tasks(graph, rows, edges)
    comm = np.arange(base, base + len(rows))
    rank = {int(comm[i]): r for r, i in enumerate(sorted(range(len(order)), key=order.__getitem__))}
    prio = {int(comm[i]): p for i, p in enumerate(priority)}
    size = {int(comm[i]): b for i, b in enumerate(nbytes)}

    def policies_for(priced: dict) -> dict:
        """The network's policies, each transfer costing as much as ``priced`` bytes."""
        policies = {}
        networks: dict = {}  # one Network per simulation, shared by the push and pull queues
        for resource in sorted({r["resource"] for r in rows}):
            inner = Priority(prio, rank) if sliced else Fifo(rank)
            if config.framework == "horovod" and not sliced:
                inner = HorovodCycle(inner, size, config.options.fusion_buffer_bytes, config.options.cycle_time_us, cost,
                                     horovod_copy_us(rate) if rate else None, priced)
            if config.on_shared_links:
                inner = _OnSharedLinks(inner, priced, _plan_maker(config, resource), networks)
            policies[resource] = inner
        return policies

    schedule = simulate(graph, policies_for(size))
    link = _driving_link(config)
    if link.has_cpu_contention and len(comm):
        waits_on = thread if config.framework == "horovod" else None
        schedule = _with_cpu_contention(graph, schedule, comm, size, link, policies_for, n, waits_on)
    worker0 = np.zeros(len(graph.tasks), dtype=bool)
    worker0[:n] = True
    if barrier is not None:
        worker0[barrier] = True  # it closes worker 0's last iteration
    iterations_with = max(sum(1 for m in per_iteration.values() if m), 1)
    return ClusterSchedule(
        schedule,
        comm,
        worker0,
        len(rows) / iterations_with,
        sum(nbytes) / iterations_with / (2 if config.framework == "ps" else 1),
    )


def _driving_link(config: ClusterConfig):
    """The link whose CPU contention applies: the NIC across machines, loopback inside one."""
    cluster = config.cluster
    return cluster.inter_node if cluster.machines > 1 else cluster.intra_node


_CONTENTION_PASSES = 4


def _with_horovod_loop(worker: TaskGraph, link, cycle_us: float) -> TaskGraph:
    """The worker with its CPU work slowed by Horovod's background loop, which takes
    ``link.horovod_loop_us`` of the worker's core every cycle (``collectors/horovod_loop_probe.py``)
    and so leaves the training step ``1 - loop / cycle`` of it."""
    if not link.horovod_loop_us:
        return worker
    if link.horovod_loop_us >= cycle_us:
        raise GraphError(
            f"Horovod's loop takes {link.horovod_loop_us:g} us of every {cycle_us:g} us cycle: the worker would never compute"
        )
    slowed = worker.copy()
    slowed.scale(cpu_work(slowed.tasks), 1.0 / (1.0 - link.horovod_loop_us / cycle_us))
    return slowed


def _with_cpu_contention(graph: TaskGraph, schedule: Schedule, comm: np.ndarray, size: dict, link, policies_for, n: int,
                         polling_thread: Optional[str] = None) -> Schedule:
    """Re-simulate with communication and CPU work slowing each other where they overlapped.

    Worker 0's core is busy while it runs CPU work, and, where ``polling_thread`` is named
    (Horovod's), while that thread waits for communication: Horovod's ``synchronize()`` spins on
    ``sched_yield`` until the all-reduce is done, so the transfers it waits for share the core
    as they would with compute (DDP's wait blocks). A transfer that overlaps a busy core for a
    fraction ``f`` of its time lasts
    ``1 + (comm_slowdown - 1) f`` times as long, with the link's slowdown at the size of the
    all-reduce it went in (a fused batch's, whose bytes are priced as that many more; the
    tensors still fuse by their own bytes); a CPU task overlapping communication for a fraction
    ``g`` lasts
    ``1 + (compute_slowdown - 1) g`` times as long. The overlaps come from the previous
    schedule and the factors always apply to the uncontended durations, so the passes settle
    on a schedule consistent with its own overlaps (a few passes; the loop stops when the
    makespan moves less than 0.1 %).
    """
    tasks = graph.tasks
    base = tasks["duration_us"].to_numpy(dtype=float).copy()
    comm_bytes = np.array([size[t] for t in comm.tolist()], dtype=float)
    comm_resource = tasks["resource"].astype(str).to_numpy()[comm]
    cpu = cpu_work(tasks)
    worker0_cpu = cpu[cpu < n]
    waits = _CommWaits(graph, comm, polling_thread) if polling_thread else None
    for _ in range(_CONTENTION_PASSES):
        wait_start, wait_end = waits.intervals(schedule) if waits else ([], [])
        busy = _Union(np.concatenate([schedule.start_us[worker0_cpu], wait_start]),
                      np.concatenate([schedule.end_us[worker0_cpu], wait_end]))
        in_flight = _Union(schedule.start_us[comm], schedule.end_us[comm])
        batch_bytes = _batch_bytes(comm_resource, schedule.start_us[comm], schedule.end_us[comm], comm_bytes)
        comm_factor = 1 + (link.comm_slowdown_at(batch_bytes) - 1) * busy.fraction_of(schedule.start_us[comm], schedule.end_us[comm])
        cpu_factor = 1 + (link.compute_slowdown - 1) * in_flight.fraction_of(schedule.start_us[cpu], schedule.end_us[cpu])
        duration = base.copy()
        duration[comm] *= comm_factor
        duration[cpu] *= cpu_factor
        tasks["duration_us"] = duration
        priced = dict(zip(comm.tolist(), (comm_bytes * comm_factor).tolist()))
        previous = schedule.makespan_us
        schedule = simulate(graph, policies_for(priced))
        if abs(schedule.makespan_us - previous) <= 1e-3 * previous:
            break
    return schedule


def _batch_bytes(resource: np.ndarray, start_us: np.ndarray, end_us: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The bytes of the all-reduce each transfer went in: transfers on one resource that start
    and end together were fused into one."""
    batches = pd.DataFrame({"resource": resource, "start": start_us, "end": end_us, "nbytes": nbytes})
    return batches.groupby(["resource", "start", "end"])["nbytes"].transform("sum").to_numpy(dtype=float)


class _CommWaits:
    """Worker 0's waits on ``thread`` for communication in a schedule: from the end of the task
    before one that a transfer feeds to that task's start. Which tasks those are does not change
    from one contention pass to the next; only their times do."""

    def __init__(self, graph: TaskGraph, comm: np.ndarray, thread: str):
        resource = graph.tasks["resource"].astype(str).to_numpy()
        self.on_thread = np.flatnonzero(resource == thread)
        edges = graph.edges
        self.fed_by_comm = np.isin(self.on_thread, edges["dst"].to_numpy()[np.isin(edges["src"].to_numpy(), comm)])

    def intervals(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        """Start and end times of the waits."""
        order = np.argsort(schedule.start_us[self.on_thread], kind="stable")
        tasks = self.on_thread[order]
        waiting = self.fed_by_comm[order][1:]
        starts, ends = schedule.end_us[tasks[:-1]][waiting], schedule.start_us[tasks[1:]][waiting]
        return starts[ends > starts], ends[ends > starts]


class _Union:
    """A set of time intervals, merged, for measuring how much of another interval it covers."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        order = np.argsort(starts, kind="stable")
        merged_start, merged_end = [], []
        for a, b in zip(starts[order].tolist(), ends[order].tolist()):
            if merged_end and a <= merged_end[-1]:
                merged_end[-1] = max(merged_end[-1], b)
            else:
                merged_start.append(a)
                merged_end.append(b)
        self.start = np.asarray(merged_start)
        self.end = np.asarray(merged_end)
        self.before = np.concatenate([[0.0], np.cumsum(self.end - self.start)])  # covered before each interval

    def covered_until(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.start, t, side="right")  # intervals starting at or before t
        last = np.maximum(i - 1, 0)
        partial = np.where(i > 0, np.clip(t - self.start[last], 0, self.end[last] - self.start[last]), 0.0)
        return self.before[last] * (i > 0) + partial

    def fraction_of(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        length = ends - starts
        covered = self.covered_until(ends) - self.covered_until(starts)
        return np.where(length > 0, covered / np.where(length > 0, length, 1), 0.0)


class _OnSharedLinks(Policy):
    """Runs each batch its policy picks as the collective's plan of transfers on the cluster's
    links (``topology.network``), so collectives in flight at once (a parameter server's pushes
    and pulls) share the links they cross instead of each taking its idle-network time."""

    def __init__(self, inner: Policy, nbytes: dict, plan_of, networks: dict):
        self.inner, self.nbytes, self.plan_of, self.networks = inner, nbytes, plan_of, networks

    def choose_batch(self, ready, now_us):
        return self.inner.choose_batch(ready, now_us)

    def start_at(self, now_us):
        return self.inner.start_at(now_us)

    def finished(self, batch, start_us, end_us):
        self.inner.finished(batch, start_us, end_us)

    def execute(self, env: simpy.Environment, batch, now_us):
        network = self.networks.get(env)
        if network is None:
            network = self.networks.setdefault(env, Network(env, self.plan_of.cluster))
        return network.execute(self.plan_of(sum(self.nbytes[t] for t in batch)))


class _PlanMaker:
    def __init__(self, cluster: Cluster, op: str, algorithm: Optional[str]):
        self.cluster, self.op, self.algorithm = cluster, op, algorithm

    def __call__(self, nbytes: float) -> Plan:
        return collective_plan(self.cluster, self.op, nbytes, algorithm=self.algorithm)


def _plan_maker(config: ClusterConfig, resource: str) -> _PlanMaker:
    if config.framework != "ps":
        return _PlanMaker(config.cluster, "all_reduce", config.algorithm)
    return _PlanMaker(config.cluster, "push" if resource.endswith("push") else "pull", None)


def _comm_row(m: Message, resource: str, duration_us: float, ready_us: float) -> dict:
    return {
        "name": m.name if m.phase != "allreduce" else f"all-reduce {m.name}",
        "kind": int(TaskKind.COMM),
        "resource": resource,
        "duration_us": float(duration_us),
        "release_us": -np.inf,
        "order_key": ready_us if ready_us == ready_us else np.inf,
        "measured_start_us": np.nan,
        "measured_end_us": np.nan,
        "context": f"iteration {m.iteration} > {m.phase}",
        "operator": "",
        "layer": "",
        "event": -1,
    }


def _add_comm_tasks(graph: TaskGraph, rows: list, edges: list) -> None:
    if not rows:
        return
    extra = pd.DataFrame(rows)
    tasks = graph.tasks
    categorical = [c for c in tasks.columns if isinstance(tasks[c].dtype, pd.CategoricalDtype)]
    combined = pd.concat([tasks.astype({c: object for c in categorical}), extra], ignore_index=True)
    graph.tasks = combined.astype({c: "category" for c in categorical})
    graph.add_edges([(s, d, lag, int(EdgeKind.USER)) for s, d, lag in edges])


def _replicate(worker: TaskGraph, copies: int, config: ClusterConfig) -> TaskGraph:
    """``copies`` workers; worker 0 keeps its resource names, the others are prefixed."""
    graph = worker.copy()
    if copies == 1:
        return graph
    n = len(worker.tasks)
    frames, edge_frames = [], []
    kinds = worker.tasks["kind"].to_numpy()
    gpu = np.isin(kinds, [int(k) for k in GPU_TASK_KINDS])
    unscaled = np.isin(kinds, [int(TaskKind.WAIT)])
    slow = {s.machine: s for s in config.stragglers}
    for k in range(copies):
        t = worker.tasks.copy()
        if k:
            t["resource"] = t["resource"].cat.rename_categories(lambda r, k=k: f"worker {k}: {r}")
        machine = k // config.cluster.gpus_per_machine
        if machine in slow:
            duration = t["duration_us"].to_numpy().copy()
            duration[~unscaled] *= slow[machine].slowdown
            duration[gpu] *= slow[machine].gpu_slowdown
            t["duration_us"] = duration
        frames.append(t)
        e = worker.edges.copy()
        e["src"] += k * n
        e["dst"] += k * n
        edge_frames.append(e)
    categorical = [c for c in worker.tasks.columns if isinstance(worker.tasks[c].dtype, pd.CategoricalDtype)]
    tasks = pd.concat([f.astype({c: object for c in categorical}) for f in frames], ignore_index=True)
    graph.tasks = tasks.astype({c: "category" for c in categorical})
    graph.edges = pd.concat(edge_frames, ignore_index=True)
    return graph


def _iteration_thread(worker: TaskGraph, iterations: pd.DataFrame) -> str:
    threads = [t for t in iterations["thread"] if t is not None]
    if threads:
        return f"cpu {threads[0]}"
    cpu = worker.tasks.loc[worker.tasks["resource"].astype(str).str.startswith("cpu "), "resource"]
    if cpu.empty:
        raise GraphError("the trace has no CPU thread to attach communication to")
    return str(cpu.astype(str).value_counts().index[0])


class _SyncPoints:
    """What waits for communication in each iteration of the worker graph."""

    def __init__(self, worker: TaskGraph, iterations: pd.DataFrame, thread: str):
        self.worker = worker
        self.iterations = iterations
        tasks = worker.tasks
        self.start = tasks["measured_start_us"].to_numpy()
        self.on_thread = (tasks["resource"].astype(str) == thread).to_numpy()
        self.in_optimizer = worker.match(OPTIMIZER_STEP)
        self.kinds = tasks["kind"].to_numpy()
        self.cache: dict = {}

    def _span(self, it: int) -> np.ndarray:
        row = self.iterations.iloc[it]
        return (self.start >= row.start_us) & (self.start < row.end_us)

    def first_of_iteration(self, it: int) -> Optional[int]:
        if it >= len(self.iterations):
            return None
        ids = np.flatnonzero(self._span(it) & self.on_thread)
        return int(ids[np.argmin(self.start[ids])]) if len(ids) else None

    def optimizer(self, it: int, on_gpu: bool) -> Optional[int]:
        key = ("optimizer", it, on_gpu)
        if key not in self.cache:
            cpu = np.flatnonzero(self._span(it) & self.on_thread & self.in_optimizer)
            found = int(cpu[np.argmin(self.start[cpu])]) if len(cpu) else None
            if found is not None and on_gpu:
                gpu = np.flatnonzero(self.in_optimizer & np.isin(self.kinds, [int(TaskKind.KERNEL)]))
                gpu = gpu[self.start[gpu] >= self.start[found]]
                found = int(gpu[np.argmin(self.start[gpu])]) if len(gpu) else found
            self.cache[key] = found if found is not None else self.first_of_iteration(it + 1)
        return self.cache[key]

    def forward_ops(self, it: int) -> np.ndarray:
        """First task of each weight-using operator of iteration ``it``'s forward pass, in order."""
        key = ("forward", it)
        if key not in self.cache:
            tasks = self.worker.tasks
            names = tasks["name"].astype(str).to_numpy()
            outer = tasks["operator"].astype(str).to_numpy()
            span = self._span(it) & self.on_thread
            candidates = np.flatnonzero(span & (names == outer))
            weight = [t for t in candidates.tolist() if _WEIGHT_OPS.match(names[t])]
            event = tasks["event"].to_numpy()
            firsts, seen = [], set()
            for t in sorted(weight, key=lambda t: self.start[t]):
                if event[t] not in seen:
                    seen.add(event[t])
                    firsts.append(t)
            self.cache[key] = np.asarray(firsts, dtype=np.int64)
        return self.cache[key]

    def consumer(self, it: int, m: Message, layerwise: bool, framework: str, layers: int) -> Optional[int]:
        """The task that waits for message ``m`` of iteration ``it`` (None: the end barrier).

        Layer by layer, the gradient at forward position ``p`` of ``layers`` is needed by the
        weight operator at the same relative position of the next forward pass.
        """
        if not layerwise:
            return self.optimizer(it, on_gpu=framework == "ddp")
        if it + 1 >= len(self.iterations):
            return None
        ops = self.forward_ops(it + 1)
        if not len(ops):
            return self.first_of_iteration(it + 1)
        position = min(m.layers) if m.layers else m.priority
        return int(ops[min(position * len(ops) // max(layers, 1), len(ops) - 1)])

    def barrier(self, graph: TaskGraph) -> int:
        """A zero-length task closing the last iteration, for communication nothing else awaits."""
        last = self.iterations.iloc[-1]
        ids = np.flatnonzero(self.on_thread & (self.start < last.end_us))
        after = int(ids[np.argmax(self.start[ids])])
        barrier = graph.insert(after, None, "end of training step", 0.0)
        graph.tasks.loc[barrier, ["measured_start_us", "measured_end_us"]] = last.end_us
        return barrier
