"""Point-to-point operations: send/recv and all-to-all, which NCCL's tuner does not price.

NCCL runs both as pairs of sends and receives scheduled by ``src/enqueue.cc``
(``scheduleP2pTasksToPlan``, ``addP2pToPlan``) on its p2p channels (``src/graph/paths.cc``:
``ncclTopoComputeP2pChannels``, ``ncclTopoGetNchannels``; chunk sizes in ``src/init.cc``,
``computeBuffSizes``). We follow that schedule and time the chunk pipeline it makes.

**The schedule (NCCL's facts).**

* The communicator has ``P`` p2p channels: its collective channel count, a power of two up
  (``pow2Up``), at most 64. A peer gets at most ``c_max`` channels: 2 per NVLink between the two
  GPUs (2 over PCIe); through the network (2.29 and later) one per NIC, and enough to carry the
  NICs' rate at 14 GB/s a channel (``NCCL_P2P_PER_CHANNEL_NET_BW``), before 2.29 two, halved
  while ``2 n > 4 P``; the fewest over the peers, a power of two up. Across nodes (2.29 and
  later) ``c_max`` halves while ``c_max ceil(n / 8) > P`` (all peers' channels in one round of
  8), else it is at most ``P``.
* A peer's send of ``b`` bytes starts on ``c_min`` channels (``c_max`` halved while ``c_min n >
  P``), at most one per minimum part (a Simple step / 8 in one node, / 2 across nodes), and
  doubles its channels while a part exceeds the maximum part (32 steps in one node, one step
  across nodes), up to ``c_max``.
* LL when ``b`` is at most 16 KiB a channel (``NCCL_P2P_LL_THRESHOLD``), Simple otherwise.
* A Simple step moves 512 KiB over NVLink inside one node (``NCCL_P2P_NVL_CHUNKSIZE``), 128 KiB
  over PCIe or when the communicator spans nodes (``NCCL_P2P_PCI/NET_CHUNKSIZE``; 256 KiB on Arm
  hosts with Blackwell GPUs from 2.29), a quarter of it through a NIC below one step of bytes and
  half below eight; an LL step 32 KiB of data (a 512 KiB LL buffer over ``NCCL_STEPS`` = 8
  slots, half of it flags).
* An all-to-all's peers are rounds (``ncclP2pSchedule``). In one node each round has its own
  base channel (``ncclP2pChannelBaseForRound``), so the ``n - 1`` sends run at once while their
  channels fit in ``P``, one batch after another beyond. Across nodes the ranks form groups of
  8 (``NCCL_P2P_SCHEDULE_GROUP_SIZE``, or fewer where a node has fewer ranks) and the 8 rounds
  of one group share their base channel, 8 operations to a batch: a class of peers takes one
  channel set per group it spans (``_lanes``).

**The time.** A channel is one CUDA block whose warps a send and a receive split (``sendrecv.h``),
so one direction moves at half a ring channel's NVLink speed (``bw_intra / 2`` of NCCL's
search, ``graphs.ring_graph`` on one node): ``r``; a send/recv's channel through the network at
most the 14 GB/s a channel that NCCL sizes its network peers' channels by
(``NCCL_P2P_PER_CHANNEL_NET_BW``; ours to use it as the rate: Together AI's B200 send/recv
sweeps over 8 x 400 Gb/s NICs move 14.5 GB/s on the one channel a peer gets at 16 and 32 nodes,
26 on two at 8 nodes, 42 to 44 on four). Not for an all-to-all, whose channels carry several
peers' sends at once: there the cap made the two-node B200 table's middle sizes 15 to 30 % slower
than measured, and no table tells what a channel moves when shared. The ``A = min(P, sum of lanes x c)``
channels at work share the GPU's NVLink (the ring's channels x speed) and, for peers on other
nodes, its share of the node's NICs at NCCL's speed steps (``o`` times slower for the share of
traffic that leaves a leaf, ``network.machines_per_leaf``). Peers of one link class (NVLink,
network), ``m`` sends of ``b`` bytes on ``c`` channels each, move at::

    R = min(B_link, A x (class lanes x c / sum of lanes x c) x r)      (LL: half)
    T = L + k x hop + max over classes of [ m b / R + m c min(step, b / c) / R ]

the second term being the pipeline's fill: a part's last step must still be copied out of the
receiver's buffer (``NCCL_STEPS`` = 8 slots keep the steps before it in flight). ``L`` is NCCL's
ring base latency of the protocol, ``hop`` its ring step latency on the link (through a NIC:
Simple's plus the NIC's whatever the protocol, as the proxy posts every send) and ``k`` the
batches a channel runs one after another; across nodes at least one network step per group of
8 peers (ours, not NCCL's source: chosen against the two-node B200 table, about 37 us at its
smallest sizes); a send/recv has one peer, so one network step at any scale (Together AI's B200
sweeps: the same 26 to 34 us at 1 KiB from 2 to 32 nodes).

**Where it departs from NCCL.** Older releases had other p2p schedulers, not read here: every
release gets the newest schedule, with its own rule for a network peer's channels (2.29).
PXN (a remote peer's bytes cross NVLink to the GPU on the destination's rail first) is folded
into the network share, which is the same per NIC. The per-channel rate of a channel that
holds several operations is kept (their warps split it). What a fabric's point-to-point path
achieves between nodes is the measured ``p2p_efficiency`` (``measured.py``); inside a node the
NVLink's measured ``link_efficiency`` applies as for the collectives. ``p2p_efficiency`` is
fitted on all-to-all tables, whose every NIC carries many flows at once and delivers about half
its rate; a send/recv (a pipeline's activations) sends one flow a NIC, as a ring does, and gets
the NIC kind's ``efficiency`` instead (the B200 sweeps: 42 to 44 GB/s of a 400 Gb/s NIC).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import tuning
from .graphs import Comm, comm_channels, ring_graph
from .measured import public
from .model import Option, Predicted
from ..units import TopologyError, as_gigabytes_per_s

P2P_LL_THRESHOLD = 16384        # bytes per channel (enqueue.cc, NCCL_P2P_LL_THRESHOLD)
P2P_PER_BATCH = 8               # NCCL_MAX_DEV_WORK_P2P_PER_BATCH
NVL_CHUNK = 1 << 19             # NCCL_P2P_NVL_CHUNKSIZE
NET_CHUNK = 1 << 17             # NCCL_P2P_NET_CHUNKSIZE
PCI_CHUNK = 1 << 17             # NCCL_P2P_PCI_CHUNKSIZE
LL_STEP_DATA = 512 * 1024 // 8 // 2  # DEFAULT_LL_BUFFSIZE over NCCL_STEPS slots, half of it flags
NET_CHANNEL_GBS = 14.0          # NCCL_P2P_PER_CHANNEL_NET_BW (2.29 and later)
NEW_NET_RULE = (2, 29, 0)       # paths.cc: channels per network peer by the NICs' rate; Arm x Blackwell chunks


def _pow2_up(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclass(frozen=True)
class Schedule:
    """What NCCL derives for a communicator's point-to-point operations (see the module docstring)."""

    channels: int       # P: p2pnChannels
    per_peer: int       # c_max: p2pnChannelsPerPeer
    min_per_peer: int   # c_min: scheduleP2pTasksToPlan's nChannelsMin
    step: int           # a Simple step's bytes: p2pChunkSize
    n_nodes: int


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


