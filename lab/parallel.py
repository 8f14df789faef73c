"""Real runs of today's parallelism on the lab, the ground truth for the parallel predictions.

For each setting (a family of ``examples/parallel.py`` on an example transformer, a cluster
shape and a NIC rate) the harness

1. captures the single-worker trace the prediction starts from, once per model and batch size
   (``validate.capture``: ``whatif collect`` of the example on one core, three processes, the
   one of median speed kept), at the batch one rank computes on: a data-parallel rank's batch
   (FSDP, EP, the data dimension of FSDP+TP), the tensor-parallel group's shared batch (TP) or
   the whole pipeline batch (PP), and for a pipeline also one microbatch. The bundle's
   ``layers.json`` names every leaf module under its block (``blocks.N....``, the units) with
   its parameters, its forward and backward intervals, and the trace records every operator's
   input shapes (the GEMMs', the attention's, the router's and experts');
2. runs the setting for real ``repeats`` times on an emulated cluster (``cluster.run_job``,
   ``examples/run_distributed.py --framework FAMILY``), ``steps`` timed iterations after
   ``warmup``, and takes the median run's median iteration, as ``whatif validate`` does;
3. asks ``predictor`` (when given) for the predicted iteration and writes one record per
   setting: every setting, the parallel degrees in the scenario's vocabulary
   (``parallelism``: the scenario's ``parallelism:`` block of issue 28), the measured time with every run's median and
   their spread, every rank's median, where rank 0's steps went, the captures, and
   ``predicted_ms`` (empty without a predictor).

A tensor-parallel setting also measures, once per model, batch and sequence parallelism, what
its library costs the host (:func:`measure_tensor_dispatch`), which the predictor gives the
scenario as ``parallelism.tensor_dispatch``: a plain capture does not hold it.

CPU. The box has two cores. A 2-rank setting gets a core per worker (``cluster.pin``); a 4-rank
setting (FSDP+TP on 2 machines x 2 workers) runs as two 1-core machines, each machine's two
workers sharing its core, which the simulation must model as a machine whose workers share one
core (processor sharing), and the capture it starts from has a core to itself.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from whatif.collectors.bundle import read_bundle
from whatif.collectors.capture import STEADY_ALLOCATOR

from .cluster import TORCH_FAMILIES, LabError, LabSpec, pin, progress, run_job
from .validate import _examples, capture, measure

#: The variants a campaign can run: name -> (family, model, settings).
VARIANTS = {
    "fsdp": ("fsdp", "transformer", {}),
    "tp": ("tp", "transformer", {}),
    "tp+sp": ("tp", "transformer", {"sequence_parallel": True}),
    "pp-gpipe": ("pp", "transformer", {"schedule": "gpipe"}),
    "pp-1f1b": ("pp", "transformer", {"schedule": "1f1b"}),
    "ep": ("ep", "moe", {}),
    "fsdp+tp": ("fsdp+tp", "transformer", {}),
}
#: variants that need more than two ranks (their smallest layout is 2 machines x 2 workers)
FOUR_RANKS = ("fsdp+tp",)
LOOPBACK_MBPS = 1000.0  # the NIC rate of a one-machine setting, whose workers talk over loopback
#: what a predictor is called with: the setting, the captures ("step", and "microbatch" for a
#: pipeline) and the work folder (where ``validate.links(bandwidth, work)`` keeps calibrations),
#: and ``cpu_speed`` (keyword, default 1: the host's CPU work ``cpu_speed`` times faster than
#: captured); it returns the predicted iteration in milliseconds
Predictor = Callable[["ParallelSetting", dict, Path], float]


@dataclass(frozen=True)
class ParallelSetting:
    """One real run's settings. ``bandwidth_mbps`` None: one machine, its workers on loopback."""

    family: str
    model: str
    machines: int
    gpus_per_machine: int
    bandwidth_mbps: Optional[float]
    batch_size: int = 8  # per data-parallel rank; the whole pipeline's batch (the examples' own: 8)
    tensor: int = 2  # fsdp+tp
    sequence_parallel: bool = False
    microbatches: int = 4  # pp
    schedule: str = "1f1b"  # pp

    def __post_init__(self) -> None:
        if self.family not in TORCH_FAMILIES:
            raise LabError(f"unknown family {self.family!r}; choose from {', '.join(TORCH_FAMILIES)}")
        if self.family == "pp" and self.batch_size % self.microbatches:
            raise LabError(f"a batch of {self.batch_size} does not split into {self.microbatches} microbatches")
        if self.family == "fsdp+tp" and self.world % self.tensor:
            raise LabError(f"{self.tensor} tensor-parallel ranks do not divide {self.world} ranks")

    @property
    def world(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def variant(self) -> str:
        if self.family == "pp":
            return f"pp-{self.schedule}"
        return self.family + ("+sp" if self.sequence_parallel else "")

    @property
    def label(self) -> str:
        where = "loopback" if self.bandwidth_mbps is None else f"{self.bandwidth_mbps:g} Mbps"
        return f"{self.variant} {self.model} {self.machines}x{self.gpus_per_machine} @ {where}"

    def options(self) -> list[str]:
        """The family's arguments of ``examples/run_distributed.py``."""
        if self.family == "pp":
            return ["--microbatches", str(self.microbatches), "--schedule", self.schedule]
        out = ["--sequence-parallel"] if self.sequence_parallel and self.family in ("tp", "fsdp+tp") else []
        return out + (["--tensor", str(self.tensor)] if self.family == "fsdp+tp" else [])

    def parallelism(self) -> dict:
        """The setting as the scenario's ``parallelism`` block: ranks in Megatron's order
        (tensor fastest, then data, then pipeline), the blocks as units."""
        w = self.world
        degrees = {
            "fsdp": {"data": w, "fsdp": True},
            "tp": {"data": 1, "tensor": w, "sequence_parallel": self.sequence_parallel},
            "pp": {"data": 1, "pipeline": {"stages": w, "microbatches": self.microbatches, "schedule": self.schedule}},
            "ep": {"data": w, "expert": w},
            "fsdp+tp": {"data": w // self.tensor, "tensor": self.tensor, "fsdp": True,
                        "sequence_parallel": self.sequence_parallel},
        }[self.family]
        if self.sequence_parallel:  # DTensor's SequenceParallel: each norm's gradient all-reduced on its own
            degrees["sequence_parallel_grads"] = "per_parameter"
        return {**degrees, "placement": ["tensor", "data", "pipeline"], "units": r"blocks\.\d+"}

    def degrees(self) -> dict:
        """data, tensor, pipeline and expert ranks, as the run reports them."""
        block = self.parallelism()
        pipeline = block.get("pipeline", {"stages": 1})["stages"]
        return {"data": block["data"], "tensor": block.get("tensor", 1), "pipeline": pipeline,
                "expert": block.get("expert", 1)}

    def capture_batches(self) -> dict:
        """The batch sizes to capture: what one rank computes in a step, and a microbatch."""
        out = {"step": self.batch_size}
        if self.family == "pp":
            out["microbatch"] = self.batch_size // self.microbatches
        return out

    def spec(self) -> LabSpec:
        return LabSpec(self.machines, self.gpus_per_machine,
                       LOOPBACK_MBPS if self.bandwidth_mbps is None else self.bandwidth_mbps)


def default_settings(variants=tuple(VARIANTS), bandwidths=(200.0, 1000.0), loopback: bool = True,
                     batch_size: int = 8, microbatches: int = 4) -> list[ParallelSetting]:
    """The campaign: every variant on 2 machines x 1 worker at every bandwidth and, with
    ``loopback``, on 1 machine x 2 workers; FSDP+TP on 2 machines x 2 workers (tensor parallel
    inside a machine, over loopback, and FSDP across the NICs)."""
    out = []
    for name in variants:
        if name not in VARIANTS:
            raise LabError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        family, model, settings = VARIANTS[name]
        shapes = [(2, 2)] if name in FOUR_RANKS else [(2, 1)] + ([(1, 2)] if loopback else [])
        for machines, gpus in shapes:
            for bandwidth in bandwidths if machines > 1 else [None]:
                extra = {"microbatches": microbatches} if family == "pp" else {}
                out.append(ParallelSetting(family, model, machines, gpus, bandwidth, batch_size, **settings, **extra))
    return out


@dataclass
class ParallelPoint:
    """One setting measured (and predicted)."""

    setting: ParallelSetting
    status: str  # "ok" or "failed: why"
    measured_ms: float = float("nan")  # the median run's median iteration
    runs_ms: list = field(default_factory=list)  # every run's median iteration
    spread_pct: float = float("nan")  # (slowest - fastest run) / measured
    iteration_iqr_pct: float = float("nan")  # rank 0's iterations in the median run: interquartile range / median
    workers_ms: list = field(default_factory=list)  # every rank's median in the median run
    cores: list = field(default_factory=list)  # the cores each rank was pinned to
    phase_wall_ms: list = field(default_factory=list)  # every rank's phases (median run)
    other_threads_cpu_ms: list = field(default_factory=list)  # every rank's communication threads' CPU per step
    parameter_bytes: list = field(default_factory=list)  # every rank's parameters
    captures: dict = field(default_factory=dict)  # "step" / "microbatch" -> bundle path
    capture_plain_ms: dict = field(default_factory=dict)  # the same -> its median step without the profiler
    predicted_ms: Optional[float] = None
    error_pct: Optional[float] = None
    prediction_error: Optional[str] = None  # what the predictor raised
    #: the box's speed at the runs: a plain one-worker step (one core, the capture's batch)
    #: measured after each run (see :func:`run_setting`)
    anchor_ms: list = field(default_factory=list)
    #: the prediction with the capture's CPU time scaled to the anchors' speed (faster-cpu)
    anchored_ms: Optional[float] = None
    anchored_error_pct: Optional[float] = None
    steps: int = 0
    warmup: int = 0


def run_setting(setting: ParallelSetting, work: Path, repeats: int = 3, steps: int = 20, warmup: int = 5,
                predictor: Optional[Predictor] = None, steady_allocator: bool = False) -> ParallelPoint:
    """Capture (once per model and batch, kept in ``work``), run ``repeats`` times, predict."""
    if repeats < 1 or steps < 1 or warmup < 0:
        raise LabError("repeats and steps must be at least 1, warm-up at least 0")
    work = work.resolve()
    allocator = STEADY_ALLOCATOR if steady_allocator else None
    bundles = {kind: capture(setting.model, work, batch_size=batch, allocator=allocator)
               for kind, batch in setting.capture_batches().items()}
    plain = {kind: _median(read_bundle(path).unprofiled_step_ms) for kind, path in bundles.items()}
    if setting.family in TENSOR_FAMILIES:
        bundles["tensor_dispatch"] = measure_tensor_dispatch(setting.model, setting.batch_size,
                                                             setting.sequence_parallel, work)
    if setting.family in FSDP_FAMILIES:
        bundles["fsdp_dispatch"] = measure_fsdp_dispatch(setting.model, setting.batch_size, work)
    run_dir = work / "parallel_runs" / run_name(setting)
    reports, anchors = [], []
    for r in range(repeats):
        reports.append(measure(setting.model, setting.spec(), setting.family, run_dir / f"run{r}", steps=steps,
                               warmup=warmup, batch_size=setting.batch_size, allocator=allocator,
                               options=setting.options()))
        anchors.append(anchor_step(setting.model, setting.batch_size, run_dir / f"anchor{r}", steps, warmup))
    _check_degrees(setting, reports[0])
    runs = [float(report["median_ms"]) for report in reports]
    measured = statistics.median(runs)
    median_run = min(reports, key=lambda report: abs(float(report["median_ms"]) - measured))
    workers = median_run["workers"]
    point = ParallelPoint(
        setting, "ok", measured, runs, 100.0 * (max(runs) - min(runs)) / measured,
        100.0 * _iqr(workers[0]["iteration_ms"]) / float(workers[0]["median_ms"]),
        [float(w["median_ms"]) for w in workers],
        [pin(setting.spec(), rank, _cores()) for rank in range(setting.world)],
        [w["phase_wall_ms"] for w in workers],
        [float(w["other_threads_cpu_ms_per_step"]) for w in workers],
        [int(w["parameter_bytes"]) for w in workers],
        {kind: str(path) for kind, path in bundles.items()}, plain, steps=steps, warmup=warmup, anchor_ms=anchors,
    )
    if predictor is not None:
        predict_point(point, predictor, work)
    return point


def anchor_step(model: str, batch_size: int, out: Path, steps: int, warmup: int) -> float:
    """One worker's plain step (``examples/run_distributed.py --framework single``, one core,
    ``batch_size``): the box's speed when a setting runs. The box is a virtual machine whose
    speed drifts by 10 to 20 % over minutes (one capture's processes ran their plain steps at
    201 to 215 ms where plain runs half an hour later took 177 to 195), so each run is followed
    by one of these, which :func:`predict_point` holds against the capture's plain step."""
    report = measure(model, LabSpec(1, 1, LOOPBACK_MBPS), "ddp", out, steps=steps, warmup=warmup, batch_size=batch_size)
    return float(report["workers"][0]["median_ms"])


TENSOR_FAMILIES = ("tp", "fsdp+tp")
FSDP_FAMILIES = ("fsdp", "fsdp+tp")
DISPATCH_RUNS, DISPATCH_STEPS, DISPATCH_WARMUP = 3, 10, 3
FSDP_DISPATCH_RUNS = 5  # FSDP2's is a sixth of DTensor's per step, and the box drifts as much


def tensor_dispatch_path(model: str, batch_size: int, sequence_parallel: bool, work: Path) -> Path:
    return work / "tensor_dispatch" / f"{model}_batch{batch_size}{'_sp' if sequence_parallel else ''}.json"


def measure_tensor_dispatch(model: str, batch_size: int, sequence_parallel: bool, work: Path,
                            runs: int = DISPATCH_RUNS, steps: int = DISPATCH_STEPS, warmup: int = DISPATCH_WARMUP) -> Path:
    """The host time DTensor's tensor parallelism adds per column/row pair, in forward, backward
    and the optimizer step, kept in ``work`` (measured once; the path of its JSON).

    One worker on one core (as the captures run) trains ``model`` at ``batch_size`` ``runs``
    times plain (``--framework single``) and as many times under the family's tensor-parallel
    plan on a one-rank mesh (``--framework tp`` in a world of one: every operator at full size,
    no communication), the two alternating because the box's speed drifts; each phase's median
    step, plain against parallelized, differs by what the library does on the host (inputs and
    outputs converted to and from DTensors, sharding propagation for each operator of a
    parallelized layer, each sharded parameter's update dispatched). The median difference over
    the runs, divided by the plan's pairs (``tensor_pairs`` in the run's report), is
    ``forward_us``, ``backward_us`` and ``step_us`` (never below 0)."""
    path = tensor_dispatch_path(model, batch_size, sequence_parallel, work)
    if not path.exists():
        options = ["--sequence-parallel"] if sequence_parallel else []
        issue = measure_collective_issue(sequence_parallel)  # before the file exists: kept whole or not at all
        _measure_dispatch(model, batch_size, path, "tp", "tensor_pairs", options, runs, steps, warmup, issue)
    return path


#: The ways of ``lab/probes/tp_collectives.py`` each tensor-parallel mode issues: DTensor's
#: all-reduce (the row-parallel output, and under sequence parallelism the norms' gradients)
#: and sequence parallelism's all-gather and reduce-scatter.
ISSUED = {False: ("dtensor",), True: ("dtensor", "dtensor_gather", "dtensor_scatter")}


def measure_collective_issue(sequence_parallel: bool) -> dict:
    """``collective_us``: the training thread's CPU time per collective DTensor issues, beyond
    what a one-rank mesh (the dispatch runs above) and the links' price hold: the probe's thread
    time per redistribution on two ranks (after compute, as in a step), less the same on a mesh of
    one (which skips the collective) and less a plain ``dist.all_reduce``'s (the op the links
    were calibrated with), averaged over the ways the mode issues (:data:`ISSUED`), never below
    0; with the probe's figures (``collective_probe``: each way's median thread milliseconds)."""
    two, one = _probe_collectives(2), _probe_collectives(1)
    extra = {way: two[way] - one[way] - two["dist"] for way in ISSUED[sequence_parallel]}
    return {"collective_us": max(statistics.mean(extra.values()), 0.0) * 1e3,
            "collective_probe": {"two_ranks_ms": two, "one_rank_ms": one}}


def _probe_collectives(world: int) -> dict:
    """Each way's median thread CPU milliseconds, from ``lab/probes/tp_collectives.py`` on
    ``world`` ranks (its last line: JSON of quartiles by way)."""
    progress(f"tensor-parallel collectives' host time on {world} rank{'s' if world > 1 else ''}")
    out = subprocess.run([sys.executable, "-m", "whatif.lab.probes.tp_collectives"], capture_output=True, text=True,
                         env=dict(os.environ, TP_PROBE_WORLD=str(world)), timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise LabError(f"the collectives probe on {world} ranks failed (exit {out.returncode}): "
                       f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {way: quartiles["thread_cpu"][1] for way, quartiles in json.loads(lines[-1]).items()}


def _measure_dispatch(model: str, batch_size: int, path: Path, framework: str, count_key: str, options: list,
                      runs: int, steps: int, warmup: int, extra: Optional[dict] = None) -> None:
    """Plain runs and ``framework``'s in a world of one, alternating, ``runs`` each (one worker
    on one core); each phase's median difference over the runs, divided by the count the
    framework's report gives as ``count_key``, in microseconds, written to ``path`` with the
    runs' phases and ``extra`` (what else was measured for the file)."""
    spec = LabSpec(1, 1, LOOPBACK_MBPS)
    phases: dict = {"single": [], framework: []}
    count = 0
    for r in range(runs):
        for which in ("single", framework):
            progress(f"{framework} dispatch of {model}: {which}, run {r + 1} of {runs}")
            out = path.parent / path.stem / f"{which}_run{r}"
            argv = [sys.executable, str(_examples() / "run_distributed.py"), "--model", model,
                    "--framework", which, "--steps", str(steps), "--warmup", str(warmup), "--threads", "1",
                    "--batch-size", str(batch_size), "--json", str(out / "report.json")] + (options if which != "single" else [])
            out.mkdir(parents=True, exist_ok=True)
            result = run_job(spec, "ddp" if which == "single" else which, argv, out, timeout_s=900)
            if any(result.exit_codes):
                raise LabError(f"the {framework} dispatch run failed (exit codes {result.exit_codes}); logs in {out}")
            report = json.loads((out / "report.json").read_text())
            phases[which].append(report["workers"][0]["phase_wall_ms"])
            count = report.get("parallelism", {}).get(count_key, count)
    if not count:
        raise LabError(f"the {framework} run of {model} reported no {count_key}")
    plain, parallel = phases["single"], phases[framework]
    per = {f"{phase}_us": max(statistics.median(t[phase] - p[phase] for p, t in zip(plain, parallel)), 0.0) * 1e3 / count
           for phase in ("forward", "backward", "step")}
    path.write_text(json.dumps({**per, count_key: count, "plain_phase_ms": plain, f"{framework}_phase_ms": parallel,
                                **(extra or {})}, indent=1) + "\n")


def fsdp_dispatch_path(model: str, batch_size: int, work: Path) -> Path:
    return work / "fsdp_dispatch" / f"{model}_batch{batch_size}.json"


def measure_fsdp_dispatch(model: str, batch_size: int, work: Path, runs: int = FSDP_DISPATCH_RUNS,
                          steps: int = DISPATCH_STEPS, warmup: int = DISPATCH_WARMUP) -> Path:
    """The host time FSDP2 adds per unit, in forward, backward and the optimizer step, kept in
    ``work`` (measured once; the path of its JSON), as :func:`measure_tensor_dispatch` measures
    DTensor's: ``model`` at ``batch_size`` on one core, plain (``--framework single``) and under
    ``fully_shard`` in a world of one (``--framework fsdp``: every block a unit, then the root;
    no collective, FSDP2 gathers nothing for one rank), alternating, ``runs`` times each; each
    phase's median difference over the units (``fsdp_units`` in the run's report) is
    ``forward_us``, ``backward_us`` and ``step_us`` (never below 0). It holds FSDP2's hooks, its
    gradients packed for the reduce-scatter (``fsdp::chunk_cat``) and copied into the sharded
    gradients, and the sharded parameters' update; the copies around an all-gather, which a
    world of one does not make, are the pass's to price (``sim/parallel/fsdp.py``)."""
    path = fsdp_dispatch_path(model, batch_size, work)
    if not path.exists():
        _measure_dispatch(model, batch_size, path, "fsdp", "fsdp_units", [], runs, steps, warmup)
    return path


def dispatch_block(path: Path) -> dict:
    """``measure_tensor_dispatch``'s (or ``measure_fsdp_dispatch``'s) JSON as the scenario's
    ``parallelism.tensor_dispatch`` (``fsdp_dispatch``)."""
    measured = json.loads(Path(path).read_text())
    block = {phase: f"{measured[f'{phase}_us']:.1f}us" for phase in ("forward", "backward", "step")}
    if "collective_us" in measured:
        block["collective"] = f"{measured['collective_us']:.1f}us"
    return block


def predict_point(point: ParallelPoint, predictor: Predictor, work: Path) -> None:
    """Fill ``point``'s prediction from ``predictor``; what it raises is kept in ``prediction_error``
    (a campaign goes on to the next setting), its last line and where it was raised."""
    point.predicted_ms = point.error_pct = point.prediction_error = None
    point.anchored_ms = point.anchored_error_pct = None
    captures = {k: Path(v) for k, v in point.captures.items()}

    def error_pct(ms: float) -> float:
        return 100.0 * (ms - point.measured_ms) / point.measured_ms

    try:
        predicted = float(predictor(point.setting, captures, work))
    except Exception as err:  # noqa: BLE001 - kept in the record, one line
        where = traceback.extract_tb(err.__traceback__)[-1]
        point.prediction_error = f"{type(err).__name__}: {err} ({Path(where.filename).name}:{where.lineno})"
        return
    point.predicted_ms, point.error_pct = predicted, error_pct(predicted)
    plain = point.capture_plain_ms.get("step")
    if point.anchor_ms and plain:
        speed = plain / statistics.median(point.anchor_ms)  # > 1: the box ran faster than at the capture
        try:
            anchored = float(predictor(point.setting, captures, work, cpu_speed=speed))
        except Exception as err:  # noqa: BLE001 - kept in the record, one line
            point.prediction_error = f"anchored: {type(err).__name__}: {err}"
            return
        point.anchored_ms, point.anchored_error_pct = anchored, error_pct(anchored)


def run_name(setting: ParallelSetting) -> str:
    where = "loopback" if setting.bandwidth_mbps is None else f"{setting.bandwidth_mbps:g}mbps"
    return f"{setting.variant}_{setting.model}_{setting.machines}x{setting.gpus_per_machine}_{where}_batch{setting.batch_size}" + (
        f"_mb{setting.microbatches}" if setting.family == "pp" else "")


def _check_degrees(setting: ParallelSetting, report: dict) -> None:
    """The run did what the setting says (the degrees examples/parallel.py reported)."""
    ran = {k: report["parallelism"][k] for k in ("data", "tensor", "pipeline", "expert")}
    if ran != setting.degrees():
        raise LabError(f"{setting.label} ran as {ran}, not {setting.degrees()}")


def _cores() -> int:
    return os.cpu_count() or 1


def _median(values: list) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _iqr(values: list) -> float:
    if len(values) < 4:
        return max(values) - min(values) if values else float("nan")
    low, _, high = statistics.quantiles(values, n=4)
    return high - low


# -- the campaign's files ---------------------------------------------------------------------

COLUMNS = [
    "variant", "family", "model", "machines", "gpus_per_machine", "world", "bandwidth_mbps", "batch_size",
    "data", "tensor", "pipeline", "expert", "fsdp", "sequence_parallel", "microbatches", "schedule",
    "status", "measured_ms", "predicted_ms", "error_pct", "runs_ms", "spread_pct", "iteration_iqr_pct",
    "workers_ms", "cores", "other_threads_cpu_ms", "capture_step_plain_ms", "capture_microbatch_plain_ms",
    "capture_step", "capture_microbatch", "steps", "warmup", "prediction_error",
    "anchor_ms", "anchored_ms", "anchored_error_pct",
]


def as_record(point: ParallelPoint) -> dict:
    """The point as JSON: its setting, its parallelism block and everything measured."""
    record = asdict(point)
    record["setting"] = {**asdict(point.setting), "variant": point.setting.variant, "world": point.setting.world}
    record["parallelism"] = point.setting.parallelism()
    return record


def csv_row(point: ParallelPoint) -> dict:
    s = point.setting
    degrees = s.degrees()
    joined = lambda values, f="{:.2f}": ";".join(f.format(v) for v in values)  # noqa: E731
    row = {
        "variant": s.variant, "family": s.family, "model": s.model, "machines": s.machines,
        "gpus_per_machine": s.gpus_per_machine, "world": s.world, "bandwidth_mbps": s.bandwidth_mbps,
        "batch_size": s.batch_size, **degrees, "fsdp": s.family in ("fsdp", "fsdp+tp"),
        "sequence_parallel": s.sequence_parallel, "microbatches": s.microbatches if s.family == "pp" else None,
        "schedule": s.schedule if s.family == "pp" else None, "status": point.status,
        "predicted_ms": point.predicted_ms, "error_pct": point.error_pct, "prediction_error": point.prediction_error,
        "steps": point.steps, "warmup": point.warmup, "anchored_ms": point.anchored_ms,
        "anchored_error_pct": point.anchored_error_pct,
    }
    if point.status == "ok":
        row.update(
            measured_ms=point.measured_ms, runs_ms=joined(point.runs_ms), spread_pct=point.spread_pct,
            iteration_iqr_pct=point.iteration_iqr_pct, workers_ms=joined(point.workers_ms),
            cores=";".join(",".join(map(str, c)) for c in point.cores),
            other_threads_cpu_ms=joined(point.other_threads_cpu_ms),
            capture_step_plain_ms=point.capture_plain_ms.get("step"),
            capture_microbatch_plain_ms=point.capture_plain_ms.get("microbatch"),
            capture_step=point.captures.get("step"), capture_microbatch=point.captures.get("microbatch"),
            anchor_ms=joined(point.anchor_ms),
        )
    return {c: ("" if row.get(c) is None else row[c]) for c in COLUMNS}


def run_campaign(settings: list, out: Path, repeats: int = 3, steps: int = 20, warmup: int = 5,
                 predictor: Optional[Predictor] = None, steady_allocator: bool = False, resume: bool = False,
                 progress: Callable[[str], None] = print) -> list[ParallelPoint]:
    """Every setting measured in turn into ``out``/parallel_validation.{csv,json} (rewritten as
    each finishes, so an interrupted campaign keeps what it measured; ``resume`` skips the
    settings measured already), captures and logs under ``out``/work."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "parallel_validation.json"
    done = _read_records(json_path) if resume else []
    finished = {run_name(ParallelSetting(**_setting_fields(r["setting"]))) for r in done if r["status"] == "ok"}
    records = [r for r in done if r["status"] == "ok"]
    points = []
    for setting in settings:
        if run_name(setting) in finished:
            continue
        try:
            point = run_setting(setting, out / "work", repeats, steps, warmup, predictor, steady_allocator)
        except LabError as err:
            point = ParallelPoint(setting, f"failed: {err}", steps=steps, warmup=warmup)
        points.append(point)
        records.append(as_record(point))
        write_campaign(out, records)
        shown = f"{point.measured_ms:.1f} ms (runs {', '.join(f'{ms:.1f}' for ms in point.runs_ms)}; spread {point.spread_pct:.1f} %)" \
            if point.status == "ok" else point.status
        progress(f"{setting.label}: {shown}")
    return points


def _setting_fields(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("variant", "world")}


def _read_records(path: Path) -> list:
    return json.loads(path.read_text())["points"] if path.exists() else []


def write_campaign(out: Path, records: list) -> None:
    """``records`` (``as_record``) as the campaign's JSON and CSV in ``out``."""
    points = [point_of_record(r) for r in records]
    (out / "parallel_validation.json").write_text(json.dumps({"points": records}, indent=1) + "\n")
    with (out / "parallel_validation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for point in points:
            writer.writerow(csv_row(point))


def point_of_record(record: dict) -> ParallelPoint:
    """A point back from its JSON record."""
    fields = {k: v for k, v in record.items() if k not in ("setting", "parallelism")}
    return ParallelPoint(ParallelSetting(**_setting_fields(record["setting"])), **fields)
