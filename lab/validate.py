"""Holding a prediction against a real run: capture 1x1, predict M x G, run M x G, compare.

For one example model (``examples/``) and one configuration:

1. capture a single-worker bundle of the model on one core (``whatif collect``), which also
   times steps without the profiler, so that its overhead can be taken out of the prediction,
   in three processes, keeping the one of median speed;
2. predict the configuration from it with the prediction pipeline (``whatif/pipeline.py``, as
   ``whatif predict`` does), on links calibrated on the lab's own network (``whatif lab
   calibrate``), with the framework settings the real run uses (Horovod's fusion buffer and
   cycle time are set explicitly for both);
3. run the model for real as every worker of an emulated cluster (``lab/cluster.py``), each
   worker with the same CPU share as the capture (one thread, its own core where the box has
   enough; with ``steady_allocator`` both it and the capture run with glibc's allocator fixed,
   ``capture.STEADY_ALLOCATOR``), and take the median iteration after warm-up; do that ``repeats`` times and take the
   median run, because on a shared or virtual machine whole runs differ by more than the
   sampling error of one run's median: six back-to-back runs of vgg 1x2 with DDP had medians
   from 178 to 205 ms on the box this was built on;
4. report measured (with every run's median), predicted and the error, and the minor page
   faults per step of the capture and of the run: on the box this was built on, vgg's plain
   steps faulted 18 000 times a step (70 MB zeroed again) under glibc's defaults and its
   two-worker DDP runs under 3 000, which hid 20 ms of unmodelled communication cost behind
   20 ms of page faults the capture had and the runs had not.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml

from whatif.collectors.bundle import is_bundle, read_bundle, record_processes
from whatif.collectors.capture import STEADY_ALLOCATOR, CaptureError, collect
from whatif.pipeline import predict as run_pipeline
from whatif.scenario import Scenario

from .calibrate import calibrate, calibration_day
from .cluster import LabError, LabSpec, carry_priority, check_can_run, progress, run_job

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MODELS = ("convnet", "vgg", "wide_mlp", "transformer", "moe")
FUSION_BUFFER_BYTES = 64 * 1024 * 1024
CYCLE_TIME_MS = 5.0
CAPTURE_STEPS = 8
BATCH_SIZE_ENV = "WHATIF_EXAMPLE_BATCH_SIZE"  # examples/profiled_training.py reads it under the capture API
CAPTURE_WARMUP = 10
CAPTURE_PROCESSES = 3
STEADY_SPREAD = 0.05


@dataclass
class ValidationPoint:
    model: str
    machines: int
    gpus_per_machine: int
    bandwidth_mbps: float
    latency_ms: float
    framework: str
    measured_ms: float
    predicted_ms: float
    error_pct: float
    predicted_with_profiler_ms: float  # the same prediction with the profiler's overhead left in the trace
    capture_profiled_ms: float  # the 1x1 capture's median profiled iteration
    capture_unprofiled_ms: float  # its median warm-up step without profiler or hooks (NaN: not timed)
    batch_size: Optional[int]  # the batch size predicted and run (None: the example's own)
    predict_from: Optional[int]  # the batch size captured, when it differs from batch_size
    workers_measured_ms: list  # every worker's median in the median run
    runs_measured_ms: list  # every repeated run's median iteration; measured_ms is their median
    # minor page faults per step: the capture's unprofiled steps and worker 0 of the median run
    # (NaN: not recorded). Far apart, the capture and the run did not measure the same work
    # (glibc returning a step's large tensors to the kernel in one and keeping them in the other).
    capture_page_faults_per_step: float = float("nan")
    capture_plain_spread_pct: float = float("nan")  # the capture's plain steps: interquartile range over median
    run_page_faults_per_step: float = float("nan")
    # where worker 0's steps went in the median run (examples/run_distributed.py's PhaseClock):
    # each phase's wall and training-thread CPU time, and the CPU time of its other threads,
    # the framework's communication, which shared the worker's core with the training step
    run_phase_wall_ms: dict = field(default_factory=dict)
    run_phase_cpu_ms: dict = field(default_factory=dict)
    run_other_threads_cpu_ms_per_step: float = float("nan")
    captures_plain_ms: list = field(default_factory=list)  # every capture process's median plain step
    predicted_ms_low: float = float("nan")  # the prediction's 90 % interval (report/intervals.py)
    predicted_ms_high: float = float("nan")


def _examples() -> Path:
    if not (EXAMPLES / "run_distributed.py").is_file():
        raise LabError(f"validation runs the example models in {EXAMPLES}, which this installation does not have")
    return EXAMPLES


def capture_path(model: str, work: Path, batch_size: Optional[int] = None) -> Path:
    """Where the validation kept in ``work`` has ``model``'s 1x1 capture."""
    return work / "captures" / (f"{model}_1x1.bundle" if batch_size is None else f"{model}_1x1_batch{batch_size}.bundle")


