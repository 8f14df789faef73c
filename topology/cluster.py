"""Clusters as data: machines of GPUs, the link between GPUs of a machine and each machine's NIC.

A cluster is described by a plain dict, as it comes from YAML (Calculon's approach: hardware is
data, not code)::

    machines: 4
    gpus_per_machine: 8
    intra_node: nvlink2                            # a preset name
    inter_node: {preset: 25gbe, efficiency: 0.85}  # a preset with overrides
    # or: inter_node: {bandwidth: 25Gbps, latency: 10us, efficiency: 0.9}

Link presets live in ``presets/links.yaml``, with the numbers' sources.

A GPU cluster can instead name its hardware (``fabric.py``): ``machine: dgx_h100`` (with
``gpu``, ``nics_per_machine``, ``nic``, ``nvlink_domain``, ``network``, ... to override), which
also supplies ``gpus_per_machine``, ``intra_node`` and ``inter_node``. ``backend`` says which
family of models times its collectives (``cost.py``): ``nccl`` by default when the
cluster names its hardware that way, ``gloo`` otherwise, so every description written before
the fabric keys existed keeps today's models; ``backend: nccl`` on such a description derives
the fabric from its two links. ``nccl:`` says what NCCL runs: its release, ``NCCL_ALGO`` and
``NCCL_PROTO`` as ``algorithm`` and ``protocol``, and calibrated factors (``whatif calibrate
nccl-tests``). Every problem in a description is reported as a
:class:`~whatif.topology.units.TopologyError` whose message is one line that names the
offending key.

Endpoints. The network moves bytes between endpoints: GPU ``g`` (``0 <= g < n_gpus``, numbered
machine by machine, so GPU ``g`` is on machine ``g // gpus_per_machine``) and one host CPU per
machine, ``host(k) = n_gpus + k``, where parameter servers run. ``server_machines`` adds
machines without GPUs (hosts only, same NIC) for dedicated parameter servers; they are numbered
after the GPU machines.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np

from .fabric import FABRIC_KEYS, Fabric, fabric_from_links, wants_fabric
from .fabric import Calibration
from .yamlfile import load_preset, read_yaml
from .units import (
    TopologyError,
    format_bandwidth,
    format_duration,
    parse_bandwidth,
    parse_fraction,
    parse_latency,
    parse_size,
)

LINK_KINDS = ("inter_node", "intra_node")
_LOOP = "_loop"
_FRAMEWORK_LOOP = re.compile(r"[a-z][a-z0-9]*_loop")  # a framework's background loop: horovod_loop
_LINK_KEYS = ("preset", "bandwidth", "latency", "efficiency", "floor", "cpu_contention", "collectives", "note")
#: The Gloo ops a link may carry calibrated figures of its own for (``Link.collectives``).
#: ``send_recv``: two ranks send to each other at once (the op's ring step); ``send``: one rank
#: sends and its peer receives, nothing the other way (a pipeline's activation or gradient),
#: which prices ``send_recv`` where a one-way transfer is meant (``sim/parallel/pipeline.py``).
CALIBRATED_OPS = ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "send")
CLUSTER_KEYS = ("machines", "gpus_per_machine", "intra_node", "inter_node", "server_machines", "shared_memory", "name", "note",
                "cores_per_machine")
CLUSTER_KEYS += ("backend",) + FABRIC_KEYS
BACKENDS = ("nccl", "gloo")
_SHARED_MEMORY_KEYS = ("among", "core_bandwidth", "total_bandwidth", "compute", "note")


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


def _normalize(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in " -_")


def _check_keys(config: Mapping, allowed: tuple, key: str) -> None:
    for k in config:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TopologyError(_join(key, str(k)), f"unknown key; {hint}known keys: {', '.join(allowed)}")


@dataclass(frozen=True)
class Link:
    """A full-duplex link: ``bandwidth_bytes_per_us`` in each direction, at once.

    A transfer over it takes ``latency_us + nbytes / effective_bandwidth_bytes_per_us`` when it
    has the link to itself; ``efficiency`` is the fraction of the nominal bandwidth that
    collective traffic achieves (protocol headers, flow control). ``name`` is the preset the
    link came from, if any.

    Where the workers' own CPU cores drive the link (Gloo on CPU workers: the TCP stack and the
    reductions run on the core that also computes), communication and compute slow each other
    down while they overlap: ``comm_slowdown`` is how much longer a transfer takes while the
    worker's CPU computes, ``compute_slowdown`` how much longer CPU work takes while a transfer
    is in flight (YAML: ``cpu_contention: {comm: 1.1, compute: 1.2}``; ``whatif lab calibrate``
    measures both). GPU workers whose NICs and NCCL need no host CPU keep the default 1.

    A transfer's slowdown may depend on its size (YAML: ``comm: {4MB: 1.2, 16MB: 1.6, 64MB:
    2.5}``, read by :meth:`comm_slowdown_at` between the sizes by log-size, and as the nearest
    one beyond them): Linux's scheduler places a thread that wakes from sleep ahead of one that
    has been computing, so a short all-reduce on a busy core is hardly slowed, while a long one
    uses up that credit and gets its fair half of the core. On loopback, where an all-reduce is
    all CPU work, the lab measured 1.17 at 4 MB, 1.64 at 16 MB and 2.47 at 64 MB.

    ``framework_loops_us`` holds, by framework name, the CPU time a framework's background loop
    takes from such a worker's core in every cycle while it coordinates with its peers over this
    link (YAML: ``cpu_contention: {NAME_loop: DURATION}``, e.g. ``{horovod_loop: 130us}``, as
    ``whatif lab calibrate`` writes it). It is a measurement of the worker's CPU and this link,
    taken beside the link's other contention factors (it differs across machines and inside
    one); what it does to the worker is the framework's model (``sim/frameworks/horovod.py``).

    ``collectives`` holds, by op (:data:`CALIBRATED_OPS`), the bandwidth, latency and efficiency
    that op achieves on this link where they differ from the link's own (YAML: ``collectives:
    {all_gather: {latency: 80us, efficiency: 0.9}}``, each entry overriding the keys it names;
    ``whatif lab calibrate`` times each op Gloo runs, ``lab/probes/collectives.py``). The link's
    own figures (the all-reduce's, as calibrated) price every op without an entry:
    :meth:`for_op`.

    ``floors_us`` holds, by op, the least time one collective of that op takes on this link
    however small (YAML: ``floor: 2.4ms`` on the link for the all-reduce, whose figures the
    link's own are, and ``floor:`` in an op's ``collectives`` entry for that op; none by default,
    and an op's entry does not inherit the link's). Gloo's all-reduce of 1 to 64 kB between two
    of the lab's CPU workers took 2.2 to 3.0 ms each in a burst across machines at 200 and 1000
    Mbps (``lab/probes/small_allreduce.py``), where the latency fitted over 64 kB to 64 MB gives
    0.5 to 1.5 ms: the host's cost of a collective, not the wire's, which a line through the
    large sizes cannot hold. A collective's time is the larger of its closed form and its floor
    (:meth:`floor_us`; ``cost.py``).
    """

    bandwidth_bytes_per_us: float
    latency_us: float = 0.0
    efficiency: float = 1.0
    name: str = ""
    comm_slowdown: Union[float, tuple] = 1.0  # a factor, or ((size_bytes, factor), ...) by size
    compute_slowdown: float = 1.0
    framework_loops_us: tuple = ()  # ((framework name, us per cycle), ...)
    collectives: tuple = ()  # ((op, bandwidth_bytes_per_us, latency_us, efficiency), ...)
    floors_us: tuple = ()  # ((op, least time of one collective, us), ...): "all_reduce" or a CALIBRATED_OPS op

    def __post_init__(self):
        if not (np.isfinite(self.bandwidth_bytes_per_us) and self.bandwidth_bytes_per_us > 0):
            raise TopologyError("bandwidth_bytes_per_us", f"must be positive, got {self.bandwidth_bytes_per_us}")
        if not (np.isfinite(self.latency_us) and self.latency_us >= 0):
            raise TopologyError("latency_us", f"must not be negative, got {self.latency_us}")
        if not (0 < self.efficiency <= 1):
            raise TopologyError("efficiency", f"must be in (0, 1], got {self.efficiency}")
        for name, factors in (("comm", self._comm_factors[1]), ("compute", [self.compute_slowdown])):
            for value in factors:
                if not (np.isfinite(value) and value >= 1):
                    raise TopologyError(f"cpu_contention.{name}", f"must be a factor >= 1, got {value}")
        sizes = self._comm_factors[0]
        if not (np.all(sizes > 0) and np.all(np.diff(sizes) > 0)):
            raise TopologyError("cpu_contention.comm", f"sizes must be positive and distinct, got {sizes.tolist()}")
        for framework, loop_us in self.framework_loops_us:
            if not (np.isfinite(loop_us) and loop_us >= 0):
                raise TopologyError(f"cpu_contention.{framework}{_LOOP}", f"must not be negative, got {loop_us}")
        for op, *figures in self.collectives:
            if op not in CALIBRATED_OPS:
                raise TopologyError(f"collectives.{op}", f"unknown op; known: {', '.join(CALIBRATED_OPS)}")
            Link(*figures)  # checked as a link of its own
        for op, floor in self.floors_us:
            if op != "all_reduce" and op not in CALIBRATED_OPS:
                raise TopologyError(f"collectives.{op}.floor", f"unknown op; known: all_reduce, {', '.join(CALIBRATED_OPS)}")
            if not (np.isfinite(floor) and floor >= 0):
                raise TopologyError("floor" if op == "all_reduce" else f"collectives.{op}.floor", f"must not be negative, got {floor}")

    def for_op(self, op: str) -> "Link":
        """The link as ``op`` sees it: its calibrated figures for that op, if any, else itself."""
        for name, bandwidth, latency, efficiency in self.collectives:
            if name == op:
                return replace(self, bandwidth_bytes_per_us=bandwidth, latency_us=latency, efficiency=efficiency,
                               collectives=())
        return self

    def floor_us(self, op: str) -> float:
        """The least time one ``op`` takes on this link (0: no floor measured)."""
        return dict(self.floors_us).get(op, 0.0)

    @property
    def _comm_factors(self) -> tuple[np.ndarray, np.ndarray]:
        """Sizes (bytes) and the comm slowdown at each; one size for a single factor."""
        if isinstance(self.comm_slowdown, tuple):
            sizes, factors = zip(*sorted(self.comm_slowdown)) if self.comm_slowdown else ((1.0,), (1.0,))
            return np.asarray(sizes, dtype=float), np.asarray(factors, dtype=float)
        return np.array([1.0]), np.array([float(self.comm_slowdown)])

    def comm_slowdown_at(self, nbytes) -> np.ndarray:
        """The comm slowdown of transfers of ``nbytes`` each."""
        sizes, factors = self._comm_factors
        return np.interp(np.log(np.maximum(np.asarray(nbytes, dtype=float), 1.0)), np.log(sizes), factors)

    def framework_loop_us(self, framework: str) -> float:
        """CPU time per cycle that ``framework``'s background loop takes from a worker's core
        while it coordinates over this link (0: none measured)."""
        return dict(self.framework_loops_us).get(framework, 0.0)

    @property
    def has_cpu_contention(self) -> bool:
        return bool(self._comm_factors[1].max() > 1) or self.compute_slowdown > 1

    @property
    def effective_bandwidth_bytes_per_us(self) -> float:
        return self.bandwidth_bytes_per_us * self.efficiency

    def transfer_time_us(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over the link when nothing else uses it."""
        return self.latency_us + nbytes / self.effective_bandwidth_bytes_per_us

    def describe(self) -> str:
        name = f"{self.name}: " if self.name else ""
        return f"{name}{format_bandwidth(self.effective_bandwidth_bytes_per_us)}, {format_duration(self.latency_us)}"

    @classmethod
    def from_config(cls, value: Any, key: str = "link", kind: str = "inter_node") -> "Link":
        """A link from a preset name, ``{bandwidth, latency, efficiency}``, or ``{preset, ...overrides}``.

        ``kind`` (``inter_node`` or ``intra_node``) says which presets the name is looked up in.
        """
        if isinstance(value, Link):
            return value
        if isinstance(value, str):
            return _preset(value, key, kind)
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected a preset name or a mapping with bandwidth and latency, got {value!r}")
        _check_keys(value, _LINK_KEYS, key)
        base = _preset(value["preset"], _join(key, "preset"), kind) if "preset" in value else None
        # what is given is checked before what is missing: a negative bandwidth is the error to
        # name, not the latency left out beside it
        bandwidth = parse_bandwidth(value["bandwidth"], _join(key, "bandwidth")) if "bandwidth" in value else None
        latency = parse_latency(value["latency"], _join(key, "latency")) if "latency" in value else None
        efficiency = parse_fraction(value["efficiency"], _join(key, "efficiency")) if "efficiency" in value else None
        if base is None:
            for required, example in (("bandwidth", "25Gbps"), ("latency", "10us")):
                if required not in value:
                    raise TopologyError(
                        _join(key, required),
                        f"missing; write e.g. {required}: {example}, or use a preset ({', '.join(preset_names(kind))})",
                    )
        overridden = any(k in value for k in ("bandwidth", "latency", "efficiency"))
        link = cls(
            bandwidth_bytes_per_us=bandwidth if bandwidth is not None else base.bandwidth_bytes_per_us,
            latency_us=latency if latency is not None else base.latency_us,
            efficiency=efficiency if efficiency is not None else (base.efficiency if base is not None else 1.0),
            name=(f"{base.name}*" if overridden else base.name) if base is not None else "",
            **_cpu_contention(value.get("cpu_contention"), _join(key, "cpu_contention")),
        )
        collectives, floors = _collectives(link, value.get("collectives"), _join(key, "collectives"))
        if "floor" in value:
            floors = (("all_reduce", parse_latency(value["floor"], _join(key, "floor"))),) + floors
        elif base is not None:
            floors = base.floors_us + floors
        return replace(link, collectives=collectives, floors_us=floors)


def _collectives(link: Link, value: Any, key: str) -> tuple:
    """``{OP: {bandwidth, latency, efficiency, floor}, ...}`` as ``Link.collectives`` (each op's
    figures, the link's own where the entry leaves one out) and the ops' floors, ``Link.floors_us``
    (absent: none)."""
    if value is None:
        return (), ()
    if not isinstance(value, Mapping):
        raise TopologyError(key, f"expected {{OP: {{latency: ..., efficiency: ...}}}}, got {value!r}")
    _check_keys(value, CALIBRATED_OPS, key)
    out, floors = [], []
    for op, entry in value.items():
        where = _join(key, op)
        if not isinstance(entry, Mapping):
            raise TopologyError(where, f"expected {{bandwidth, latency, efficiency}}, got {entry!r}")
        _check_keys(entry, ("bandwidth", "latency", "efficiency", "floor"), where)
        if "floor" in entry:
            floors.append((op, parse_latency(entry["floor"], _join(where, "floor"))))
        out.append((op,
                    parse_bandwidth(entry["bandwidth"], _join(where, "bandwidth")) if "bandwidth" in entry else link.bandwidth_bytes_per_us,
                    parse_latency(entry["latency"], _join(where, "latency")) if "latency" in entry else link.latency_us,
                    parse_fraction(entry["efficiency"], _join(where, "efficiency")) if "efficiency" in entry else link.efficiency))
    return tuple(out), tuple(floors)


def _cpu_contention(value: Any, key: str) -> dict:
    """``{comm: F or {SIZE: F, ...}, compute: F, NAME_loop: DURATION, ...}`` as Link's fields (absent: none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TopologyError(key, f"expected {{comm: FACTOR, compute: FACTOR}}, got {value!r}")
    loops = [k for k in value if isinstance(k, str) and _FRAMEWORK_LOOP.fullmatch(k)]
    _check_keys({k: v for k, v in value.items() if k not in loops}, ("comm", "compute", f"NAME{_LOOP}"), key)
    factors = {}
    if loops:
        factors["framework_loops_us"] = tuple(
            (k[: -len(_LOOP)], parse_latency(value[k], _join(key, k))) for k in sorted(loops)
        )
    factors["compute_slowdown"] = _slowdown(value.get("compute", 1.0), _join(key, "compute"))
    comm = value.get("comm", 1.0)
    if isinstance(comm, Mapping):
        if not comm:
            raise TopologyError(_join(key, "comm"), "expected a factor or {SIZE: FACTOR, ...}, got an empty mapping")
        by_size = {}
        for size, factor in comm.items():
            nbytes = parse_size(size, _join(key, f"comm.{size}"))
            if nbytes <= 0 or nbytes in by_size:
                raise TopologyError(_join(key, f"comm.{size}"), "sizes must be positive and distinct")
            by_size[nbytes] = _slowdown(factor, _join(key, f"comm.{size}"))
        factors["comm_slowdown"] = tuple(sorted(by_size.items()))
    else:
        factors["comm_slowdown"] = _slowdown(comm, _join(key, "comm"))
    return factors


def _slowdown(raw: Any, key: str) -> float:
    """A slowdown factor from YAML: a number, at least 1."""
    try:
        factor = float(raw)
    except (TypeError, ValueError):
        raise TopologyError(key, f"expected a number >= 1, got {raw!r}") from None
    if not (np.isfinite(factor) and factor >= 1):
        raise TopologyError(key, f"must be a factor >= 1, got {raw!r}")
    return factor


@functools.lru_cache(maxsize=None)
def link_presets() -> dict:
    """``{"inter_node": {name: Link}, "intra_node": {name: Link}}`` from ``presets/links.yaml``."""
    source = resources.files(__package__).joinpath("presets", "links.yaml")
    data = load_preset(source.read_text(encoding="utf-8"))
    presets = {}
    for kind in LINK_KINDS:
        presets[kind] = {}
        for name, entry in (data.get(kind) or {}).items():
            key = f"links.yaml:{kind}.{name}"
            _check_keys(entry, _LINK_KEYS[1:], key)
            presets[kind][_normalize(str(name))] = Link(
                bandwidth_bytes_per_us=parse_bandwidth(entry["bandwidth"], _join(key, "bandwidth")),
                latency_us=parse_latency(entry["latency"], _join(key, "latency")),
                efficiency=parse_fraction(entry.get("efficiency", 1.0), _join(key, "efficiency")),
                name=_normalize(str(name)),
            )
    return presets


@dataclass(frozen=True)
class SharedMemory:
    """CPU workers that share one memory system slow each other down where they stream memory
    at the same time, as data-parallel workers do, running the same step in lockstep.

    A worker alone streams at ``core_bandwidth_bytes_per_us``; all the workers that share the
    memory stream ``total_bandwidth_bytes_per_us`` together, split evenly, so a worker's
    memory traffic takes ``core / min(core, total / sharing)`` times as long, and the rest of its
    CPU work ``compute_slowdown`` times as long (``whatif lab calibrate`` measures all three,
    ``lab/probes/memory.py``). ``among`` says who shares: the workers of a ``machine``
    (CPU workers of a real cluster), or the whole ``cluster`` (the lab, whose machines are
    network namespaces of one box). GPU workers stream from their own memory: leave it out.
    YAML: ``shared_memory: {among: cluster, core_bandwidth: 40GB/s, total_bandwidth: 48GB/s,
    compute: 1.0}``."""

    among: str
    core_bandwidth_bytes_per_us: float
    total_bandwidth_bytes_per_us: float
    compute_slowdown: float = 1.0

    def __post_init__(self):
        if self.among not in ("machine", "cluster"):
            raise TopologyError("shared_memory.among", f"must be machine or cluster, got {self.among!r}")
        for key, value in (("core_bandwidth", self.core_bandwidth_bytes_per_us), ("total_bandwidth", self.total_bandwidth_bytes_per_us)):
            if not (np.isfinite(value) and value > 0):
                raise TopologyError(f"shared_memory.{key}", f"must be positive, got {value}")
        if not (np.isfinite(self.compute_slowdown) and self.compute_slowdown >= 1):
            raise TopologyError("shared_memory.compute", f"must be a factor >= 1, got {self.compute_slowdown}")

    def memory_slowdown(self, sharing: int) -> float:
        """How much longer a worker's memory traffic takes while ``sharing`` workers stream."""
        if sharing <= 1:
            return 1.0
        return self.core_bandwidth_bytes_per_us / min(self.core_bandwidth_bytes_per_us, self.total_bandwidth_bytes_per_us / sharing)

    @classmethod
    def from_config(cls, value: Any, key: str = "shared_memory") -> "SharedMemory":
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected {{among: cluster, core_bandwidth: 40GB/s, total_bandwidth: 48GB/s}}, got {value!r}")
        _check_keys(value, _SHARED_MEMORY_KEYS, key)
        for required in ("among", "core_bandwidth", "total_bandwidth"):
            if required not in value:
                raise TopologyError(_join(key, required), "missing; whatif lab calibrate measures it")
        return cls(
            among=str(value["among"]),
            core_bandwidth_bytes_per_us=parse_bandwidth(value["core_bandwidth"], _join(key, "core_bandwidth")),
            total_bandwidth_bytes_per_us=parse_bandwidth(value["total_bandwidth"], _join(key, "total_bandwidth")),
            compute_slowdown=_slowdown(value.get("compute", 1.0), _join(key, "compute")),
        )


def preset_names(kind: str) -> list:
    """Names of the link presets of ``kind`` (``inter_node`` or ``intra_node``)."""
    return list(link_presets()[kind])


def _preset(name: Any, key: str, kind: str) -> Link:
    if kind not in LINK_KINDS:
        raise TopologyError(key, f"link kind must be one of {', '.join(LINK_KINDS)}, got {kind!r}")
    if not isinstance(name, str):
        raise TopologyError(key, f"expected a preset name, got {name!r}")
    presets = link_presets()
    found = presets[kind].get(_normalize(name))
    if found is not None:
        return found
    known = ", ".join(presets[kind])
    other = next(k for k in LINK_KINDS if k != kind)
    if _normalize(name) in presets[other]:
        raise TopologyError(key, f"{name!r} is an {other} link; {kind} presets: {known}")
    close = difflib.get_close_matches(_normalize(name), list(presets[kind]), n=3, cutoff=0.4)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    try:
        parse_bandwidth(name, key)
        hint += f"for a custom link write {{bandwidth: {name}, latency: 10us}}; "
    except TopologyError:
        pass
    raise TopologyError(key, f"unknown preset {name!r}; {hint}known: {known}")


def _count(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or value != int(value):
        raise TopologyError(key, f"must be a whole number, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise TopologyError(key, f"must be {what}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Cluster:
    """``machines`` machines of ``gpus_per_machine`` GPUs each.

    GPUs of a machine talk over ``intra_node`` (per GPU and direction, see ``network.py``);
    machines talk through their NICs, ``inter_node``, over a non-blocking switch, so the only
    shared capacity between machines is each NIC's egress and ingress. ``server_machines`` are
    extra GPU-less machines with the same NIC, for dedicated parameter servers.
    ``cores_per_machine``: the CPU cores a machine's CPU workers run on, where they are fewer than
    its workers (None: a core for each; the lab's 2 machines x 2 workers on a 2-core box have 1):
    ``sim/parallel/job.py`` shares them out.
    """

    machines: int
    gpus_per_machine: int
    intra_node: Link
    inter_node: Link
    server_machines: int = 0
    name: str = ""
    shared_memory: Optional[SharedMemory] = None
    backend: str = "gloo"
    fabric: Optional[Fabric] = None
    cores_per_machine: Optional[int] = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise TopologyError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "nccl" and self.fabric is None:
            object.__setattr__(self, "fabric", fabric_from_links(
                self.machines, self.gpus_per_machine, self.intra_node.name, self.intra_node.effective_bandwidth_bytes_per_us,
                self.inter_node.effective_bandwidth_bytes_per_us, self.inter_node.latency_us))
        if self.fabric is not None and (self.fabric.machines, self.fabric.gpus_per_machine) != (self.machines, self.gpus_per_machine):
            raise TopologyError("machines", "the fabric and the cluster disagree on machines or gpus_per_machine")
        _count(self.machines, "machines", 1)
        _count(self.gpus_per_machine, "gpus_per_machine", 1)
        _count(self.server_machines, "server_machines", 0)
        if self.cores_per_machine is not None:
            _count(self.cores_per_machine, "cores_per_machine", 1)
        for kind in LINK_KINDS:
            if not isinstance(getattr(self, kind), Link):
                raise TopologyError(kind, f"expected a Link, got {getattr(self, kind)!r}")

    @property
    def workers_sharing_memory(self) -> int:
        """How many workers share each worker's memory system (1: none, or no ``shared_memory``)."""
        if self.shared_memory is None:
            return 1
        return self.n_gpus if self.shared_memory.among == "cluster" else self.gpus_per_machine

    # -- endpoints -------------------------------------------------------------------------------

    @property
    def n_gpus(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def n_machines(self) -> int:
        """GPU machines plus server machines: the number of NICs."""
        return self.machines + self.server_machines

    @property
    def n_endpoints(self) -> int:
        """GPUs plus one host per machine."""
        return self.n_gpus + self.n_machines

    def host(self, machine: int) -> int:
        """The endpoint id of ``machine``'s host CPU (``machine >= machines`` is a server machine)."""
        if not 0 <= machine < self.n_machines:
            raise TopologyError("machine", f"{machine} does not exist; the cluster has {self.n_machines} machines")
        return self.n_gpus + machine

    def gpus_of(self, machine: int) -> range:
        g = self.gpus_per_machine
        return range(machine * g, (machine + 1) * g) if machine < self.machines else range(0)

    @functools.cached_property
    def endpoint_machines(self) -> np.ndarray:
        """The machine of every endpoint, indexed by endpoint id."""
        gpus = np.arange(self.n_gpus, dtype=np.int64) // self.gpus_per_machine
        hosts = np.arange(self.n_machines, dtype=np.int64)
        machines = np.concatenate([gpus, hosts])
        machines.flags.writeable = False
        return machines

    def machine_of(self, endpoint):
        """The machine of an endpoint id (or an array of them)."""
        return self.endpoint_machines[endpoint]

    def link_between(self, src: int, dst: int) -> Link:
        """The link a transfer from ``src`` to ``dst`` uses: ``intra_node`` within a machine."""
        return self.intra_node if self.machine_of(src) == self.machine_of(dst) else self.inter_node

    def describe(self) -> str:
        servers = f" + {self.server_machines} server machines" if self.server_machines else ""
        return (
            f"{self.machines} x {self.gpus_per_machine} GPUs{servers}; "
            f"intra_node {self.intra_node.describe()}; inter_node {self.inter_node.describe()}"
        )

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, key: str = "") -> "Cluster":
        """A cluster from a plain dict; errors name keys under ``key`` (e.g. ``cluster.machines``)."""
        if not isinstance(config, Mapping):
            raise TopologyError(key or "cluster", f"expected a mapping with machines, gpus_per_machine, ..., got {config!r}")
        _check_keys(config, CLUSTER_KEYS, key)
        config = with_fabric_links(config, key)
        fabric = Fabric.from_config(config, key) if wants_fabric(config) else None
        backend = config.get("backend", "nccl" if fabric is not None else "gloo")
        if backend not in BACKENDS:
            raise TopologyError(_join(key, "backend"), f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
        for required in ("machines", "gpus_per_machine", "intra_node", "inter_node"):
            if required not in config:
                examples = {
                    "machines": "machines: 4",
                    "gpus_per_machine": "gpus_per_machine: 8",
                    "intra_node": f"intra_node: nvlink2 (presets: {', '.join(preset_names('intra_node'))})",
                    "inter_node": f"inter_node: 25gbe (presets: {', '.join(preset_names('inter_node'))})",
                }
                raise TopologyError(_join(key, required), f"missing; write e.g. {examples[required]}")
        cluster = cls(
            machines=_count(config["machines"], _join(key, "machines"), 1),
            gpus_per_machine=_count(config["gpus_per_machine"], _join(key, "gpus_per_machine"), 1),
            intra_node=Link.from_config(config["intra_node"], _join(key, "intra_node"), "intra_node"),
            inter_node=Link.from_config(config["inter_node"], _join(key, "inter_node"), "inter_node"),
            server_machines=_count(config.get("server_machines", 0), _join(key, "server_machines"), 0),
            name=str(config.get("name", "")),
            shared_memory=(
                SharedMemory.from_config(config["shared_memory"], _join(key, "shared_memory"))
                if config.get("shared_memory") is not None else None
            ),
            backend=backend,
            fabric=fabric,
            cores_per_machine=(None if config.get("cores_per_machine") is None
                               else _count(config["cores_per_machine"], _join(key, "cores_per_machine"), 1)),
        )
        if cluster.fabric is not None and config.get("nccl") and fabric is None:
            calibration = Calibration.from_config(config["nccl"], _join(key, "nccl"))
            object.__setattr__(cluster, "fabric", dataclasses.replace(cluster.fabric, calibration=calibration))
        return cluster


def with_fabric_links(config: Mapping, key: str = "") -> Mapping:
    """``config`` with what the fabric it names supplies where it does not say: its
    ``gpus_per_machine`` and the two links of the single-NIC model (``Fabric.legacy_links``),
    which the parameter server and the shared-links ``Network`` use; a description without
    fabric keys as it is. A scenario's grid fills a cluster in this way before varying it."""
    if not isinstance(config, Mapping) or not wants_fabric(config):
        return config
    fabric = Fabric.from_config({k: v for k, v in config.items() if k != "machines"}, key)  # a grid may list them
    return {"gpus_per_machine": fabric.gpus_per_machine, **fabric.legacy_links(), **config}


def load_cluster(path: Union[str, Path], key: Optional[str] = None) -> Cluster:
    """A cluster from a YAML file; ``key`` picks a sub-mapping (e.g. ``cluster`` in a scenario)."""
    path = Path(path)
    try:
        data = read_yaml(path)
    except TopologyError as err:
        raise TopologyError(str(path), err.message) from None
    if key is not None:
        if not isinstance(data, Mapping) or key not in data:
            raise TopologyError(f"{path}:{key}", "missing")
        data = data[key]
    return Cluster.from_config(data, key or "")
