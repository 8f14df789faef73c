"""Data-parallel training on a cluster: worker graphs stitched together by communication tasks.

Every worker runs the single-GPU graph. Each message of the framework (``sim/frameworks/``:
what it sends, on which queue, under which policy, and what waits for it) becomes a task on the
cluster's network queue that starts once its gradients are ready on every worker and the
queue's policy (the framework's, around ``sim.policies``) picks it; it lasts as long as its
collective takes on the cluster (``topology.collective_cost``, on the cluster's backend: NCCL's
algorithms and choice on a GPU fabric, the links' closed forms on a cluster of two links); and
what the framework makes wait for it (the optimizer step, or the next forward use of the layer)
waits for it on every worker. Which collective each communication task ran in (its bytes,
after Horovod's fusion; NCCL's algorithm, protocol and channels for them) is recorded beside the
schedule (``ClusterSchedule.collectives``), for reports and timelines.

Collectives of one queue run one at a time, as NCCL's stream and Horovod's background thread run
them, so an all-reduce takes its time on an otherwise idle cluster: NCCL's model on a fabric,
the closed forms of ``topology.collectives`` on two links, which the topology tests hold to the
link-sharing simulation. Where a
framework's queues overlap (a parameter server's push and pull, whose transfers meet on the
same NICs), each message's plan (``topology.collective_plan``) runs on ``topology.network``'s
shared links, in flight with the others. Where the workers' cores drive the link, the schedule
is settled with the CPU contention between communication and compute (``sim/cpu_contention.py``).

Identical workers need not all be simulated: every worker would compute the same schedule, so
one worker graph plus the network gives the same answer (a test compares it with full
replication). Workers that differ (a straggler machine, per-GPU slowdowns) are not all simulated
either: one worker of each kind is, and of those only worker 0 (whose iterations are reported)
and the kinds no other kind dominates. The worker graph is a max-plus system (every start is the
largest of the ends it waits for, plus lags, on resources of a fixed order), so a worker whose
every factor is at least another's ends every task no earlier, given the same communication;
a message starts once its gradients are ready on the slowest worker, and the dominated workers
never decide it. Where the CPU's contention with communication re-times the tasks from their
own overlaps, that order need not hold, and every kind is simulated (``simulated_workers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

import simpy

from whatif.topology import Cluster, Network, Plan, collective_cost, collective_plan

from .cpu_contention import driving_link, fused_bytes, with_cpu_contention
from .engine import Policy, Schedule, compile_structure, simulate
from .frameworks import Framework, FrameworkOptions, Message, framework
from .frameworks.sync_points import SyncPoints, iteration_thread
from .gradients import Gradients
from .parallel import Parallelism
from .graph import GPU_TASK_KINDS, EdgeKind, GraphError, TaskGraph, TaskKind, concat_tasks
from .passes.shared_memory import slow_beside_peers
from .policies import Fifo, Priority

POLICIES = ("fifo", "p3")
_KEPT_SCHEDULES = 3  # per cluster graph: the schedules a configuration of the same durations and prices reuses


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
    algorithm: Optional[str] = None  # the all-reduce's; None: the backend's choice (ring on the link models)
    options: FrameworkOptions = field(default_factory=FrameworkOptions)
    stragglers: Sequence[Straggler] = ()
    replicate: Optional[bool] = None  # True: every worker; False: worker 0 only; None: the kinds that decide
    # each worker's own factor on its GPU tasks (a GPU's speed, drawn per GPU); empty: none
    gpu_slowdowns: Sequence[float] = ()
    # run each collective's plan on links shared with the collectives in flight beside it, or
    # time it by its closed form; None: shared where the framework's queues overlap (a parameter
    # server's push and pull), closed form for all-reduce, whose one queue runs a collective at a
    # time (the two agree there, and the closed form is much faster on large clusters)
    shared_links: Optional[bool] = None
    # how fast the worker's CPU streams gradient bytes (sim/frameworks/copies.py); None: the
    # frameworks' copies of the gradients are not simulated (a GPU trace, or no rate found)
    pass_bytes_per_us: Optional[float] = None
    # a parallel job's parallelism (sim/parallel/); None: plain data parallelism, as before
    parallelism: Optional[Parallelism] = None
    # gradient compression (``sim/passes/recipes.py``): each message sends ``bytes_factor`` of its
    # gradients' bytes and takes ``codec_us_per_byte`` per gradient byte more to encode and decode
    bytes_factor: float = 1.0
    codec_us_per_byte: float = 0.0
    # the same cluster as each run of its links' calibration measured them (whatif lab calibrate's
    # runs): predicted too, their spread widens the prediction's interval (report/intervals.py)
    calibrations: Sequence[Cluster] = ()

    @property
    def on_shared_links(self) -> bool:
        return framework(self.framework).queues_overlap if self.shared_links is None else self.shared_links

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
    # per communication task (the index): its bytes and the collective it ran in (``_collectives``)
    collectives: pd.DataFrame = field(default_factory=lambda: _collectives_frame([]))
    # the key of the cluster graph (``lay_cluster``) whose durations the schedule's graph is; None: another graph
    laid: Optional[tuple] = None


def _prices(config: ClusterConfig, fw: Framework) -> dict:
    """For each phase of the framework's messages, the time (us) of one of ``nbytes`` on the
    cluster (``topology.collective_cost``)."""
    prices = {}
    for phase in fw.phases:
        op, algorithm = fw.collective(phase, config.algorithm)

        @lru_cache(maxsize=None)
        def price(nbytes: float, op=op, algorithm=algorithm) -> float:
            sent = collective_cost(config.cluster, op, nbytes * config.bytes_factor, algorithm=algorithm).time_us
            return sent + nbytes * config.codec_us_per_byte

        prices[phase] = price
    return prices


def simulate_cluster(worker: TaskGraph, gradients: Gradients, iterations: pd.DataFrame, config: ClusterConfig,
                     laid: Optional[dict] = None, alone: Optional[Schedule] = None) -> ClusterSchedule:
    """Simulate ``config.workers`` copies of ``worker`` training together. ``laid``, where
    given, keeps the cluster graphs built for this ``worker``, ``gradients`` and ``iterations``
    (:class:`_ClusterGraph`, by what decides their tasks and edges): a grid's configurations that
    differ only in their links and sizes share one, and only its durations are set anew.
    ``alone``, where given, is ``worker`` simulated already (``simulate(worker)``, whose graph is
    ``worker`` itself): one worker's configuration is that schedule, not simulated again."""
    if config.workers == 1:
        schedule = alone if alone is not None and alone.graph is worker else simulate(worker)
        return ClusterSchedule(schedule, np.zeros(0, np.int64), np.ones(len(worker.tasks), bool), 0.0, 0.0)
    key, built = lay_cluster(worker, gradients, iterations, config, laid)
    fw = framework(config.framework)
    prices = _prices(config, fw)
    durations = built.durations(config, fw, prices)
    link = driving_link(config.cluster)
    # the schedule depends on the cluster through the durations and the prices the policies ask
    # alone, unless its links are simulated (shared) or re-time the tasks (CPU contention)
    repeatable = not config.on_shared_links and not (link.has_cpu_contention and len(built.comm))
    if repeatable:
        prices = {phase: _Asked(price) for phase, price in prices.items()}
        schedule = built.simulated_already(durations, prices)
        if schedule is not None:
            return _cluster_schedule(config, fw, built, schedule, key if laid is not None else None)
    graph = built.with_durations(durations)
    sliced, rate = built.sliced, config.pass_bytes_per_us
    comm, size = built.comm, built.size

    def policies_for(priced: dict) -> dict:
        """The network's policies, each transfer costing as much as ``priced`` bytes."""
        policies = {}
        networks: dict = {}  # one Network per simulation, shared by the push and pull queues
        for resource in built.queues:
            phase = built.phase_of_queue[resource]
            inner = Priority(built.prio, built.rank) if sliced else Fifo(built.rank)
            inner = fw.queue_policy(inner, size, priced, config.options, prices[phase], rate, sliced)
            if config.on_shared_links:
                op, algorithm = fw.collective(phase, config.algorithm)
                inner = _OnSharedLinks(inner, priced, _PlanMaker(config.cluster, op, algorithm, config.bytes_factor),
                                       networks)
            policies[resource] = inner
        return policies

    schedule = simulate(graph, policies_for(size), built.structure)
    if link.has_cpu_contention and len(comm):
        polling = built.thread if fw.spins_while_waiting else None
        schedule = with_cpu_contention(graph, schedule, comm, size, link, policies_for, built.n, polling)
    if repeatable:
        built.keep(durations, prices, schedule)
    return _cluster_schedule(config, fw, built, schedule, key if laid is not None and schedule.graph is graph else None)


