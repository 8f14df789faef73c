"""What-if scenarios in YAML: a trace, a cluster (or a grid of clusters), a framework and a policy.

A scenario file looks like::

    trace: ../data/convnet_cpu.pt.trace.json.gz      # relative to this file; or a bundle folder
    iteration: ProfilerStep#.*                        # optional, default ProfilerStep#N
    cluster:
      machines: [1, 2, 3, 4]
      gpus_per_machine: [1, 2]
      intra_node: nvlink2                             # preset or {bandwidth, latency, efficiency}
      inter_node: {bandwidth: [10Gbps, 20Gbps, 40Gbps], latency: 5us}
      links: lab-topology.yaml                        # optional: links from whatif lab calibrate
      shared_memory: {among: machine, core_bandwidth: 40GB/s, total_bandwidth: 60GB/s}  # CPU workers only
    framework: horovod                                # horovod | ddp | ps, or a list
    policy: fifo                                      # fifo | p3, or a list
    collective: ring                                  # the all-reduce: ring | hierarchical (NCCL: ring | tree | ...)
    optimizations: [amp]                              # any of whatif simulate's
    gradients: {total: 100MB}                         # or {sizes: [..]}; default: from the trace
    stragglers: [{machine: 1, slowdown: 1.5}]         # or gpu_slowdown
    gpu_variation: {sigma: 0.05, seed: 0}             # each GPU's GPU tasks x exp(N(0, sigma)), drawn per GPU
    network: auto                                     # closed_form | shared_links (see sim.distributed)
    profiler_overhead: remove                         # keep: predict from the profiled times as they are
    batch_size: {from: 32, to: 64}                    # or just 64 (traced at the bundle's batch size)
    perfmodel: models.json                            # operator models for batch_size (default: perfmodel fit --cache)
    framework_options: {fusion_buffer: 64MB, cycle_time: 5ms, bucket_cap: 25MB,
                        first_bucket: 1MB, partition: 4MB, slice: 1MB}
    parallelism:                                      # optional: a parallel job (sim/parallel/)
      data: 4                                         # default: the GPUs left by tensor x pipeline
      zero: 3                                         # 0 (DDP) | 1 | 2 | 3, or fsdp: true (= zero 3)
      tensor: 2
      sequence_parallel: true
      pipeline: {stages: 2, microbatches: 8, schedule: 1f1b, virtual_stages: 1, partition: balanced,
                 microbatch_trace: mb.bundle}       # optional: the model traced at one microbatch
      expert: 2                                       # carved out of the data ranks
      recompute: selective                            # none | selective | full
      placement: [tensor, data, pipeline]             # fastest-varying first
      units: 'blocks\\.\\d+'                          # how to find the repeated blocks
      optimizer: adam                                 # for the memory per GPU: adam | adamw | sgd | sgd-plain
      gpu_memory: 80GB                                # default: the fabric's GPU's

This module knows the scenario's own keys (the top level, ``gradients``, ``stragglers``,
``batch_size``) and nothing else: the cluster block is whatever ``topology.Cluster.from_config``
takes (less ``links``, a file this module reads relative to the scenario; and one machine of one
GPU where ``machines`` or ``gpus_per_machine`` is left out), the collectives are topology's
all-reduce algorithms, and frameworks, their options, policies and optimizations are the
registries of ``sim/``.

The grid. A list makes a grid axis in three places: ``framework`` and ``policy``, every key of
``parallelism`` (but ``optimizer`` and ``gpu_memory``; for ``placement`` and
``pipeline.partition``, which take a list, a list of lists), and anywhere in
the cluster block, at any depth (``machines: [1, 2]``, ``inter_node: [10gbe, 40gbe]``,
``inter_node: {bandwidth: [10Gbps, 40Gbps]}``), since a cluster takes no list as a value; a
list's items are taken as written. The scenario is every combination of its axes, the first
varying slowest: a GPU fabric's own keys where they hold lists (``machine: [dgx_h100,
dgx_b200]``, ``nics_per_machine``, ``nccl: {algorithm: [ring, tree]}``, ..., each fabric filled
from its preset on its own), ``machines``, ``gpus_per_machine``, the cluster's other axes in the
order the file writes them, then ``framework``, ``policy`` and the parallelism's axes. Every
mistake is reported as one line naming the file and the key.

With ``parallelism`` the framework defaults to ``ddp``: plain data parallelism (``zero: 0`` and
no other family) is the data-parallel cluster simulation, the others are a parallel job
(``sim/parallel/job.py``); ``data x tensor x pipeline`` must be the cluster's GPUs.
"""

from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np


from whatif.collectors.bundle import is_bundle
from whatif.collectors.diagnostics import plural, warn
from whatif.collectors.ranks import folder_traces, is_job, one_trace
from whatif.sim.distributed import POLICIES, ClusterConfig, Straggler
from whatif.sim.frameworks import FRAMEWORKS, FrameworkOptions
from whatif.sim.graph import GraphError
from whatif.sim.parallel import Parallelism, is_parallel_job
from whatif.sim.parallel.memory import OPTIMIZER_STATE_BYTES
from whatif.sim.passes.registry import OPTIMIZATIONS, optimization_name, parse_optimization
from whatif.topology import CLUSTER_KEYS, Cluster, TopologyError, as_gbps, collective_cost, parse_size, with_fabric_links
from whatif.topology.fabric import FABRIC_KEYS, wants_fabric
from whatif.topology.units import parse_latency
from whatif.topology.yamlfile import read_yaml, with_cluster_file