def links_path(bandwidth_mbps: float, work: Path) -> Path:
    """Where the validation kept in ``work`` has the lab network calibrated at ``bandwidth_mbps``."""
    return work / "links" / f"links_{bandwidth_mbps:g}mbps.yaml"


def capture(model: str, work: Path, steps: int = CAPTURE_STEPS, warmup: int = CAPTURE_WARMUP, batch_size: Optional[int] = None,
            allocator: Optional[dict] = None) -> Path:
    """A single-worker bundle of ``model`` on one core (``whatif collect``), kept in ``work``.

    The warm-up is long enough that the capture also times ``warmup - 2`` steps without the
    profiler, which the prediction uses to remove the profiler's overhead, and takes as the
    step's time. The model is captured ``CAPTURE_PROCESSES`` times, each in its own process, and
    the capture of median speed (median plain step) is kept, as the real runs it is held against
    are the median of ``repeats`` processes: a virtual machine runs a whole process at one of a
    few speeds, and a 1x1 prediction is its capture's speed. One capture of the wide MLP ran its
    plain steps at 134 ms where the three real runs that followed took 106 to 111 ms.
    Captures whose plain steps spread more than ``STEADY_SPREAD`` (interquartile range over
    median: something else ran on the box) are passed over while a steadier one exists: one
    wide MLP captured on a busy box timed them from 105 to 150 ms."""
    bundle = capture_path(model, work, batch_size)
    if is_bundle(bundle):
        return bundle
    bundle.parent.mkdir(parents=True, exist_ok=True)
    carry_priority()  # the capture runs in this process's session
    command = ["taskset", "-c", "0", sys.executable, str(_examples() / f"{model}.py")]
    env = {"OMP_NUM_THREADS": "1", BATCH_SIZE_ENV: "" if batch_size is None else str(batch_size), **(allocator or {})}
    plain_steps: dict[Path, list] = {}  # each process's bundle and its plain steps
    try:
        for process in range(CAPTURE_PROCESSES):
            progress(f"capturing {model} on one worker, process {process + 1} of {CAPTURE_PROCESSES}")
            candidate = bundle.with_name(f"{bundle.name}.process{process}")
            shutil.rmtree(candidate, ignore_errors=True)
            collect(command, out=candidate, steps=steps, warmup=warmup, env=env)
            plain_steps[candidate] = read_bundle(candidate).unprofiled_step_ms
        median_capture(plain_steps).rename(bundle)
        medians = [_median_or_nan(steps) for steps in plain_steps.values()]
        captures_record(bundle).write_text(json.dumps(medians))
        record_processes(bundle, medians)  # the prediction's interval holds every process's speed
    except CaptureError as err:
        raise LabError(f"capturing {model} failed: {err}") from None
    finally:
        for candidate in plain_steps:
            shutil.rmtree(candidate, ignore_errors=True)
    return bundle


def captures_record(bundle: Path) -> Path:
    """Where every capture process's median plain step is kept beside the bundle kept."""
    return bundle.with_name(f"{bundle.name}.processes.json")