def _cluster_schedule(config: ClusterConfig, fw: Framework, built: "_ClusterGraph", schedule: Schedule,
                      laid: Optional[tuple]) -> ClusterSchedule:
    comm = built.comm
    return ClusterSchedule(
        schedule,
        comm,
        built.worker0,
        len(comm) / built.iterations_with,
        sum(built.nbytes) * config.bytes_factor / built.iterations_with / len(fw.phases),
        _collectives(config, fw, schedule, comm, built.queue, built.nbytes),
        laid,
    )


class _Asked:
    """A price (``_prices``) that keeps what it was asked and answered."""

    def __init__(self, price: Callable[[float], float]):
        self.price, self.answers = price, {}

    def __call__(self, nbytes: float) -> float:
        value = self.answers[nbytes] = self.price(nbytes)
        return value


def lay_cluster(worker: TaskGraph, gradients: Gradients, iterations: pd.DataFrame, config: ClusterConfig,
                laid: Optional[dict] = None) -> tuple[tuple, "_ClusterGraph"]:
    """The graph of ``config``'s cluster but for its durations (:class:`_ClusterGraph`), and its
    key in ``laid`` (what decides its tasks and edges), which keeps it where given; one there
    already is not built again. For a configuration of several workers."""
    if config.policy not in POLICIES:
        raise GraphError(f"unknown policy {config.policy!r}; choose from {', '.join(POLICIES)}")
    fw = framework(config.framework)
    simulated = simulated_workers(config)
    key = (fw.name, config.policy, config.options, config.pass_bytes_per_us, tuple(simulated))
    built = laid.get(key) if laid is not None else None
    if built is None:
        built = _ClusterGraph(worker, gradients, iterations, config, fw, simulated)
        if laid is not None:
            laid[key] = built
    return key, built


