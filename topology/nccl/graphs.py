"""What NCCL's topology search finds for a communicator: channels and their speeds.

NCCL builds, for each algorithm family, a *graph* (``src/graph/search.cc``): how many channels
(parallel rings or trees, one CUDA block each) and at what bandwidth per channel inside a node
(``bw_intra``) and between nodes (``bw_inter``). The tuner (``model.py``) turns those into bus
bandwidths. The search itself walks the machine's PCIe/NVLink/NIC graph; here we compute its
result from the fabric's numbers, as the search would for the regular machines of ``fabric.py``:

* a channel at speed ``s`` takes ``s`` of every resource it crosses. Inside a node each GPU's
  NVLink (or PCIe) carries every channel, entering and leaving; between nodes each channel
  leaves and enters every node through one NIC, so a NIC of ``B`` holds ``floor(B / s)``
  channels and a GPU's PCIe link ``floor(pcie / s)``;
* the search tries NCCL's speeds (``tuning.SPEEDS_*``) from the fastest one that a single path
  allows (``system->maxBw``) downwards, keeps the best ``channels x speed`` among the speeds
  above half of the first that fits (its ``> .49`` rule), and then, when the speed is 25 GB/s or
  more, splits every channel in two at half the speed (``ncclTopoDupChannels``);
* NVLS (NVLink SHARP) uses one channel per local GPU (at most 32), at the speed that fits
  ``ppn`` channels into a GPU's NVLink; between nodes its heads use the NICs.

Departures: one GPU type per communicator; GPUs on a PCIe switch are assumed to reach their
own NICs at full PCIe rate and each other at their PCIe rate (no CPU-socket crossing); a NIC
shared by several GPUs is shared evenly. NCCL's exact search can land one speed step apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..fabric import Fabric
from ..units import TopologyError, as_gigabytes_per_s
from . import tuning
from .versions import LATEST, Tuner, tuner


@dataclass(frozen=True)
class Graph:
    """One algorithm family's channels: ``channels`` at ``bw_intra`` / ``bw_inter`` GB/s each."""

    channels: int
    bw_intra: float
    bw_inter: float
    link_intra: str  # nvlink or pci: the link class of the hops inside a node
    cap_channels: Optional[float] = None  # CUDA blocks that run it, if not ``channels`` (NCCL_MIN_NCHANNELS)

    @property
    def blocks(self) -> float:
        """The channels per-channel ceilings count: more than the search's where NCCL_MIN_NCHANNELS
        makes NCCL duplicate them (they still share the search's links)."""
        return self.channels if self.cap_channels is None else self.cap_channels