from .pipeline import Request, WhatIf

_TOP_KEYS = (
    "trace", "iteration", "cluster", "framework", "policy", "collective", "optimizations",
    "gradients", "stragglers", "gpu_variation", "framework_options", "replicate", "network", "profiler_overhead", "batch_size",
    "perfmodel", "name", "description", "parallelism",
)
#: What a scenario's cluster block leaves out: one machine of one GPU.
_CLUSTER_DEFAULTS = {"machines": 1, "gpus_per_machine": 1}
_GRID_KEYS = ("cluster", "framework", "policy", "parallelism")
_PARALLELISM_KEYS = ("data", "fsdp", "zero", "reshard_after_forward", "fsdp_dispatch", "tensor", "sequence_parallel",
                     "sequence_parallel_grads", "tensor_dispatch", "pipeline", "expert", "recompute", "placement",
                     "units", "optimizer", "gpu_memory")
_PIPELINE_KEYS = ("stages", "microbatches", "schedule", "virtual_stages", "partition", "microbatch_trace")
#: parallelism keys that take a list as one value: a grid over them is a list of lists
_LIST_VALUED = ("placement", "pipeline.partition")


class ScenarioError(Exception):
    """A scenario that cannot be used: ``str`` is ``FILE: KEY: problem``."""

    def __init__(self, path, key: str, message: str):
        self.path, self.key = str(path), key
        super().__init__(f"{path}: {key}: {message}" if key else f"{path}: {message}")


@dataclass
class ScenarioPoint:
    """One configuration of the grid."""

    cluster: Cluster
    framework: str
    policy: str
    inter_node_gbps: float
    parallelism: Optional[Parallelism] = None
    calibrations: list = field(default_factory=list)  # the cluster as each calibration run measured its links


@dataclass
class Scenario:
    name: str  # the file's path, or what Scenario.from_dict was told to call it: errors begin with it
    trace: Path
    iteration: Optional[str]
    points: list[ScenarioPoint]
    collective: Optional[str] = None  # None: the cluster's backend chooses (ring on the link models, NCCL's choice)
    optimizations: list = field(default_factory=list)
    gradient_sizes: Optional[list] = None
    gradient_total: Optional[float] = None
    stragglers: list = field(default_factory=list)
    gpu_variation: Optional[tuple] = None  # (sigma, seed): each GPU's slowdown exp(N(0, sigma))
    options: FrameworkOptions = field(default_factory=FrameworkOptions)
    replicate: Optional[bool] = None
    shared_links: Optional[bool] = None
    remove_profiler_overhead: bool = True  # where the trace is a bundle that timed unprofiled steps
    batch_size: Optional[int] = None  # predict at this batch size (sim/passes/batch_size.py)
    traced_batch_size: Optional[int] = None  # the trace's (None: the bundle's, else inferred)
    perfmodel: Optional[Path] = None
    optimizer: str = "adam"  # the memory count's (parallelism.optimizer)
    gpu_memory: Optional[float] = None  # bytes (parallelism.gpu_memory); None: the fabric GPU's
    microbatch_trace: Optional[Path] = None  # parallelism.pipeline.microbatch_trace
    job_traces: list = field(default_factory=list)  # a multi-rank job's traces (a folder, or a list): whatif/jobs.py

    @classmethod
    def from_file(cls, path) -> "Scenario":
        """Parse and validate a scenario file (YAML loaded safely); relative paths in it are
        relative to the file."""
        path = Path(path)
        doc = _load_yaml(path, path, "")
        return cls.from_dict(doc, base_dir=path.parent, name=str(path))

    @classmethod
    def from_dict(cls, doc: Any, base_dir=".", name: str = "scenario") -> "Scenario":
        """Validate a scenario given as the mapping its YAML would load to; relative paths in it
        are relative to ``base_dir``, and errors begin with ``name``."""
        return _parse(doc, Path(base_dir), name)

    def request(self) -> Request:
        """What the scenario asks of the prediction pipeline (``whatif/pipeline.py``)."""
        configs = [
            ClusterConfig(
                cluster=point.cluster,
                framework=point.framework,
                policy=point.policy,
                algorithm=self.collective,
                options=self.options,
                stragglers=[s for s in self.stragglers if s.machine < point.cluster.machines],
                gpu_slowdowns=gpu_slowdowns(self.gpu_variation, point.cluster.n_gpus),
                replicate=self.replicate,
                shared_links=self.shared_links,
                parallelism=point.parallelism,
                calibrations=point.calibrations,
            )
            for point in self.points
        ]
        return Request(
            trace=self.trace,
            iteration=self.iteration,
            remove_profiler_overhead=self.remove_profiler_overhead,
            batch_size=self.batch_size,
            traced_batch_size=self.traced_batch_size,
            perfmodel=self.perfmodel,
            what_if=WhatIf(optimizations=list(self.optimizations)),
            clusters=configs,
            gradient_sizes=self.gradient_sizes,
            gradient_total=self.gradient_total,
            optimizer=self.optimizer,
            gpu_memory_bytes=self.gpu_memory,
            microbatch_trace=self.microbatch_trace,
        )