def without_graph(run: ClusterSchedule, held) -> tuple[ClusterSchedule, Optional[np.ndarray]]:
    """``run`` to send to a process that holds the cluster graphs keyed ``held`` (as this one
    holds them): where its schedule's graph is one of them with durations of its own, without
    that graph, and its durations (which :func:`with_graph` lays back over the cluster graph
    there); else ``run`` as it is, and None."""
    if run.laid is None or run.laid not in held:
        return run, None
    durations = run.schedule.graph.tasks["duration_us"].to_numpy()
    return replace(run, schedule=replace(run.schedule, graph=None)), durations


def with_graph(run: ClusterSchedule, durations: Optional[np.ndarray], laid: dict) -> ClusterSchedule:
    """A run :func:`without_graph` sent, its graph laid back: the cluster graph with ``durations``."""
    if durations is None:
        return run
    return replace(run, schedule=replace(run.schedule, graph=laid[run.laid].with_durations(durations)))


class _ClusterGraph:
    """The graph of a configuration's cluster but for its durations: the simulated workers, one
    after another (worker ``k`` other than 0 with its resources prefixed ``worker k: ``), the
    barrier closing the last iteration, and the framework's messages as communication tasks on
    their queues, with their edges; what the queues' policies rank them by, and the engine's
    :class:`~whatif.sim.engine.Structure` of it all. Its tasks and edges depend on the framework,
    the policy, its options, the copies' rate and the workers simulated, not on the cluster's
    links or size, which only set durations (:meth:`durations`)."""

    def __init__(self, worker: TaskGraph, gradients: Gradients, iterations: pd.DataFrame, config: ClusterConfig,
                 fw: Framework, simulated: list[int]):
        self.thread = iteration_thread(worker, iterations)
        sync = SyncPoints(worker, iterations, self.thread)
        self.sliced = config.policy == "p3"
        layerwise = self.sliced or fw.layerwise
        worker, gradients, waiters = fw.add_copies(worker, gradients, sync, iterations, config.pass_bytes_per_us,
                                                   layerwise)
        self.worker, self.simulated, self.n = worker, simulated, len(worker.tasks)
        copies, n = len(simulated), self.n
        graph = _replicate(worker, simulated)
        rows, edges, phases = [], [], []
        nbytes, priority, order = [], [], []
        per_iteration, layers = {}, {}
        for it in range(len(iterations)):
            of_iteration = gradients.of_iteration(it)
            per_iteration[it], layers[it] = fw.messages(of_iteration, config.options, self.sliced), len(of_iteration)
        closing = sync.barrier(graph) if any(per_iteration.values()) else None  # (its task before, its row)
        barrier = len(graph.tasks) if closing is not None else None
        base = len(graph.tasks) + (closing is not None)
        measured_end = worker.tasks["measured_end_us"].to_numpy()
        last_iteration = max((it for it, messages in per_iteration.items() if messages), default=-1)
        for it, messages in per_iteration.items():
            first_id = base + len(rows)
            for j, m in enumerate(messages):
                tid = base + len(rows)
                ready_us = max((measured_end[t] for t in m.ready_after), default=np.nan)
                rows.append(_comm_row(m, fw.queue(m.phase), 0.0, ready_us))
                phases.append(m.phase)
                nbytes.append(m.nbytes)
                priority.append(m.priority)
                order.append((ready_us if ready_us == ready_us else np.inf, it, j))
                for k in range(copies):
                    edges += [(t + k * n, tid, 0.0) for t in m.ready_after]
                if m.follows is not None:
                    edges.append((first_id + m.follows, tid, 0.0))
                if m.phase == "push":
                    continue
                waiter = waiters[it] if it in waiters else fw.waiter(sync, it, m, layerwise, layers[it])
                targets = [waiter + k * n for k in range(copies)] if waiter is not None else []
                if waiter is None or it == last_iteration:
                    # the step's end waits for its communication: with a GPU-side wait (DDP) nothing
                    # on the CPU would, and the last iteration's span would miss it
                    targets.append(barrier)
                edges += [(tid, c, 0.0) for c in targets]
        if closing is not None:  # the barrier and the messages join the graph together, the table rebuilt once
            _add_comm_tasks(graph, [closing[1], *rows], [(closing[0], barrier, 0.0), *edges])
        self.graph, self.base = graph, base
        self.structure = compile_structure(graph).with_release(graph.tasks["release_us"].to_numpy())
        self.comm = _read_only(np.arange(base, base + len(rows)))
        comm = self.comm.tolist()
        self.phases, self.nbytes = phases, nbytes
        self.queue = np.asarray([r["resource"] for r in rows], dtype=object)
        self.rank = {comm[i]: r for r, i in enumerate(sorted(range(len(order)), key=order.__getitem__))}
        self.prio = dict(zip(comm, priority))
        self.size = dict(zip(comm, nbytes))
        self.phase_of_queue = {fw.queue(phase): phase for phase in fw.phases}
        self.queues = sorted({r["resource"] for r in rows})
        worker0 = np.zeros(len(graph.tasks), dtype=bool)
        worker0[:n] = True
        if barrier is not None:
            worker0[barrier] = True  # it closes worker 0's last iteration
        self.worker0 = _read_only(worker0)
        self.iterations_with = max(sum(1 for m in per_iteration.values() if m), 1)
        self.kept: list = []  # (durations, prices asked, schedule) of the last few simulated (keep)

    def durations(self, config: ClusterConfig, fw: Framework, prices: dict) -> np.ndarray:
        """Every task's duration on ``config``'s cluster: each simulated worker's, slowed beside
        its peers on a shared memory system, by the framework's CPU costs and by its own
        factors; the barrier's 0; each message's price (``_prices``)."""
        worker = self.worker
        if config.cluster.workers_sharing_memory > 1:
            worker = slow_beside_peers(worker, config.cluster)
        worker = fw.add_cpu_costs(worker, config.cluster, config.options)
        own = worker.tasks["duration_us"].to_numpy(dtype=np.float64)
        kinds = worker.tasks["kind"].to_numpy()
        gpu = np.isin(kinds, [int(k) for k in GPU_TASK_KINDS])
        unscaled = np.isin(kinds, [int(TaskKind.WAIT)])
        scaled = config.replicate is not False
        parts = []
        for k in self.simulated:
            duration = own.copy()
            slowdown, gpu_slowdown, factor = _factors(config, k) if scaled else (1.0, 1.0, 1.0)
            if (slowdown, gpu_slowdown, factor) != (1.0, 1.0, 1.0):
                duration[~unscaled] *= slowdown
                duration[gpu] *= gpu_slowdown
                if factor != 1.0:
                    duration[gpu] *= factor
            parts.append(duration)
        parts.append(np.zeros(self.base - len(self.simulated) * self.n))  # the barrier
        parts.append(np.array([prices[p](b) for p, b in zip(self.phases, self.nbytes)], dtype=np.float64))
        return np.concatenate(parts)

    def simulated_already(self, durations: np.ndarray, prices: dict) -> Optional[Schedule]:
        """The schedule kept (:meth:`keep`) of a configuration with these durations whose
        policies' every question of its prices ``prices`` answer the same: the simulation is
        deterministic, and it would run the same (a machine of two GPUs at each inter-node
        bandwidth); None if none."""
        for kept, answers, schedule in self.kept:
            if np.array_equal(kept, durations) and all(
                    prices[phase].price(nbytes) == value for phase, asked in answers.items()
                    for nbytes, value in asked.items()):
                return schedule
        return None

    def keep(self, durations: np.ndarray, prices: dict, schedule: Schedule) -> None:
        """Keep a schedule simulated with ``durations`` and the prices ``prices`` (``_Asked``),
        the last few."""
        self.kept = [(durations, {phase: dict(price.answers) for phase, price in prices.items()}, schedule),
                     *self.kept[:_KEPT_SCHEDULES - 1]]

    def with_durations(self, duration: np.ndarray) -> TaskGraph:
        """The cluster graph with these durations: a graph of its own (CPU contention re-times
        its durations in place), sharing every other column and the edges."""
        tasks = self.graph.tasks.copy(deep=False)
        tasks["duration_us"] = duration
        return TaskGraph(tasks, self.graph.edges, self.graph.ops, self.graph.workload, list(self.graph.notes))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _collectives(config: ClusterConfig, fw: Framework, schedule: Schedule, comm: np.ndarray, queue: np.ndarray,
                 nbytes: list) -> pd.DataFrame:
    """The collective each communication task (on its ``queue``) ran in, as
    ``topology.collective_cost`` names it: the tasks of one queue that started and ended
    together ran as one (Horovod's fusion), and their bytes together decide the algorithm and
    protocol, as they decide NCCL's."""
    total = fused_bytes(queue, schedule.start_us[comm], schedule.end_us[comm], np.asarray(nbytes, dtype=float))
    phase_of_queue = {fw.queue(phase): phase for phase in fw.phases}
    named = {}
    for key in dict.fromkeys(zip(queue.tolist(), total.tolist())):
        op, algorithm = fw.collective(phase_of_queue[key[0]], config.algorithm)
        named[key] = collective_cost(config.cluster, op, key[1] * config.bytes_factor, algorithm=algorithm)
    rows = [(int(t), q, own, named[q, b]) for t, q, own, b in zip(comm.tolist(), queue.tolist(), nbytes, total.tolist())]
    return _collectives_frame(rows)


