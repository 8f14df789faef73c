"""Point-to-point operations: send/recv and all-to-all, which NCCL's tuner does not price.

NCCL runs both as sends and receives between pairs of ranks (``enqueue.cc``, p2p channels), LL
for small messages and Simple for large ones. We price them with the same pieces as the
collectives (``model.py``): a latency and the bandwidth of the link each byte crosses.

* **send/recv** (nccl-tests ``sendrecv_perf``: every rank sends ``S`` bytes to the next and
  receives as much from the previous one)::

      T = L + S / B,  B = a GPU's NVLink (the ring graph's channels x speed, one node), or
                          its share of the NICs (``fabric.gpu_network_bytes_per_us``, at NCCL's
                          speed steps) when a neighbour is on another node

  with LL (half the bandwidth, NCCL's ring/LL latencies) below NCCL's LL threshold of 16 KiB
  per channel and Simple above, whichever the estimate prefers; all-to-all likewise by the
  bytes per peer.

* **all-to-all** (``alltoall_perf``: every rank sends ``S/n`` of its ``S`` bytes to every rank):
  each rank sends ``(ppn-1)/n S`` over NVLink and ``(n-ppn)/n S`` through the NICs, at once
  (PXN moves traffic for another rail over NVLink first, which we fold into the NVLink share)::

      T = L + max(S_nvlink / B_nvlink, S_net x o / B_net)

  ``B_net`` is the node's NICs shared by its ranks; ``o`` the oversubscription felt by the share
  of traffic that leaves a leaf (``network.machines_per_leaf``). ``L`` is the Simple base
  latency plus one step per batch of 8 peers (NCCL_MAX_DEV_WORK_P2P_PER_BATCH) over the
  slowest link. These latency terms are ours, not NCCL's.
"""

from __future__ import annotations

import math

from . import tuning
from .graphs import Comm, ring_graph
from .measured import public
from .model import Option, Predicted
from ..units import TopologyError, as_gigabytes_per_s

P2P_LL_THRESHOLD = 16384  # bytes per channel (enqueue.cc, NCCL_P2P_LL_THRESHOLD)
P2P_PER_BATCH = 8
P2P_CHANNELS_PER_PEER = 2  # the fewest NCCL gives a peer (paths.cc: 2 per NVLink, PCIe path or NIC)


def _nic_step_gbs(comm: Comm) -> float:
    """One NIC as a channel sees it: its rate at NCCL's speed steps, reached through PCIe (GB/s)."""
    steps = tuning.SPEEDS_INTER[tuning.speed_row(comm.fabric.gpu.compute_capability)]
    per_nic = as_gigabytes_per_s(comm.fabric.net_device_bytes_per_us)
    pcie = as_gigabytes_per_s(comm.fabric.gpu.pcie_bytes_per_us)
    return next((s for s in steps if s <= min(per_nic, pcie) + 1e-9), steps[-1])


def _net_gbs(comm: Comm) -> float:
    """One GPU's bandwidth into the network through its own NICs (GB/s)."""
    gpu = as_gigabytes_per_s(comm.fabric.gpu_network_bytes_per_us)
    return min(gpu, _nic_step_gbs(comm) * max(1.0, comm.fabric.nics_per_gpu if not comm.fabric.fused else 1.0))


def _nvlink_gbs(comm: Comm) -> float:
    ring = ring_graph(Comm(comm.fabric, comm.ranks[:1], 1, max(2, comm.ppn), comm.node_nics, comm.ranks_per_machine))
    return ring.channels * ring.bw_intra


def _latency(comm: Comm, protocol: str, link: str, steps: int) -> float:
    """The ring's base latency and ``steps`` hops: over NVLink or PCIe at the protocol's step
    latency, over the network at Simple's whatever the protocol (the proxy thread posts every
    send, LL or not) plus the NIC's own. The measured constants come on top (:func:`_timed`)."""
    p = tuning.protocol_index(protocol)
    if link == "net":
        hop = tuning.HOP_LATENCY_US["net"]["ring"][2] + comm.fabric.nic.latency_us
    else:
        hop = tuning.HOP_LATENCY_US[link]["ring"][p]
    return tuning.BASE_LATENCY_US["ring"][p] + steps * hop


