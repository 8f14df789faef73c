"""GPU fabrics as they are built: GPUs, NVLink domains, NICs, and the network above them.

A :class:`Fabric` is the hardware a communication library sees, described by data (Calculon's
approach) from three preset files beside this module: ``gpus.yaml`` (what a GPU brings: NVLink
links and their bandwidth, NVLink SHARP, PCIe), ``nics.yaml`` (a NIC's rate and transport) and
``machines.yaml`` (a machine: its GPUs, its NVLink domain, its NICs, its CPU). A cluster YAML
names a machine and says how many::

    machine: dgx_h100        # 8 H100 on NVSwitches, 8 x 400 Gb/s NDR, one NIC per GPU
    machines: 16
    network: {machines_per_leaf: 32, oversubscription: 1}   # optional

and may override any of the machine's keys (``gpu``, ``gpus_per_machine``, ``nvlink_domain``,
``nvswitch``, ``nics_per_machine``, ``nic``, ``cpu``). Without ``machine`` the keys describe the
machine themselves (``gpu`` is then required).

How the pieces connect, and what each model assumes:

* **NVLink domain.** ``nvlink_domain`` GPUs reach each other over NVLink; with ``nvswitch`` each
  at its full NVLink bandwidth (``nvlinks x nvlink_bandwidth`` per direction). A domain is a
  machine's baseboard (8 GPUs) or several machines joined by NVLink Switch trays (GB200 NVL72:
  18 trays of 4, one domain of 72). NCCL calls a domain a *node* (with multi-node NVLink it
  treats the clique as one), and so do the collective models.
* **NICs, rail-optimised.** A machine's ``nics_per_machine`` NICs are spread evenly over its
  GPUs: GPU ``i`` of a machine uses NIC ``i * nics / gpus`` (a DGX's GPU i to NIC i; two NICs
  per GPU on an AWS p5 of 32). A GPU reaches its NICs through PCIe, so it moves at most its
  PCIe bandwidth into them.
* **Network tiers.** NIC ``i`` of every machine hangs off rail ``i`` (``rails: true``, the default
  of DGX SuperPODs); ``machines_per_leaf`` machines share a leaf switch (0: every machine on one
  non-blocking switch tier), and the links above a leaf are ``oversubscription`` times thinner
  than those below it. ``sharp: true`` says the switches can reduce (InfiniBand SHARP), which
  enables NCCL's CollNet algorithms.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping, Optional

from .nccl.tuning import ALGORITHMS, LINK_CLASSES, PROTOCOLS, parse_choices
from .nccl.measured import KINDS as MEASURED_KINDS
from .nccl.measured import SPEC, Measured, public
from .nccl.versions import parse_version
from .units import TopologyError, gigabytes_per_s, parse_bandwidth, parse_fraction, parse_latency, parse_size
from .yamlfile import load_preset

FABRIC_KEYS = ("machine", "gpu", "nvlink_domain", "nvswitch", "nics_per_machine", "nic", "cpu", "network", "nccl")
_MACHINE_KEYS = ("gpu", "gpus_per_machine", "nvlink_domain", "nvswitch", "nics_per_machine", "nic", "cpu")
_GPU_KEYS = ("compute_capability", "nvlinks", "nvlink_bandwidth", "nccl_nvlink_bandwidth", "nvls", "pcie", "memory")
_NIC_KEYS = ("preset", "bandwidth", "transport", "kind", "latency", "efficiency")
_NETWORK_KEYS = ("rails", "machines_per_leaf", "oversubscription", "sharp")
TRANSPORTS = ("ib", "roce", "efa", "socket", "ofi")
CPUS = ("intel", "amd", "arm")

# PCIe x16 as NCCL's topology model counts it (src/graph/topo.cc: width * speed / 80 GB/s with
# kvDictPciGen's 60, 120, 240, 480 per lane for 8, 16, 32, 64 GT/s): gen3 12 GB/s ... gen6 96.
PCIE_X16_GB_S = {"gen3": 12.0, "gen4": 24.0, "gen5": 48.0, "gen6": 96.0}


def _normalize(name: str) -> str:
    return "".join(ch for ch in str(name).lower() if ch not in " -_")


def _check_keys(config: Mapping, allowed: tuple, key: str) -> None:
    for k in config:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TopologyError(f"{key}.{k}" if key else str(k), f"unknown key; {hint}known keys: {', '.join(allowed)}")


@functools.lru_cache(maxsize=None)
def _presets(kind: str) -> dict:
    source = resources.files(__package__).joinpath("presets", f"{kind}.yaml")
    data = load_preset(source.read_text(encoding="utf-8")) or {}
    return {_normalize(name): (str(name), entry) for name, entry in data.items()}


def _preset(kind: str, name: Any, key: str) -> tuple:
    if not isinstance(name, str):
        raise TopologyError(key, f"expected a {kind[:-1]} preset name, got {name!r}")
    found = _presets(kind).get(_normalize(name))
    if found is None:
        known = [n for n, _ in _presets(kind).values()]
        close = difflib.get_close_matches(_normalize(name), list(_presets(kind)), n=2, cutoff=0.5)
        hint = f"did you mean {' or '.join(_presets(kind)[c][0] for c in close)}? " if close else ""
        raise TopologyError(key, f"unknown {kind[:-1]} {name!r}; {hint}known: {', '.join(known)}")
    return found


def preset_names(kind: str) -> list:
    """Names of the ``gpus``, ``nics`` or ``machines`` presets."""
    return [name for name, _ in _presets(kind).values()]


def gpu_chip(preset: str) -> str:
    """The chip a GPU preset is: a preset named ``CHIP_VARIANT`` (``a100_40gb``) is ``CHIP``'s
    part with other memory, whose kernels run as fast."""
    return str(preset).partition("_")[0]


def gpu_of_device(device_name: str) -> Optional[str]:
    """The GPU preset a CUDA device name is (``NVIDIA H100 80GB HBM3``: ``h100``; ``Tesla
    V100-SXM2-32GB``: ``v100``; ``NVIDIA GH200 480GB``: ``gh200``, the longest preset name the
    device's contains), or None."""
    device = _normalize(device_name)
    found = [(len(key), name) for key, (name, _) in _presets("gpus").items() if key in device]
    return max(found)[1] if found else None


def _count(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise TopologyError(key, f"must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(key, f"must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class Gpu:
    """A GPU as communication sees it; bandwidths per direction."""

    name: str
    compute_capability: int
    nvlinks: int
    nvlink_bandwidth_bytes_per_us: float       # per link, the datasheet's
    nccl_nvlink_bandwidth_bytes_per_us: float  # per link, NCCL's topology model's
    nvls: bool
    pcie: str
    memory_bytes: Optional[float] = None  # what a job can use (None: not known)

    @property
    def nvlink_total_bytes_per_us(self) -> float:
        """All NVLinks together as NCCL counts them (links x SMxx_NVLINK_BW)."""
        return self.nvlinks * self.nccl_nvlink_bandwidth_bytes_per_us

    @property
    def pcie_bytes_per_us(self) -> float:
        return gigabytes_per_s(PCIE_X16_GB_S[self.pcie])

    @classmethod
    def from_config(cls, value: Any, key: str) -> "Gpu":
        name, entry = _preset("gpus", value, key)
        where = f"gpus.yaml:{name}"
        _check_keys(entry, _GPU_KEYS, where)
        pcie = str(entry.get("pcie", "gen4")).lower()
        if pcie not in PCIE_X16_GB_S:
            raise TopologyError(f"{where}.pcie", f"must be one of {', '.join(PCIE_X16_GB_S)}, got {pcie!r}")
        nvlinks = _count(entry.get("nvlinks", 0), f"{where}.nvlinks", 0)
        zero = "0GB/s"
        return cls(
            name=name,
            compute_capability=_count(entry["compute_capability"], f"{where}.compute_capability", 30),
            nvlinks=nvlinks,
            nvlink_bandwidth_bytes_per_us=_bandwidth0(entry.get("nvlink_bandwidth", zero), f"{where}.nvlink_bandwidth"),
            nccl_nvlink_bandwidth_bytes_per_us=_bandwidth0(entry.get("nccl_nvlink_bandwidth", zero), f"{where}.nccl_nvlink_bandwidth"),
            nvls=_flag(entry.get("nvls", False), f"{where}.nvls"),
            pcie=pcie,
            memory_bytes=parse_size(entry["memory"], f"{where}.memory") if "memory" in entry else None,
        )


def _bandwidth0(value: Any, key: str) -> float:
    """A bandwidth that may be zero (a GPU without NVLink)."""
    if isinstance(value, str) and value.strip().split("G")[0].strip() in ("0", "0.0"):
        return 0.0
    return parse_bandwidth(value, key)


@dataclass(frozen=True)
class Nic:
    """One NIC port: ``bandwidth_bytes_per_us`` per direction, over ``transport``.

    ``kind`` says which measured constants apply (``nccl/measured.py``: per-hop latency and
    achieved rate by NIC kind, e.g. ``efa2`` for AWS's second EFA generation, ``tcpxo`` for
    Google's GPUDirect-TCPXO); it defaults to the transport.
    """

    name: str
    bandwidth_bytes_per_us: float
    transport: str = "ib"
    latency_us: float = 0.0
    efficiency: float = 1.0
    kind: str = ""

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", self.transport)

    @property
    def effective_bandwidth_bytes_per_us(self) -> float:
        return self.bandwidth_bytes_per_us * self.efficiency

    @classmethod
    def from_config(cls, value: Any, key: str) -> "Nic":
        if isinstance(value, Nic):
            return value
        if isinstance(value, str):
            value = {"preset": value}
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected a NIC preset ({', '.join(preset_names('nics'))}) or a mapping, got {value!r}")
        _check_keys(value, _NIC_KEYS, key)
        name, base = _preset("nics", value["preset"], f"{key}.preset") if "preset" in value else ("", {})
        merged = {**base, **{k: v for k, v in value.items() if k != "preset"}}
        if "bandwidth" not in merged:
            raise TopologyError(f"{key}.bandwidth", "missing; write e.g. bandwidth: 400Gbps, or a preset")
        transport = str(merged.get("transport", "ib")).lower()
        if transport not in TRANSPORTS:
            raise TopologyError(f"{key}.transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        overridden = any(k in value for k in _NIC_KEYS[1:])
        kind = str(merged.get("kind", transport)).lower()
        if kind not in MEASURED_KINDS:
            raise TopologyError(f"{key}.kind", f"must be one of {', '.join(MEASURED_KINDS)}, got {kind!r}")
        return cls(
            name=(f"{name}*" if overridden else name) if name else "custom",
            bandwidth_bytes_per_us=parse_bandwidth(merged["bandwidth"], f"{key}.bandwidth"),
            transport=transport,
            latency_us=parse_latency(merged.get("latency", 0), f"{key}.latency"),
            efficiency=parse_fraction(merged.get("efficiency", 1.0), f"{key}.efficiency"),
            kind=kind,
        )


@dataclass(frozen=True)
class Network:
    """The switches above the NICs; see the module docstring."""

    rails: bool = True
    machines_per_leaf: int = 0
    oversubscription: float = 1.0
    sharp: bool = False

    @classmethod
    def from_config(cls, value: Any, key: str) -> "Network":
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected {{rails: true, machines_per_leaf: 32, oversubscription: 1, sharp: false}}, got {value!r}")
        _check_keys(value, _NETWORK_KEYS, key)
        over = value.get("oversubscription", 1.0)
        if isinstance(over, bool) or not isinstance(over, (int, float)) or not over >= 1:
            raise TopologyError(f"{key}.oversubscription", f"must be a number >= 1 (uplinks this many times thinner), got {over!r}")
        return cls(
            rails=_flag(value.get("rails", True), f"{key}.rails"),
            machines_per_leaf=_count(value.get("machines_per_leaf", 0), f"{key}.machines_per_leaf", 0),
            oversubscription=float(over),
            sharp=_flag(value.get("sharp", False), f"{key}.sharp"),
        )


NODE_CLASSES = ("2", "3+")


def node_class(n_nodes: int) -> str:
    """The node-count class of a communicator across ``n_nodes`` nodes (NVLink domains), as
    NCCL's tuner keys its ceilings (``tuning.cc``'s N1 / N2 / N4 columns, ``index2 = nNodes <= 2
    ? nNodes-1 : 2``): "2" or "3+"; "" for one node, whose link class already says so."""
    return "" if n_nodes <= 1 else "2" if n_nodes == 2 else "3+"


@dataclass(frozen=True)
class Calibration:
    """What measurements say that specs cannot: per link class and (algorithm, protocol), the
    fraction of the modelled bandwidth the fabric delivers and a factor on the modelled latency.

    ``factors`` holds ``(link, algorithm, protocol, bandwidth, latency[, nodes])`` rows; ``*``
    stands for any algorithm or protocol. ``nodes`` (a :func:`node_class`, "" or absent for any)
    keeps a factor to communicators of that node count: ``whatif calibrate`` writes it for trees,
    whose shape across two nodes is not their shape across more (``calibrate.factor_nodes``;
    YAML: ``tree/simple@2``, ``tree/simple@3+``). ``version`` is the NCCL release the cluster runs (``2.26.2``):
    it decides which algorithms exist and how NCCL's tuner picks among them
    (``nccl/versions.py``); without it, the newest modelled. ``measured`` are the constants
    only measurements give (``nccl/measured.py``): ``spec`` for none, else the public tables'
    estimates. ``min_channels`` is ``NCCL_MIN_NCHANNELS``; ``algorithm`` and ``protocol`` are
    ``NCCL_ALGO`` and ``NCCL_PROTO`` (``ring``, ``ring,tree``, ``^nvls``; empty: NCCL's
    choice), which every collective on the cluster obeys unless its caller forces its own. YAML
    (``whatif calibrate nccl-tests`` writes the factors)::

        nccl:
          version: 2.26.2
          measured: spec
          min_channels: 24
          algorithm: ring        # NCCL_ALGO
          protocol: ^ll          # NCCL_PROTO
          source: whatif calibrate nccl-tests ...
          net:
            ring/simple: {bandwidth: 0.93, latency: 1.2}
            tree/simple@3+: {bandwidth: 1.1}
            "*": {bandwidth: 0.95}
    """

    factors: tuple = ()
    source: str = ""
    version: tuple = ()
    measured: Optional[Measured] = None  # None: the public tables' estimates (nccl/measured.py)
    min_channels: int = 0  # NCCL_MIN_NCHANNELS (NCCL_MIN_CTAS): rings and trees run on at least this many
    algorithm: str = ""  # NCCL_ALGO ("": NCCL chooses)
    protocol: str = ""  # NCCL_PROTO ("": NCCL chooses)

    @property
    def constants(self) -> Measured:
        """The measured constants the model uses: this cluster's, else the public estimates."""
        return public() if self.measured is None else self.measured

    def factors_for(self, link: str, algorithm: str, protocol: str, n_nodes: int = 1) -> tuple:
        """``(bandwidth, latency)`` factors on a communicator across ``n_nodes`` nodes: the most
        specific row that matches (a row of its node class before one for any), else ``(1, 1)``."""
        wanted = node_class(n_nodes)
        for want in ((algorithm, protocol), (algorithm, "*"), ("*", "*")):
            for nodes in dict.fromkeys((wanted, "")):
                for row in self.factors:
                    if row[0] == link and (row[1], row[2]) == want and _row_nodes(row) == nodes:
                        return row[3], row[4]
        return 1.0, 1.0

    def as_config(self) -> dict:
        out: dict = {"version": ".".join(str(v) for v in self.version)} if self.version else {}
        if self.measured is not None:
            out["measured"] = "spec" if self.measured == SPEC else self.measured.as_config()
        if self.min_channels:
            out["min_channels"] = self.min_channels
        out.update({k: getattr(self, k) for k in ("algorithm", "protocol") if getattr(self, k)})
        if self.source:
            out["source"] = self.source
        for row in self.factors:
            link, algorithm, protocol, bandwidth, latency = row[:5]
            name = ("*" if algorithm == "*" else f"{algorithm}/{protocol}") + (f"@{_row_nodes(row)}" if _row_nodes(row) else "")
            out.setdefault(link, {})[name] = {"bandwidth": round(float(bandwidth), 4), "latency": round(float(latency), 4)}
        return out

    @classmethod
    def from_config(cls, value: Any, key: str) -> "Calibration":
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected {{version: 2.26.2, net: {{ring/simple: {{bandwidth: 0.9, latency: 1.1}}}}}}, "
                                     f"got {value!r}")
        _check_keys(value, ("version", "measured", "min_channels", "algorithm", "protocol", "source") + LINK_CLASSES, key)
        rows = []
        for link in LINK_CLASSES:
            entries = value.get(link) or {}
            if not isinstance(entries, Mapping):
                raise TopologyError(f"{key}.{link}", f"expected a mapping of ALGORITHM/PROTOCOL to factors, got {entries!r}")
            for name, factors in entries.items():
                where = f"{key}.{link}.{name}"
                pair, _, nodes = str(name).partition("@")
                if nodes and nodes not in NODE_CLASSES:
                    raise TopologyError(where, f"unknown node class {nodes!r} after @; known: {', '.join(NODE_CLASSES)}")
                algorithm, _, protocol = pair.partition("/")
                protocol = protocol or "*"
                if algorithm != "*" and algorithm not in ALGORITHMS + ("p2p",):
                    raise TopologyError(where, f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}, p2p, *")
                if protocol != "*" and protocol not in PROTOCOLS:
                    raise TopologyError(where, f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}, *")
                if not isinstance(factors, Mapping):
                    raise TopologyError(where, f"expected {{bandwidth: 0.9, latency: 1.1}}, got {factors!r}")
                _check_keys(factors, ("bandwidth", "latency"), where)
                bandwidth = _factor(factors.get("bandwidth", 1.0), f"{where}.bandwidth")
                latency = _factor(factors.get("latency", 1.0), f"{where}.latency")
                rows.append((link, algorithm, protocol, bandwidth, latency, nodes))
        version = parse_version(value["version"], f"{key}.version") if value.get("version") is not None else ()
        measured = Measured.from_config(value["measured"], f"{key}.measured") if "measured" in value else None
        if value.get("measured") == "public":
            measured = None
        min_channels = _count(value.get("min_channels", 0), f"{key}.min_channels", 0)
        forced = {k: "" if value.get(k) is None else str(value[k]) for k in ("algorithm", "protocol")}
        try:
            parse_choices(forced["algorithm"] or None, forced["protocol"] or None)
        except TopologyError as err:
            raise TopologyError(f"{key}.{err.key}", err.message) from None
        return cls(tuple(rows), str(value.get("source", "")), version, measured, min_channels, **forced)


def _row_nodes(row: tuple) -> str:
    return row[5] if len(row) > 5 else ""


def _factor(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 100):
        raise TopologyError(key, f"must be a positive factor, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Fabric:
    """``machines`` machines of ``gpus_per_machine`` GPUs; see the module docstring.

    GPU ``g`` (numbered machine by machine, as ``Cluster`` numbers them) is on machine
    ``g // gpus_per_machine`` and in NVLink domain ``g // nvlink_domain``; a cluster smaller
    than a domain (8 trays of an NVL72 rack) uses part of one.
    """

    gpu: Gpu
    machines: int
    gpus_per_machine: int
    nvlink_domain: int
    nvswitch: bool
    nics_per_machine: int
    nic: Nic
    cpu: str = "intel"
    network: Network = field(default_factory=Network)
    machine: str = ""
    calibration: Calibration = field(default_factory=Calibration)

    def __post_init__(self):
        g, d = self.gpus_per_machine, self.nvlink_domain
        if d > g and d % g:
            raise TopologyError("nvlink_domain", f"a domain spanning machines must hold whole machines of {g} GPUs, got {d}")
        if d < g and g % d:
            raise TopologyError("nvlink_domain", f"must divide gpus_per_machine ({g}) or be a multiple of it, got {d}")
        if self.gpu.nvlinks == 0 and d > 1:
            raise TopologyError("nvlink_domain", f"{self.gpu.name} has no NVLink; leave nvlink_domain out (or 1)")

    @property
    def n_gpus(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def nvlink(self) -> bool:
        """GPUs of a domain talk over NVLink (else over PCIe and host memory)."""
        return self.gpu.nvlinks > 0 and self.nvlink_domain > 1

    @property
    def node_size(self) -> int:
        """GPUs per NCCL node: the NVLink domain, or the machine where there is none."""
        return self.nvlink_domain if self.nvlink else self.gpus_per_machine

    def node_of(self, gpu: int) -> int:
        return gpu // self.node_size

    def machine_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_machine

    @property
    def nics_per_gpu(self) -> float:
        return self.nics_per_machine / self.gpus_per_machine

    @property
    def fused(self) -> bool:
        """Whether each GPU's several NICs act as one network device: NCCL merges the ports of one
        card (``NCCL_NET_MERGE_LEVEL``), AWS's plugin stripes over a GPU's EFA devices."""
        return self.nics_per_machine > self.gpus_per_machine and self.nics_per_machine % self.gpus_per_machine == 0

    @property
    def net_devices_per_machine(self) -> int:
        """The network devices NCCL sees on a machine: its NICs, or one fused device per GPU."""
        return self.gpus_per_machine if self.fused else self.nics_per_machine

    @property
    def net_device_bytes_per_us(self) -> float:
        """One network device's bandwidth, per direction."""
        per = self.nics_per_machine // self.gpus_per_machine if self.fused else 1
        return per * self.nic.effective_bandwidth_bytes_per_us

    def device_of(self, gpu: int) -> int:
        """The (cluster-wide) network device rail-assigned to ``gpu``."""
        local = gpu % self.gpus_per_machine
        per_machine = self.net_devices_per_machine
        return self.machine_of(gpu) * per_machine + local * per_machine // self.gpus_per_machine

    @property
    def gpu_network_bytes_per_us(self) -> float:
        """What one GPU can push into the network: its NICs' share, at most its PCIe link."""
        share = self.nic.effective_bandwidth_bytes_per_us * max(self.nics_per_gpu, 0.0)
        return min(share, self.gpu.pcie_bytes_per_us)

    def describe(self) -> str:
        what = f"{self.machine}: " if self.machine else ""
        domain = f", NVLink domain {self.nvlink_domain}" if self.nvlink else ", PCIe"
        return (f"{what}{self.machines} x {self.gpus_per_machine} {self.gpu.name}{domain}, "
                f"{self.nics_per_machine} x {self.nic.name} per machine")

    def legacy_links(self) -> dict:
        """``intra_node`` and ``inter_node`` for the single-NIC model of ``cluster.py``.

        ``intra_node`` is one GPU's NVLink (or PCIe) at NCCL's modelled rate; ``inter_node``
        a machine's NICs together, so that model's one NIC per machine carries what all of them
        carry. Latencies are NCCL's per-step Ring/Simple ones (tuning.cc: NVLink 3.4 us, PCI
        5.7 us, NET 14 us) plus the NIC's own.
        """
        if self.nvlink:
            intra = {"bandwidth": f"{self.gpu.nvlinks * self.gpu.nvlink_bandwidth_bytes_per_us}MB/s", "latency": "3.4us",
                     "efficiency": self.gpu.nccl_nvlink_bandwidth_bytes_per_us / self.gpu.nvlink_bandwidth_bytes_per_us}
        else:
            intra = {"bandwidth": f"{self.gpu.pcie_bytes_per_us}MB/s", "latency": "5.7us"}
        inter = {"bandwidth": f"{self.nics_per_machine * self.nic.bandwidth_bytes_per_us}MB/s",
                 "latency": f"{14.0 + self.nic.latency_us}us", "efficiency": self.nic.efficiency}
        return {"intra_node": intra, "inter_node": inter}

    @classmethod
    def from_config(cls, config: Mapping, key: str = "") -> "Fabric":
        """A fabric from a cluster mapping's ``machine``, ``gpu``, ``nic``, ... keys."""

        def at(sub: str) -> str:
            return f"{key}.{sub}" if key else sub

        base: dict = {}
        name = ""
        if "machine" in config:
            name, base = _preset("machines", config["machine"], at("machine"))
            _check_keys(base, _MACHINE_KEYS, f"machines.yaml:{name}")
        spec = {**base, **{k: config[k] for k in _MACHINE_KEYS if k in config}}
        if "gpu" not in spec:
            raise TopologyError(at("gpu"), f"missing; write e.g. machine: dgx_h100 ({', '.join(preset_names('machines'))}) "
                                           f"or gpu: h100 ({', '.join(preset_names('gpus'))})")
        gpu = Gpu.from_config(spec["gpu"], at("gpu"))
        per_machine = _count(spec.get("gpus_per_machine", config.get("gpus_per_machine", 1)), at("gpus_per_machine"))
        default_domain = per_machine if gpu.nvlinks else 1
        if "nvlink_domain" not in config and base.get("nvlink_domain") == base.get("gpus_per_machine"):
            spec.pop("nvlink_domain", None)  # a machine's own NVLink domain: its GPUs, however many are used
        cpu = str(spec.get("cpu", "intel")).lower()
        if cpu not in CPUS:
            raise TopologyError(at("cpu"), f"must be one of {', '.join(CPUS)}, got {cpu!r}")
        return cls(
            gpu=gpu,
            machines=_count(config.get("machines", 1), at("machines")),
            gpus_per_machine=per_machine,
            nvlink_domain=_count(spec.get("nvlink_domain", default_domain), at("nvlink_domain")),
            nvswitch=_flag(spec.get("nvswitch", gpu.nvlinks > 0), at("nvswitch")),
            nics_per_machine=_count(spec.get("nics_per_machine", 1), at("nics_per_machine")),
            nic=Nic.from_config(spec.get("nic", "ib_ndr"), at("nic")),
            cpu=cpu,
            network=Network.from_config(config.get("network"), at("network")),
            machine=name,
            calibration=Calibration.from_config(config["nccl"], at("nccl")) if config.get("nccl") else Calibration(),
        )


def wants_fabric(config: Mapping) -> bool:
    """Whether a cluster mapping describes a GPU fabric (any of :data:`FABRIC_KEYS` but ``nccl``)."""
    return any(k in config for k in FABRIC_KEYS if k != "nccl")


def fabric_from_links(machines: int, gpus_per_machine: int, intra_name: str, intra_bytes_per_us: float,
                      inter_bytes_per_us: float, inter_latency_us: float) -> Fabric:
    """The fabric an old-style cluster (two links) stands for, for the NCCL backend.

    The GPU is guessed from the intra-node link's preset (nvlink2: V100, nvlink3: A100, else a
    PCIe A10G-class GPU); its NVLink runs at the link's rate; one NIC per machine at the
    inter-node link's rate, over sockets, its latency beyond NCCL's InfiniBand constants.
    """
    guess = {"nvlink2": "v100", "nvlink3": "a100", "nvlink4": "h100", "nvlink5": "b200"}.get(intra_name.rstrip("*"), "a10g")
    gpu = Gpu.from_config(guess, "intra_node")
    if gpu.nvlinks:
        per_link = intra_bytes_per_us / gpu.nvlinks
        gpu = Gpu(gpu.name, gpu.compute_capability, gpu.nvlinks, per_link, per_link, gpu.nvls, gpu.pcie)
    nic = Nic("inter_node", inter_bytes_per_us, "socket", max(0.0, inter_latency_us - 14.0))
    return Fabric(gpu, machines, gpus_per_machine, gpus_per_machine if gpu.nvlinks else 1, gpu.nvlinks > 0, 1, nic)