@dataclass(frozen=True)
class Comm:
    """A communicator: ``ranks`` (GPU ids of ``fabric``) and what NCCL derives from them.

    ``n_nodes`` counts NVLink domains (NCCL's nodes), ``ppn`` the most ranks on one, ``node_nics``
    the fewest network devices (NICs, or a GPU's fused NICs) the ranks of a node are
    rail-assigned to, ``ranks_per_machine`` the most ranks on one machine. ``tuner`` is the
    NCCL release's tables the communicator is searched and priced with (``versions.py``): the
    cluster's ``nccl: {version: ...}``, else the newest.
    """

    fabric: Fabric
    ranks: tuple
    n_nodes: int
    ppn: int
    node_nics: int
    ranks_per_machine: int
    tuner: Tuner = None

    def __post_init__(self):
        if self.tuner is None:
            object.__setattr__(self, "tuner", tuner(self.fabric.calibration.version or LATEST))

    def with_tuner(self, other: Tuner) -> "Comm":
        """The same communicator under another release's tables."""
        return self if other is self.tuner else Comm(self.fabric, self.ranks, self.n_nodes, self.ppn, self.node_nics,
                                                     self.ranks_per_machine, other)

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def arch(self) -> str:
        return tuning.arch(self.fabric.gpu.compute_capability)

    @property
    def link_intra(self) -> str:
        return "nvlink" if self.fabric.nvlink else "pci"

    @classmethod
    def of(cls, fabric: Fabric, ranks: Optional[Sequence[int]] = None) -> "Comm":
        if ranks is None:
            ids = np.arange(fabric.n_gpus)
        else:
            ids = np.asarray(list(ranks), dtype=np.int64).reshape(-1)
            if not len(ids):
                raise TopologyError("ranks", "must name at least one GPU")
            if ids.min() < 0 or ids.max() >= fabric.n_gpus:
                bad = ids.min() if ids.min() < 0 else ids.max()
                raise TopologyError("ranks", f"GPU {bad} does not exist; the cluster has GPUs 0..{fabric.n_gpus - 1}")
            if len(np.unique(ids)) != len(ids):
                raise TopologyError("ranks", "a GPU appears twice")
        nodes = ids // fabric.node_size
        _, per_node = np.unique(nodes, return_counts=True)
        machines = ids // fabric.gpus_per_machine
        _, per_machine = np.unique(machines, return_counts=True)
        # each rank's rail-assigned network device (Fabric.device_of, for every rank at once), and
        # how many distinct ones the ranks of each node have: the fewest of those
        per_device = fabric.net_devices_per_machine
        devices = machines * per_device + (ids % fabric.gpus_per_machine) * per_device // fabric.gpus_per_machine
        span = int(devices.max()) + 1
        _, nics = np.unique(np.unique(nodes * span + devices) // span, return_counts=True)
        return cls(fabric, tuple(ids.tolist()), len(per_node), int(per_node.max()), int(nics.min()),
                   int(per_machine.max()))


def _gbs(bytes_per_us: float) -> float:
    return as_gigabytes_per_s(bytes_per_us)


def intra_total(comm: Comm) -> float:
    """A GPU's bandwidth to the other GPUs of its node, GB/s as NCCL counts it (its release's
    SMxx_NVLINK_BW: the preset's per-link figure is the newest release's, scaled to the older)."""
    gpu = comm.fabric.gpu
    if not comm.fabric.nvlink:
        return _gbs(gpu.pcie_bytes_per_us)
    row = tuning.arch(gpu.compute_capability)
    scale = comm.tuner.nvlink_bw[row] / tuner(LATEST).nvlink_bw[row]
    return _gbs(gpu.nvlink_total_bytes_per_us) * scale


def nic_path(comm: Comm) -> float:
    """One channel's best path to the network: a NIC, reached through the GPU's PCIe."""
    fabric = comm.fabric
    return min(_gbs(fabric.net_device_bytes_per_us), _gbs(fabric.gpu.pcie_bytes_per_us))


def _search(speeds: tuple, max_bw: float, capacity, max_channels: int) -> tuple:
    """(channels, speed) as NCCL's search settles: see the module docstring."""
    usable = [s for s in speeds if s <= max_bw + 1e-9] or [speeds[-1]]
    first = next((s for s in usable if capacity(s) >= 1), None)
    if first is None:
        return 1, usable[-1]
    best = (0.0, 0, first)
    for s in usable:
        if s < first * 0.49:
            break
        if s > first:
            continue
        n = min(max_channels, capacity(s))
        if n * s > best[0] + 1e-9:
            best = (n * s, n, s)
    return best[1], best[2]


def _dup(channels: int, bw: float, compute_capability: int, max_channels: int) -> tuple:
    """ncclTopoDupChannels: fast channels are split in two at half the speed."""
    if bw < 25.0 or (compute_capability > 80 and bw < 50.0 and channels > 4):
        return channels, bw
    doubled = min(channels * 2, max_channels)
    return doubled, bw / math.ceil(doubled / channels)


def ring_graph(comm: Comm) -> Graph:
    """The ring (and tree) graph: channels through every GPU of each node and one NIC per node."""
    cc = comm.fabric.gpu.compute_capability
    row = tuning.speed_row(cc)
    intra = intra_total(comm)
    max_channels = tuning.MAX_CHANNELS // 2
    if comm.n_nodes == 1:
        channels, speed = _search(comm.tuner.speeds_intra[row], intra, lambda s: int(intra / s + 1e-9), max_channels)
    else:
        nic = _gbs(comm.fabric.net_device_bytes_per_us)
        pcie = _gbs(comm.fabric.gpu.pcie_bytes_per_us)
        through = (comm.ppn - 1) / comm.ppn if comm.ppn > 1 else 0.0

        def capacity(s: float) -> int:
            fits = [comm.node_nics * int(nic / s + 1e-9), comm.ppn * int(pcie / s + 1e-9)]
            if through:
                fits.append(int(intra / (s * through) + 1e-9))
            return min(fits)

        channels, speed = _search(comm.tuner.speeds_inter[row], nic_path(comm), capacity, max_channels)
    channels, speed = _dup(channels, speed, cc, max_channels)
    return Graph(channels, speed, speed, comm.link_intra)


def tree_graph(comm: Comm) -> Graph:
    """The tree graph: the ring's channels, with a faster intra-node speed where there is room.

    Pass 2 of NCCL's search raises a tree's ``bw_intra`` (never its ``bw_inter``) one speed step
    at a time while it stays below twice ``bw_inter`` and the GPUs' NVLink still holds every
    channel; across two nodes the tuner prices trees at ``bw_intra``, so a two-node tree moves
    nearly twice a ring's bytes per channel (it sends the message once each way, a ring twice).
    """
    ring = ring_graph(comm)
    if comm.n_nodes == 1:
        return ring
    intra = intra_total(comm)
    speeds = comm.tuner.speeds_inter[tuning.speed_row(comm.fabric.gpu.compute_capability)]
    bw_intra = ring.bw_intra
    for s in reversed(speeds):
        if s > bw_intra and bw_intra < 2 * ring.bw_inter and ring.channels * s <= intra + 1e-9:
            bw_intra = s
    return Graph(ring.channels, bw_intra, ring.bw_inter, ring.link_intra)


def nvls_graph(comm: Comm) -> Optional[Graph]:
    """NVLink SHARP's graph, or None where NVLS is unavailable (no NVSwitch NVLS, one GPU a node)."""
    fabric = comm.fabric
    if not (fabric.gpu.nvls and fabric.nvswitch and fabric.nvlink and comm.ppn >= 2):
        return None
    row = tuning.speed_row(fabric.gpu.compute_capability)
    heads = min(tuning.MAX_NVLS_ARITY, comm.ppn)
    intra = intra_total(comm)
    speeds_intra, speeds_inter = comm.tuner.speeds_intra[row], comm.tuner.speeds_inter[row]
    bw_intra = next((s for s in speeds_intra if heads * s <= intra + 1e-9), speeds_intra[-1])
    bw_inter = bw_intra
    if comm.n_nodes > 1:
        heads = min(heads, comm.node_nics)
        path = nic_path(comm)
        bw_inter = next((s for s in speeds_inter if s <= path + 1e-9), speeds_inter[-1])
    return Graph(heads, bw_intra, bw_inter, "nvlink")


def collnet_graph(comm: Comm) -> Optional[Graph]:
    """CollNet's graph (in-network reduction, SHARP), or None without it or across one node."""
    if not comm.fabric.network.sharp or comm.n_nodes < 2:
        return None
    ring = ring_graph(comm)
    heads = max(1, min(comm.ppn, comm.node_nics, tuning.MAX_DIRECT_ARITY + 1))
    return Graph(heads, intra_total(comm) / heads if comm.fabric.nvlink else ring.bw_intra, nic_path(comm), comm.link_intra)


def comm_channels(comm: Comm, ring: Graph) -> int:
    """The communicator's channel count (CUDA blocks a ring or tree kernel may use).

    connect.cc doubles the graph's channels once (``ncclTopoPostset``), and (2.20 and later) once
    more on Hopper and later across nodes when a channel runs above 45 GB/s and there are fewer
    than 16.
    """
    channels = min(tuning.MAX_CHANNELS, ring.channels * 2)
    if (comm.tuner.hopper_channel_doubling and comm.fabric.gpu.compute_capability >= 90 and comm.n_nodes > 1
            and ring.bw_intra > 45.0 and channels < 16):
        channels *= 2
    return channels


def nvls_channels(comm: Comm) -> int:
    """NVLS's channel count (nvls.cc): 16 on Hopper, 24 (one node) or 32 on Blackwell (2.27 and
    later; 2.25-2.26: 32, before: 16)."""
    table = comm.tuner.nvls_channels
    if comm.arch == "blackwell":
        return table["blackwell"] if comm.n_nodes > 1 else table["blackwell_one_node"]
    return table["hopper"]
