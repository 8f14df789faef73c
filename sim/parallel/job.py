"""A parallel job built from one rank's graph: the family passes applied in order, and its memory.

:func:`parallelize` takes the traced single-rank graph, its units and a :class:`Parallelism`
on a cluster, computes the process groups (``placement.groups``), and applies the passes of
the families the parallelism uses, in :data:`PASS_ORDER` (tensor, expert, fsdp, pipeline; an
activation recomputation's time, ``recompute.py``, after tensor and expert): each
is ``PASSES[family](graph, units, par, cluster, ranks_of) -> TaskGraph`` (or ``(TaskGraph,
Units)``), ``ranks_of`` being rank 0's group in each dimension. Identical ranks are simulated
once, as the data-parallel fast path does: rank 0 stands for all (the pipeline pass builds its
stages into the graph it returns). A family with no pass registered is refused with a one-line
error, never ignored. The passes register themselves when their module is imported
(``PASSES["tensor"] = apply_tensor``), which this module does; the passes import only the
package's ``__init__`` and ``units``, so there is no cycle.

Plain data parallelism (``zero: 0``, no other family) is not a job here: it takes the
data-parallel cluster path of ``sim/distributed.py`` unchanged. Data parallelism beside
another family is the ``fsdp`` family's pass: ZeRO / FSDP sharding (``zero >= 1``), or with
``zero: 0`` DDP's all-reduce of each unit's gradients over the data group.

The COMM tasks the passes insert name their dimension and bytes (``tensor``, ``data``,
``pipeline``, ``expert``, ``fsdp``; ``1.05MB``, ``3.159 MB``, ``1048576 B``): :func:`comm_name`
writes such a name, :func:`comm_dimension` and :func:`comm_bytes` read one back, and the report
splits exposed communication by dimension. Rank 0 is the whole graph, or its ``stage 0: ``
resources where the pipeline pass built one graph of every stage.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from whatif.sim.cpu_contention import Intervals, driving_link, with_cpu_contention
from whatif.sim.engine import Schedule, simulate
from whatif.sim.graph import GPU_TASK_KINDS, TaskGraph, TaskKind, cpu_work, label_mask

from . import PASS_ORDER, PASSES, Parallelism, ParallelismError
from . import expert, fsdp, pipeline, tensor  # noqa: F401  (each registers its pass in PASSES)
from .memory import MemoryBreakdown, fits, gpu_memory_bytes, memory_per_gpu
from .placement import groups, ranks_of
from .recompute import apply_recompute
from .units import Units, find_units

#: The dimensions a COMM task's name may carry, the first that occurs in it counting.
COMM_DIMENSIONS = ("tensor", "sequence", "expert", "fsdp", "zero", "data", "pipeline")
_COMM_DIMENSION = re.compile(r"\b(" + "|".join(COMM_DIMENSIONS) + r")\b")
_COMM_BYTES = re.compile(r"\b(\d+(?:\.\d+)?(?:e[+-]?\d+)?) ?(B|kB|KB|MB|GB)\b")
_UNIT_BYTES = {"B": 1.0, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_STAGE = re.compile(r"^stage (\d+): ")
_SHARING_PASSES = 4  # re-simulations for the NIC's sharing to settle (with_nic_sharing)
#: What a family's key is in the scenario, for the refusals.
_FAMILY_KEY = {"tensor": "parallelism.tensor", "expert": "parallelism.expert", "fsdp": "parallelism.zero",
               "pipeline": "parallelism.pipeline"}


@dataclass
class ParallelJob:
    """One parallel job: rank 0's graph after the passes (standing for every identical rank),
    the groups, and what the report needs."""

    par: Parallelism
    graph: TaskGraph  # rank 0's graph after every pass
    units: Units  # of ``graph``
    groups: dict  # dimension -> list of GPU-id tuples (placement.groups)
    ranks_of: dict  # dimension -> rank 0's group
    passes: list = field(default_factory=list)  # the families applied, in order
    memory: Optional[MemoryBreakdown] = None
    gpu_memory_bytes: Optional[float] = None

    @property
    def fits(self) -> Optional[bool]:
        return fits(self.memory, self.gpu_memory_bytes) if self.memory is not None else None

    def rank0(self) -> np.ndarray:
        """Mask of rank 0's tasks: the first stage's where the pipeline pass named its
        resources ``stage D: ...``, else every task."""
        column = self.graph.tasks["resource"]
        if not label_mask(column, lambda r: _STAGE.match(r) is not None).any():
            return np.ones(len(column), dtype=bool)
        return label_mask(column, lambda r: (m := _STAGE.match(r)) is not None and m.group(1) == "0")

    def comm_tasks(self) -> np.ndarray:
        """Ids of the graph's communication tasks."""
        return np.flatnonzero(self.graph.tasks["kind"].to_numpy() == int(TaskKind.COMM))


