"""``whatif advise``: what a user could do to a job, ranked by the throughput each would gain.

The options are the optimization library (``sim/passes/registry.py``: Daydream's recipes, each
applied alone on top of the job as it is) and, with a scenario, its alternatives: every other
configuration of its grid (bandwidths, machines and GPUs, frameworks, policies, parallelism)
and every framework and policy on the first configuration's cluster. The first configuration of
the grid is the job as it is (the baseline); without a scenario, the traced job on one worker.

Every option goes through the one pipeline (``whatif/pipeline.py``), on one study of the trace.
Its gain is in throughput, samples per second against the baseline's. On a cluster a
configuration's ``speedup`` is its throughput over one worker's *of its own prediction*, so the
throughput is ``speedup / one_worker_ms`` and the gain ``(speedup_option / one_worker_ms_option)
/ (speedup_baseline / one_worker_ms_baseline) - 1``: an alternative configuration shares the
baseline's worker (the ratio of speed-ups), a recipe changes it (mixed precision on eight
workers is compared with the eight workers as they are, not with its own one worker). On one
worker, the iteration times' ratio. A recipe that does not apply to the trace (no batch normalization, no
communication) is listed as not applicable with the pass's reason, never left out.

Each option's reason is one line from the baseline's critical paths (``sim/critical_path.py``):
the share of the paths in what the option changes (the data loading, the GPU's kernels, the
exposed communication, ...), and how long the GPU idles over them, e.g. "37 % of the step's
critical path is data loading (the GPU is idle 69 % of the step): no-dataloader gains 27.7 %".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from whatif.collectors.diagnostics import Diagnostics, collecting
from whatif.report.critical_path import gpu_idle_fraction
from whatif.report.iterations import iteration_report
from whatif.sim.critical_path import CriticalPath, iteration_critical_paths
from whatif.sim.distributed import POLICIES, ClusterConfig
from whatif.sim.frameworks import FRAMEWORKS
from whatif.sim.graph import GPU_TASK_KINDS, GraphError, TaskGraph, TaskKind
from whatif.sim.passes.optimizations import DATA_LOADING, OPTIMIZER_STEP
from whatif.sim.passes.recipes import MemorySaved
from whatif.sim.passes.registry import OPTIMIZATIONS
from whatif.topology import TopologyError, as_gbps

from .pipeline import Prediction, Request, WhatIf, predict, same_graph
from .scenario import Scenario
from .study import TraceStudy

#: The recipes as advise tries them (a value where the name needs one). A faster host CPU is
#: not among them: a next GPU generation is a purchase, a host twice as fast rarely is; ask for
#: it with ``--optimization faster-cpu=K``.
RECIPES = tuple("faster-gpu=2" if name == "faster-gpu" else name for name in OPTIMIZATIONS if name != "faster-cpu")
_COMM = "communication"
_GPU = "GPU kernels"
#: a target pattern that starts with this counts only the GPU kernels it matches
_KERNELS = "kernels: "
#: what each recipe changes on the critical path: a phrase, and the tasks (a pattern of the tasks
#: it changes, or kinds of path time)
TARGETS: dict[str, tuple[str, Union[str, tuple]]] = {
    "amp": (_GPU, ("gpu",)),
    "faster-gpu": (_GPU, ("gpu",)),
    "fused-optimizer": ("the optimizer step", OPTIMIZER_STEP),
    "no-dataloader": ("data loading", DATA_LOADING),
    "restructure-bn": ("batch normalization and ReLU kernels", _KERNELS + r"(?:batch_norm|aten::relu|clamp_min|threshold_backward)"),
    "metaflow-fusion": ("kernels of convolutions, GEMMs and their element-wise epilogues",
                        _KERNELS + r"(?:convolution|aten::(?:addmm|mm|linear|relu|add|clamp_min))"),
    "gist": ("GPU kernels (its encode and decode kernels join them)", ("gpu",)),
    "vdnn": ("GPU kernels (its copies over PCIe wait beside them)", ("gpu",)),
    "gradient-compression": (_COMM, (_COMM,)),
    "blueconnect": (_COMM, (_COMM,)),
}
#: the tasks a recipe adds, by name, and what they are: their share of the option's own
#: critical path says what a recipe that adds work costs
ADDED = {
    "gist": (r"^gist ", "its encode and decode kernels"),
    "vdnn": (r"^vdnn ", "its copies over PCIe"),
    "gradient-compression": (r"^gradient compression ", "its encode and decode kernels"),
}


@dataclass
class Option:
    """One thing the user could do, and what the prediction says of it."""

    name: str
    kind: str  # "recipe" or "alternative"
    applicable: bool
    reason: str  # the critical path's one line; where not applicable, why
    predicted_ms: float = math.nan
    gain_pct: float = math.nan  # throughput over the baseline's, in percent
    low_ms: float = math.nan  # the prediction's 90 % interval (report/intervals.py); nan: none
    high_ms: float = math.nan
    memory_saved_mb: float = math.nan  # per iteration, a memory recipe's
    configuration: dict = field(default_factory=dict)  # an alternative's (or the baseline's) cluster row


@dataclass
class Advice:
    trace: str
    scenario: Optional[str]
    baseline: Option
    options: list[Option]  # ranked, the best first; then those not applicable

    @property
    def ranked(self) -> list[Option]:
        return [o for o in self.options if o.applicable]

    @property
    def not_applicable(self) -> list[Option]:
        return [o for o in self.options if not o.applicable]


def advise(trace: Union[str, Path], scenario: Optional[Scenario] = None, iteration: Optional[str] = None,
           progress: Callable[[str], None] = lambda text: None, recipes: Sequence[str] = RECIPES,
           every_framework: bool = True) -> Advice:
    """Every option for the job of ``trace`` (on ``scenario``'s first configuration, where one is
    given), predicted and ranked: the ``recipes``, and the scenario's alternatives (its grid, and
    with ``every_framework`` every framework and policy on its first cluster)."""
    if scenario is not None and iteration is None:
        iteration = scenario.iteration
    study = TraceStudy.from_trace(trace, iteration)
    request = replace(scenario.request(), trace=study, iteration=None) if scenario is not None else Request(study)
    clusters = list(request.clusters)
    base_request = replace(request, clusters=clusters[:1])
    base = predict(base_request)
    baseline = _baseline_option(base)
    paths, schedule_graph, idle = _critical_paths(base)
    options = []
    for spec in recipes:
        progress(f"predicting {spec}")
        what_if = WhatIf(optimizations=list(request.what_if.optimizations) + [spec])
        try:
            with collecting(Diagnostics()):  # the option's row says what it changes; the input's warnings came above
                changed = predict(replace(base_request, what_if=what_if))
        except GraphError as err:
            options.append(Option(spec, "recipe", False, str(err)))
            continue
        if same_graph(base.worker, changed.worker):  # amp or faster-gpu on a CPU worker's trace: nothing to rank
            options.append(Option(spec, "recipe", False, f"{spec}: changes no task of this trace"
                                  + ("" if study.graph.workload.has_gpu else " (it has no GPU)")))
            continue
        option = _measured(spec, "recipe", changed, baseline)
        option.memory_saved_mb = _memory_saved_mb(changed.worker, len(study.iterations))
        option.reason = _reason(spec, option, paths, schedule_graph, idle, base) + _added_cost(spec, changed)
        options.append(option)
    if clusters:
        for config in _alternatives(clusters, every_framework):
            name = _config_name(config)
            progress(f"predicting {name}")
            try:
                changed = predict(replace(request, clusters=[config]))
            except (GraphError, TopologyError, ValueError) as err:
                options.append(Option(name, "alternative", False, str(err)))
                continue
            option = _measured(name, "alternative", changed, baseline)
            option.reason = _reason(name, option, paths, schedule_graph, idle, base) + memory_note(option, baseline)
            options.append(option)
    # an alternative that cannot run for want of GPU memory ranks after everything else (the
    # recipes keep their place: the memory count does not follow what they change)
    ranked = sorted((o for o in options if o.applicable),
                    key=lambda o: (o.kind == "alternative" and _fits(o) is False, -o.gain_pct))
    return Advice(str(trace), None if scenario is None else scenario.name, baseline,
                  ranked + [o for o in options if not o.applicable])


def _baseline_option(base: Prediction) -> Option:
    if base.results is None:
        return Option("as traced (one worker)", "baseline", True, "", base.iteration_ms, 0.0, *base.iteration_interval)
    row = base.results.iloc[0].to_dict()
    label = next(iter(base.runs))
    return Option(label, "baseline", True, "", float(row["iteration_ms"]), 0.0, *_row_interval(row),
                  configuration={**_plain(row), "one_worker_ms": base.iteration_ms})


def _measured(name: str, kind: str, changed: Prediction, baseline: Option) -> Option:
    """The option's iteration, its interval and its throughput gain over the baseline's."""
    if changed.results is None:
        ms = changed.iteration_ms
        return Option(name, kind, True, "", ms, 100.0 * (baseline.predicted_ms / ms - 1), *changed.iteration_interval)
    row = changed.results.iloc[0].to_dict()
    base_throughput = baseline.configuration["speedup"] / baseline.configuration["one_worker_ms"]
    gain = 100.0 * (float(row["speedup"]) / changed.iteration_ms / base_throughput - 1)
    return Option(name, kind, True, "", float(row["iteration_ms"]), gain, *_row_interval(row),
                  configuration=_plain(row))


def _fits(option: Option) -> Optional[bool]:
    """Whether an option's (or the baseline's) configuration fits its GPUs' memory; None where
    no memory was counted (no ``parallelism`` block) or the GPUs' is unknown."""
    fits = option.configuration.get("fits")
    return {"yes": True, "no": False}.get(fits) if isinstance(fits, str) else None


