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
    network: auto                                     # closed_form | shared_links (see sim.distributed)
    profiler_overhead: remove                         # keep: predict from the profiled times as they are
    batch_size: {from: 32, to: 64}                    # or just 64 (traced at the bundle's batch size)
    perfmodel: models.json                            # operator models for batch_size (default: perfmodel fit --cache)
    framework_options: {fusion_buffer: 64MB, cycle_time: 5ms, bucket_cap: 25MB,
                        first_bucket: 1MB, partition: 4MB, slice: 1MB}

This module knows the scenario's own keys (the top level, ``gradients``, ``stragglers``,
``batch_size``) and nothing else: the cluster block is whatever ``topology.Cluster.from_config``
takes (less ``links``, a file this module reads relative to the scenario; and one machine of one
GPU where ``machines`` or ``gpus_per_machine`` is left out), the collectives are topology's
all-reduce algorithms, and frameworks, their options, policies and optimizations are the
registries of ``sim/``.

The grid. A list makes a grid axis in two places: ``framework`` and ``policy``, and anywhere in
the cluster block, at any depth (``machines: [1, 2]``, ``inter_node: [10gbe, 40gbe]``,
``inter_node: {bandwidth: [10Gbps, 40Gbps]}``), since a cluster takes no list as a value; a
list's items are taken as written. The scenario is every combination of its axes, the first
varying slowest: ``machines``, ``gpus_per_machine``, the cluster's other axes in the order the
file writes them, then ``framework`` and ``policy``. Every mistake is reported as one line
naming the file and the key.
"""

from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional


from whatif.collectors.bundle import is_bundle
from whatif.sim.distributed import POLICIES, ClusterConfig, Straggler
from whatif.sim.frameworks import FRAMEWORKS, FrameworkOptions
from whatif.sim.graph import GraphError
from whatif.sim.passes.optimizations import OPTIMIZATIONS, optimization_name, parse_optimization
from whatif.topology import Cluster, TopologyError, as_gbps, collective_cost, parse_size, with_fabric_links
from whatif.topology.yamlfile import read_yaml

from .pipeline import Request, WhatIf

_TOP_KEYS = (
    "trace", "iteration", "cluster", "framework", "policy", "collective", "optimizations",
    "gradients", "stragglers", "framework_options", "replicate", "network", "profiler_overhead", "batch_size",
    "perfmodel", "name", "description",
)
#: What a scenario's cluster block leaves out: one machine of one GPU.
_CLUSTER_DEFAULTS = {"machines": 1, "gpus_per_machine": 1}
_GRID_KEYS = ("cluster", "framework", "policy")


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
    options: FrameworkOptions = field(default_factory=FrameworkOptions)
    replicate: Optional[bool] = None
    shared_links: Optional[bool] = None
    remove_profiler_overhead: bool = True  # where the trace is a bundle that timed unprofiled steps
    batch_size: Optional[int] = None  # predict at this batch size (sim/passes/batch_size.py)
    traced_batch_size: Optional[int] = None  # the trace's (None: the bundle's, else inferred)
    perfmodel: Optional[Path] = None

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
                replicate=self.replicate,
                shared_links=self.shared_links,
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
        )


#: The most GPUs one machine may have: the largest NVLink domain sold as one (GB200 NVL72); the
#: machine presets have 8.
MAX_GPUS_PER_MACHINE = 72
#: The most clusters a grid may have, and GPUs a cluster (the CLI asks for --yes well before)
MAX_GRID_CLUSTERS = 10_000
MAX_CLUSTER_GPUS = 1_000_000


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
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = (f"; did you mean {close[0]!r}?" if close else "") + f"; known keys: {', '.join(allowed)}"
            raise ScenarioError(name, f"{where}.{key}" if where else str(key), f"unknown key{hint}")


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


def _path(base_dir: Path, value) -> Path:
    given = Path(str(value))
    return given if given.is_absolute() else base_dir / given


def _parse(doc: Any, base_dir: Path, name: str) -> Scenario:
    _check_keys(name, doc, _TOP_KEYS, "")
    for required in ("trace", "cluster"):
        if required not in doc:
            raise ScenarioError(name, required, "missing")
    trace = _path(base_dir, doc["trace"])
    if trace.is_dir() and not is_bundle(trace):
        raise ScenarioError(name, "trace", f"{trace} is a folder but not a trace bundle (no bundle.json)")
    if not (trace.is_file() or is_bundle(trace)):
        raise ScenarioError(name, "trace", f"no such file: {trace}")

    clusters = _clusters(name, base_dir, doc["cluster"])
    frameworks = [_choice(name, "framework", f, FRAMEWORKS) for f in _as_list(doc.get("framework", "horovod"))]
    policies = [_choice(name, "policy", p, POLICIES) for p in _as_list(doc.get("policy", "fifo"))]
    for key, values in (("framework", frameworks), ("policy", policies)):
        if not values:
            raise ScenarioError(name, key, "an empty list leaves nothing to predict")
    points = [
        ScenarioPoint(cluster, framework, policy, as_gbps(cluster.inter_node.bandwidth_bytes_per_us))
        for cluster in clusters
        for framework, policy in itertools.product(frameworks, policies)
    ]

    scenario = Scenario(
        name=name,
        trace=trace,
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
    if doc.get("perfmodel") is not None:
        scenario.perfmodel = _path(base_dir, doc["perfmodel"])
        if not scenario.perfmodel.is_file():
            raise ScenarioError(name, "perfmodel", f"no such file: {scenario.perfmodel}")
    return scenario


# -- the cluster block and its grid ---------------------------------------------------------------


def _clusters(name: str, base_dir: Path, block: Any) -> list[Cluster]:
    """Every cluster of the block's grid, validated by ``Cluster.from_config``."""
    if not isinstance(block, dict):
        raise ScenarioError(name, "cluster", f"expected a mapping, got {type(block).__name__}")
    try:  # a machine: preset's GPUs and links, before the defaults fill the rest and the grid varies them
        config = {**_CLUSTER_DEFAULTS, **with_fabric_links(_with_links_file(name, base_dir, block), "cluster")}
    except TopologyError as err:
        raise ScenarioError(name, err.key, err.message) from None
    axes = _axes(config)
    for where, items in axes:
        if not items:
            raise ScenarioError(name, ".".join(("cluster", *where)), "an empty list leaves nothing to predict")
    size = math.prod(len(items) for _, items in axes)
    if size > MAX_GRID_CLUSTERS:
        raise ScenarioError(name, "cluster", f"a grid of {size} clusters (more than {MAX_GRID_CLUSTERS}): "
                                             "split it into several scenarios")
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
    order the mapping writes them."""
    if isinstance(value, list):
        return [(where, value)]
    if isinstance(value, dict):
        return [axis for key, item in value.items() for axis in _axes(item, (*where, key))]
    return []


def _replaced(mapping: dict, where: tuple, value: Any) -> dict:
    """``mapping`` with the value at key path ``where`` replaced (copies along the path)."""
    head, *rest = where
    return {**mapping, head: _replaced(mapping[head], tuple(rest), value) if rest else value}


def _with_links_file(name: str, base_dir: Path, cluster: dict) -> dict:
    """``links: FILE`` (e.g. written by ``whatif lab calibrate``) supplies intra_node,
    inter_node and shared_memory where it has one; keys the scenario gives itself win, so a bandwidth list can vary a calibrated
    link's rate while keeping its latency and efficiency."""
    if "links" not in cluster:
        return cluster
    links_path = _path(base_dir, cluster["links"])
    links = _load_yaml(links_path, name, "cluster.links")
    if not isinstance(links, dict) or not {"intra_node", "inter_node"} <= set(links):
        raise ScenarioError(name, "cluster.links", f"{links_path} has no intra_node and inter_node links")
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


def _options(name: str, spec) -> FrameworkOptions:
    if not isinstance(spec, dict):
        raise ScenarioError(name, "framework_options", f"expected a mapping, got {type(spec).__name__}")
    try:
        return FrameworkOptions.from_config(spec, "framework_options")
    except TopologyError as err:
        raise ScenarioError(name, err.key, err.message) from None