def median_capture(plain_steps: dict) -> Path:
    """Of captures (bundle: its plain steps), the one of median speed among the steady ones
    (all of them when none is steady); of two, the faster."""
    steady = {c: steps for c, steps in plain_steps.items() if plain_step_spread(steps) <= STEADY_SPREAD}
    by_speed = sorted(steady or plain_steps, key=lambda c: _median_or_nan(plain_steps[c]))
    return by_speed[(len(by_speed) - 1) // 2]


def plain_step_spread(times: list[float]) -> float:
    """Interquartile range over median of a capture's steps timed without the profiler
    (``Bundle.unprofiled_step_ms``; 0 with too few to tell)."""
    if len(times) < 4:
        return 0.0
    low, median, high = statistics.quantiles(times, n=4)
    return (high - low) / median


def links(bandwidth_mbps: float, work: Path) -> Path:
    """The lab network calibrated at ``bandwidth_mbps`` (kept in ``work``); a kept calibration
    of another day is used, with a warning (:func:`stale_links`)."""
    path = links_path(bandwidth_mbps, work)
    if path.exists() and path not in _WARNED:
        _WARNED.add(path)
        warning = stale_links(path)
        if warning:
            progress(warning)
    if not path.exists():
        progress(f"calibrating the lab's network at {bandwidth_mbps:g} Mbps (once per bandwidth; kept in {path})")
        path.parent.mkdir(parents=True, exist_ok=True)
        calibrate(bandwidth_mbps, path, path.parent / f"calibration_{bandwidth_mbps:g}", horovod_cycle_ms=CYCLE_TIME_MS)
    return path


_WARNED: set = set()  # the links files this process has already said were stale


def stale_links(path: Path, today: Optional[str] = None) -> Optional[str]:
    """One line saying that the links file ``path`` was not calibrated ``today`` (UTC, ISO) on
    this box, or None where it was. The lab's virtual machine changes speed between days: links
    calibrated five days before a campaign priced its loopback points up to 17 points off
    (``docs/validation/parallel.md``, campaign F), so a kept calibration is named, not trusted."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return f"warning: {path}: unreadable; delete it to calibrate again"
    when = doc.get("calibrated") if isinstance(doc, dict) else None
    today = today or calibration_day()
    if not isinstance(when, dict) or "date" not in when:
        return (f"warning: {path} carries no calibration date (written before 2026-12-03): the box's speed "
                f"drifts between days; delete it to calibrate again")
    if str(when["date"]) != today:
        return (f"warning: {path} was calibrated on {when['date']}, not today: the box's speed drifts between "
                f"days; delete it to calibrate again")
    return None


def predict(trace: Path, links_file: Path, machines: int, gpus: int, bandwidth_mbps: float, framework: str,
            batch_sizes: Optional[tuple[int, int]] = None, profiler_overhead: str = "remove"):
    """The predicted iteration (ms), its 90 % interval (low, high) and what the prediction removed
    as profiler overhead (``profiler_overhead="keep"``: predicted from the profiled times as they are)."""
    scenario = validation_scenario(trace, links_file, machines, gpus, bandwidth_mbps, framework, batch_sizes,
                                   profiler_overhead)
    prediction = run_pipeline(scenario.request())
    row = prediction.results.iloc[0]
    interval = (float(row["iteration_ms_low"]), float(row["iteration_ms_high"]))
    return float(row["iteration_ms"]), interval, prediction.profiler_overhead


def validation_scenario(trace: Path, links_file: Path, machines: int, gpus: int, bandwidth_mbps: float,
                        framework: str, batch_sizes: Optional[tuple[int, int]] = None,
                        profiler_overhead: str = "remove") -> Scenario:
    """The scenario a validation point is predicted with: the capture on the calibrated links,
    with the framework settings the real run uses."""
    doc = {
        "trace": str(trace),
        "cluster": {
            "machines": machines,
            "gpus_per_machine": gpus,
            "links": str(links_file),
            "inter_node": {"bandwidth": f"{bandwidth_mbps:g}Mbps"},
        },
        "framework": framework,
        "policy": "fifo",
        "framework_options": {"fusion_buffer": f"{FUSION_BUFFER_BYTES}B", "cycle_time": f"{CYCLE_TIME_MS:g}ms"},
        "profiler_overhead": profiler_overhead,
    }
    if batch_sizes is not None:
        doc["batch_size"] = {"from": batch_sizes[0], "to": batch_sizes[1]}
    return Scenario.from_dict(doc, name=f"the validation of {trace} at {machines}x{gpus}")


def measure(model: str, spec: LabSpec, framework: str, out: Path, steps: int = 20, warmup: int = 5,
            batch_size: Optional[int] = None, allocator: Optional[dict] = None, options: Sequence[str] = ()) -> dict:
    """The real run: every worker's iteration times, median after warm-up (``options``: more
    arguments of ``examples/run_distributed.py``, a parallel family's settings)."""
    report = out / "report.json"
    argv = [
        sys.executable, str(_examples() / "run_distributed.py"), "--model", model,
        "--framework", framework if spec.workers > 1 else "single",
        "--steps", str(steps), "--warmup", str(warmup), "--threads", str(spec.threads_per_worker),
        "--json", str(report),
    ] + ([] if batch_size is None else ["--batch-size", str(batch_size)]) + list(options)
    horovod = {"HOROVOD_FUSION_THRESHOLD": str(FUSION_BUFFER_BYTES), "HOROVOD_CYCLE_TIME": f"{CYCLE_TIME_MS:g}"}
    result = run_job(spec, framework, argv, out, timeout_s=1800, env={**horovod, **(allocator or {})})
    if any(result.exit_codes):
        raise LabError(f"the real run failed (exit codes {result.exit_codes}); logs in {out}")
    return json.loads(report.read_text())


def validate(
    model: str, machines: int, gpus: int, bandwidth_mbps: float, framework: str, work: Path,
    latency_ms: float = 0.0, steps: int = 20, batch_size: Optional[int] = None, predict_from: Optional[int] = None,
    repeats: int = 3, steady_allocator: bool = False,
) -> ValidationPoint:
    """One point: capture 1x1 (at ``predict_from`` when given, else at ``batch_size``), predict
    ``machines`` x ``gpus`` at ``batch_size``, run it for real ``repeats`` times at ``batch_size``,
    compare the prediction with the median run."""
    if model not in MODELS:
        raise LabError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    for option, value in (("--repeats", repeats), ("--steps", steps), ("--batch-size", batch_size),
                          ("--predict-from", predict_from)):
        if value is not None and value < 1:
            raise LabError(f"{option} must be at least 1, not {value}")
    work = work.resolve()  # the prediction's scenario names the capture and links by absolute path
    if predict_from is not None and batch_size is None:
        raise LabError("--predict-from B0 needs --batch-size B: the batch size to predict and run at")
    captured_at = predict_from if predict_from is not None else batch_size
    allocator = STEADY_ALLOCATOR if steady_allocator else None
    spec = LabSpec(machines, gpus, bandwidth_mbps, latency_ms)
    check_can_run(spec)  # a latency without sch_netem, or too many machines: before minutes of captures
    trace = capture(model, work, batch_size=captured_at, allocator=allocator)
    links_file = links(bandwidth_mbps, work)
    changed = (predict_from, batch_size) if predict_from is not None and predict_from != batch_size else None
    progress(f"predicting {model} at {machines}x{gpus}")
    predicted_ms, interval, overhead = predict(trace, links_file, machines, gpus, bandwidth_mbps, framework, changed)
    with_profiler_ms, _, _ = predict(trace, links_file, machines, gpus, bandwidth_mbps, framework, changed, "keep")
    batch = "" if batch_size is None else f"_batch{batch_size}"
    run_dir = work / "runs" / f"{model}_{framework}_{machines}x{gpus}_{bandwidth_mbps:g}mbps{batch}"
    reports = []
    for r in range(repeats):
        progress(f"running {model} for real on {machines}x{gpus} with {framework}, run {r + 1} of {repeats}")
        reports.append(measure(model, spec, framework, run_dir / f"run{r}", steps=steps, batch_size=batch_size,
                               allocator=allocator))
    runs_ms = [float(report["median_ms"]) for report in reports]
    measured_ms = statistics.median(runs_ms)
    median_run = min(reports, key=lambda report: abs(float(report["median_ms"]) - measured_ms))
    worker0 = median_run.get("workers", [{}])[0]
    captured = read_bundle(trace)
    return ValidationPoint(
        model, machines, gpus, bandwidth_mbps, latency_ms, framework, measured_ms, predicted_ms,
        100.0 * (predicted_ms - measured_ms) / measured_ms,
        with_profiler_ms,
        overhead.profiled_ms if overhead else float("nan"), overhead.unprofiled_ms if overhead else float("nan"),
        batch_size, predict_from,
        [float(w["median_ms"]) for w in median_run.get("workers", [])],
        runs_ms,
        _median_or_nan(captured.unprofiled_page_faults),
        100.0 * plain_step_spread(captured.unprofiled_step_ms),
        float(worker0.get("page_faults_per_step", float("nan"))),
        worker0.get("phase_wall_ms", {}),
        worker0.get("phase_cpu_ms", {}),
        float(worker0.get("other_threads_cpu_ms_per_step", float("nan"))),
        _captures_plain_ms(trace),
        *interval,
    )


def _captures_plain_ms(bundle: Path) -> list:
    record = captures_record(bundle)
    return json.loads(record.read_text()) if record.exists() else []


def _median_or_nan(values: list) -> float:
    return float(statistics.median(values)) if values else float("nan")


def as_record(point: ValidationPoint) -> dict:
    return asdict(point)
