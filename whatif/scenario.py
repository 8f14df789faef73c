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

Lists in ``machines``, ``gpus_per_machine``, ``inter_node.bandwidth`` (or ``inter_node`` itself,
as a list of presets), ``framework`` and ``policy`` make the scenario the grid of all their
combinations. Every mistake is reported as one line naming the file and the key.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from whatif.collectors.bundle import is_bundle
from whatif.sim.distributed import POLICIES, Straggler
from whatif.sim.frameworks import FRAMEWORKS, FrameworkOptions
from whatif.sim.passes.optimizations import OPTIMIZATIONS
from whatif.topology import (
    CLUSTER_KEYS, Cluster, TopologyError, as_gbps, collective_cost, parse_latency, parse_size, with_fabric_links,
)

_TOP_KEYS = (
    "trace", "iteration", "cluster", "framework", "policy", "collective", "optimizations",
    "gradients", "stragglers", "framework_options", "replicate", "network", "profiler_overhead", "batch_size",
    "perfmodel", "name", "description",
)
_CLUSTER_KEYS = CLUSTER_KEYS + ("links",)
_OPTION_KEYS = {
    "bucket_cap": "bucket_cap_bytes",
    "first_bucket": "first_bucket_bytes",
    "fusion_buffer": "fusion_buffer_bytes",
    "cycle_time": "cycle_time_us",
    "partition": "partition_bytes",
    "slice": "slice_bytes",
}


class ScenarioError(Exception):
    """A scenario that cannot be used: ``str`` is ``FILE: KEY: problem``."""

    def __init__(self, path: Path, key: str, message: str):
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
    path: Path
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


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_keys(path: Path, mapping: Any, allowed, where: str) -> None:
    if not isinstance(mapping, dict):
        raise ScenarioError(path, where or "", f"expected a mapping, got {type(mapping).__name__}")
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = (f"; did you mean {close[0]!r}?" if close else "") + f"; known keys: {', '.join(allowed)}"
            raise ScenarioError(path, f"{where}.{key}" if where else str(key), f"unknown key{hint}")