def comm_name(op: str, dimension: str, nbytes: float) -> str:
    """The name of a COMM task a pass inserts: ``all_reduce tensor 1.05MB``."""
    return f"{op} {dimension} {nbytes / 1e6:.6g}MB"


def comm_bytes(name: str) -> float:
    """The bytes a COMM task's name carries (``1.05MB``, ``3.159 MB``, ``1048576 B``; 0 where
    it says none)."""
    match = _COMM_BYTES.search(str(name))
    return float(match.group(1)) * _UNIT_BYTES[match.group(2)] if match else 0.0


def comm_dimension(name: str) -> str:
    """The dimension a COMM task's name carries (``other`` where none: the trace's own)."""
    match = _COMM_DIMENSION.search(str(name))
    if not match:
        return "other"
    return {"sequence": "tensor", "zero": "fsdp"}.get(match.group(1), match.group(1))


def simulate_job(job: ParallelJob, cluster) -> Schedule:
    """Rank 0's graph simulated; on CPU workers whose cores drive the link (the cluster's driving
    link has ``cpu_contention``) re-simulated with communication and compute slowing each other
    where they overlap, as the data-parallel path does (``sim/cpu_contention.py``): DDP's
    all-reduces beside expert or tensor parallelism run on Gloo's threads during backward. A
    collective the thread waits for (FSDP2's on CPU) overlaps nothing of its own thread.

    Workers sharing cores: where a machine of CPU workers has fewer cores than workers
    (``cluster.cores_per_machine``), its workers, running one program in lockstep, compute at
    the same time and share the cores evenly (processor sharing): on a CPU-only trace every CPU
    task of the rank takes ``gpus_per_machine / cores_per_machine`` times as long (a collective
    it waits for takes no core, and keeps its time)."""
    graph = job.graph
    share = cores_shared(cluster)
    if share > 1 and not graph.workload.has_gpu:
        graph = graph.copy()
        graph.scale(cpu_work(graph.tasks), share)
    schedule = simulate(graph)
    users = nic_users(job, cluster)
    if users is not None:
        graph = graph if graph is not job.graph else graph.copy()
        schedule = with_nic_sharing(graph, schedule, *users)
    link = driving_link(cluster)
    comm = job.comm_tasks()
    if link.has_cpu_contention and len(comm):
        names = job.graph.tasks["name"].astype(str).to_numpy()[comm]
        size = {int(t): comm_bytes(name) for t, name in zip(comm.tolist(), names)}
        schedule = with_cpu_contention(graph, schedule, comm, size, link, lambda priced: None, len(graph.tasks))
    return schedule