def _one_node(comm: Comm) -> Comm:
    return Comm(comm.fabric, comm.ranks[:1], 1, max(2, comm.ppn), comm.node_nics, comm.ranks_per_machine,
                comm.tuner)


def _nvlink_gbs(comm: Comm) -> float:
    """The GPU's NVLink (PCIe) rate as NCCL's ring search finds it: channels x speed."""
    ring = ring_graph(_one_node(comm))
    return ring.channels * ring.bw_intra


def channel_gbs(comm: Comm) -> float:
    """One p2p channel's rate in one direction: half a ring channel's (its warps split between a
    send and a receive)."""
    return ring_graph(_one_node(comm)).bw_intra / 2.0


def schedule(comm: Comm) -> Schedule:
    """NCCL's p2p channels, channels per peer and step size for ``comm`` (paths.cc, init.cc)."""
    fabric, n = comm.fabric, comm.n_ranks
    total = min(tuning.MAX_CHANNELS, _pow2_up(min(comm_channels(comm, ring_graph(comm)), tuning.MAX_CHANNELS)))
    new = comm.tuner.version >= NEW_NET_RULE
    candidates = []
    if comm.ppn > 1:
        if fabric.nvlink:
            # through NVSwitch a peer is reached over all of the GPU's NVLinks; in a mesh over one or two
            candidates.append(2 * max(1, fabric.gpu.nvlinks if fabric.nvswitch else 1))
        else:
            candidates.append(2)
    if comm.n_nodes > 1:
        nics = max(1, int(round(fabric.nics_per_gpu))) if fabric.nics_per_gpu >= 1 else 1
        if new:
            candidates.append(max(nics, math.ceil(_net_gbs(comm) / NET_CHANNEL_GBS - 1e-9)))
        else:
            two = 2
            while two * n > total * 4 and two > 1:
                two //= 2
            candidates.append(max(nics if fabric.fused else 1, two))
    per_peer = _pow2_up(min(candidates)) if candidates else 1
    if comm.n_nodes > 1 and new:
        while per_peer * math.ceil(n / P2P_PER_BATCH) > total and per_peer > 1:
            per_peer //= 2
    per_peer = min(per_peer, total)
    low = per_peer
    while low * n > total and low > 1:
        low //= 2
    if comm.n_nodes > 1:
        arm_blackwell = new and fabric.cpu == "arm" and fabric.gpu.compute_capability >= 100
        step = NET_CHUNK * (2 if arm_blackwell else 1)
    else:
        step = NVL_CHUNK if fabric.nvlink else PCI_CHUNK
    return Schedule(total, per_peer, low, step, comm.n_nodes)


