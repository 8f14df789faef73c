"""Answering a scenario: the grid of cluster configurations, each simulated, against 1x1; and
a trace's job predicted at another batch size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd

from whatif.collectors.iterations import find_iterations
from whatif.collectors.load import load_trace
from whatif.report.cluster import cluster_breakdown, collective_mix
from whatif.report.iterations import iteration_report, steady_median
from whatif.sim.build import build_graph
from whatif.sim.distributed import ClusterConfig, simulate_cluster
from whatif.sim.engine import simulate
from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
from whatif.sim.gradients import find_gradients
from whatif.sim.graph import TaskGraph, TaskKind
from whatif.sim.passes.batch_size import change_batch_size
from whatif.sim.passes.profiler_overhead import ProfilerOverhead, remove_profiler_overhead
from whatif.sim.passes.shared_memory import add_memory_bytes
from whatif.sim.perfmodels.cache import default_models
from whatif.sim.perfmodels.models import PerfModels, load_models
from whatif.study import TraceStudy, WhatIf

from .scenario import Scenario


@dataclass
class ScenarioResult:
    results: pd.DataFrame  # one row per configuration
    runs: dict  # configuration label -> ClusterSchedule
    gradient_source: str
    bytes_per_iteration: float
    baseline_ms: float
    profiler_overhead: Optional[ProfilerOverhead] = None  # what was taken out of the trace, if anything


def predict_scenario(scenario: Scenario) -> ScenarioResult:
    """Simulate every configuration of ``scenario``; speed-ups are against one worker (1x1),
    which is the replay of the (optimized) trace, less the profiler's overhead where the trace
    is a bundle that measured it (``sim/passes/profiler_overhead.py``)."""
    study = TraceStudy.from_trace(scenario.trace, scenario.iteration)
    worker = WhatIf(optimizations=scenario.optimizations).apply(study.graph)
    if any(point.cluster.workers_sharing_memory > 1 for point in scenario.points):
        worker = add_memory_bytes(worker)
    unprofiled_ms = worker.workload.unprofiled_step_ms
    if scenario.remove_profiler_overhead and unprofiled_ms:
        worker = remove_profiler_overhead(worker, study.iterations, unprofiled_ms)
    if scenario.batch_size is not None:
        worker = _change_batch_size(worker, scenario)
    baseline = iteration_report(simulate(worker), study.iterations)
    baseline_ms = steady_median(baseline["predicted_ms"])
    without_comm = worker.copy()
    without_comm.remove(without_comm.select(kinds=[TaskKind.COMM]))  # replaced by simulated ones
    gradients = find_gradients(without_comm, study.iterations, scenario.gradient_sizes, scenario.gradient_total)
    pass_rate = pass_rate_bytes_per_us(study.graph)
    rows, runs = [], {}
    for point in scenario.points:
        config = ClusterConfig(
            cluster=point.cluster,
            framework=point.framework,
            policy=point.policy,
            algorithm=scenario.collective,
            options=scenario.options,
            stragglers=[s for s in scenario.stragglers if s.machine < point.cluster.machines],
            replicate=scenario.replicate,
            shared_links=scenario.shared_links,
            pass_bytes_per_us=pass_rate,
        )
        graph = worker if config.workers == 1 else without_comm
        run = simulate_cluster(graph, gradients, study.iterations, config)
        report = iteration_report(run.schedule, study.iterations, run.worker0)
        breakdown = cluster_breakdown(run, report)
        iteration_ms = steady_median(report["predicted_ms"])
        workers = config.workers
        row = {
            "machines": point.cluster.machines,
            "gpus_per_machine": point.cluster.gpus_per_machine,
            "workers": workers,
            "inter_node_gbps": round(point.inter_node_gbps, 3),
            "framework": point.framework,
            "policy": point.policy,
            "iteration_ms": iteration_ms,
            "speedup": workers * baseline_ms / iteration_ms,
            "scaling_efficiency": baseline_ms / iteration_ms,
            "exposed_comm_ms": steady_median(breakdown["exposed_comm_ms"]),
            "comm_ms": steady_median(breakdown["comm_ms"]),
            "compute_ms": steady_median(breakdown["compute_ms"]),
            "idle_ms": steady_median(breakdown["idle_ms"]),
            "messages_per_iteration": run.messages_per_iteration,
            "comm_mb_per_iteration": run.bytes_per_iteration / 1e6,
        }
        if point.cluster.backend == "nccl":
            row["collectives"] = collective_mix(run)  # NCCL's choice, where NCCL chooses
        rows.append(row)
        runs[_label(row)] = run
    return ScenarioResult(
        pd.DataFrame(rows), runs, gradients.source, gradients.bytes_per_iteration(), baseline_ms,
        worker.last_note(ProfilerOverhead),
    )


def _change_batch_size(worker: TaskGraph, scenario: Scenario) -> TaskGraph:
    """The worker's iteration rebuilt at the scenario's batch size (operator models; the CPU
    overheads between operators stay), from the batch size the trace was taken at."""
    traced = scenario.traced_batch_size or worker.workload.environment.get("batch_size")
    models = load_models(scenario.perfmodel) if scenario.perfmodel is not None else default_models()
    return change_batch_size(worker, models, scenario.batch_size, traced)


def _label(row: dict) -> str:
    return f"{row['machines']}x{row['gpus_per_machine']} {row['inter_node_gbps']:g}Gbps {row['framework']} {row['policy']}"


def predict_at_batch_size(
    trace_path: Union[str, Path],
    from_batch: Optional[int],
    to_batch: int,
    models: Union[PerfModels, str, Path, None] = None,
    unprofiled_ms: Optional[Sequence[float]] = None,
) -> float:
    """The steady-state median iteration (ms) the trace's job would take at ``to_batch``.

    ``from_batch`` is the batch size the trace was captured at (None: inferred); ``models`` a
    :class:`PerfModels`, a models file, or None for this machine's cached quick fit. Where the
    unprofiled iteration times at ``from_batch`` are known (``unprofiled_ms``, else a capture
    bundle's unprofiled warm-up steps), the profiler's overhead is taken out of the trace first
    (``sim/passes/profiler_overhead.py``): the job predicted runs without the profiler, and the
    overhead, paid per operator call, does not grow with the batch."""
    report = predict_iterations_at_batch_size(trace_path, from_batch, to_batch, models, unprofiled_ms)
    return steady_median(report["predicted_ms"])


def predict_iterations_at_batch_size(
    trace_path: Union[str, Path],
    from_batch: Optional[int],
    to_batch: int,
    models: Union[PerfModels, str, Path, None] = None,
    unprofiled_ms: Optional[Sequence[float]] = None,
) -> pd.DataFrame:
    """Every iteration of :func:`predict_at_batch_size`'s prediction (``iteration_report``)."""
    if models is None:
        models = default_models()
    elif not isinstance(models, PerfModels):
        models = load_models(models)
    trace = load_trace(trace_path)
    graph = build_graph(trace)
    iterations = find_iterations(trace)
    if unprofiled_ms is None:
        unprofiled_ms = graph.workload.unprofiled_step_ms or None
    if unprofiled_ms is not None:
        graph = remove_profiler_overhead(graph, iterations, unprofiled_ms)
    graph = change_batch_size(graph, models, to_batch, from_batch)
    return iteration_report(simulate(graph), iterations)
