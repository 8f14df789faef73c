"""What only measurements can say: launch costs, per-hop latencies and achieved line rates.

NCCL's tuner (``versions.py``) and the vendors' specs give the structure of a collective's time
and most of its constants, but not all of them:

* ``kernel_us[arch]``: what a collective costs on the GPU beyond NCCL's latencies (the kernel's
  launch and its first work descriptor), the same for every algorithm, so NCCL leaves it out;
  by GPU generation (Volta, Ampere, Hopper, Blackwell), whose launch paths differ.
* ``hop_us[kind]``: what one network hop costs beyond NCCL's InfiniBand-tuned constants, by
  NIC kind: EFA's SRD through libfabric and the aws-ofi-nccl plugin (three generations),
  Google's GPUDirect-TCPX(O) plugins and its RoCE plugin gIB, HPE Slingshot through libfabric's
  CXI provider, RoCE and InfiniBand themselves.
* ``efficiency[kind]``: the fraction of NCCL's network-bound bandwidth a NIC kind delivers
  (not estimated from the public tables, see :func:`fit`; 1 unless set).
* ``link_efficiency[link]``: the same for what crosses no network, by link class (``nvlink``,
  ``pci``): the share of the NVLink or PCIe rate NCCL's kernels reach on this machine (clocks,
  NVLink generation's real rate, ACS); ``nvls`` for what NVLS and NVLS tree move through the
  NVSwitch's multicast and reduction, a rate of its own (``model.local_link``); fitted only from
  a cluster's own tables, like ``efficiency``. With the kernel start and the per-hop latency these are physical constants of
  a machine and its NICs, the same at every scale, so a calibration at one scale carries to
  another (``whatif calibrate nccl-tests``).
* ``p2p_efficiency``: the same for point-to-point traffic between nodes (all-to-all), whose
  per-peer connections move far less than a ring's.
* ``host_launch_us``, ``host_call_us``: what nccl-tests' host thread spends per iteration and
  GPU (a launch) and per NCCL call (all-to-all makes ``2n`` of them), which bounds a table's
  time when one thread drives several GPUs (``-g 8``): ``T = max(T_gpu, g (launch + calls x
  call))``. This is the benchmark's, not the collective's, so :func:`whatif.topology.collective_cost`
  never adds it; the bench and ``whatif calibrate nccl-tests`` compare tables with it.

:data:`SPEC` has none of them (0 us, full rate): predictions from NCCL's constants and the
vendors' specs alone. :func:`public` loads the estimates shipped in ``presets/measured.yaml``,
fitted to the public nccl-tests tables of ``bench/nccl_tests`` (``bench/nccl_accuracy.py
--write-measured``), which clusters use unless their ``nccl:`` block says ``measured: spec``.
:func:`fit` estimates them from any set of table rows: least squares on the log of the time,
each table weighted equally, a constant that no row informs left at its SPEC value.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..units import TopologyError
from ..yamlfile import load_preset

ARCHS = ("volta", "turing", "ampere", "hopper", "blackwell")
KINDS = ("ib", "roce", "gib", "efa1", "efa2", "efa3", "efa", "tcpx", "tcpxo", "socket", "slingshot", "ofi")
LINKS = ("nvlink", "nvls", "pci")
#: How lightly :func:`fit` holds a rate to its prior: a residual of ``RATE_PULL x log(rate /
#: prior)`` beside the rows' (each ``log(predicted / measured)``, a table's rows weighing one in
#: all). A rate the rows determine moves as they say (one at 0.8 where they say so costs as much
#: as 0.7 % of error on one row); where they determine only a product of two, this chooses.
RATE_PULL = 0.03
BOUNDS = {"kernel_us": (0.0, 40.0), "hop_us": (0.0, 200.0), "efficiency": (0.1, 1.5), "link_efficiency": (0.1, 1.5),
          "p2p_efficiency": (0.1, 1.5),
          "host_launch_us": (0.0, 20.0), "host_call_us": (0.0, 5.0)}


def at_bound(value: float, bounds: tuple) -> bool:
    """Whether a fitted ``value`` is at (within 0.1 % of) either end of its ``bounds``, which
    both are above 0: where a bounded least-squares fit leaves a parameter, the rows want more
    than any value it allows."""
    lo, hi = bounds
    return value <= lo * (1 + 1e-3) or value >= hi * (1 - 1e-3)


@dataclass(frozen=True)
class Measured:
    """See the module docstring; ``kernel_us``, ``hop_us``, ``efficiency`` and ``link_efficiency``
    are ``((key, value), ...)`` by GPU generation, NIC kind or link class."""

    kernel_us: tuple = ()
    hop_us: tuple = ()
    efficiency: tuple = ()
    link_efficiency: tuple = ()
    p2p_efficiency: float = 1.0
    host_launch_us: float = 0.0
    host_call_us: float = 0.0
    source: str = "spec"
    fitted_on: tuple = field(default=(), compare=False)

    def kernel(self, arch: str) -> float:
        return _lookup(self.kernel_us, arch, "", 0.0)

    def hop(self, kind: str, transport: str = "") -> float:
        return _lookup(self.hop_us, kind, transport, 0.0)

    def net_efficiency(self, kind: str, transport: str = "") -> float:
        return _lookup(self.efficiency, kind, transport, 1.0)

    def local_efficiency(self, link: str) -> float:
        return _lookup(self.link_efficiency, link, "", 1.0)

    def at_bounds(self) -> list:
        """The rates (``efficiency``, ``link_efficiency``, ``p2p_efficiency``) at a bound of
        :data:`BOUNDS`, each as ``nvls at 1.5``: where a fit puts one, no rate it allows
        explains the rows, and the other constants have bent to make up for it."""
        out = []
        for name, pairs in (("efficiency", self.efficiency), ("link_efficiency", self.link_efficiency),
                            ("p2p_efficiency", (("p2p", self.p2p_efficiency),))):
            out += [f"{key} at {value:.2g}" for key, value in pairs if at_bound(value, BOUNDS[name])]
        return out

    def host_us(self, gpus_per_thread: int, calls_per_gpu: int) -> float:
        """nccl-tests' host time per iteration for one thread driving ``gpus_per_thread`` GPUs."""
        return gpus_per_thread * (self.host_launch_us + calls_per_gpu * self.host_call_us)

    def as_config(self) -> dict:
        return {"source": self.source, "kernel_us": {k: round(v, 3) for k, v in self.kernel_us},
                "hop_us": {k: round(v, 3) for k, v in self.hop_us},
                "efficiency": {k: round(v, 4) for k, v in self.efficiency},
                **({"link_efficiency": {k: round(v, 4) for k, v in self.link_efficiency}}
                   if self.link_efficiency else {}),
                "p2p_efficiency": round(self.p2p_efficiency, 4), "host_launch_us": round(self.host_launch_us, 3),
                "host_call_us": round(self.host_call_us, 3), "fitted_on": list(self.fitted_on)}

    @classmethod
    def from_config(cls, value: Any, key: str = "measured") -> "Measured":
        if value == "spec":
            return SPEC
        if value in (None, "public"):
            return public()
        if not isinstance(value, Mapping):
            raise TopologyError(key, f"expected spec, public, or a mapping of measured constants, got {value!r}")
        allowed = ("source", "kernel_us", "hop_us", "efficiency", "link_efficiency", "p2p_efficiency",
                   "host_launch_us", "host_call_us", "fitted_on")
        for k in value:
            if k not in allowed:
                raise TopologyError(f"{key}.{k}", f"unknown key; known keys: {', '.join(allowed)}")
        pairs = {}
        for name, known, what in (("kernel_us", ARCHS, "GPU generation"), ("hop_us", KINDS, "NIC kind"),
                                  ("efficiency", KINDS, "NIC kind"), ("link_efficiency", LINKS, "link class")):
            entries = value.get(name) or {}
            if not isinstance(entries, Mapping):
                raise TopologyError(f"{key}.{name}", f"expected a mapping of {what} to a number, got {entries!r}")
            for kind, number in entries.items():
                if kind not in known:
                    raise TopologyError(f"{key}.{name}.{kind}", f"unknown {what}; known: {', '.join(known)}")
                pairs.setdefault(name, []).append((str(kind), _number(number, f"{key}.{name}.{kind}", BOUNDS[name])))
        return cls(kernel_us=tuple(pairs.get("kernel_us", ())),
                   hop_us=tuple(pairs.get("hop_us", ())), efficiency=tuple(pairs.get("efficiency", ())),
                   link_efficiency=tuple(pairs.get("link_efficiency", ())),
                   p2p_efficiency=_number(value.get("p2p_efficiency", 1.0), f"{key}.p2p_efficiency",
                                          BOUNDS["p2p_efficiency"]),
                   host_launch_us=_number(value.get("host_launch_us", 0.0), f"{key}.host_launch_us",
                                          BOUNDS["host_launch_us"]),
                   host_call_us=_number(value.get("host_call_us", 0.0), f"{key}.host_call_us", BOUNDS["host_call_us"]),
                   source=str(value.get("source", "")), fitted_on=_names(value.get("fitted_on")))