def memory_note(option: Option, baseline: Option) -> str:
    """`` 55.9 GB a GPU (does not fit)``, or `` 55.9 -> 54.0 GB a GPU`` where it differs from the
    baseline's: an option's memory as a reason says it ('' where none was counted)."""
    gb, base_gb = option.configuration.get("memory_gb"), baseline.configuration.get("memory_gb")
    if not isinstance(gb, (int, float)) or not math.isfinite(gb):
        return ""
    said = f"{gb:.1f} GB a GPU"
    if isinstance(base_gb, (int, float)) and math.isfinite(base_gb) and option is not baseline and abs(gb - base_gb) >= 0.05:
        said = f"{base_gb:.1f} -> {said}"
    return f"; {said}" + (" (does not fit)" if _fits(option) is False else "")


def _row_interval(row: dict) -> tuple[float, float]:
    return float(row.get("iteration_ms_low", math.nan)), float(row.get("iteration_ms_high", math.nan))


def _plain(row: dict) -> dict:
    keep = ("machines", "gpus_per_machine", "workers", "inter_node_gbps", "framework", "policy", "parallelism",
            "iteration_ms", "speedup", "exposed_comm_ms", "bubble_ms", "memory_gb", "fits")
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()
            if k in keep or (k.startswith("exposed_") and k.endswith("_ms"))}