def peer_channels(s: Schedule, nbytes: float) -> int:
    """The channels one send of ``nbytes`` runs on (addP2pToPlan)."""
    if nbytes <= 0:
        return 1
    min_part = s.step // 2 if s.n_nodes > 1 else s.step // 8
    max_part = s.step if s.n_nodes > 1 else s.step * 32
    c = min(s.min_per_peer, math.ceil(nbytes / min_part))
    part = max(min_part, math.ceil(nbytes / c))
    while part > max_part and c <= s.per_peer // 2:
        c *= 2
        part = math.ceil(nbytes / c)
    return c


def step_data(s: Schedule, protocol: str, network: bool, nbytes: float) -> float:
    """The data one step of a send carries (enqueue.cc's chunk size for p2p)."""
    if protocol == "ll":
        return LL_STEP_DATA
    step = s.step
    if network:
        step = step / 4 if nbytes < s.step else step / 2 if nbytes < 8 * s.step else step
    return step


@dataclass(frozen=True)
class _Class:
    """The peers of one link class: ``peers`` sends of ``nbytes`` each."""

    link: str        # nvlink, pci or net
    peers: int
    nbytes: float
    bound_gbs: float  # the GPU's rate on that link


def _lanes(comm: Comm, s: Schedule, k: "_Class") -> int:
    """The channel sets a class's sends take: one per peer in one node (each round its own base
    channel), one per group of 8 peers across nodes (``ncclP2pSchedule``'s groups of
    ``NCCL_P2P_SCHEDULE_GROUP_SIZE`` ranks share their round's base channel, 8 operations to a
    batch)."""
    if s.n_nodes == 1:
        return k.peers
    size = math.gcd(P2P_PER_BATCH, comm.ppn)
    mine = 1 if k.link != "net" else 0  # the own group holds the rank itself
    return math.ceil((k.peers + mine) / size)


def _price(comm: Comm, s: Schedule, classes: list, protocols, op: str) -> tuple:
    """``(protocol, latency, hops, local_us, net_us, channels)`` for the classes' sends at once."""
    active = [k for k in classes if k.peers > 0]
    chans = {k.link: peer_channels(s, k.nbytes) for k in active}
    ll = all(k.nbytes <= chans[k.link] * P2P_LL_THRESHOLD for k in active)
    if protocols is not None:
        allowed = [p for p in ("ll", "simple") if p in protocols]
        if not allowed:
            raise TopologyError("protocol", f"NCCL's p2p uses ll or simple, not {'/'.join(sorted(protocols))}")
        ll = (ll and "ll" in allowed) or allowed == ["ll"]
    proto = "ll" if ll else "simple"
    factor = tuning.RING_LL_FACTOR if ll else 1.0
    lanes = {k.link: _lanes(comm, s, k) * chans[k.link] for k in active}
    demand = sum(lanes.values())
    at_work = min(s.channels, demand)
    batches = max(1, math.ceil(demand / s.channels))
    one_channel = channel_gbs(comm)
    local = net = 0.0
    for k in active:
        c = chans[k.link]
        per_channel = one_channel
        if k.link == "net" and not many_flows(op):  # a send/recv's channels through the network
            per_channel = min(one_channel, NET_CHANNEL_GBS)
        rate = min(k.bound_gbs, at_work * (lanes[k.link] / demand) * per_channel) * factor  # GB/s = kB/us
        chunk = min(step_data(s, proto, k.link == "net", k.nbytes), k.nbytes / c)
        t = (k.peers * k.nbytes + chunk * k.peers * c) / (1000.0 * rate)
        if k.link == "net":
            net = max(net, t)
        else:
            local = max(local, t)
    link = "net" if any(k.link == "net" for k in active) else comm.link_intra
    p = tuning.protocol_index(proto)
    if link == "net":
        hop = tuning.HOP_LATENCY_US["net"]["ring"][2] + comm.fabric.nic.latency_us
    else:
        hop = tuning.HOP_LATENCY_US[link]["ring"][p]
    if link == "net":  # one network step per group of 8 peers (ours: the groups' proxy work in turn)
        batches = max(batches, math.ceil(sum(k.peers for k in active) / P2P_PER_BATCH))
    latency = tuning.BASE_LATENCY_US["ring"][p] + batches * hop
    hops = float(batches) if link == "net" else 0.0
    return proto, latency, hops, local, net, max(chans.values()), link