def _timed(comm: Comm, option: Option, latency: float, hops: float, local: float, net: float, combine: str,
           calibration, channels: int) -> Predicted:
    """A point-to-point prediction with the measured constants (``measured.py``): the kernel's
    start, the NIC kind's hop latency, the achieved fraction of the NVLink (PCIe) rate and of
    the network rate that point-to-point traffic between nodes gets; then the calibration's
    factors."""
    measured = public() if calibration is None else calibration.constants
    efficiency, latency_factor = _factors(calibration, option.link, option.protocol)
    nic = comm.fabric.nic
    timed_latency = (latency + measured.kernel(comm.arch) + hops * measured.hop(nic.kind, nic.transport)) * latency_factor
    net_time = net / measured.p2p_efficiency if net else 0.0
    local_time = local / measured.local_efficiency(comm.link_intra)
    transfer = (max(local_time, net_time) if combine == "max" else local_time + net_time) / efficiency
    return Predicted(option, timed_latency, transfer, channels, hops, nic.kind, local, net, combine, latency)


def _oversubscription(comm: Comm) -> float:
    network, machines = comm.fabric.network, comm.fabric.machines
    per_leaf = network.machines_per_leaf
    if per_leaf <= 0 or machines <= per_leaf or network.oversubscription <= 1:
        return 1.0
    leaving = (machines - per_leaf) / (machines - 1)
    return max(1.0, leaving * network.oversubscription)


def _factors(calibration, link: str, protocol: str) -> tuple:
    return (1.0, 1.0) if calibration is None else calibration.factors_for(link, "p2p", protocol)


def send_recv(comm: Comm, nbytes: float, protocols=None, calibration=None) -> Predicted:
    """Every rank sends ``nbytes`` to the next; see the module docstring."""
    crosses = comm.n_nodes > 1
    link = "net" if crosses else comm.link_intra
    bw = min(_net_gbs(comm), _nvlink_gbs(comm)) if crosses else _nvlink_gbs(comm)
    channels = max(1, min(ring_graph(comm).channels, 8))
    best = None
    for proto, factor in (("ll", tuning.RING_LL_FACTOR), ("simple", 1.0)):
        if protocols is not None and proto not in protocols:
            continue
        if protocols is None and proto == "ll" and nbytes > channels * P2P_LL_THRESHOLD:
            continue
        option = Option("send_recv", "p2p", proto, _latency(comm, proto, link, 1), bw * factor, channels, link)
        transfer = nbytes / (1000.0 * option.bandwidth_gbs)
        local, net = (0.0, transfer) if crosses else (transfer, 0.0)
        found = _timed(comm, option, option.latency_us, 1.0 if crosses else 0.0, local, net, "sum", calibration,
                       channels)
        if best is None or found.time_us < best.time_us:
            best = found
    if best is None:
        raise TopologyError("protocol", f"NCCL's send/recv uses ll or simple, not {'/'.join(sorted(protocols))}")
    return best


def all_to_all(comm: Comm, nbytes: float, protocols=None, calibration=None) -> Predicted:
    """Every rank sends ``nbytes / n`` to every rank; see the module docstring."""
    n, ppn = comm.n_ranks, comm.ppn
    nvlink = _nvlink_gbs(comm)
    net_per_rank = comm.node_nics * _nic_step_gbs(comm) / ppn
    intra_time = nbytes * (ppn - 1) / n / (1000.0 * nvlink) if ppn > 1 else 0.0
    inter_time = nbytes * (n - ppn) / n * _oversubscription(comm) / (1000.0 * net_per_rank) if comm.n_nodes > 1 else 0.0
    link = "net" if comm.n_nodes > 1 else comm.link_intra
    per_peer_ll = nbytes / n <= P2P_CHANNELS_PER_PEER * P2P_LL_THRESHOLD
    proto = "ll" if (protocols is None and per_peer_ll) or (protocols is not None and "simple" not in protocols) else "simple"
    if proto == "ll":
        intra_time, inter_time = intra_time / tuning.RING_LL_FACTOR, inter_time / tuning.RING_LL_FACTOR
    steps = math.ceil((n - 1) / P2P_PER_BATCH)
    latency = _latency(comm, proto, link, steps)
    effective = nbytes / (1000.0 * max(intra_time, inter_time)) if max(intra_time, inter_time) > 0 else math.inf
    channels = max(1, min(ring_graph(comm).channels * 2, tuning.MAX_CHANNELS // 2))
    option = Option("all_to_all", "p2p", proto, latency, effective, channels, link)
    return _timed(comm, option, latency, steps if comm.n_nodes > 1 else 0.0, intra_time, inter_time, "max",
                  calibration, channels)
