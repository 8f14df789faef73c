"""Where a simulated cluster iteration's time goes (compute, exposed communication, idle), and
each configuration's row of the results, and which collectives carried its communication; for a
parallel job (``sim/parallel/``), its memory per GPU and its exposed communication by dimension."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from whatif.sim.distributed import ClusterConfig, ClusterSchedule
from whatif.sim.graph import GPU_TASK_KINDS, GraphError, TaskKind
from whatif.sim.parallel.memory import MemoryBreakdown, fits
from whatif.topology import Cluster, as_gbps

from .intervals import steady_interval
from .iterations import IntervalUnion, steady_median

if TYPE_CHECKING:  # the parallel passes are imported by the functions of parallel jobs, where a grid has one
    from whatif.sim.parallel.job import ParallelJob


def cluster_breakdown(run: ClusterSchedule, report: pd.DataFrame) -> pd.DataFrame:
    """Per iteration of worker 0: ``compute_ms`` (its GPU busy, or its CPU threads where the
    trace has no GPU), ``comm_ms`` (the network busy), ``exposed_comm_ms`` (the network busy
    while worker 0 computes nothing on its GPU or CPU threads: communication the iteration
    waits for) and ``idle_ms`` (the rest of the span); the three add up to the iteration."""
    schedule = run.schedule
    compute, working, on_network = _breakdown_tasks(run)
    start, end = schedule.start_us, schedule.end_us
    computing = IntervalUnion(start[compute], end[compute])
    communicating = IntervalUnion(start[on_network], end[on_network])
    working_only = IntervalUnion(start[working], end[working])
    # its merged blocks stand for the intervals they merge: the same union, the same blocks
    working_or_comm = IntervalUnion(np.r_[working_only.start, start[on_network]],
                                    np.r_[working_only.end, end[on_network]])
    rows = []
    for lo, hi in zip(report["span_start_us"], report["span_end_us"]):
        if not np.isfinite(lo):
            rows.append({"compute_ms": np.nan, "comm_ms": np.nan, "exposed_comm_ms": np.nan, "idle_ms": np.nan})
            continue
        busy = computing.within(lo, hi)
        comm = communicating.within(lo, hi)
        worked = working_only.within(lo, hi)
        worked_or_comm = working_or_comm.within(lo, hi)
        exposed = worked_or_comm - worked
        rows.append(
            {
                "compute_ms": busy / 1e3,
                "comm_ms": comm / 1e3,
                "exposed_comm_ms": exposed / 1e3,
                "idle_ms": max(hi - lo - busy - exposed, 0.0) / 1e3,
            }
        )
    return pd.DataFrame(rows)


#: The tasks :func:`cluster_breakdown` reads of the last few cluster graphs, by their worker-0
#: mask and communication tasks (arrays a grid's configurations on one cluster graph share):
#: ``(worker0, comm_tasks, (compute, working, on_network))``
_BREAKDOWN_TASKS: list = []
_BREAKDOWN_KEPT = 4


def _breakdown_tasks(run: ClusterSchedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ids of worker 0's compute tasks (its GPU's, or its CPU threads' where it has no GPU
    task), of its working tasks (GPU and CPU) and of the communication tasks, resource by
    resource in each one's order (a policy's queue may run its own otherwise): a union of
    their intervals then mostly sorts runs that are sorted already, and is the same union
    whatever the order. Kept while ``run``'s mask and communication tasks are the same
    read-only arrays (a laid cluster graph's, whose configurations differ in durations alone)."""
    graph = run.schedule.graph
    for worker0, comm, ids in _BREAKDOWN_TASKS:
        if worker0 is run.worker0 and comm is run.comm_tasks and len(worker0) == len(graph.tasks):
            return ids
    kinds = graph.tasks["kind"].to_numpy()
    on_network = np.zeros(len(kinds), dtype=bool)
    on_network[run.comm_tasks] = True
    gpu = np.isin(kinds, [int(k) for k in GPU_TASK_KINDS]) & run.worker0 & ~on_network
    cpu = np.isin(kinds, [int(TaskKind.CPU), int(TaskKind.RUNTIME)]) & run.worker0
    compute = gpu if gpu.any() else cpu
    order = np.concatenate(graph.resource_order()) if len(kinds) else np.zeros(0, dtype=np.int64)
    ids = tuple(order[mask[order]] for mask in (compute, gpu | cpu, on_network))
    if not (run.worker0.flags.writeable or run.comm_tasks.flags.writeable):  # arrays no one can change
        _BREAKDOWN_TASKS.insert(0, (run.worker0, run.comm_tasks, ids))
        del _BREAKDOWN_TASKS[_BREAKDOWN_KEPT:]
    return ids