#: The most GPUs one machine may have: the largest NVLink domain sold as one (GB200 NVL72); the
#: machine presets have 8.
MAX_GPUS_PER_MACHINE = 72
#: The most clusters a grid may have, and GPUs a cluster (the CLI asks for --yes well before)
MAX_GRID_CLUSTERS = 10_000
MAX_CLUSTER_GPUS = 1_000_000
#: The most calibration runs a links file may keep (each is predicted too: its spread widens the interval)
MAX_CALIBRATION_RUNS = 5


def _load_yaml(path: Path, name, key: str) -> Any:
    """A YAML file read within bounds (``topology/yamlfile.py``): the scenario (``key`` "") or
    a file it names (``key`` the scenario's key that names it, ``name`` the scenario)."""
    try:
        return read_yaml(path)
    except TopologyError as err:
        raise ScenarioError(name, key, f"{path}: {err.message}" if key else err.message) from None


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_keys(name: str, mapping: Any, allowed, where: str) -> None:
    if not isinstance(mapping, dict):
        raise ScenarioError(name, where or "", f"expected a mapping, got {type(mapping).__name__}")
    for key in mapping:
        if key not in allowed:
            home = _home_of(str(key), where)
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = (f"; it belongs under {home}" if home else f"; did you mean {close[0]!r}?" if close else "")
            raise ScenarioError(name, f"{where}.{key}" if where else str(key),
                                f"unknown key{hint}; known keys: {', '.join(allowed)}")


def _home_of(key: str, where: str) -> Optional[str]:
    """Where a key misplaced at ``where`` belongs, written as the user would write it there
    (``machines`` at the top: ``cluster:``), or None for a key known in no other block."""
    homes = (("cluster", tuple(k for k in CLUSTER_KEYS if k not in _TOP_KEYS)),  # not name or network: both blocks'
             ("parallelism", _PARALLELISM_KEYS),
             ("parallelism.pipeline", _PIPELINE_KEYS))
    for block, keys in homes:
        if key in keys and block != where:
            if block == "parallelism.pipeline":
                return f"parallelism: {{pipeline: {{stages: N, {key}: ...}}}}"
            return f"{block}: {{{key}: ...}}"
    return None


def _one(name: str, key: str, value, expected: str) -> None:
    """Refuse a list or mapping where ``key`` takes one value."""
    if isinstance(value, (list, tuple, dict)):
        shape = "a mapping" if isinstance(value, dict) else "a list"
        why = (f"{key} takes one value or a list of them" if key in _GRID_KEYS
               else f"{key} is not a grid axis (lists make a grid in {', '.join(_GRID_KEYS)})")
        raise ScenarioError(name, key, f"expected {expected}, got {shape} {value!r}: {why}")