def _timed(comm: Comm, option: Option, latency: float, hops: float, local: float, net: float, combine: str,
           calibration, channels: int) -> Predicted:
    """A point-to-point prediction with the measured constants (``measured.py``): the kernel's
    start, the NIC kind's hop latency, the achieved fraction of the NVLink (PCIe) rate and of
    the network rate (an all-to-all's many flows through each NIC: ``p2p_efficiency``; a
    send/recv's one flow a NIC, like a ring's: the NIC kind's ``efficiency``, as the
    collectives'); then the calibration's factors."""
    measured = public() if calibration is None else calibration.constants
    efficiency, latency_factor = _factors(calibration, option.link, option.protocol, comm.n_nodes)
    nic = comm.fabric.nic
    timed_latency = (latency + measured.kernel(comm.arch) + hops * measured.hop(nic.kind, nic.transport)) * latency_factor
    rate = measured.p2p_efficiency if many_flows(option.op) else measured.net_efficiency(nic.kind, nic.transport)
    net_time = net / rate if net else 0.0
    local_time = local / measured.local_efficiency(comm.link_intra)
    transfer = (max(local_time, net_time) if combine == "max" else local_time + net_time) / efficiency
    return Predicted(option, timed_latency, transfer, channels, hops, nic.kind, local, net, combine, latency)


def many_flows(op: str) -> bool:
    """Whether ``op`` sends through each NIC to many peers at once (an all-to-all), whose
    achieved share of the network is the measured ``p2p_efficiency``; a send/recv's one flow a
    NIC gets the NIC kind's ``efficiency``, as a ring's flows do."""
    return op == "all_to_all"


def _oversubscription(comm: Comm) -> float:
    network, machines = comm.fabric.network, comm.fabric.machines
    per_leaf = network.machines_per_leaf
    if per_leaf <= 0 or machines <= per_leaf or network.oversubscription <= 1:
        return 1.0
    leaving = (machines - per_leaf) / (machines - 1)
    return max(1.0, leaving * network.oversubscription)


def _factors(calibration, link: str, protocol: str, n_nodes: int) -> tuple:
    return (1.0, 1.0) if calibration is None else calibration.factors_for(link, "p2p", protocol, n_nodes)


def _predict(comm: Comm, op: str, nbytes: float, classes: list, protocols, calibration) -> Predicted:
    s = schedule(comm)
    proto, latency, hops, local, net, channels, link = _price(comm, s, classes, protocols, op)
    total = max(local, net)
    effective = nbytes / (1000.0 * total) if total > 0 else math.inf
    option = Option(op, "p2p", proto, latency, effective, channels, link)
    return _timed(comm, option, latency, hops, local, net, "max", calibration, channels)


def send_recv(comm: Comm, nbytes: float, protocols=None, calibration=None) -> Predicted:
    """Every rank sends ``nbytes`` to the next (one round: a send and a receive); see the module
    docstring. Across nodes the slowest rank's neighbour is on another node."""
    if comm.n_nodes > 1:
        kind = _Class("net", 1, nbytes, min(_net_gbs(comm), _nvlink_gbs(comm)))
    else:
        kind = _Class(comm.link_intra, 1, nbytes, _nvlink_gbs(comm))
    return _predict(comm, "send_recv", nbytes, [kind], protocols, calibration)


def all_to_all(comm: Comm, nbytes: float, protocols=None, calibration=None) -> Predicted:
    """Every rank sends ``nbytes / n`` to every rank; see the module docstring."""
    n, ppn = comm.n_ranks, comm.ppn
    share = nbytes / n
    net_per_rank = comm.node_nics * _nic_step_gbs(comm) / ppn / _oversubscription(comm)
    classes = [_Class(comm.link_intra, ppn - 1, share, _nvlink_gbs(comm)),
               _Class("net", n - ppn if comm.n_nodes > 1 else 0, share, net_per_rank)]
    if n == 1:
        classes = [_Class(comm.link_intra, 1, 0.0, _nvlink_gbs(comm))]
    return _predict(comm, "all_to_all", nbytes, classes, protocols, calibration)