def configuration_row(config: ClusterConfig, run: ClusterSchedule, report: pd.DataFrame, baseline_ms: float) -> dict:
    """One configuration's row of the results: its cluster, framework and policy, the steady
    median of worker 0's iterations (``report``) with its prediction interval
    (``iteration_ms_low`` to ``iteration_ms_high``, ``report/intervals.py``) and the medians of
    their breakdown, and its speed-up over one worker's ``baseline_ms`` (throughput: ``workers x
    baseline / iteration``)."""
    breakdown = cluster_breakdown(run, report)
    iteration_ms = steady_median(report["predicted_ms"])
    low_ms, high_ms = steady_interval(report["predicted_ms"])
    cluster = config.cluster
    return {
        "machines": cluster.machines,
        "gpus_per_machine": cluster.gpus_per_machine,
        "workers": config.workers,
        "inter_node_gbps": round(as_gbps(cluster.inter_node.bandwidth_bytes_per_us), 3),
        "framework": config.framework,
        "policy": config.policy,
        "iteration_ms": iteration_ms,
        "iteration_ms_low": low_ms,
        "iteration_ms_high": high_ms,
        "speedup": config.workers * baseline_ms / iteration_ms,
        "scaling_efficiency": baseline_ms / iteration_ms,
        "exposed_comm_ms": steady_median(breakdown["exposed_comm_ms"]),
        "comm_ms": steady_median(breakdown["comm_ms"]),
        "compute_ms": steady_median(breakdown["compute_ms"]),
        "idle_ms": steady_median(breakdown["idle_ms"]),
        "messages_per_iteration": run.messages_per_iteration,
        "comm_mb_per_iteration": run.bytes_per_iteration / 1e6,
        **({"collectives": collective_mix(run)} if cluster.backend == "nccl" else {}),  # NCCL's choice, where NCCL chooses
    }


def memory_columns(memory: MemoryBreakdown, gpu_memory_bytes) -> dict:
    """A parallel configuration's memory columns: GB per GPU (its most loaded stage) and
    whether that fits the GPU (``yes``, ``no``, or ``unknown`` where the GPU's memory is)."""
    verdict = fits(memory, gpu_memory_bytes)
    return {"memory_gb": memory.total_gb, "fits": {True: "yes", False: "no", None: "unknown"}[verdict]}


def parallel_row(config: ClusterConfig, job: ParallelJob, run: ClusterSchedule, report: pd.DataFrame,
                 baseline_ms: float) -> dict:
    """A parallel job's row: :func:`configuration_row` for rank 0, its throughput against one
    worker's (``data`` replicas of the traced batch per iteration), its memory, and its exposed
    communication by dimension (``exposed_tensor_ms``, ...: the time the dimension's
    communication runs while rank 0 computes nothing; dimensions that overlap each other count
    in each)."""
    from whatif.sim.parallel.job import comm_bytes

    run.messages_per_iteration = len(run.comm_tasks) / max(1, int(report["predicted_ms"].notna().sum()))
    names = job.graph.tasks["name"].astype(str).to_numpy()
    run.bytes_per_iteration = sum(comm_bytes(n) for n in names[run.comm_tasks]) / max(
        1, int(report["predicted_ms"].notna().sum()))
    row = configuration_row(config, run, report, baseline_ms)
    if config.cluster.backend == "nccl":  # NCCL's choice for each dimension, where NCCL chooses
        row["collectives"] = parallel_collective_mix(job)
    row["speedup"] = job.par.data * baseline_ms / row["iteration_ms"]
    row["scaling_efficiency"] = row["speedup"] / config.workers
    row["parallelism"] = job.par.describe()
    row.update(memory_columns(job.memory, job.gpu_memory_bytes))
    row.update(exposed_by_dimension(run, report, names))
    if job.par.pipeline > 1:
        row["bubble_ms"] = pipeline_bubble_ms(run, row["idle_ms"])
    return row