#: A parallel step's parts that are not compute, as the reason names them (``_step_parts``).
_PARTS = {"bubble_ms": "pipeline bubble"}
_REPLICAS = re.compile(r"\bdp(\d+)\b")


def _replicas(configuration: dict) -> Optional[int]:
    """How many replicas of the model a configuration trains (its ``dpN``; plain data
    parallelism: every worker), which its throughput goes with."""
    found = _REPLICAS.search(str(configuration.get("parallelism") or ""))
    workers = configuration.get("workers")
    return int(found.group(1)) if found else (int(workers) if workers is not None else None)


def _step_parts(configuration: dict) -> str:
    """The largest parts of a configuration's step that are not compute (exposed communication
    by dimension, the pipeline's bubble), each at least 1 % of it, largest first: at most three."""
    step = float(configuration.get("iteration_ms") or math.nan)
    parts = []
    for key, value in configuration.items():
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value) or key == "exposed_comm_ms":
            continue
        if key in _PARTS:
            parts.append((float(value), _PARTS[key]))
        elif key.startswith("exposed_") and key.endswith("_ms"):
            parts.append((float(value), f"exposed {key[len('exposed_'):-len('_ms')]} communication"))
    shown = sorted((p for p in parts if math.isfinite(step) and p[0] >= 0.01 * step), reverse=True)[:3]
    return ", ".join(f"{ms:.1f} ms {what}" for ms, what in shown)


def _alternatives(clusters: list[ClusterConfig], every_framework: bool = True) -> list[ClusterConfig]:
    """The grid's other configurations, then (``every_framework``) every framework and policy on
    the first one's cluster that the grid does not have already."""
    first = clusters[0]
    seen = {_config_name(first)}
    found = []
    extra = [replace(first, framework=f, policy=p) for f in FRAMEWORKS for p in POLICIES] if every_framework else []
    for config in clusters[1:] + (extra if first.workers > 1 and first.parallelism is None else []):
        name = _config_name(config)
        if name not in seen:
            seen.add(name)
            found.append(config)
    return found


def _config_name(config: ClusterConfig) -> str:
    cluster = config.cluster
    name = (f"{cluster.machines}x{cluster.gpus_per_machine} {as_gbps(cluster.inter_node.bandwidth_bytes_per_us):g}Gbps "
            f"{config.framework} {config.policy}")
    return name + (f" {config.parallelism.describe()}" if config.parallelism is not None else "")


