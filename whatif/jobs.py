"""A multi-rank job's scenario: the job as its traces ran it, moved to other clusters.

A scenario whose ``trace`` is a job's per-rank traces (a folder of them, or a list) predicts
that job, every rank with its own graph, joined at its collectives as they met
(``sim/multirank.py``): the real skew and waits of the run. What a scenario can change there is
the cluster and the optimizations (its framework, parallelism and gradients are the traces'):

* each configuration of the ``cluster`` grid must have as many GPUs as the job has ranks (rank
  ``k`` on GPU ``k``, machine by machine); every collective's transfer is repriced on it by
  ``topology.collective_cost``, with the algorithm and protocol NCCL's tuner chooses there (not
  the traced ones, which were chosen for the traced cluster); a rank arrives at a collective
  when its own work lets it, as in the trace, so the waits move with the transfers;
* ``optimizations`` apply to every rank's graph, as ``whatif simulate FOLDER`` applies them.

A configuration's step is the slowest rank's steady median iteration; its speed-up is over the
job as traced (the same ranks, the traced transfers: the replay), ``comm_ms`` the steady median
of the slowest rank's transfers per iteration and ``exposed_comm_ms`` what it waited at
collectives for the others, beyond the transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import pandas as pd

from whatif.collectors.diagnostics import warn
from whatif.collectors.ranks import load_traces
from whatif.report.iterations import steady_median
from whatif.report.ranks import RankReport, rank_reports
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.engine import Schedule
from whatif.sim.multirank import Job, build_job, transfer_on
from whatif.topology import as_gbps

from .pipeline import WhatIf, clusters_gpu_note


@dataclass
class JobPrediction:
    """Every configuration of a job's scenario: ``results`` (one row each, as ``predict``'s
    table shows them), and per configuration label its schedule and its ranks' reports."""

    job: Job
    replay_ms: float  # the slowest rank's steady median step, as traced
    results: pd.DataFrame
    runs: dict = field(default_factory=dict)  # label -> Schedule
    reports: dict = field(default_factory=dict)  # label -> list[RankReport]
    gpu_note: str = ""  # where the clusters' GPUs are not the traced ones (pipeline.clusters_gpu_note)


def _slowest(reports: list[RankReport], column: str = "predicted_ms") -> tuple[float, RankReport]:
    steps = [(steady_median(r.iterations[column]), r) for r in reports]
    return max(steps, key=lambda pair: pair[0])


def predict_job(scenario: Scenario) -> JobPrediction:
    """Each configuration of ``scenario`` (whose ``job_traces`` name a job) predicted."""
    traces = load_traces(scenario.job_traces)
    for path, why in traces.skipped:
        warn(path, 1, f"skipped, {why}")
    world = len(traces.ranks)
    for point in scenario.points:
        if point.cluster.n_gpus != world:
            raise ScenarioError(scenario.name, "cluster",
                                f"the job has {world} ranks and a configuration {point.cluster.n_gpus} GPUs "
                                f"({point.cluster.machines} x {point.cluster.gpus_per_machine}): a job's traces "
                                "predict it on as many GPUs as it has ranks")
    job = build_job(traces, scenario.iteration)
    replay = job.replay()
    replay_ms, _ = _slowest(rank_reports(job, replay))
    what_if = WhatIf(optimizations=list(scenario.optimizations))
    rows, runs, reports = [], {}, {}
    for point in scenario.points:
        graph = job.with_collectives(transfer_on(point.cluster, as_traced=False))
        schedule: Schedule = job.simulate(what_if.apply(graph) if what_if.changes_anything else graph)
        ranked = rank_reports(job, schedule, replay)
        step_ms, slowest = _slowest(ranked)
        cluster = point.cluster
        label = f"{cluster.machines}x{cluster.gpus_per_machine} {cluster.describe()}"
        rows.append({
            "machines": cluster.machines, "gpus_per_machine": cluster.gpus_per_machine, "workers": world,
            "inter_node_gbps": round(as_gbps(cluster.inter_node.bandwidth_bytes_per_us), 3),
            "framework": "as traced", "policy": "-", "iteration_ms": step_ms,
            "speedup": replay_ms / step_ms, "scaling_efficiency": replay_ms / step_ms,
            "exposed_comm_ms": steady_median(slowest.iterations["collective_wait_ms"]),
            "comm_ms": steady_median(slowest.iterations["transfer_ms"]),
            "slowest_rank": slowest.rank,
        })
        runs[label], reports[label] = schedule, ranked
    devices = [d for rank in traces.ranks for d in rank.trace.device_properties]
    note = clusters_gpu_note(devices, [point.cluster for point in scenario.points], scenario.optimizations)
    return JobPrediction(job, replay_ms, pd.DataFrame(rows), runs, reports, note)


def job_results_note(prediction: JobPrediction, scenario: Scenario) -> str:
    """The line above a job's table: what was predicted, from what."""
    job = prediction.job
    where = scenario.job_traces[0] if len(scenario.job_traces) == 1 else f"{scenario.job_traces[0]} ..."
    return (f"{where}: a job of "
            f"{len(job.ranks)} ranks joined at {len(job.collectives)} collectives; as traced, its slowest rank's "
            f"step {prediction.replay_ms:.2f} ms; each configuration reprices every collective on its cluster")
