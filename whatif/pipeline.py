"""One prediction pipeline: trace -> graph -> passes -> cluster -> simulation -> report.

Every prediction goes through :func:`predict`: the commands ``simulate``, ``critical-path``
and ``predict``, the benches, the lab's validation runs and the notebook (``replay`` of one
trace asks for no change, so it simulates the study's own graph, :attr:`TraceStudy.replay`,
without importing this module and the cluster simulation). A :class:`Request` says what each
step does:

1. **trace -> graph** (``whatif/study.py``): the trace or bundle read, its dependency graph
   built, its iterations found (``trace``, ``iteration``), or a :class:`TraceStudy` given.
2. **passes** (``sim/passes/``), each taking a graph and returning a new one, in this order:

   a. the bytes each CPU task's operators move (``add_memory_bytes``), only where a cluster
      puts several workers on one memory system;
   b. the profiler's overhead taken out (``remove_profiler_overhead``, with the plain steps'
      times ``unprofiled_ms``, else the bundle's): a correction of the trace, so before any
      change, which would otherwise spread the measured overhead over fewer or other tasks;
   c. the batch size (``batch_size``, from ``traced_batch_size``, by the operator models
      ``perfmodel``): the traced job at another size;
   d. the what-ifs (``what_if``): optimizations, then scalings, then removals.

   After (b) the graph is the *unchanged* job, which ``simulate``'s speed-up is against;
   after (d) it is the *worker*, simulated alone (``1x1``).
3. **cluster** (``clusters``): none, or data-parallel configurations (``sim/distributed.py``),
   every worker the worker graph, communicating its gradients (found in it,
   ``sim/gradients.py``, or ``gradient_sizes`` / ``gradient_total``). A configuration with a
   ``parallelism`` that uses more than plain data parallelism is a parallel job instead
   (``sim/parallel/job.py``: the worker graph's units found, the family passes applied to rank
   0's graph, which is simulated); every configuration with a ``parallelism`` reports its
   memory per GPU and whether it fits (``sim/parallel/memory.py``). The configurations are
   independent of one another: they run one after the other, or on several processes or a
   Dask or Ray cluster (``whatif/sweep.py``), with the same results in the same order.
4. **simulation** (``sim/engine.py``) and 5. **report** (``report/``): per iteration of the
   worker, and a row per cluster configuration, each with an interval (``report/intervals.py``)
   that holds the same prediction made on each run of the links' calibration and on each
   other process that captured the job (a bundle's ``processes``).

The defaults, and why. A prediction is of the job as it runs, without the profiler, so the
profiler's overhead is removed (``remove_profiler_overhead=True``) wherever the plain step was
timed: by a capture bundle's unprofiled warm-up steps, or as ``unprofiled_ms``. That holds for
``simulate`` and ``predict`` alike, and for the benches and the lab that hold predictions
against real runs. A replay keeps it: ``replay`` and ``critical-path`` check and explain the
trace as it was measured, so ``critical-path`` asks for ``remove_profiler_overhead=False``. A
plain trace file has no unprofiled steps, and nothing is removed from it either way. The traced batch size is
the one given, else the bundle's, else inferred from the first layer's input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd

from whatif.collectors.bundle import MIN_WARMUP_FOR_OVERHEAD, short_warmup
from whatif.collectors.diagnostics import plural, warn
from whatif.report.cluster import configuration_labels, configuration_row, memory_columns, parallel_row
from whatif.report.intervals import relative_interval, steady_interval, widened
from whatif.report.iterations import IterationSpans, iteration_report, speedup_report, steady_median
from whatif.sim.distributed import (ClusterConfig, ClusterSchedule, lay_cluster, simulate_cluster, slowest_pace,
                                    with_graph, without_graph)
from whatif.sim.engine import Schedule, simulate
from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
from whatif.sim.gradients import Gradients, find_gradients
from whatif.sim.graph import GraphError, TaskGraph, TaskKind
from whatif.sim.parallel import Parallelism, is_parallel_job
from whatif.sim.parallel.accumulation import accumulation_rule
from whatif.sim.parallel.memory import gpu_memory_bytes, memory_per_gpu
from whatif.sim.parallel.recompute import apply_recompute
from whatif.sim.parallel.units import Units, UnitsError, find_units, no_units, parameters_from_shapes
from whatif.sim.passes.batch_size import BatchSizeChange, change_batch_size, infer_batch_size, parameter_shapes
from whatif.sim.passes.registry import apply_optimization, optimization_name
from whatif.sim.passes.recipes import CommunicationChange
from whatif.sim.passes.profiler_overhead import ProfilerOverhead, remove_profiler_overhead
from whatif.sim.passes.shared_memory import add_memory_bytes
from whatif.sim.perfmodels.cache import default_models
from whatif.sim.perfmodels.models import PerfModels, load_models
from whatif.topology.fabric import gpu_chip, gpu_of_device

from .study import TraceStudy
from .sweep import Sweep, run_sweep, runs_elsewhere


@dataclass(frozen=True)
class WhatIf:
    """A set of changes to apply to the graph, in this order: optimizations, scalings, removals.

    ``optimizations`` are names of ``sim/passes/registry.py``'s registry (``faster-gpu=2``
    for one with a value); ``scale`` pairs a regular expression with a duration factor;
    ``remove`` lists regular expressions. Patterns match a task's name and the operators and
    annotations around it.
    """

    optimizations: Sequence[str] = ()
    scale: Sequence[tuple[str, float]] = ()
    remove: Sequence[str] = ()

    @property
    def changes_anything(self) -> bool:
        return bool(self.optimizations or self.scale or self.remove)

    def apply(self, graph: TaskGraph) -> TaskGraph:
        """A new graph with the changes made; ``graph`` is left alone."""
        for spec in self.optimizations:
            changed = apply_optimization(graph, spec)
            warn(f"optimization {spec!r}", int(same_graph(graph, changed)), "changes no task of this trace, so it "
                                                                              "changes nothing")
            graph = changed
        graph = graph.copy()
        for pattern, factor in self.scale:
            graph.scale(self._matching(graph, "--scale", f"{pattern}={factor:g}", pattern), factor)
        for pattern in self.remove:
            graph.remove(self._matching(graph, "--remove", pattern, pattern))
        return graph

    @staticmethod
    def _matching(graph: TaskGraph, option: str, spec: str, pattern: str):
        """The tasks ``pattern`` selects; a warning where it selects none (a misspelt name)."""
        tasks = graph.select(pattern=pattern)
        warn(f"{option} {spec!r}", int(len(tasks) == 0), "matches no task, so it changes nothing")
        return tasks


def same_graph(before: TaskGraph, after: TaskGraph) -> bool:
    """Whether a pass left the graph as it was: the same tasks at the same durations, the same
    edges, no note added (a recipe that changes the communication leaves only a note)."""
    return (len(after.tasks) == len(before.tasks) and len(after.edges) == len(before.edges)
            and len(after.notes) == len(before.notes)
            and np.array_equal(after.tasks["duration_us"].to_numpy(), before.tasks["duration_us"].to_numpy()))


@dataclass(frozen=True)
class Request:
    """What a prediction does at each step (see the module's docstring for the order and the
    defaults)."""

    trace: Union[str, Path, TraceStudy]  # a trace file or bundle folder, or a study already loaded
    iteration: Optional[str] = None  # the annotation marking an iteration (with a path); None: ProfilerStep#N
    remove_profiler_overhead: bool = True  # where the plain step was timed
    unprofiled_ms: Optional[Sequence[float]] = None  # the plain steps' times; None: the bundle's, if any
    batch_size: Optional[int] = None  # predict at this batch size
    traced_batch_size: Optional[int] = None  # the trace's; None: the bundle's, else inferred
    perfmodel: Union[PerfModels, str, Path, None] = None  # operator models; None: this machine's cached ones
    what_if: WhatIf = field(default_factory=WhatIf)
    clusters: Sequence[ClusterConfig] = ()  # none: one worker only
    gradient_sizes: Optional[Sequence[float]] = None  # what the clusters communicate; None: from the trace
    gradient_total: Optional[float] = None
    optimizer: str = "adam"  # a parallel configuration's memory count (sim/parallel/memory.py)
    gpu_memory_bytes: Optional[float] = None  # what it must fit in; None: the cluster's GPUs', if known
    microbatch_trace: Union[str, Path, None] = None  # the model traced at a pipeline's microbatch
    keep_runs: bool = True  # each configuration's run in Prediction.runs; False: its row alone (no timelines)


@dataclass
class Prediction:
    """What :func:`predict` found: the graphs, the worker's schedule and report, and, where the
    request named clusters, one row per configuration (``results``) and its run (``runs``, by
    the row's label, ``2x1 10Gbps horovod fifo``)."""

    request: Request
    study: TraceStudy
    unchanged: TaskGraph  # the traced job as it runs: corrected, not changed
    worker: TaskGraph  # after every pass: the graph each worker runs
    schedule: Schedule  # the worker simulated alone
    report: pd.DataFrame  # its iterations, against the measured ones (report.iterations)
    results: Optional[pd.DataFrame] = None
    runs: dict = field(default_factory=dict)  # label -> ClusterSchedule (empty where the request kept none)
    gradients: Optional[Gradients] = None  # what the clusters communicated
    processes: list = field(default_factory=list)  # the same request on each other capture process's plain step

    @property
    def iteration_ms(self) -> float:
        """The worker's steady-state median iteration: one worker's, which the clusters'
        speed-ups are against."""
        return steady_median(self.report["predicted_ms"])

    @property
    def iteration_interval(self) -> tuple[float, float]:
        """The worker's prediction interval around :attr:`iteration_ms` (``report/intervals.py``:
        from the spread of its steady iterations; ``nan`` where it has fewer than three), widened
        to hold the other capture processes' predictions (:attr:`processes`)."""
        row = {"iteration_ms": self.iteration_ms}
        row["iteration_ms_low"], row["iteration_ms_high"] = steady_interval(self.report["predicted_ms"])
        others = [{"iteration_ms": p.iteration_ms, **dict(zip(("iteration_ms_low", "iteration_ms_high"),
                                                              p.iteration_interval))} for p in self.processes]
        row = widened(row, others)
        return row["iteration_ms_low"], row["iteration_ms_high"]

    @property
    def profiler_overhead(self) -> Optional[ProfilerOverhead]:
        """What was taken out of the trace as the profiler's overhead (None: nothing)."""
        return self.worker.last_note(ProfilerOverhead)

    @property
    def batch_change(self) -> Optional[BatchSizeChange]:
        return self.worker.last_note(BatchSizeChange)

    @property
    def gradient_source(self) -> str:
        return self.gradients.source

    @property
    def bytes_per_iteration(self) -> float:
        return self.gradients.bytes_per_iteration()

    @cached_property
    def unchanged_schedule(self) -> Schedule:
        """The unchanged job simulated (the replay itself where nothing was corrected)."""
        return self.study.replay if self.unchanged is self.study.graph else simulate(self.unchanged)

    def speedup_report(self) -> pd.DataFrame:
        """Every iteration of the worker beside the unchanged job's (``replay_ms``), with the
        speed-up over it; no error column, as nothing measured the changed run."""
        return speedup_report(self.report, iteration_report(self.unchanged_schedule, self.study.iterations))


def predict(request: Request, sweep: Sweep = Sweep()) -> Prediction:
    """Run the pipeline for ``request``; its cluster configurations run as ``sweep`` says (by
    default one after the other, here), with the same results whichever way."""
    study = _study(request)
    iterations = study.iterations
    graph = study.graph
    if any(config.cluster.workers_sharing_memory > 1 for config in request.clusters):
        graph = add_memory_bytes(graph)
    unprofiled_ms = request.unprofiled_ms if request.unprofiled_ms is not None else graph.workload.unprofiled_step_ms
    if request.remove_profiler_overhead and unprofiled_ms is not None and len(unprofiled_ms):
        graph = remove_profiler_overhead(graph, iterations, unprofiled_ms)
    elif request.remove_profiler_overhead:
        _check_warmup(study)
    unchanged = graph
    if request.batch_size is not None:
        graph = change_batch_size(graph, _models(request.perfmodel), request.batch_size, request.traced_batch_size)
    if request.what_if.changes_anything:
        graph = request.what_if.apply(graph)
    schedule = study.replay if graph is study.graph else simulate(graph)
    report = iteration_report(schedule, iterations)
    emptied = report.loc[report["predicted_ms"].isna(), "name"].tolist()
    if emptied and request.what_if.changes_anything:
        raise GraphError(
            f"the what-if removed every task of iteration {emptied[0]!r}"
            + (f" and {len(emptied) - 1} more" if len(emptied) > 1 else "")
            + "; nothing is left to predict"
        )
    prediction = Prediction(request, study, unchanged, graph, schedule, report)
    _check_communication_changes(graph, request.clusters)
    _check_gpu_factors(study, request.clusters)
    if request.clusters:
        _simulate_clusters(prediction, sweep)
    _hold_other_processes(prediction, sweep)
    return prediction


def _hold_other_processes(prediction: Prediction, sweep: Sweep) -> None:
    """Where several processes captured the job (``Workload.process_unprofiled_ms``: the lab
    captures three and keeps the one of median speed), the request predicted again on each other
    process's plain step (the profiler-overhead correction's reference), and every interval
    widened to hold those predictions (``report/intervals.py`` ``widened``): a whole process runs
    at one of a few speeds on a shared or virtual machine, and the run a prediction is held to
    is another process. The central values stay the kept capture's."""
    request, study = prediction.request, prediction.study
    kept = study.graph.workload.unprofiled_step_ms
    if request.unprofiled_ms is not None or not request.remove_profiler_overhead or not len(kept):
        return
    own = float(np.median(kept))
    others = [ms for ms in study.graph.workload.process_unprofiled_ms if not math.isclose(ms, own, rel_tol=1e-9)]
    prediction.processes = [predict(replace(request, trace=study, iteration=None, unprofiled_ms=[ms], keep_runs=False), sweep)
                            for ms in others]
    if prediction.results is not None and prediction.processes:
        rows = prediction.results.to_dict("records")
        prediction.results = pd.DataFrame([widened(row, [p.results.iloc[i].to_dict() for p in prediction.processes])
                                           for i, row in enumerate(rows)])


def _check_communication_changes(worker: TaskGraph, clusters: Sequence[ClusterConfig]) -> None:
    """Refuse a recipe that changes the gradient communication (``sim/passes/recipes.py``) where
    the job has none for it to change: no traced communication kernel and no cluster of several
    workers; for a decomposed all-reduce, no cluster of several machines of several GPUs on the
    link models."""
    for change in (note for note in worker.notes if isinstance(note, CommunicationChange)):
        if change.algorithm is not None:
            if not any(_hierarchical(config) for config in clusters):
                raise GraphError(f"{change.recipe}: decomposes the all-reduce across a hierarchy of machines and their "
                                 "GPUs; give a scenario whose cluster has several machines of several GPUs each "
                                 "(on the link models: NCCL's fabric chooses its own algorithm)")
        elif change.traced_messages == 0 and not any(config.workers > 1 for config in clusters):
            raise GraphError(f"{change.recipe}: the job communicates nothing (no communication kernel in the trace, "
                             "no cluster of several workers): give a scenario")


def _check_warmup(study: TraceStudy) -> None:
    """A warning where a bundle's warm-up was too short to time a step without the profiler
    (``collectors/bundle.py``): its overhead stays in the prediction."""
    bundle = getattr(study.trace, "bundle", None)
    warmup = bundle.manifest.get("warmup_steps") if bundle is not None else None
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        warn(bundle.path, int(warmup < MIN_WARMUP_FOR_OVERHEAD), short_warmup(warmup))


def _check_gpu_factors(study: TraceStudy, clusters: Sequence[ClusterConfig]) -> None:
    """A warning where a configuration slows GPU tasks (a straggler's ``gpu_slowdown``, a
    scenario's ``gpu_variation``) on a trace that has none: the factor changes nothing."""
    slowed = sum(any(s.gpu_slowdown != 1.0 for s in config.stragglers) or any(f != 1.0 for f in config.gpu_slowdowns)
                 for config in clusters)
    if not study.graph.workload.has_gpu:
        warn(study.trace.path, slowed, f"has no GPU task, so the GPU slowdown of {plural(slowed, 'configuration')} "
                                       "(gpu_slowdown, gpu_variation) changes nothing")


def traced_gpu_note(prediction: "Prediction") -> str:
    """A note where the clusters' GPUs are not the one the trace ran on and no ``faster-gpu``
    says how much faster they compute: each GPU then runs the traced kernels at the traced
    speed, so the prediction differs only by the clusters' communication. Empty otherwise (a
    trace without a GPU, or with an unknown one)."""
    request = prediction.request
    return clusters_gpu_note(prediction.study.trace.device_properties, [c.cluster for c in request.clusters],
                             request.what_if.optimizations)


def clusters_gpu_note(device_properties: Sequence, clusters: Sequence, optimizations: Sequence[str]) -> str:
    """:func:`traced_gpu_note` from its parts: the traces' ``deviceProperties`` (a job's ranks'
    together), the clusters predicted, the what-ifs asked."""
    if any(str(name).startswith("faster-gpu") for name in optimizations):
        return ""
    devices = sorted({str(d.get("name", "")) for d in device_properties if isinstance(d, dict)})
    traced = {gpu_chip(gpu) for gpu in (gpu_of_device(name) for name in devices) if gpu is not None}
    if len(traced) != 1:
        return ""
    others = sorted({c.fabric.gpu.name for c in clusters if c.fabric is not None and gpu_chip(c.fabric.gpu.name) not in traced})
    if not others:
        return ""
    return (f"the trace ran on {', '.join(devices)}; on the clusters' {', '.join(others)} GPUs its kernels keep their "
            f"traced times, so those rows differ only in communication (their compute: a scenario of their own with "
            f"optimizations: [faster-gpu=K])")


def slowest_rank_note(prediction: "Prediction") -> str:
    """A note where a parallel job has stragglers or GPU variation: its ranks, simulated as one,
    run at the slowest rank's pace (``sim/parallel/job.at_pace``), since each waits for the
    others at every collective; empty otherwise."""
    paced = []
    for config in prediction.request.clusters:
        pace = slowest_pace(config)
        if is_parallel_job(config.parallelism) and pace != (1.0, 1.0):
            paced.append(f"{config.parallelism.describe()} x{pace[0]:.2f} (GPU x{pace[1]:.2f})")
    if not paced:
        return ""
    return ("stragglers / gpu_variation: a parallel job's ranks wait for each other at every collective, so each job "
            f"is simulated as one rank at its slowest rank's pace, on all its work (and on its GPU's): {'; '.join(paced)}")


def pipeline_note(prediction: "Prediction") -> str:
    """Where a configuration pipelines more than one microbatch, what a microbatch's forward and
    backward take (``sim/parallel/pipeline.py``: measured by the microbatch trace, else linear in
    the batch, which a GPU's small kernels do not keep to) and how its later backwards add their
    gradients into those the first wrote (``sim/parallel/accumulation.py``); empty otherwise."""
    if not any(c.parallelism is not None and int(c.parallelism.pipeline) > 1 and int(c.parallelism.microbatches) > 1
               for c in prediction.request.clusters):
        return ""
    graph = prediction.study.graph
    if prediction.request.microbatch_trace is not None:
        times = f"as the microbatch trace measured them ({prediction.request.microbatch_trace})"
    elif graph.workload.has_gpu:
        times = ("linear in the batch, each GPU task at 1/m of its traced time: a GPU runs a small microbatch's "
                 "kernels less efficiently, so this is likely optimistic; parallelism.pipeline.microbatch_trace, "
                 "a trace of one microbatch, gives measured times")
    else:
        times = ("linear in the batch, each CPU operator at 1/m of its traced time; "
                 "parallelism.pipeline.microbatch_trace, a trace of one microbatch, gives measured times")
    rule = accumulation_rule(graph)
    return (f"pipeline: microbatch times {times}; each later microbatch's backward adds its gradients into the "
            f"first's: {rule}")


def _hierarchical(config: ClusterConfig) -> bool:
    cluster = config.cluster
    return cluster.machines > 1 and cluster.gpus_per_machine > 1 and cluster.backend != "nccl"


def _communication_changed(config: ClusterConfig, worker: TaskGraph, gradients: Gradients) -> ClusterConfig:
    """``config`` with the recipes' changes to the gradient communication (a worker's notes):
    gradient compression's bytes and codec time, BlueConnect's all-reduce where the cluster
    has the hierarchy for it (a warning where it has not)."""
    for change in (note for note in worker.notes if isinstance(note, CommunicationChange)):
        if change.algorithm is not None:
            if _hierarchical(config):
                config = replace(config, algorithm=change.algorithm)
            else:
                warn(f"{change.recipe} on {config.cluster.machines}x{config.cluster.gpus_per_machine}", 1,
                     "has no hierarchy of machines and GPUs to decompose the all-reduce across, so it changes nothing")
            continue
        per_iteration = gradients.bytes_per_iteration()
        codec = change.codec_us_per_iteration / per_iteration if per_iteration > 0 else 0.0
        config = replace(config, bytes_factor=config.bytes_factor * change.bytes_factor,
                         codec_us_per_byte=config.codec_us_per_byte + codec)
    return config


def _study(request: Request) -> TraceStudy:
    if isinstance(request.trace, TraceStudy):
        if request.iteration is not None:
            raise ValueError("a study has its iterations already: give the trace's path with iteration")
        return request.trace
    return TraceStudy.from_trace(request.trace, request.iteration)


def _microbatch_graph(request: Request) -> Optional[TaskGraph]:
    """The microbatch trace's graph, read as the trace is (its profiler overhead removed where its
    bundle timed plain steps) and changed by the request's what-ifs as the trace is, without its
    own communication; None without one."""
    if request.microbatch_trace is None:
        return None
    study = TraceStudy.from_trace(request.microbatch_trace, request.iteration)
    graph = study.graph
    unprofiled_ms = graph.workload.unprofiled_step_ms
    if request.remove_profiler_overhead and unprofiled_ms is not None and len(unprofiled_ms):
        graph = remove_profiler_overhead(graph, study.iterations, unprofiled_ms)
    if request.what_if.changes_anything:
        graph = request.what_if.apply(graph)
    graph = graph.copy()
    graph.remove(graph.select(kinds=[TaskKind.COMM]))
    return graph


def _microbatch_fits(request: Request, worker: TaskGraph, microbatch: Optional[TaskGraph]) -> dict:
    """For each microbatch count of the request's pipelines, whether the microbatch trace was
    traced at the pipeline's microbatch: the batch (``--batch-size``'s where given, else the
    trace's) over that count. A configuration where it was not is built without it (the
    operator models, else the linear rule, scale its units), with a warning: a grid over the
    microbatch count, or another batch size, would otherwise take one microbatch's times for
    another's. Where either batch cannot be told, the trace is used as given, with a warning."""
    counts = sorted({int(c.parallelism.microbatches) for c in request.clusters
                     if c.parallelism is not None and c.parallelism.pipeline > 1 and c.parallelism.microbatches > 1})
    if microbatch is None or not counts:
        return {}
    where = f"parallelism.pipeline.microbatch_trace {request.microbatch_trace}"
    batch, traced = _batch_of(worker), _batch_of(microbatch)
    if batch is None or traced is None:
        warn(where, 1, "used as given: the batch it or the trace was traced at cannot be told, so whether it is "
                       "the pipeline's microbatch is not checked")
        return {}
    fits = {m: batch % m == 0 and batch // m == traced for m in counts}
    unfit = [m for m in counts if not fits[m]]
    warn(where, len(unfit), f"traced at batch {traced}, which is not the microbatch of batch {batch} in "
                            f"{' or '.join(str(m) for m in unfit)} microbatches: those configurations scale the "
                            "traced units to their microbatch instead")
    return fits


def _batch_of(graph: TaskGraph) -> Optional[int]:
    """The batch ``graph`` runs at: the last ``--batch-size`` change's, else the traced one; None
    where it cannot be told."""
    changes = [note for note in graph.notes if isinstance(note, BatchSizeChange)]
    if changes:
        return changes[-1].to_batch
    try:
        return infer_batch_size(graph, parameter_shapes(graph))[0]
    except GraphError:
        return None


def _models(perfmodel: Union[PerfModels, str, Path, None]) -> PerfModels:
    if isinstance(perfmodel, PerfModels):
        return perfmodel
    return load_models(perfmodel) if perfmodel is not None else default_models()


def _simulate_clusters(prediction: Prediction, sweep: Sweep) -> None:
    """Every configuration of the request simulated (run as ``sweep`` says, ``whatif/sweep.py``),
    its row and run added to ``prediction``. One worker runs the worker graph as it is; several
    run it without its own communication, which the framework's messages replace."""
    request, study, worker = prediction.request, prediction.study, prediction.worker
    without_comm = worker.copy()
    without_comm.remove(without_comm.select(kinds=[TaskKind.COMM]))
    gradients = find_gradients(without_comm, study.iterations, request.gradient_sizes, request.gradient_total)
    microbatch = _microbatch_graph(request)
    grid = _Grid(worker, without_comm, gradients, study.iterations, pass_rate_bytes_per_us(study.graph),
                 prediction.iteration_ms, prediction.iteration_interval, request.optimizer, request.gpu_memory_bytes,
                 microbatch, alone=prediction.schedule, alone_report=prediction.report,
                 microbatch_fits=_microbatch_fits(request, without_comm, microbatch),
                 dtype_bytes=_amp_dtype_bytes(request, study), keep_runs=request.keep_runs)
    if request.keep_runs and runs_elsewhere(sweep, len(request.clusters)):
        for config in request.clusters:  # laid here once, not in every process, and not sent back
            _lay(grid, config)
        grid.held = frozenset(grid.laid)
    rows, runs = zip(*run_sweep(_configuration, grid, request.clusters, sweep, pack=_sent, unpack=_received))
    labels, described = configuration_labels(list(rows), request.clusters)
    prediction.results = pd.DataFrame(list(rows))
    prediction.results.attrs["described"] = described  # the columns that tell rows apart: tables and plots show them
    prediction.runs = dict(zip(labels, runs)) if request.keep_runs else {}
    prediction.gradients = gradients


@dataclass
class _Grid:
    """What every configuration of a grid is simulated from, made once."""

    worker: TaskGraph
    without_comm: TaskGraph
    gradients: Gradients
    iterations: pd.DataFrame
    pass_rate: float  # the trace's copy rate, for configurations that give none
    iteration_ms: float  # one worker's, which speed-ups are against
    iteration_interval: tuple  # and its interval, which a pipeline's step borrows
    optimizer: str
    gpu_memory_bytes: Optional[float]
    microbatch: Optional[TaskGraph] = None  # the microbatch trace's graph, without its communication
    microbatch_fits: dict = field(default_factory=dict)  # microbatches -> whether the microbatch trace is at batch / m
    alone: Optional[Schedule] = None  # the worker simulated alone: every 1x1 configuration's schedule
    alone_report: Optional[pd.DataFrame] = None  # and its iterations' report (iteration_report), read only
    units: dict = field(default_factory=dict)  # parallelism.units -> the worker's units, found once
    passes: dict = field(default_factory=dict)  # the leading parallel passes' graphs (parallelize's cache)
    laid: dict = field(default_factory=dict)  # the cluster graphs built, which simulate_cluster keeps
    laid_recomputed: dict = field(default_factory=dict)  # those of workers with a recomputation, by its kind
    dtype_bytes: Optional[int] = None  # the memory count's element size: 2 under amp, else the trace's
    held: frozenset = frozenset()  # the keys of those laid before the sweep ran elsewhere: on both sides
    spans: dict = field(default_factory=dict)  # what their reports read of them (_spans)
    keep_runs: bool = True  # the runs go back to the caller (Request.keep_runs); else the rows alone


def _lay(grid: _Grid, config: ClusterConfig) -> None:
    """``config``'s cluster graph laid in ``grid.laid`` (``lay_cluster``), where its
    configuration simulates one: several workers, no parallelism's families. A configuration
    that cannot be laid raises its error here, as its run would: the sweep stops at it."""
    if config.pass_bytes_per_us is None:
        config = replace(config, pass_bytes_per_us=grid.pass_rate)
    par = config.parallelism
    if config.workers > 1 and not is_parallel_job(par):
        lay_cluster(grid.without_comm, grid.gradients, grid.iterations, config, grid.laid)


def _sent(grid: _Grid, result: tuple[dict, ClusterSchedule]) -> tuple:
    """A configuration's result as a process sends it back: its run's graph left out where both
    sides hold the cluster graph it was laid over (``grid.held``); its row alone where the runs
    are not kept."""
    row, run = result
    if run is None:
        return row, None, None
    return (row, *without_graph(run, grid.held))


def _received(grid: _Grid, sent: tuple) -> tuple[dict, Optional[ClusterSchedule]]:
    """A result :func:`_sent` sent, with its run's graph again (None where the runs are not kept)."""
    row, run, durations = sent
    return row, with_graph(run, durations, grid.laid) if run is not None else None


def _configuration(grid: _Grid, config: ClusterConfig) -> tuple[dict, Optional[ClusterSchedule]]:
    """One configuration simulated: its row of the results and its run; where its links keep
    their calibration's runs, simulated on each of them too, which widens the row's interval."""
    if config.pass_bytes_per_us is None:
        config = replace(config, pass_bytes_per_us=grid.pass_rate)
    if config.workers > 1:
        config = _communication_changed(config, grid.worker, grid.gradients)
    row, run = _simulated(grid, config)
    calibrated = [_simulated(grid, replace(config, cluster=cluster, calibrations=()))[0] for cluster in config.calibrations]
    return widened(row, calibrated), run if grid.keep_runs else None


def _simulated(grid: _Grid, config: ClusterConfig) -> tuple[dict, ClusterSchedule]:
    par = config.parallelism
    if is_parallel_job(par):
        from whatif.sim.parallel.job import at_pace, parallelize, simulate_job  # imported where a grid has a parallel job

        microbatch = grid.microbatch if grid.microbatch_fits.get(int(par.microbatches), True) else None
        job = parallelize(*_job_graph(grid, par), par, config.cluster, grid.optimizer, grid.gpu_memory_bytes, microbatch,
                          cache=grid.passes, dtype_bytes=grid.dtype_bytes)
        job = at_pace(job, *slowest_pace(config))  # stragglers, gpu_variation: the slowest rank sets the pace
        schedule = simulate_job(job, config.cluster)
        run = ClusterSchedule(schedule, job.comm_tasks(), job.rank0(), 0.0, 0.0)
        report = _job_report(schedule, grid.iterations, run.worker0)
        row = parallel_row(config, job, run, report, grid.iteration_ms)
        if report["measured_ms"].isna().all():  # a step built anew (a pipeline's): no traced iterations of its own
            low, high = relative_interval(row["iteration_ms"], grid.iteration_ms, grid.iteration_interval)
            row.update(iteration_ms_low=low, iteration_ms_high=high)
        return row, run
    worker, laid, alone = grid.worker if config.workers == 1 else grid.without_comm, grid.laid, grid.alone
    if par is not None and par.recompute != "none":  # its cost on the worker, laid apart from the others'
        worker = _recomputed_worker(grid, worker, par)
        laid = grid.laid_recomputed.setdefault((par.recompute, par.units), {})  # (one worker lays none)
        alone = None
    run = simulate_cluster(worker, grid.gradients, grid.iterations, config, laid, alone)
    if config.workers > 1:
        report = _spans(grid, run).report(run.schedule)
    elif run.schedule is grid.alone and grid.alone_report is not None:
        report = grid.alone_report  # the worker alone, whose report the prediction made already
    else:
        report = iteration_report(run.schedule, grid.iterations)
    row = configuration_row(config, run, report, grid.iteration_ms)
    if par is not None:  # plain data parallelism: the cluster path, and its memory
        memory = memory_per_gpu(grid.without_comm, _units(grid.units, grid.without_comm, par, False), par,
                                grid.optimizer, grid.dtype_bytes, parameter_bytes=grid.gradients.bytes_per_iteration())
        gpu_bytes = grid.gpu_memory_bytes if grid.gpu_memory_bytes is not None else gpu_memory_bytes(config.cluster)
        row.update(parallelism=par.describe(), **memory_columns(memory, gpu_bytes))
        row["exposed_data_ms"] = row["exposed_comm_ms"] if config.workers > 1 else 0.0  # its one dimension
        if row.get("collectives"):  # named by dimension, as a parallel job's are
            row["collectives"] = f"data {row['collectives']}"
    return row, run


def _amp_dtype_bytes(request: Request, study: TraceStudy) -> Optional[int]:
    """The memory count's element size where mixed precision (``amp``) is asked of a GPU trace:
    activations in half precision and ZeRO's 2 + 2 + 12 bytes a parameter; None otherwise (the
    trace's own; amp changes no task of a CPU trace, and so no byte of its memory either)."""
    amp = any(optimization_name(o) == "amp" for o in request.what_if.optimizations)
    return 2 if amp and study.graph.workload.has_gpu else None


def _recomputed_worker(grid: _Grid, worker: TaskGraph, par: Parallelism) -> TaskGraph:
    """``worker`` (the grid's worker graph, with or without its communication) with the
    recomputed forward charged (``sim/parallel/recompute.py``), once per kind and units."""
    key = ("recompute", par.recompute, par.units, worker is grid.worker)
    if key not in grid.units:
        units = _units(grid.units, worker, par, True) if worker is grid.without_comm else find_units(worker, par.units)
        grid.units[key] = apply_recompute(worker, units, par)
    return grid.units[key]


def _spans(grid: _Grid, run: ClusterSchedule) -> IterationSpans:
    """What worker 0's report reads of a cluster's graph, made once per cluster graph: the
    configurations that share one (``grid.laid``) share its worker mask, which keys them."""
    known = grid.spans.get(id(run.worker0))
    if known is None or known[0] is not run.worker0:
        known = grid.spans[id(run.worker0)] = (run.worker0, IterationSpans(run.schedule.graph, grid.iterations,
                                                                           run.worker0))
    return known[1]


def _job_graph(grid: _Grid, par: Parallelism) -> tuple[TaskGraph, Units]:
    """The worker graph a parallel job is built from, and its units (once per pattern). Where no
    bundle lists the parameters, the graph carries those its operators' recorded shapes give
    (``parameters_from_shapes``), which size the job's collectives and memory; a trace with
    neither cannot size them and is refused, rather than predicted without communication."""
    key = ("job", par.units)
    if key not in grid.units:
        graph, units = grid.without_comm, _units(grid.units, grid.without_comm, par, True)
        if not len(graph.workload.parameters):
            estimated = parameters_from_shapes(graph, units)
            if not len(estimated):
                raise UnitsError("parallelism: the trace lists no parameters (a capture bundle: whatif collect) and "
                                 "records no operator input shapes (torch.profiler's record_shapes=True), so a "
                                 "parallel job's collectives and memory cannot be sized")
            weights = float((estimated["numel"] * estimated["element_size"]).sum())
            traced = grid.gradients.bytes_per_iteration()
            if traced > 0 and abs(weights - traced) > 0.1 * traced:
                warn(graph.workload.source or "the trace", 1,
                     f"its operators' weights come to {weights / 1e6:.1f} MB and its gradients to {traced / 1e6:.1f} MB "
                     f"({grid.gradients.source}): the parallel job is sized by the weights")
            graph = TaskGraph(graph.tasks, graph.edges, graph.ops, replace(graph.workload, parameters=estimated),
                              list(graph.notes))
            units = find_units(graph, par.units)
        grid.units[key] = (graph, units)
    return grid.units[key]


def _units(cache: dict, graph: TaskGraph, par: Parallelism, required: bool) -> Units:
    """The worker's units for ``par.units`` (found once per pattern); where a job does not need
    them (plain data parallelism's memory count), none when none are found."""
    if par.units not in cache:
        try:
            cache[par.units] = find_units(graph, par.units)
        except UnitsError as err:
            cache[par.units] = err
    found = cache[par.units]
    if isinstance(found, UnitsError):
        if required:
            raise found
        return no_units(graph)
    return found


def _job_report(schedule: Schedule, iterations: pd.DataFrame, rank0: np.ndarray) -> pd.DataFrame:
    """A parallel job's iterations, as the traced iterations' spans find them on rank 0; where
    a pass built the graph of one step anew (the pipeline pass's stages and microbatches: no
    traced span holds it), one row, the step from the first task to the last on any rank."""
    report = iteration_report(schedule, iterations, rank0)
    if report["predicted_ms"].notna().any() or not len(schedule.start_us):
        return report
    lo, hi = float(np.min(schedule.start_us)), float(np.max(schedule.end_us))
    return pd.DataFrame([{"name": "step", "measured_ms": np.nan, "predicted_ms": (hi - lo) / 1e3, "error_pct": np.nan,
                          "span_start_us": lo, "span_end_us": hi}])