def _collectives_frame(rows: list) -> pd.DataFrame:
    """``(task, queue, task_bytes, CollectiveCost)`` rows as a frame indexed by task: the task's
    own bytes, and the op, bytes, algorithm, protocol and channels of the collective it ran in."""
    columns = ["task", "queue", "task_bytes", "op", "collective_bytes", "algorithm", "protocol", "channels"]
    frame = pd.DataFrame([(t, q, own, c.op, c.nbytes, c.algorithm, c.protocol, c.channels) for t, q, own, c in rows],
                         columns=columns)
    return frame.set_index("task")


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
    """The plan of a collective of ``nbytes`` of gradients, which sends ``bytes_factor`` of them
    (a plan has no room for a codec's time: on shared links compression's bytes count, its
    encoding and decoding do not), made once per size: P3's slices and a parameter server's
    partitions repeat a few sizes, and the network routes a plan's steps once."""

    def __init__(self, cluster: Cluster, op: str, algorithm: Optional[str], bytes_factor: float = 1.0):
        self.cluster, self.op, self.algorithm, self.bytes_factor = cluster, op, algorithm, bytes_factor
        self.plans: dict = {}

    def __call__(self, nbytes: float) -> Plan:
        if nbytes not in self.plans:
            self.plans[nbytes] = collective_plan(self.cluster, self.op, nbytes * self.bytes_factor, algorithm=self.algorithm)
        return self.plans[nbytes]


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
    graph.tasks = concat_tasks([graph.tasks, pd.DataFrame(rows)])
    graph.add_edges([(s, d, lag, int(EdgeKind.USER)) for s, d, lag in edges])