def _choice(name: str, key: str, value, allowed) -> str:
    _one(name, key, value, f"one of {', '.join(allowed)}")
    text = str(value).strip().lower()
    if text not in allowed:
        close = difflib.get_close_matches(text, list(allowed), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ScenarioError(name, key, f"unknown value {value!r}{hint} (choose from {', '.join(allowed)})")
    return text


def _collective(name: str, value) -> Optional[str]:
    """The all-reduce algorithm the scenario asks for (None: the backend's choice); each
    cluster's backend checks the name (``ring`` or ``hierarchical`` on the link models,
    NCCL_ALGO's names on a fabric)."""
    if value is None:
        return None
    _one(name, "collective", value, "one all-reduce algorithm")
    return str(value).strip().lower()


#: What a scenario of a multi-rank job may say: the job's framework, parallelism and gradients
#: are in its traces, so the what-ifs are its cluster (each rank on a GPU) and optimizations.
JOB_KEYS = ("name", "description", "trace", "iteration", "cluster", "optimizations")


def _job_traces(name: str, base_dir: Path, doc: dict) -> list:
    """A multi-rank job's traces, where ``trace`` names several files or a folder that is no
    capture bundle (``collectors/ranks.py`` reads them); [] for one trace."""
    value = doc["trace"]
    paths = [_path(base_dir, v) for v in value] if isinstance(value, list) else [_path(base_dir, value)]
    if not paths:
        raise ScenarioError(name, "trace", "an empty list names no trace")
    if not is_job(paths):
        return []
    for i, path in enumerate(paths):
        if not path.exists():
            raise ScenarioError(name, f"trace[{i}]" if len(paths) > 1 else "trace", f"no such file: {path}")
    if len(paths) == 1:  # a folder: said first, where it cannot be a job, whatever the other keys are
        found = folder_traces(paths[0])
        if len(found) == 1:
            raise ScenarioError(name, "trace", f"{paths[0]} {one_trace(found[0].name)}")
        if not found:
            raise ScenarioError(name, "trace", f"{paths[0]} holds no trace (no .json or .json.gz file, no capture "
                                               "bundle) and is no capture bundle itself (no bundle.json)")
    extra = [key for key in doc if key not in JOB_KEYS]
    if extra:
        raise ScenarioError(name, extra[0], "not for a multi-rank job's traces, which hold its framework, "
                                            f"parallelism and gradients; a job's scenario takes {', '.join(JOB_KEYS)}")
    return paths


def _path(base_dir: Path, value) -> Path:
    given = Path(str(value))
    return given if given.is_absolute() else base_dir / given


def _parse(doc: Any, base_dir: Path, name: str) -> Scenario:
    _check_keys(name, doc, _TOP_KEYS, "")
    for required in ("trace", "cluster"):
        if required not in doc:
            raise ScenarioError(name, required, "missing")
    job = _job_traces(name, base_dir, doc)
    trace = job[0] if job else _path(base_dir, doc["trace"])
    if not job and not (trace.is_file() or is_bundle(trace)):
        raise ScenarioError(name, "trace", f"no such file: {trace}")

    try:  # cluster: FILE, or {file: FILE, ...}: a cluster file (whatif calibrate nccl-tests --out)
        block = with_cluster_file(doc["cluster"], base_dir)
    except TopologyError as err:
        raise ScenarioError(name, "cluster" if isinstance(doc["cluster"], str) else "cluster.file", err.message) from None
    clusters = _clusters(name, base_dir, block)
    # the same grid on each calibration run's links (a links file from whatif lab calibrate keeps them)
    calibration_runs = range(len(_calibration_runs(name, base_dir, block)))
    runs = [_clusters(name, base_dir, block, run) for run in calibration_runs]
    parallel = _parallelism(name, doc.get("parallelism"))
    default_framework = "horovod" if doc.get("parallelism") is None else "ddp"
    frameworks = [_choice(name, "framework", f, FRAMEWORKS) for f in _as_list(doc.get("framework", default_framework))]
    policies = [_choice(name, "policy", p, POLICIES) for p in _as_list(doc.get("policy", "fifo"))]
    for key, values in (("framework", frameworks), ("policy", policies)):
        if not values:
            raise ScenarioError(name, key, "an empty list leaves nothing to predict")
    points = [
        ScenarioPoint(cluster, framework, policy, as_gbps(cluster.inter_node.bandwidth_bytes_per_us), par,
                      [run[i] for run in runs])
        for i, cluster in enumerate(clusters)
        for framework, policy in itertools.product(frameworks, policies)
        for par in _parallelisms(name, parallel, cluster)
    ]

    scenario = Scenario(
        name=name,
        trace=trace,
        job_traces=job,
        iteration=None if doc.get("iteration") is None else str(doc["iteration"]),
        points=points,
        collective=_collective(name, doc.get("collective")),
        optimizations=[_optimization(name, o) for o in _as_list(doc.get("optimizations") or [])],
    )
    for point in points if scenario.collective is not None else []:
        try:  # the backend's names: ring or hierarchical on the link models, NCCL_ALGO's on a fabric
            collective_cost(point.cluster, "all_reduce", 0.0, algorithm=scenario.collective)
        except TopologyError as err:
            raise ScenarioError(name, "collective", err.message) from None
    _gradients(name, doc.get("gradients"), scenario)
    machines = max(point.cluster.machines for point in points)
    scenario.stragglers = [_straggler(name, i, s, machines) for i, s in enumerate(_as_list(doc.get("stragglers") or []))]
    for i, straggler in enumerate(scenario.stragglers):
        fewer = sum(point.cluster.machines <= straggler.machine for point in points)
        warn(name, fewer, f"stragglers[{i}].machine: machine {straggler.machine} is not in "
                          f"{plural(fewer, 'configuration')} of fewer machines, which run without it")
    scenario.gpu_variation = _gpu_variation(name, doc.get("gpu_variation"))
    scenario.options = _options(name, doc.get("framework_options") or {})
    replicate = doc.get("replicate", "auto")
    if replicate not in ("auto", True, False):
        raise ScenarioError(name, "replicate", f"expected auto, true or false, got {replicate!r}")
    scenario.replicate = None if replicate == "auto" else bool(replicate)
    network = _choice(name, "network", doc.get("network", "auto"), ("auto", "closed_form", "shared_links"))
    scenario.shared_links = {"auto": None, "closed_form": False, "shared_links": True}[network]
    overhead = _choice(name, "profiler_overhead", doc.get("profiler_overhead", "remove"), ("remove", "keep"))
    scenario.remove_profiler_overhead = overhead == "remove"
    _batch_size(name, doc.get("batch_size"), scenario)
    _memory_options(name, doc.get("parallelism"), scenario)
    scenario.microbatch_trace = _microbatch_trace(name, base_dir, doc.get("parallelism"), points)
    if doc.get("perfmodel") is not None:
        scenario.perfmodel = _path(base_dir, doc["perfmodel"])
        if not scenario.perfmodel.is_file():
            raise ScenarioError(name, "perfmodel", f"no such file: {scenario.perfmodel}")
    _plain_data_parallel_only(name, doc, scenario)
    return scenario


#: Keys a parallel job (tensor, pipeline, expert, ZeRO/FSDP) does not use: its collectives are
#: sized from the trace's parameters and run as its passes insert them, each priced by the backend.
PLAIN_DATA_PARALLEL_KEYS = ("collective", "framework_options", "gradients")


def _plain_data_parallel_only(name: str, doc: dict, scenario: "Scenario") -> None:
    """What of the scenario a parallel job cannot use, left out or said, never dropped in
    silence: a parallel job runs DDP's all-reduce in FIFO order, so its configurations with
    another framework or policy are left out (counted in a warning; refused where none is left),
    and the keys only plain data parallelism reads (and gradient compression, which compresses
    its all-reduces) are named in a warning."""
    parallel = [p for p in scenario.points if is_parallel_job(p.parallelism)]
    if not parallel:
        return
    other = [p for p in parallel if (p.framework, p.policy) != ("ddp", "fifo")]
    if other:
        kept = [p for p in scenario.points if not any(p is q for q in other)]
        asked = sorted({p.framework for p in other if p.framework != "ddp"} | {p.policy for p in other if p.policy != "fifo"})
        why = (f"a parallel job (tensor, pipeline, expert or zero >= 1) runs DDP's all-reduce in FIFO order; "
               f"{', '.join(asked)} {'applies' if len(asked) == 1 else 'apply'} to plain data parallelism only")
        if not kept:
            key = "framework" if any(p.framework != "ddp" for p in other) else "policy"
            raise ScenarioError(name, key, f"{why} (framework: ddp, policy: fifo)")
        warn(name, len(other), f"left out {plural(len(other), 'configuration')} of a parallel job with {', '.join(asked)}: {why}")
        scenario.points = kept
    unused = [key for key in PLAIN_DATA_PARALLEL_KEYS if doc.get(key) is not None]
    unused += [f"optimizations: {o}" for o in scenario.optimizations if optimization_name(o) == "gradient-compression"]
    unused += ["network: shared_links"] * (scenario.shared_links is True) + ["replicate: true"] * (scenario.replicate is True)
    jobs = sorted({p.parallelism.describe() for p in scenario.points if is_parallel_job(p.parallelism)})
    if unused and jobs:  # (none where every parallel configuration was left out above)
        warn(name, 1, f"{', '.join(unused)}: for plain data parallelism only; the parallel configurations "
                      f"({', '.join(jobs)}) do not use {'it' if len(unused) == 1 else 'them'}: their passes size their "
                      "collectives from the trace's parameters, and the backend prices them as they are")


# -- the cluster block and its grid ---------------------------------------------------------------


def _clusters(name: str, base_dir: Path, block: Any, calibration_run: Optional[int] = None) -> list[Cluster]:
    """Every cluster of the block's grid, validated by ``Cluster.from_config``; with
    ``calibration_run``, on that run's links instead of the calibration's (``_calibration_runs``)."""
    if not isinstance(block, dict):
        raise ScenarioError(name, "cluster", f"expected a mapping, got {type(block).__name__}")
    for key in block:
        home = _home_of(str(key), "cluster") if key not in CLUSTER_KEYS else None
        if home:
            raise ScenarioError(name, f"cluster.{key}", f"unknown key; it belongs under {home}")
    linked = _with_links_file(name, base_dir, block, calibration_run)
    hardware = [axis for axis in _axes(linked) if axis[0][0] in _FABRIC_GRID_KEYS] if wants_fabric(linked) else []
    if hardware:  # the fabric itself varies (machine: [dgx_h100, dgx_b200]): each one filled on its own
        _check_grid(name, hardware)
        _check_size(name, math.prod(len(items) for _, items in hardware) * math.prod(
            len(items) for where, items in _axes(linked) if where[0] not in _FABRIC_GRID_KEYS))
        out = []
        for choice in itertools.product(*(items for _, items in hardware)):
            point = linked
            for (where, _), item in zip(hardware, choice):
                point = _replaced(point, where, item)
            out += _grid_of(name, point)
        return out
    return _grid_of(name, linked)


#: The cluster keys a GPU fabric is made from (``topology.fabric``), whose lists are expanded
#: before the fabric fills the cluster's links and GPUs per machine.
_FABRIC_GRID_KEYS = (*FABRIC_KEYS, "gpus_per_machine")


def _check_grid(name: str, axes: list) -> None:
    for where, items in axes:
        if not items:
            raise ScenarioError(name, ".".join(("cluster", *where)), "an empty list leaves nothing to predict")


def _check_size(name: str, size: int) -> None:
    if size > MAX_GRID_CLUSTERS:
        raise ScenarioError(name, "cluster", f"a grid of {size} clusters (more than {MAX_GRID_CLUSTERS}): "
                                             "split it into several scenarios")


def _grid_of(name: str, linked: dict) -> list[Cluster]:
    """The clusters of ``linked``'s grid, its fabric (if any) one and filled in first."""
    try:  # a machine: preset's GPUs and links, before the defaults fill the rest and the grid varies them
        config = {**_CLUSTER_DEFAULTS, **with_fabric_links(linked, "cluster")}
    except TopologyError as err:
        raise ScenarioError(name, err.key, err.message) from None
    axes = _axes(config)
    _check_grid(name, axes)
    _check_size(name, math.prod(len(items) for _, items in axes))
    clusters = []
    for choice in itertools.product(*(items for _, items in axes)):
        point = config
        for where, item in zip((where for where, _ in axes), choice):
            point = _replaced(point, where, item)
        try:
            clusters.append(Cluster.from_config(point, "cluster"))
        except TopologyError as err:
            raise ScenarioError(name, err.key, err.message) from None
        if clusters[-1].gpus_per_machine > MAX_GPUS_PER_MACHINE:
            raise ScenarioError(name, "cluster.gpus_per_machine", f"{clusters[-1].gpus_per_machine} GPUs in one machine: "
                                f"no machine has more than {MAX_GPUS_PER_MACHINE} (GB200 NVL72); a machine preset has 8")
        if clusters[-1].n_gpus > MAX_CLUSTER_GPUS:
            raise ScenarioError(name, "cluster.machines", f"{clusters[-1].n_gpus} GPUs: more than {MAX_CLUSTER_GPUS}, "
                                "beyond any cluster built (the largest have about 100,000)")
    return clusters


def _axes(value: Any, where: tuple = ()) -> list[tuple[tuple, list]]:
    """The lists in ``value`` (a mapping, at any depth): each one's key path and items, in the
    order the mapping writes them. A calibration's measured constants (``nccl: {measured: {...}}``,
    what ``whatif calibrate nccl-tests`` writes) are one set, whose lists (``fitted_on``: the
    tables it was fitted on) are data, not a grid."""
    if isinstance(value, list):
        return [(where, value)]
    if where == _MEASURED and isinstance(value, dict):
        return []
    if isinstance(value, dict):
        return [axis for key, item in value.items() for axis in _axes(item, (*where, key))]
    return []


_MEASURED = ("nccl", "measured")


def _replaced(mapping: dict, where: tuple, value: Any) -> dict:
    """``mapping`` with the value at key path ``where`` replaced (copies along the path)."""
    head, *rest = where
    return {**mapping, head: _replaced(mapping[head], tuple(rest), value) if rest else value}


def _with_links_file(name: str, base_dir: Path, cluster: dict, calibration_run: Optional[int] = None) -> dict:
    """``links: FILE`` (e.g. written by ``whatif lab calibrate``) supplies intra_node,
    inter_node and shared_memory where it has one; keys the scenario gives itself win, so a bandwidth list can vary a calibrated
    link's rate while keeping its latency and efficiency. ``calibration_run``: the links of
    that run of the calibration (its ``runs``) instead."""
    if "links" not in cluster:
        return cluster
    links_path = _path(base_dir, cluster["links"])
    links = _load_yaml(links_path, name, "cluster.links")
    if not isinstance(links, dict) or not {"intra_node", "inter_node"} <= set(links):
        raise ScenarioError(name, "cluster.links", f"{links_path} has no intra_node and inter_node links")
    if calibration_run is not None:
        links = _runs_of(name, links_path, links)[calibration_run]
    merged = {k: v for k, v in cluster.items() if k != "links"}
    if "shared_memory" in links and "shared_memory" not in merged:
        merged["shared_memory"] = links["shared_memory"]
    for key in ("intra_node", "inter_node"):
        mine = merged.get(key)
        if mine is None:
            merged[key] = links[key]
        elif isinstance(mine, dict) and isinstance(links[key], dict):
            merged[key] = {**links[key], **mine}
    return merged


def _calibration_runs(name: str, base_dir: Path, cluster: dict) -> list[dict]:
    """The links each run of the named links file's calibration measured (``runs``, which ``whatif
    lab calibrate`` writes; none in a links file without it): each a mapping of intra_node,
    inter_node and shared_memory. At most ``MAX_CALIBRATION_RUNS``: each costs a simulation of
    every configuration."""
    if not isinstance(cluster, dict) or "links" not in cluster:
        return []
    links_path = _path(base_dir, cluster["links"])
    return _runs_of(name, links_path, _load_yaml(links_path, name, "cluster.links") or {})


def _runs_of(name: str, links_path: Path, links: Any) -> list[dict]:
    """The ``runs`` of the links file ``links_path``, read as ``links`` (see :func:`_calibration_runs`)."""
    runs = (links.get("runs") if isinstance(links, dict) else None) or []
    if not isinstance(runs, list) or not all(isinstance(r, dict) and {"intra_node", "inter_node"} <= set(r) for r in runs):
        raise ScenarioError(name, "cluster.links", f"{links_path}: runs: expected a list of links, each with intra_node "
                                                   "and inter_node (as whatif lab calibrate writes them)")
    if len(runs) > MAX_CALIBRATION_RUNS:
        raise ScenarioError(name, "cluster.links", f"{links_path}: runs: {len(runs)} calibration runs, more than "
                                                   f"{MAX_CALIBRATION_RUNS}; keep the ones to predict with")
    return runs


# -- the other keys -------------------------------------------------------------------------------


def _optimization(name: str, spec) -> str:
    _choice(name, "optimizations", optimization_name(spec), tuple(OPTIMIZATIONS))
    try:
        parse_optimization(spec)
    except GraphError as err:
        raise ScenarioError(name, "optimizations", str(err)) from None
    return str(spec)


def _batch_size(name: str, spec, scenario: Scenario) -> None:
    if spec is None:
        return
    if isinstance(spec, dict):
        _check_keys(name, spec, ("from", "to"), "batch_size")
        if "to" not in spec:
            raise ScenarioError(name, "batch_size.to", "missing: the batch size to predict at")
        to, traced = spec["to"], spec.get("from")
    else:
        to, traced = spec, None
    for key, value in (("batch_size.to" if isinstance(spec, dict) else "batch_size", to), ("batch_size.from", traced)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ScenarioError(name, key, f"expected a positive whole number, got {value!r}")
    scenario.batch_size, scenario.traced_batch_size = to, traced


def _gradients(name: str, spec, scenario: Scenario) -> None:
    if spec is None:
        return
    _check_keys(name, spec, ("total", "sizes"), "gradients")
    try:
        if "sizes" in spec:
            scenario.gradient_sizes = [parse_size(s, f"gradients.sizes[{i}]") for i, s in enumerate(_as_list(spec["sizes"]))]
        if "total" in spec:
            scenario.gradient_total = parse_size(spec["total"], "gradients.total")
    except TopologyError as err:
        raise ScenarioError(name, err.key, err.message) from None
    if scenario.gradient_sizes is not None and not scenario.gradient_sizes:
        raise ScenarioError(name, "gradients.sizes", "an empty list: give at least one size")
    for size in scenario.gradient_sizes or []:
        if size <= 0:
            raise ScenarioError(name, "gradients.sizes", "sizes must be positive")
    if scenario.gradient_total is not None and scenario.gradient_total <= 0:
        raise ScenarioError(name, "gradients.total", "must be positive")


def _straggler(name: str, index: int, spec, machines: int) -> Straggler:
    key = f"stragglers[{index}]"
    _check_keys(name, spec, tuple(f.name for f in fields(Straggler)), key)
    if "machine" not in spec:
        raise ScenarioError(name, f"{key}.machine", "missing")
    if not {"slowdown", "gpu_slowdown"} & set(spec):
        raise ScenarioError(name, key, "gives neither slowdown nor gpu_slowdown, so it slows nothing")
    machine = spec["machine"]
    if isinstance(machine, bool) or not isinstance(machine, int) or machine < 0:
        raise ScenarioError(name, f"{key}.machine", f"must be a machine index >= 0, got {machine!r}")
    if machine >= machines:
        raise ScenarioError(name, f"{key}.machine", f"machine {machine} does not exist: the largest cluster has "
                                                    f"{machines} (machines are numbered from 0)")
    factors = {}
    for factor in (f.name for f in fields(Straggler) if f.name != "machine"):
        value = spec.get(factor, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
            raise ScenarioError(name, f"{key}.{factor}", f"must be a positive finite number, got {value!r}")
        factors[factor] = float(value)
    return Straggler(machine, **factors)


def gpu_slowdowns(variation: Optional[tuple], gpus: int) -> tuple:
    """Each GPU's factor on its GPU tasks, ``exp(N(0, sigma))`` drawn in GPU order from
    ``numpy.random.default_rng(seed)``: the same cluster draws the same factors; none without
    ``gpu_variation``."""
    if variation is None:
        return ()
    sigma, seed = variation
    return tuple(np.exp(np.random.default_rng(seed).normal(0.0, sigma, gpus)).tolist())


def _gpu_variation(name: str, spec) -> Optional[tuple]:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ScenarioError(name, "gpu_variation", f"expected a mapping {{sigma, seed}}, got {type(spec).__name__}")
    _check_keys(name, spec, ("sigma", "seed"), "gpu_variation")
    sigma, seed = spec.get("sigma"), spec.get("seed", 0)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (0 <= sigma < 1):
        raise ScenarioError(name, "gpu_variation.sigma", f"must be a number in [0, 1), got {sigma!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ScenarioError(name, "gpu_variation.seed", f"must be an integer >= 0, got {seed!r}")
    return float(sigma), seed


def _options(name: str, spec) -> FrameworkOptions:
    if not isinstance(spec, dict):
        raise ScenarioError(name, "framework_options", f"expected a mapping, got {type(spec).__name__}")
    try:
        return FrameworkOptions.from_config(spec, "framework_options")
    except TopologyError as err:
        raise ScenarioError(name, err.key, err.message) from None


# -- the parallelism block ------------------------------------------------------------------------


def _parallelism(name: str, block: Any) -> list[dict]:
    """The parallelism block's grid: one keyword dict of :class:`Parallelism` per point (``data``
    left out where not given: each cluster fills it); ``[]`` without a block."""
    if block is None:
        return []
    _check_keys(name, block, _PARALLELISM_KEYS, "parallelism")
    flat: dict[str, Any] = {}
    for key, value in block.items():
        if key in ("optimizer", "gpu_memory"):
            continue
        if key == "pipeline" and isinstance(value, dict):
            _check_keys(name, value, _PIPELINE_KEYS, "parallelism.pipeline")
            flat.update((f"pipeline.{k}", v) for k, v in value.items() if k != "microbatch_trace")
        else:
            flat["pipeline.stages" if key == "pipeline" else key] = value
    axes = []
    for key, value in flat.items():
        list_valued = key in _LIST_VALUED
        is_axis = isinstance(value, list) and (not list_valued or all(isinstance(v, list) for v in value))
        if is_axis and not value:
            raise ScenarioError(name, f"parallelism.{key}", "an empty list leaves nothing to predict")
        axes.append((key, value if is_axis else [value]))
    return [_parallelism_kwargs(name, dict(zip((k for k, _ in axes), choice)))
            for choice in itertools.product(*(values for _, values in axes))]


def _parallelism_kwargs(name: str, point: dict) -> dict:
    """One grid point's keys as :class:`Parallelism`'s keywords."""
    renamed = {"pipeline.stages": "pipeline", "pipeline.microbatches": "microbatches", "pipeline.schedule": "schedule",
               "pipeline.virtual_stages": "virtual_stages", "pipeline.partition": "partition"}
    kwargs = {renamed.get(k, k): v for k, v in point.items()}
    fsdp = kwargs.pop("fsdp", None)
    if fsdp is not None:
        if not isinstance(fsdp, bool):
            raise ScenarioError(name, "parallelism.fsdp", f"expected true or false, got {fsdp!r}")
        if fsdp and kwargs.get("zero", 3) != 3:
            raise ScenarioError(name, "parallelism.fsdp", f"fsdp is zero 3; zero: {kwargs['zero']} says otherwise")
        if fsdp:
            kwargs["zero"] = 3
    for key in ("tensor_dispatch", "fsdp_dispatch"):
        if key in kwargs:
            kwargs[key], collective = _dispatch(name, kwargs[key], f"parallelism.{key}", key == "tensor_dispatch")
            if collective:
                kwargs["tensor_collective"] = collective
    for key in ("schedule", "recompute", "partition", "sequence_parallel_grads"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = kwargs[key].strip().lower()
    for key in ("placement", "partition"):
        if isinstance(kwargs.get(key), list):
            kwargs[key] = tuple(str(v).strip().lower() if key == "placement" else v for v in kwargs[key])
    if kwargs.get("units") is not None:
        kwargs["units"] = str(kwargs["units"])
    return kwargs


def _dispatch(name: str, value: Any, key: str, collective: bool = False) -> tuple:
    """``parallelism.tensor_dispatch`` or ``fsdp_dispatch``: ``{forward: 2ms, backward: 4ms, step:
    500us}`` (each key optional, 0 where left out) as :class:`Parallelism`'s tuple of
    microseconds (per column/row pair, per FSDP unit), and with ``collective`` (the tensor
    library's) the microseconds of its ``collective`` key (per collective issued; 0 without)."""
    if not isinstance(value, dict):
        raise ScenarioError(name, key, f"expected {{forward: DURATION, backward: DURATION, step: DURATION}}, got {value!r}")
    keys = ("forward", "backward", "step") + (("collective",) if collective else ())
    _check_keys(name, value, keys, key)
    out = []
    for phase in keys:
        try:
            out.append(parse_latency(value.get(phase, 0), f"{key}.{phase}"))
        except TopologyError as err:
            raise ScenarioError(name, err.key, err.message) from None
    return tuple(out[:3]), (out[3] if collective else 0.0)


def _parallelisms(name: str, grid: list[dict], cluster: Cluster) -> list[Optional[Parallelism]]:
    """The grid's parallelisms on ``cluster`` (``[None]`` without a block), each checked
    against its GPUs and against the passes there are."""
    if not grid:
        return [None]
    found = []
    for kwargs in grid:
        tensor, pipeline = kwargs.get("tensor", 1), kwargs.get("pipeline", 1)
        if "data" not in kwargs and isinstance(tensor, int) and isinstance(pipeline, int) and tensor >= 1 and pipeline >= 1:
            if cluster.n_gpus % (tensor * pipeline):
                raise ScenarioError(name, "parallelism", f"tensor x pipeline = {tensor} x {pipeline} does not divide "
                                                         f"the cluster's {cluster.n_gpus} GPUs")
            kwargs = {**kwargs, "data": cluster.n_gpus // (tensor * pipeline)}
        try:
            par = Parallelism(**kwargs)
            if par.world != cluster.n_gpus:
                raise ScenarioError(name, "parallelism",
                                    f"data x tensor x pipeline = {par.data} x {par.tensor} x {par.pipeline} = "
                                    f"{par.world} ranks, but the cluster has {cluster.n_gpus} GPUs")
            from whatif.sim.parallel.job import check_modelled  # the parallel passes: only where a scenario asks

            check_modelled(par)
        except TopologyError as err:
            raise ScenarioError(name, err.key, err.message) from None
        except TypeError as err:
            raise ScenarioError(name, "parallelism", str(err)) from None
        found.append(par)
    if any(par.microbatches > 1 for par in found) and all(par.pipeline == 1 for par in found):
        raise ScenarioError(name, "parallelism.pipeline.microbatches",
                            "no point of the scenario has pipeline stages to use them (microbatches are a "
                            "pipeline's; gradient accumulation without a pipeline is not modelled)")
    return found


def _microbatch_trace(name: str, base_dir: Path, block: Any, points: list) -> Optional[Path]:
    """``parallelism.pipeline.microbatch_trace``: a trace or bundle of the model at one microbatch
    (one path, not a grid axis), for a job with pipeline stages."""
    pipeline = block.get("pipeline") if isinstance(block, dict) else None
    if not isinstance(pipeline, dict) or pipeline.get("microbatch_trace") is None:
        return None
    key = "parallelism.pipeline.microbatch_trace"
    value = pipeline["microbatch_trace"]
    if not isinstance(value, str):
        raise ScenarioError(name, key, f"expected the path of a trace or bundle, got {value!r}")
    path = _path(base_dir, value)
    if not (path.is_file() or is_bundle(path)):
        raise ScenarioError(name, key, f"no such trace or bundle: {path}")
    staged = [point.parallelism for point in points if point.parallelism is not None and point.parallelism.pipeline > 1]
    if not staged:
        raise ScenarioError(name, key, "no point of the scenario has pipeline stages to use it")
    sizes = sorted({par.microbatches for par in staged})
    if len(sizes) > 1:
        raise ScenarioError(name, key, f"a trace of one microbatch fits one microbatch count; the grid has "
                                       f"microbatches {', '.join(map(str, sizes))}")
    return path


def _memory_options(name: str, block: Any, scenario: Scenario) -> None:
    """``parallelism.optimizer`` and ``parallelism.gpu_memory``: what the memory count assumes."""
    if not isinstance(block, dict):
        return
    if "optimizer" in block:
        scenario.optimizer = _choice(name, "parallelism.optimizer", block["optimizer"], tuple(OPTIMIZER_STATE_BYTES))
    if block.get("gpu_memory") is not None:
        _one(name, "parallelism.gpu_memory", block["gpu_memory"], "one size")
        try:
            scenario.gpu_memory = parse_size(block["gpu_memory"], "parallelism.gpu_memory")
        except TopologyError as err:
            raise ScenarioError(name, err.key, err.message) from None