def nic_users(job: ParallelJob, cluster) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The COMM tasks that cross a machine's NIC, with each one's queue and rank (a pipeline's
    stage; 0 elsewhere), as codes; None where fewer than two queues of one rank do. A task
    crosses the NIC where its dimension's group (``comm_dimension``; a rank's own experts'
    reduction, ``data experts``, the ``expert_data`` group) spans machines."""
    comm = job.comm_tasks()
    if not len(comm) or cluster is None or cluster.machines <= 1:
        return None
    tasks = job.graph.tasks
    names = tasks["name"].astype(str).to_numpy()[comm]
    resources = tasks["resource"].astype(str).to_numpy()[comm]
    spans = {}
    for dimension, ranks in job.ranks_of.items():
        ids = np.asarray(list(ranks), dtype=np.int64)
        spans[dimension] = len(ids) > 1 and len(np.unique(cluster.machine_of(ids))) > 1
    crossing = np.zeros(len(comm), dtype=bool)
    for k, name in enumerate(names.tolist()):
        dimension = comm_dimension(name)
        group = "expert_data" if dimension == "data" and "data experts" in name else {"fsdp": "data"}.get(dimension, dimension)
        crossing[k] = spans.get(group, False)
    if not crossing.any():
        return None
    stage = np.array([int(m.group(1)) if (m := _STAGE.match(r)) else 0 for r in resources[crossing].tolist()])
    _, queue = np.unique(resources[crossing], return_inverse=True)
    per_rank = {(int(r), int(q)) for r, q in zip(stage, queue.ravel())}
    if len(per_rank) == len({r for r, _ in per_rank}):  # one queue per rank: nothing to share
        return None
    return comm[crossing], queue.ravel(), stage


def with_nic_sharing(graph: TaskGraph, schedule: Schedule, users: np.ndarray, queue: np.ndarray,
                     rank: np.ndarray) -> Schedule:
    """Re-simulate with a rank's collectives on different queues sharing its NIC where they
    overlap: two collectives in flight at once each get half of it (a rank's collectives of
    several dimensions, NCCL's communicators, or Gloo's threads, run at once over the same
    link). A collective that overlaps another queue's for a fraction ``f`` of its time moves at
    half its rate for that fraction, so lasts ``1 / (1 - f / 2)`` times its time alone (twice
    it, overlapped throughout). Overlaps come from the previous schedule; a few passes, until
    the makespan moves less than 0.1 % (as ``sim/cpu_contention.py`` settles)."""
    tasks = graph.tasks
    base = tasks["duration_us"].to_numpy(dtype=float).copy()
    for _ in range(_SHARING_PASSES):
        start, end = schedule.start_us[users], schedule.end_us[users]
        factor = np.ones(len(users))
        for r in np.unique(rank).tolist():
            for q in np.unique(queue[rank == r]).tolist():
                mine, others = (rank == r) & (queue == q), (rank == r) & (queue != q)
                if others.any():
                    shared = Intervals(start[others], end[others]).fraction_of(start[mine], end[mine])
                    factor[mine] = 1.0 / (1.0 - shared / 2.0)
        duration = base.copy()
        duration[users] *= factor
        tasks["duration_us"] = duration
        previous = schedule.makespan_us
        schedule = simulate(graph)
        if abs(schedule.makespan_us - previous) <= 1e-3 * previous:
            break
    return schedule


def at_pace(job: ParallelJob, slowdown: float, gpu_slowdown: float) -> ParallelJob:
    """``job`` with rank 0 running at another rank's pace: ``slowdown`` on every task but waits
    and communication, ``gpu_slowdown`` more on its GPU's (``distributed.slowest_pace``). Ranks
    simulated as one stand for the slowest where each waits for the others at every collective
    (tensor, data and expert groups; a pipeline's stages per microbatch)."""
    if (slowdown, gpu_slowdown) == (1.0, 1.0):
        return job
    graph = job.graph.copy()
    kinds = graph.tasks["kind"].to_numpy()
    paced = ~np.isin(kinds, [int(TaskKind.COMM), int(TaskKind.WAIT)])
    graph.scale(np.flatnonzero(paced), slowdown)
    gpu = paced & np.isin(kinds, [int(k) for k in GPU_TASK_KINDS])
    graph.scale(np.flatnonzero(gpu), gpu_slowdown)
    return dataclasses.replace(job, graph=graph)


def _leading_key(key: Optional[tuple], family: str, par: Parallelism, mine: dict) -> Optional[tuple]:
    """What the graph after ``family``'s pass depends on, given ``key`` (what the graph before
    it does): for the tensor and expert passes, their degree, the fields of ``par`` they read
    and rank 0's group; None (not kept) from the first other pass on, which read more."""
    if key is None:
        return None
    if family == "tensor":
        return (*key, family, par.tensor, par.sequence_parallel, par.sequence_parallel_grads, par.tensor_dispatch,
                par.tensor_collective, tuple(mine.get(family, ())))
    if family == "expert":
        return (*key, family, par.expert, tuple(mine.get(family, ())))
    return None


#: The passes that shrink a unit's forward, which recomputation then runs again (``recompute.py``):
#: it charges its time after them, before the data-parallel and pipeline passes read the units.
_BEFORE_RECOMPUTE = ("tensor", "expert")


def _recomputed(graph: TaskGraph, units: Units, par: Parallelism, cache: Optional[dict],
                key: Optional[tuple]) -> tuple[TaskGraph, Units]:
    """``graph`` with the recomputed forward charged (``recompute.py``), and its units again
    (their forward and backward times change); kept in ``cache`` where ``key`` says what
    ``graph`` depends on (the leading passes' key), so a grid's points recompute it once."""
    key = (*key, "recompute", par.recompute, par.units) if key is not None else None
    if key is not None and key in cache:
        return cache[key]
    out = apply_recompute(graph, units, par)
    found = (graph, units) if out is graph else (out, find_units(out, par.units))
    if key is not None:
        cache[key] = found
    return found


def cores_shared(cluster) -> float:
    """How many of a machine's workers share each of its cores (1: a core each)."""
    cores = getattr(cluster, "cores_per_machine", None)
    return max(1.0, cluster.gpus_per_machine / cores) if cores else 1.0


def check_modelled(par: Parallelism) -> None:
    """Refuse, in one line naming the key, a parallelism a registered pass does not model."""
    for family in par.families():
        if family not in PASSES:
            raise ParallelismError(_FAMILY_KEY[family],
                                   f"{family} parallelism is not modelled yet (no {family} pass in sim/parallel/)")


def parallelize(graph: TaskGraph, units: Units, par: Parallelism, cluster,
                optimizer: str = "adam", gpu_memory: Optional[float] = None,
                microbatch: Optional[TaskGraph] = None, cache: Optional[dict] = None,
                dtype_bytes: Optional[int] = None) -> ParallelJob:
    """Rank 0's graph of ``par`` on ``cluster``: the registered passes applied in
    :data:`PASS_ORDER`, and the memory per GPU (``gpu_memory``: bytes, None: the cluster's GPUs',
    if known). ``microbatch``: the model traced at one microbatch, for the pipeline pass.
    ``dtype_bytes``: the memory count's element size (2 under mixed precision; None: the trace's).

    ``cache``: a dict a grid keeps across its points, where the leading passes that read only a
    few of ``par``'s fields (:func:`_leading_key`: tensor, then expert) keep their graphs and
    units, so that points differing in the other dimensions build them once. Every pass copies
    the graph it is given, so a kept graph is never changed by the passes after it."""
    check_modelled(par)
    all_groups = groups(par, cluster)
    mine = ranks_of(all_groups, 0)
    memory = memory_per_gpu(graph, units, par, optimizer=optimizer, dtype_bytes=dtype_bytes)
    applied = []
    key: Optional[tuple] = (id(graph), id(units), cluster) if cache is not None else None
    recomputed = par.recompute == "none"
    for family in PASS_ORDER:
        if family not in par.families():
            continue
        if not recomputed and family not in _BEFORE_RECOMPUTE:
            (graph, units), recomputed = _recomputed(graph, units, par, cache, key), True
            key = None  # the passes after it read more of par than a key holds
        key = _leading_key(key, family, par, mine)
        if key is not None and key in cache:
            graph, units = cache[key]
            applied.append(family)
            continue
        extra = {"microbatch": microbatch} if family == "pipeline" and microbatch is not None else {}
        result = PASSES[family](graph, units, par, cluster, mine, **extra)
        graph, units = result if isinstance(result, tuple) else (result, find_units(result, par.units))
        if key is not None:
            cache[key] = (graph, units)
        applied.append(family)
    if not recomputed:
        graph, units = _recomputed(graph, units, par, cache, key)
    return ParallelJob(par, graph, units, all_groups, mine, applied, memory,
                       gpu_memory if gpu_memory is not None else gpu_memory_bytes(cluster))