def _names(value: Any) -> tuple:
    """The tables a fit names (``fitted_on``): a list of them, or one name."""
    if value is None or value == "":
        return ()
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else (str(value),)


def _lookup(pairs: tuple, kind: str, transport: str, default: float) -> float:
    for want in (kind, transport):
        for k, v in pairs:
            if k == want:
                return v
    return default


def _number(value: Any, key: str, bounds: tuple) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not bounds[0] <= value <= bounds[1]:
        raise TopologyError(key, f"must be a number in [{bounds[0]}, {bounds[1]}], got {value!r}")
    return float(value)


SPEC = Measured()


@functools.lru_cache(maxsize=1)
def public() -> Measured:
    """The constants fitted to the public tables (``presets/measured.yaml``)."""
    source = resources.files(__package__.rsplit(".", 1)[0]).joinpath("presets", "measured.yaml")
    try:
        data = load_preset(source.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        return SPEC
    return Measured.from_config(data, "measured.yaml")


# -- fitting -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One table row as the model decomposes it under :data:`SPEC` (see :func:`fit`).

    ``time_us = max(gpu, host)`` with ``gpu = latency_us + kernel[arch] + hops x hop[kind] +
    local_us / link_efficiency[link] + net_us / efficiency[kind] + ceiling_us`` (``combine``
    "sum"; "max": the larger of the two transfers, for all-to-all, whose NVLink and network
    parts run at once), and ``host = gpus_per_thread x (launch + calls x call)``; ``ceiling_us``
    is the transfer a per-channel ceiling of NCCL's kernels sets, which no link's efficiency
    moves (``model.link_share``).
    """

    table: str
    arch: str
    measured_us: float
    latency_us: float
    hops: float
    kind: str
    local_us: float
    net_us: float
    p2p: bool
    combine: str
    gpus_per_thread: int
    calls: int
    algorithm: str = ""
    link: str = "nvlink"
    ceiling_us: float = 0.0


class _Arrays:
    """:class:`Row` fields as arrays, for fast predictions while fitting."""

    def __init__(self, rows: Sequence[Row], kinds: Sequence[str], archs: Sequence[str]):
        self.latency = np.array([r.latency_us for r in rows])
        self.hops = np.array([r.hops for r in rows])
        self.local = np.array([r.local_us for r in rows])
        self.net = np.array([r.net_us for r in rows])
        self.ceiling = np.array([r.ceiling_us for r in rows])
        self.p2p = np.array([r.p2p for r in rows])
        self.maxed = np.array([r.combine == "max" for r in rows])
        self.host_gpus = np.array([r.gpus_per_thread for r in rows], dtype=float)
        self.calls = np.array([r.calls for r in rows], dtype=float)
        index = {k: i for i, k in enumerate(kinds)}
        self.kind = np.array([index.get(r.kind, len(kinds)) for r in rows])
        index = {a: i for i, a in enumerate(archs)}
        self.arch = np.array([index.get(r.arch, len(archs)) for r in rows])
        index = {link: i for i, link in enumerate(LINKS)}
        self.link = np.array([index.get(r.link, len(LINKS)) for r in rows])

    def predict(self, kernel: np.ndarray, hop: np.ndarray, eff: np.ndarray, p2p: float, launch: float,
                call: float, link_eff: Optional[np.ndarray] = None) -> np.ndarray:
        hop_of = np.append(hop, 0.0)[self.kind]
        eff_of = np.where(self.p2p, p2p, np.append(eff, 1.0)[self.kind])
        net = self.net / eff_of
        local = self.local if link_eff is None else self.local / np.append(link_eff, 1.0)[self.link]
        transfer = np.where(self.maxed, np.maximum(local, net), local + net) + self.ceiling
        gpu = self.latency + np.append(kernel, 0.0)[self.arch] + self.hops * hop_of + transfer
        return np.maximum(gpu, self.host_gpus * (launch + self.calls * call))


def predict_rows(rows: Sequence[Row], m: Measured) -> np.ndarray:
    """The times :class:`Row` s get with the constants ``m``."""
    kinds, archs = sorted({r.kind for r in rows}), sorted({r.arch for r in rows})
    arrays = _Arrays(rows, kinds, archs)
    return arrays.predict(np.array([m.kernel(a) for a in archs]), np.array([m.hop(k) for k in kinds]),
                          np.array([m.net_efficiency(k) for k in kinds]), m.p2p_efficiency, m.host_launch_us,
                          m.host_call_us, np.array([m.local_efficiency(link) for link in LINKS]))


LATENCY_ALGORITHMS = ("ring", "tree", "p2p")
SHARE = 0.2  # a link's efficiency is fitted from bandwidth-bound rows it carries at least this share of


def _regime(row: Row) -> str:
    """``latency`` or ``bandwidth`` where one part is at least 80 % of the specs' time, else
    ``mixed``: the constants are estimated from the regimes they govern, not from protocol and
    algorithm transitions, whose errors are the model's shape, not a constant's. Latency rows
    count only for rings, trees and point-to-point, whose latency NCCL builds from per-hop
    constants; CollNet's switch aggregation and NVLS's multicast have latencies of their own,
    which a kernel start or a NIC hop would misdescribe."""
    transfer = row.local_us + row.net_us + row.ceiling_us
    share = transfer / (transfer + row.latency_us) if transfer + row.latency_us > 0 else 0.0
    if share <= 0.2:
        return "latency" if row.algorithm in LATENCY_ALGORITHMS or not row.algorithm else "mixed"
    return "bandwidth" if share >= 0.8 else "mixed"


def _prior_rate(prior: Measured, name: str) -> float:
    """The prior value of the rate ``name`` (``eff:KIND``, ``link:LINK`` or ``p2p``) of :func:`fit`."""
    kind, _, key = name.partition(":")
    if kind == "eff":
        return prior.net_efficiency(key)
    if kind == "link":
        return prior.local_efficiency(key)
    return prior.p2p_efficiency


def _merged(fitted: Sequence[tuple], prior: tuple) -> tuple:
    """``fitted`` ``(key, value)`` pairs, then ``prior``'s for the keys no row informed."""
    keys = {k for k, _ in fitted}
    return tuple(fitted) + tuple((k, v) for k, v in prior if k not in keys)


def _kernel_told_apart(rows: Sequence[Row], arch: str) -> bool:
    """Whether ``rows`` tell a GPU generation's kernel start apart from the network hops: some
    latency-bound row of it crosses no network, or its latency-bound rows cross different
    numbers of hops. Where every one crosses the same number (one two-node table: its rings
    and trees alike), ``kernel + hops x hop`` is all they say, and how it splits is the
    least squares' whim: a 16-GPU B200 table put 1.9 us more on the kernel and 4.4 us more on
    the hop than the public estimates, and the kernel then made its own 8-GPU node 10 %
    slow. There the kernel keeps its prior (the public estimate, fitted on tables of many
    node counts) and the hop takes what is left."""
    hops = {r.hops for r in rows if r.arch == arch and _regime(r) == "latency"}
    return 0 in hops or len(hops) > 1


def fit(rows: Sequence[Row], source: str = "", fit_efficiency: bool = False, prior: Measured = SPEC) -> Measured:
    """The constants that best explain ``rows`` (least squares on log time, every table weighted
    equally, a soft-L1 loss so that a few odd rows do not steer it). Only constants some row
    informs are fitted, the others keep their ``prior`` values (:data:`SPEC`'s unless given: a
    cluster's calibration starts from the public estimates): a GPU generation's kernel
    start and a NIC kind's hop latency need latency-bound rows, point-to-point efficiency
    bandwidth-bound all-to-all rows across nodes, the host costs tables in which one thread
    drives several GPUs. A NIC kind's efficiency, and a link class's, are fitted only when
    ``fit_efficiency`` says so: across the public tables the same kind delivers anywhere from
    60 % to all of its rate (p4d's EFA under NCCL 2.7 against p4de's under 2.20; Vultr's NICs
    that perftest shows at 81 %), so a public estimate would move a healthy cluster as often
    away from the truth as towards it; a cluster's own tables (``whatif calibrate
    nccl-tests``) tell its rate: the network's from bandwidth-bound rows of which the network
    carries at least a fifth (``SHARE``), NVLink's (PCIe's) from those of which it does and where
    it is not hidden behind the network (all-to-all's two parts run at once, ``combine`` "max":
    there NVLink's part informs its rate only where it is the larger at the specs' rates; else
    the kernel start and NVLink's rate trade off on rows that neither sets)."""
    from scipy.optimize import least_squares

    rows = [r for r in rows if _regime(r) != "mixed"]
    if not rows:
        return prior
    kinds, archs = sorted({r.kind for r in rows}), sorted({r.arch for r in rows})
    kernel_archs = [a for a in archs if _kernel_told_apart(rows, a)]
    hop_kinds = [k for k in kinds if any(r.kind == k and r.hops > 0 and _regime(r) == "latency" for r in rows)]
    eff_kinds = [k for k in kinds if fit_efficiency and any(
        r.kind == k and not r.p2p and r.net_us >= SHARE * (r.local_us + r.net_us + r.ceiling_us)
        and _regime(r) == "bandwidth"
        for r in rows)]
    eff_links = [link for link in LINKS if fit_efficiency and any(
        r.link == link and r.local_us >= SHARE * (r.local_us + r.net_us + r.ceiling_us)
        and (r.combine != "max" or r.local_us >= r.net_us) and _regime(r) == "bandwidth"
        for r in rows)]
    p2p = any(r.p2p and r.net_us > r.local_us and _regime(r) == "bandwidth" for r in rows)
    host = any(r.gpus_per_thread > 1 for r in rows)
    arrays = _Arrays(rows, kinds, archs)
    start = prior if prior != SPEC else None
    layout = [(f"kernel:{a}", start.kernel(a) if start else 4.0, BOUNDS["kernel_us"]) for a in kernel_archs]
    layout += [(f"hop:{k}", start.hop(k) if start else 5.0, BOUNDS["hop_us"]) for k in hop_kinds]
    layout += [(f"eff:{k}", 0.9, BOUNDS["efficiency"]) for k in eff_kinds]
    layout += [(f"link:{k}", 0.9, BOUNDS["link_efficiency"]) for k in eff_links]
    layout += [("p2p", 0.8, BOUNDS["p2p_efficiency"])] if p2p else []
    # a call's cost apart from the launch only where a thread makes several calls per GPU (all-to-all)
    calls = host and any(r.gpus_per_thread > 1 and r.calls > 1 for r in rows)
    layout += [("host_launch_us", 3.0, BOUNDS["host_launch_us"])] if host else []
    layout += [("host_call_us", 0.3, BOUNDS["host_call_us"])] if calls else []
    names = [n for n, _, _ in layout]

    def unpack(x: np.ndarray) -> tuple:
        values = dict(zip(names, x))
        kernel = np.array([values.get(f"kernel:{a}", prior.kernel(a)) for a in archs])
        hop = np.array([values.get(f"hop:{k}", prior.hop(k)) for k in kinds])
        eff = np.array([values.get(f"eff:{k}", prior.net_efficiency(k)) for k in kinds])
        link_eff = np.array([values.get(f"link:{k}", prior.local_efficiency(k)) for k in LINKS])
        return (kernel, hop, eff, values.get("p2p", prior.p2p_efficiency),
                values.get("host_launch_us", prior.host_launch_us), values.get("host_call_us", prior.host_call_us),
                link_eff)

    measured = np.array([r.measured_us for r in rows])
    count: dict = {}
    for r in rows:
        count[r.table] = count.get(r.table, 0) + 1
    weights = np.array([1.0 / math.sqrt(count[r.table]) for r in rows])

    # the rates held lightly to their priors: where the rows tell only a product of two of them
    # (NVLS tree's NVSwitch and NIC parts, both in proportion to the size, at one scale), the fit
    # takes the split nearest the prior instead of an arbitrary point of that ridge
    pulled = [i for i, n in enumerate(names) if n.startswith(("eff:", "link:")) or n == "p2p"]
    towards = np.log([_prior_rate(prior, names[i]) for i in pulled])

    def residuals(x: np.ndarray) -> np.ndarray:
        fitted = weights * np.log(arrays.predict(*unpack(x)) / measured)
        return np.concatenate([fitted, RATE_PULL * (np.log(x[pulled]) - towards)]) if pulled else fitted

    if not layout:
        return prior
    lo, hi = [b[0] for _, _, b in layout], [b[1] for _, _, b in layout]
    found = least_squares(residuals, [min(max(v, b[0]), b[1]) for _, v, b in layout], bounds=(lo, hi),
                          loss="soft_l1", f_scale=0.1)
    kernel, hop, eff, p2p_eff, launch, call, link_eff = unpack(found.x)
    return Measured(kernel_us=_merged([(a, float(kernel[archs.index(a)])) for a in kernel_archs], prior.kernel_us),
                    hop_us=_merged([(k, float(hop[kinds.index(k)])) for k in hop_kinds], prior.hop_us),
                    efficiency=_merged([(k, float(eff[kinds.index(k)])) for k in eff_kinds], prior.efficiency),
                    link_efficiency=_merged([(k, float(link_eff[LINKS.index(k)])) for k in eff_links],
                                            prior.link_efficiency),
                    p2p_efficiency=float(p2p_eff), host_launch_us=float(launch), host_call_us=float(call),
                    source=source,
                    fitted_on=tuple(sorted({r.table.replace("\\", "/").rsplit("/", 1)[-1] for r in rows})))