def pipeline_bubble_ms(run: ClusterSchedule, idle_ms: float) -> float:
    """Of rank 0's idle time, the pipeline schedule's own bubble: its fill and drain
    (``sim.parallel.pipeline.bubbles``: the busiest stage's idle, the same on every stage;
    ``(p - 1) / (m + p - 1)`` of the step with equal stages under GPipe and 1F1B), in ms, at most
    ``idle_ms``; the rest of rank 0's idle is its stage's imbalance and its waits. NaN where the
    schedule is not a pipeline's."""
    from whatif.sim.parallel.pipeline import bubbles

    try:
        table = bubbles(run.schedule)
    except GraphError:
        return float("nan")
    return min(float(table["fill_drain"].iat[0] * table["step_us"].iat[0]) / 1e3, idle_ms)


def exposed_by_dimension(run: ClusterSchedule, report: pd.DataFrame, names: np.ndarray) -> dict:
    """Per dimension of the run's communication tasks, the steady median of its exposed time."""
    from whatif.sim.parallel.job import comm_dimension

    schedule = run.schedule
    _, working, _ = _breakdown_tasks(run)  # worker 0's GPU and CPU tasks, as the breakdown reads them
    start, end = schedule.start_us, schedule.end_us
    worked = IntervalUnion(start[working], end[working])
    dimension = np.array([comm_dimension(n) for n in names[run.comm_tasks]], dtype=object)
    out = {}
    for dim in sorted(set(dimension.tolist())):
        mine = run.comm_tasks[dimension == dim]
        # the worked blocks stand for the intervals they merge, as in the breakdown
        both = IntervalUnion(np.r_[worked.start, start[mine]], np.r_[worked.end, end[mine]])
        per_iteration = [(both.within(lo, hi) - worked.within(lo, hi)) / 1e3 if np.isfinite(lo) else np.nan
                         for lo, hi in zip(report["span_start_us"], report["span_end_us"])]
        out[f"exposed_{dim}_ms"] = steady_median(pd.Series(per_iteration))
    return out


def configuration_labels(rows: list[dict], configs: Sequence[ClusterConfig]) -> tuple[list[str], list[str]]:
    """Each row's name (``2x4 25Gbps ddp fifo``), which keys the simulated runs and names their
    timelines, and the names of the columns that tell rows of one name apart. Where
    configurations of one name differ in something else (a grid over ``intra_node``, say), each
    field of the cluster or configuration that tells them apart becomes a column of their rows,
    named after the field, and a part of their names; a GPU fabric's fields are its
    ``hardware`` (``dgx_b200: b200, NVLink domain 8, 8 x ib_ndr``) and its ``nccl`` settings,
    and where the hardware differs, the links it implies are not named again."""
    labels = [f"{r['machines']}x{r['gpus_per_machine']} {r['inter_node_gbps']:g}Gbps {r['framework']} {r['policy']}"
              for r in rows]
    extra: list[list[str]] = [[] for _ in rows]
    shown = set(rows[0]) if rows else set()  # the rows' own columns (framework, parallelism ...)
    shared = {label for label in labels if labels.count(label) > 1}
    fabrics = bool(configs) and all(c.cluster.fabric is not None for c in configs)
    every = [_described(config) for config in configs] if shared or fabrics else []
    for label in shared:
        same = [i for i, other in enumerate(labels) if other == label]
        described = [every[i] for i in same]
        differing = [name for name in described[0] if len({d[name] for d in described}) > 1]
        if "hardware" in differing:
            differing = [name for name in differing if name not in ("intra_node", "inter_node")]
        for name in differing:
            values = [d[name] for d in described]
            if name in _LISTED:  # only the parts that differ: "b200" for "dgx_b200: b200, NVLink domain 8, ..."
                values = _differing_parts(values)
            for i, value in zip(same, values):
                rows[i][name] = value
                extra[i].append(name)
    across = []  # a fabric grid names its hardware (NCCL settings) on every row, not only where rows share a name
    for name in _LISTED if fabrics else ():
        values = [d[name] for d in every]
        if len(set(values)) > 1:
            for row, value in zip(rows, _differing_parts(values)):
                row[name] = value
            across.append(name)
    named = [name for name in dict.fromkeys([*(name for names in extra for name in names), *across]) if name not in shown]
    return [label + "".join(f" {name}={rows[i][name]}" for name in extra[i]) for i, label in enumerate(labels)], named


#: Described fields made of comma-separated parts, of which a row names only those that differ.
_LISTED = ("hardware", "nccl")


def _differing_parts(values: list[str]) -> list[str]:
    parts = [v.split(", ") for v in values]
    if len({len(p) for p in parts}) > 1:
        return values
    keep = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
    return [", ".join(p[k] for k in keep) for p in parts]