def _memory_saved_mb(worker: TaskGraph, iterations: int) -> float:
    note = worker.last_note(MemorySaved)
    if note is None or not np.isfinite(note.nbytes):
        return math.nan
    return note.nbytes / max(iterations, 1) / 1e6


# -- reasons ---------------------------------------------------------------------------------------


def _critical_paths(base: Prediction) -> tuple[list[CriticalPath], TaskGraph, float]:
    """The baseline's iterations' critical paths (worker 0's on a cluster), its graph, and the
    share of the steps in which its GPU idles (nan: no GPU)."""
    iterations = base.study.iterations
    if base.runs:
        run = next(iter(base.runs.values()))
        schedule, report = run.schedule, iteration_report(run.schedule, iterations, run.worker0)
    else:
        schedule, report = base.schedule, base.report
    spans = report.assign(thread=iterations["thread"].to_numpy())
    spans = spans[spans["predicted_ms"].notna()]
    paths = iteration_critical_paths(schedule, spans)
    on_gpu = np.isin(schedule.graph.tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    comm_only = on_gpu & (schedule.graph.tasks["kind"].to_numpy() == int(TaskKind.COMM))
    idle = (float(np.nanmean([gpu_idle_fraction(schedule, p.start_us, p.end_us) for p in paths]))
            if (on_gpu & ~comm_only).any() and paths else math.nan)
    return paths, schedule.graph, idle


def _share(paths: list[CriticalPath], graph: TaskGraph, target: Union[str, tuple]) -> float:
    """The share of the paths' time that is ``target``: a pattern of tasks, or path kinds."""
    total = sum(p.end_us - p.start_us for p in paths)
    if total <= 0:
        return 0.0
    if isinstance(target, tuple):
        return float(sum(p.by_kind()[list(target)].sum() for p in paths)) / total
    if target.startswith(_KERNELS):
        mask = graph.match(target[len(_KERNELS):]) & (graph.tasks["kind"].to_numpy() == int(TaskKind.KERNEL))
    else:
        mask = graph.match(target)
    spent = 0.0
    for p in paths:
        steps = p.steps[p.steps["task"] >= 0]
        spent += float(steps["duration_us"].to_numpy()[mask[steps["task"].to_numpy()]].sum())
    return spent / total


def _added_cost(spec: str, changed: Prediction) -> str:
    """For a recipe that adds tasks, their share of the changed job's own critical path."""
    recipe = spec.partition("=")[0]
    if recipe not in ADDED:
        return ""
    pattern, what = ADDED[recipe]
    paths, graph, _ = _critical_paths(changed)
    if not sum(p.end_us - p.start_us for p in paths) > 0:
        return ""
    return f" ({what} are {100 * _share(paths, graph, pattern):.0f} % of its critical path)"


def _scale_change(configuration: dict, base_row: dict) -> str:
    """`` (512 workers instead of 64, 256 model replicas instead of 64)``: what sets an
    alternative's throughput apart from the baseline's besides its step ('' where nothing)."""
    said = []
    workers, base_workers = configuration.get("workers"), base_row.get("workers")
    if workers is not None and base_workers is not None and int(workers) != int(base_workers):
        said.append(f"{int(workers)} workers instead of {int(base_workers)}")
    replicas, base_replicas = _replicas(configuration), _replicas(base_row)
    if (replicas is not None and base_replicas is not None and replicas != base_replicas
            and (workers is None or base_workers is None or replicas * int(base_workers) != base_replicas * int(workers))):
        said.append(f"{replicas} model replicas instead of {base_replicas}")
    return f" ({', '.join(said)})" if said else ""


def _reason(name: str, option: Option, paths: list, graph: TaskGraph, idle: float, base: Prediction) -> str:
    """One line: what share of the baseline's critical path the option changes, and its gain."""
    recipe = name.partition("=")[0]
    what, target = TARGETS.get(recipe, (_COMM, (_COMM,)))
    gains = f"{name} {'gains' if option.gain_pct >= 0 else 'loses'} {abs(option.gain_pct):.1f} %"
    if option.kind == "alternative":
        gains += _scale_change(option.configuration, base.results.iloc[0].to_dict())
        parts = _step_parts(option.configuration)
        if parts:
            gains += f"; of its {option.predicted_ms:.1f} ms step: {parts}"
    if not paths:
        return gains
    share = _share(paths, graph, target)
    gpu = f" (the GPU is idle {100 * idle:.0f} % of the step)" if np.isfinite(idle) else ""
    return f"{100 * share:.0f} % of the step's critical path is {what}{gpu}: {gains}"