def _choice(path: Path, key: str, value, allowed) -> str:
    text = str(value).strip().lower()
    if text not in allowed:
        close = difflib.get_close_matches(text, list(allowed), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ScenarioError(path, key, f"unknown value {value!r}{hint} (choose from {', '.join(allowed)})")
    return text


def load_scenario(path: Path) -> Scenario:
    """Parse and validate a scenario file (YAML loaded safely)."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(path, "", "no such file") from None
    except OSError as err:
        raise ScenarioError(path, "", f"cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ScenarioError(path, "", f"not valid YAML{where}") from None
    _check_keys(path, doc, _TOP_KEYS, "")
    for required in ("trace", "cluster"):
        if required not in doc:
            raise ScenarioError(path, required, "missing")
    trace = Path(str(doc["trace"]))
    if not trace.is_absolute():
        trace = path.parent / trace
    if trace.is_dir() and not is_bundle(trace):
        raise ScenarioError(path, "trace", f"{trace} is a folder but not a trace bundle (no bundle.json)")
    if not (trace.is_file() or is_bundle(trace)):
        raise ScenarioError(path, "trace", f"no such file: {trace}")

    cluster = doc["cluster"]
    _check_keys(path, cluster, _CLUSTER_KEYS, "cluster")
    cluster = _with_links_file(path, cluster)
    try:
        cluster = with_fabric_links(cluster, "cluster")  # a machine: preset's GPUs and links, before the grid varies them
    except TopologyError as err:
        raise ScenarioError(path, err.key, err.message) from None
    frameworks = [_choice(path, "framework", f, FRAMEWORKS) for f in _as_list(doc.get("framework", "horovod"))]
    policies = [_choice(path, "policy", p, POLICIES) for p in _as_list(doc.get("policy", "fifo"))]
    for key, values in (
        ("cluster.machines", _as_list(cluster.get("machines", 1))),
        ("cluster.gpus_per_machine", _as_list(cluster.get("gpus_per_machine", 1))),
        ("cluster.inter_node" + (".bandwidth" if isinstance(cluster.get("inter_node"), dict) else ""), _inter_nodes(cluster)),
        ("framework", frameworks),
        ("policy", policies),
    ):
        if not values:
            raise ScenarioError(path, key, "an empty list leaves nothing to predict")
    points = []
    for machines, gpus, inter in itertools.product(
        _as_list(cluster.get("machines", 1)), _as_list(cluster.get("gpus_per_machine", 1)), _inter_nodes(cluster)
    ):
        config = dict(cluster, machines=machines, gpus_per_machine=gpus, inter_node=inter)
        try:
            built = Cluster.from_config(config, "cluster")
        except TopologyError as err:
            raise ScenarioError(path, err.key, err.message) from None
        for framework, policy in itertools.product(frameworks, policies):
            points.append(ScenarioPoint(built, framework, policy, as_gbps(built.inter_node.bandwidth_bytes_per_us)))

    scenario = Scenario(
        path=path,
        trace=trace,
        iteration=None if doc.get("iteration") is None else str(doc["iteration"]),
        points=points,
        collective=None if doc.get("collective") is None else str(doc["collective"]).strip().lower(),
        optimizations=[_optimization(path, o) for o in _as_list(doc.get("optimizations") or [])],
    )
    for point in points if scenario.collective is not None else []:
        try:  # the backend's names: ring or hierarchical on the link models, NCCL_ALGO's on a fabric
            collective_cost(point.cluster, "all_reduce", 0.0, algorithm=scenario.collective)
        except TopologyError as err:
            raise ScenarioError(path, "collective", err.message) from None
    _gradients(path, doc.get("gradients"), scenario)
    scenario.stragglers = [_straggler(path, i, s, points) for i, s in enumerate(_as_list(doc.get("stragglers") or []))]
    scenario.options = _options(path, doc.get("framework_options") or {})
    replicate = doc.get("replicate", "auto")
    if replicate not in ("auto", True, False):
        raise ScenarioError(path, "replicate", f"expected auto, true or false, got {replicate!r}")
    scenario.replicate = None if replicate == "auto" else bool(replicate)
    network = _choice(path, "network", doc.get("network", "auto"), ("auto", "closed_form", "shared_links"))
    scenario.shared_links = {"auto": None, "closed_form": False, "shared_links": True}[network]
    overhead = _choice(path, "profiler_overhead", doc.get("profiler_overhead", "remove"), ("remove", "keep"))
    scenario.remove_profiler_overhead = overhead == "remove"
    _batch_size(path, doc.get("batch_size"), scenario)
    if doc.get("perfmodel") is not None:
        model_file = Path(str(doc["perfmodel"]))
        scenario.perfmodel = model_file if model_file.is_absolute() else path.parent / model_file
        if not scenario.perfmodel.is_file():
            raise ScenarioError(path, "perfmodel", f"no such file: {scenario.perfmodel}")
    return scenario


def _batch_size(path: Path, spec, scenario: Scenario) -> None:
    if spec is None:
        return
    if isinstance(spec, dict):
        _check_keys(path, spec, ("from", "to"), "batch_size")
        if "to" not in spec:
            raise ScenarioError(path, "batch_size.to", "missing: the batch size to predict at")
        to, traced = spec["to"], spec.get("from")
    else:
        to, traced = spec, None
    for key, value in (("batch_size.to" if isinstance(spec, dict) else "batch_size", to), ("batch_size.from", traced)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ScenarioError(path, key, f"expected a positive whole number, got {value!r}")
    scenario.batch_size, scenario.traced_batch_size = to, traced


def _with_links_file(path: Path, cluster: dict) -> dict:
    """``links: FILE`` (e.g. written by ``whatif lab calibrate``) supplies intra_node,
    inter_node and shared_memory where it has one; keys the scenario gives itself win, so a bandwidth list can vary a calibrated
    link's rate while keeping its latency and efficiency."""
    if "links" not in cluster:
        return cluster
    links_path = Path(str(cluster["links"]))
    if not links_path.is_absolute():
        links_path = path.parent / links_path
    try:
        links = yaml.safe_load(links_path.read_text())
    except FileNotFoundError:
        raise ScenarioError(path, "cluster.links", f"no such file: {links_path}") from None
    except yaml.YAMLError:
        raise ScenarioError(path, "cluster.links", f"{links_path} is not valid YAML") from None
    if not isinstance(links, dict) or not {"intra_node", "inter_node"} <= set(links):
        raise ScenarioError(path, "cluster.links", f"{links_path} has no intra_node and inter_node links")
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


def _inter_nodes(cluster: dict) -> list:
    """The inter-node links of the grid: a list of presets, or a mapping whose bandwidth is a list."""
    inter = cluster.get("inter_node")
    if isinstance(inter, list):
        return inter
    if isinstance(inter, dict) and isinstance(inter.get("bandwidth"), list):
        return [dict(inter, bandwidth=b) for b in inter["bandwidth"]]
    return [inter]


def _optimization(path: Path, spec) -> str:
    name = str(spec).partition("=")[0].strip().lower().replace("_", "-")
    if name not in OPTIMIZATIONS:
        _choice(path, "optimizations", name, tuple(OPTIMIZATIONS))
    return str(spec)


def _gradients(path: Path, spec, scenario: Scenario) -> None:
    if spec is None:
        return
    _check_keys(path, spec, ("total", "sizes"), "gradients")
    try:
        if "sizes" in spec:
            scenario.gradient_sizes = [parse_size(s, f"gradients.sizes[{i}]") for i, s in enumerate(_as_list(spec["sizes"]))]
        if "total" in spec:
            scenario.gradient_total = parse_size(spec["total"], "gradients.total")
    except TopologyError as err:
        raise ScenarioError(path, err.key, err.message) from None
    if scenario.gradient_sizes is not None and not scenario.gradient_sizes:
        raise ScenarioError(path, "gradients.sizes", "an empty list: give at least one size")
    for size in scenario.gradient_sizes or []:
        if size <= 0:
            raise ScenarioError(path, "gradients.sizes", "sizes must be positive")
    if scenario.gradient_total is not None and scenario.gradient_total <= 0:
        raise ScenarioError(path, "gradients.total", "must be positive")


def _straggler(path: Path, index: int, spec, points: list) -> Straggler:
    key = f"stragglers[{index}]"
    _check_keys(path, spec, ("machine", "slowdown", "gpu_slowdown"), key)
    if "machine" not in spec:
        raise ScenarioError(path, f"{key}.machine", "missing")
    machine = spec["machine"]
    if not isinstance(machine, int) or machine < 0:
        raise ScenarioError(path, f"{key}.machine", f"must be a machine index >= 0, got {machine!r}")
    factors = {}
    for name in ("slowdown", "gpu_slowdown"):
        value = spec.get(name, 1.0)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ScenarioError(path, f"{key}.{name}", f"must be a positive number, got {value!r}")
        factors[name] = float(value)
    return Straggler(machine, **factors)


def _options(path: Path, spec) -> FrameworkOptions:
    _check_keys(path, spec, tuple(_OPTION_KEYS), "framework_options")
    values = {}
    try:
        for key, value in spec.items():
            where = f"framework_options.{key}"
            values[_OPTION_KEYS[key]] = parse_latency(value, where) if key == "cycle_time" else parse_size(value, where)
    except TopologyError as err:
        raise ScenarioError(path, err.key, err.message) from None
    for field_name, value in values.items():
        if value <= 0:
            raise ScenarioError(path, "framework_options", f"{field_name} must be positive")
    return FrameworkOptions(**values)