def _described(config: ClusterConfig) -> dict[str, str]:
    """Every field of the configuration's cluster (a fabric as its hardware and NCCL settings),
    then its own, as text."""
    values = {f.name: getattr(config.cluster, f.name) for f in fields(Cluster)}
    fabric = values.pop("fabric", None)
    if fabric is not None:
        values["hardware"] = _hardware(fabric)
        values["nccl"] = _nccl_settings(fabric.calibration)
    values.update((f.name, getattr(config, f.name)) for f in fields(ClusterConfig)
                  if f.name not in ("cluster", "calibrations"))
    return {name: _shown(value) for name, value in values.items()}


def _hardware(fabric) -> str:
    """A fabric's machine, GPUs, NVLink and NICs, without the cluster's size."""
    domain = f"NVLink domain {fabric.nvlink_domain}" if fabric.nvlink else "PCIe"
    return ", ".join([fabric.machine or "", fabric.gpu.name, domain, f"{fabric.nics_per_machine} x {fabric.nic.name}"])


def _nccl_settings(calibration) -> str:
    """What a cluster's ``nccl:`` block sets: release, forced algorithm and protocol, minimum
    channels, and whether a calibration's factors apply."""
    parts = [f"NCCL {'.'.join(map(str, calibration.version))}" if calibration.version else "",
             f"algorithm {calibration.algorithm}" if calibration.algorithm else "",
             f"protocol {calibration.protocol}" if calibration.protocol else "",
             f"{calibration.min_channels}+ channels" if calibration.min_channels else "",
             "calibrated" if calibration.factors or calibration.measured is not None else ""]
    return ", ".join(p for p in parts if p) or "NCCL's own choice"


def _shown(value) -> str:
    return value.describe() if hasattr(value, "describe") else str(value)


def collective_mix(run: ClusterSchedule) -> str:
    """The algorithms and protocols the run's collectives used, by their share of the bytes
    communicated, largest first: ``nvls_tree/simple 96%, tree/ll128 4%``."""
    collectives = run.collectives
    if not len(collectives):
        return ""
    named = (collectives["algorithm"] + "/" + collectives["protocol"]).to_numpy()
    return _by_share(collectives["task_bytes"].groupby(named).sum())


def parallel_collective_mix(job: ParallelJob) -> str:
    """The algorithms and protocols a parallel job's collectives used, per dimension, by their
    share of that dimension's bytes in one iteration (the passes' notes record each collective as
    priced): ``tensor ring/ll; data ring/simple 97%, ring/ll 3%; pipeline p2p/simple``. Groups
    and choices in the order they first appear, as the notes hold them."""
    by_group: dict = {}  # group -> choice -> the bytes of its collectives
    for note in job.graph.notes:
        for name in ("collectives", "transfers"):
            table = getattr(note, name, None)
            if not isinstance(table, pd.DataFrame) or not len(table) or not {"algorithm", "protocol", "nbytes"} <= set(table):
                continue
            if "iteration" in table:  # a pass before the pipeline's recorded every traced iteration
                table = table[table["iteration"] == table["iteration"].min()]
            groups = table["group"].astype(str).tolist() if "group" in table else ["pipeline"] * len(table)
            choices = [f"{a}/{p}" for a, p in zip(table["algorithm"].astype(str).tolist(),
                                                  table["protocol"].astype(str).tolist())]
            for group, choice, nbytes in zip(groups, choices, table["nbytes"].astype(float).tolist()):
                by_group.setdefault(group, {}).setdefault(choice, []).append(nbytes)
    parts = []
    for group, by_choice in by_group.items():
        sums = pd.Series({choice: math.fsum(values) for choice, values in by_choice.items()}, dtype=float)
        alone = len(sums) == 1 or sums.sum() <= 0
        parts.append(f"{group} {sums.index[0] if alone else _by_share(sums)}")
    return "; ".join(parts)


def _by_share(nbytes: pd.Series) -> str:
    """Each choice (the index) by its share of the bytes, largest first: ``ring/ll128 82%, tree/ll128 18%``."""
    shares = nbytes.sort_values(ascending=False, kind="stable")
    return ", ".join(f"{name} {100 * b / shares.sum():.0f}%" for name, b in shares.items())


def collective_notes(run: ClusterSchedule) -> dict:
    """Per communication task, the collective it ran in, as a timeline's event arguments."""
    return {
        int(c.Index): {"collective": f"{c.op} of {c.collective_bytes / 1e6:.4g} MB: {c.algorithm}/{c.protocol}, "
                                    f"{c.channels} channels"}
        for c in run.collectives.itertuples()
    }