def _factors(config: ClusterConfig, k: int) -> tuple[float, float, float]:
    """Worker ``k``'s factors on its tasks: its machine's straggler ``slowdown`` (all but waits)
    and ``gpu_slowdown`` (GPU tasks), and its own GPU's (``gpu_slowdowns``)."""
    machine = k // config.cluster.gpus_per_machine
    slow = next((s for s in config.stragglers if s.machine == machine), None)
    own = float(config.gpu_slowdowns[k]) if len(config.gpu_slowdowns) else 1.0
    return (slow.slowdown, slow.gpu_slowdown, own) if slow else (1.0, 1.0, own)


def _alike(config: ClusterConfig) -> bool:
    """Whether worker 0 stands for every worker: no straggler and no GPU of its own speed, or
    ``replicate: false``."""
    return config.replicate is False or (not config.stragglers and not len(config.gpu_slowdowns))


def slowest_pace(config: ClusterConfig) -> tuple[float, float]:
    """``(slowdown, gpu_slowdown)``: the largest factor any worker has on all its work but waits,
    and on its GPU tasks (its machine's ``gpu_slowdown`` times its own GPU's), which a job whose
    ranks wait for each other at every collective runs at; ``(1, 1)`` where every worker is
    alike or ``replicate: false``."""
    if _alike(config):
        return 1.0, 1.0
    factors = [_factors(config, k) for k in range(config.workers)]
    return max(f[0] for f in factors), max(f[1] * f[2] for f in factors)


def simulated_workers(config: ClusterConfig) -> list[int]:
    """The workers to simulate, worker 0 first: every one (``replicate``), worker 0 alone
    (``replicate=False``, or identical workers), else worker 0 and one worker of each kind that
    no other kind dominates (every factor at least as large; see the module's docstring), or of
    every kind where CPU contention re-times tasks from their overlaps."""
    if config.replicate:
        return list(range(config.workers))
    if _alike(config):
        return [0]
    first: dict = {}  # kind -> its first worker
    for k in range(config.workers):
        first.setdefault(_factors(config, k), k)
    if driving_link(config.cluster).has_cpu_contention:
        deciding = list(first)
    else:
        deciding = [a for a in first if not any(b != a and all(x >= y for x, y in zip(b, a)) for b in first)]
    return [0] + sorted(first[kind] for kind in deciding if first[kind] != 0)


def _replicate(worker: TaskGraph, simulated: list[int]) -> TaskGraph:
    """The ``simulated`` workers, one after another, with worker 0's durations (each worker's
    own are set by :meth:`_ClusterGraph.durations`); worker 0 keeps its resource names, worker
    ``k`` has them prefixed ``worker k: ``."""
    graph = worker.copy()
    if simulated == [0]:
        return graph
    n = len(worker.tasks)
    frames, edge_frames = [], []
    for i, k in enumerate(simulated):
        t = worker.tasks.copy()
        if k:
            t["resource"] = t["resource"].cat.rename_categories(lambda r, k=k: f"worker {k}: {r}")
        frames.append(t)
        e = worker.edges.copy()
        e["src"] += i * n
        e["dst"] += i * n
        edge_frames.append(e)
    graph.tasks = concat_tasks(frames)
    graph.edges = pd.concat(edge_frames, ignore_index=True)
    return graph
