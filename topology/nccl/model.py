"""Collectives as NCCL runs them: every algorithm and protocol's cost, and NCCL's choice.

One formula prices every (algorithm, protocol) of a collective on a communicator::

    T(S) = L + S / B

``L`` a latency and ``B`` an algorithm bandwidth (bytes of the collective's nccl-tests "size"
per second), both from the tables of ``tuning.py`` and the channels of ``graphs.py``, exactly
as NCCL's tuner computes them (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``; NCCL 2.30's formulas below, each release's from ``versions.py``):

* ``B``: the graph's channels times their speed (``bw_intra`` within one or two nodes,
  ``bw_inter`` beyond) is a bus bandwidth; each protocol keeps its share (LL half of it and at
  most ``LL_MAX_BW``, LL128 120/128 up to a per-channel ceiling, Simple all of it); Tree keeps
  92 % up to ``TREE_MAX_BW`` per channel; NVLS is NVLink SHARP's efficiency on ``bw_intra``
  (doubled for all-reduce, which pipelines reduce and broadcast), capped between nodes by the
  NICs; PAT keeps 75 %. The bus bandwidth becomes the algorithm bandwidth by nccl-tests' own
  factor: ``n / (2(n-1))`` for a ring all-reduce, ``n / (n-1)`` for all-gather and
  reduce-scatter, 1 for broadcast and reduce; a tree moves the whole message up and down (1/2).
* ``L``: a base latency per algorithm and protocol, plus a per-step latency by link class
  (NVLink, PCI, network) times the steps: ``2(n-1)`` ring steps for all-reduce of which
  ``2(nodes-1)`` cross the network, ``2 ((ppn-1) + log2 nodes)`` tree steps, one NVLS step
  inside a node plus the tree's ``2 log2 nodes`` across them; a ring across nodes pays at least
  the CPU's network post overhead per step (3x with Simple) and, from 64 bytes per channel and
  rank, 1.4 times its latency (NCCL's "plateau").

NCCL picks the (algorithm, protocol) with the smallest ``T`` (``topoGetAlgoInfo``), and so does
:func:`choose`, with the tables and formulas of the cluster's NCCL release (``nccl:
{version: 2.26.2}``; ``versions.py``: which algorithms exist, LL's share, the per-hop
latencies, NVLS's pricing, the search's speeds); ``NCCL_ALGO`` / ``NCCL_PROTO`` become
``algorithm`` / ``protocol``.

Where we depart from NCCL's estimate, in :func:`predict` (the time we report; the choice stays
NCCL's, made on NCCL's estimate, as NCCL itself makes it):

* *the newest tables price every release's choice* (:func:`priced`): an older release's
  constants were its tuner's guesses for choosing; the newest are NCCL's best account of what
  the same algorithm does on the same hardware (LL moves half the bus bandwidth whatever 2.7
  assumed).
* *a ring's network steps* (:func:`ring_network_steps`): a small message's slowest rank waits
  for ``2n`` network steps of an all-reduce ring over ``n`` nodes of several GPUs (NCCL
  2.12-2.22's count), not the ``2(n-1)`` of NCCL's current estimate.
* *channels in use.* For small messages NCCL launches fewer channels (``topoGetAlgoInfo``: while
  ``bytes < channels x threads x threshold`` one fewer; CollNet direct by ``ncSwitch`` steps
  with a threshold per head 8 to 64 times a ring's, so it runs on fewer channels up to tens
  of MiB, :func:`channels_used`); we price them with the tuner's own formula on that many
  channels (:func:`bandwidth_on`), so per-channel ceilings shrink with them.
* *NVLS chunks and pipeline.* NVLS and NVLS tree cut small messages into small chunks
  (``calcCollChunking``), each paying a synchronisation, and take one chunk time per stage to
  fill their pipeline (:func:`chunk_slowdown`, :func:`pipeline_fill_us`).
* *NVLS's NVLink traffic inside one domain* (:func:`nvls_traffic_factor`): an all-reduce's
  bytes at ``2 (n-1)/(n+1)`` of the NVLink as NCCL counts it (links x ``SMxx_NVLINK_BW``) times
  NVLink SHARP's efficiency, not NCCL's ``2 (h-1)/h`` of its heads' quantised speed.
* *what only measurements know* (``measured.py``): the kernel's start, the same for every
  algorithm, so NCCL leaves it out; what a network hop costs beyond NCCL's InfiniBand constants
  and what fraction of the line rate a NIC kind delivers. Estimated from the public tables
  (or none, ``measured: spec``).
* *a Simple tree's chain fill* (:func:`tree_chain_fill_us`): the first 512 KiB chunk crosses
  ``2 (ppn - 1)`` NVLink and ``2 log2 nodes`` network hops whole before every stage is busy;
  NCCL's per-hop latency is a constant. Small on 8-GPU nodes, milliseconds on a 72-GPU NVLink
  domain's chain (GB200 NVL72 racks).
* *which rate a transfer waits on* (:func:`link_share`, :func:`network_share`,
  :func:`ring_nic_share`): the transfer is split into what NVLink (PCIe) sets, what the NICs
  set and what a per-channel ceiling of NCCL's kernels sets, so that a measured NVLink or NIC
  efficiency acts on its own part only. NCCL takes the smaller of the bandwidths and does not
  split; a ring across NVLink domains whose NICs outnumber its channels waits on NVLink, not on
  the one-NIC speed NCCL's search gives its channels.
* *the fabric's own efficiency*, per link class and (algorithm, protocol), and a latency factor:
  1 from specs, fitted by ``whatif calibrate nccl-tests`` (``calibration`` of the fabric).

Not modelled: kernels that got faster or slower between releases (beyond what the tuner's
tables say), user-buffer registration and symmetric kernels, CUDA graphs, and congestion from
other jobs. Point-to-point (send/recv,
all-to-all) is not in NCCL's tuner; see ``p2p.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

from ..units import TopologyError
from . import tuning
from .graphs import (Comm, Graph, collnet_graph, comm_channels, intra_total, nic_path, nvls_channels, nvls_graph,
                     ring_graph, tree_graph)
from .measured import public
from .versions import LATEST, extra, tuner

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")

NVLS_CHUNK_SYNC_US = 2 * 3.4  # see chunk_slowdown


@dataclass(frozen=True)
class Option:
    """One (algorithm, protocol) for one collective on one communicator, as NCCL's tuner sees it.

    ``latency_us`` and ``bandwidth_gbs`` (algorithm bandwidth, GB/s) are NCCL's; ``link`` is the
    class of the link that bounds it (``net`` across nodes); ``channels`` the CUDA blocks it may use.
    """

    op: str
    algorithm: str
    protocol: str
    latency_us: float
    bandwidth_gbs: float
    channels: int
    link: str


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def _bus_bandwidth(comm: Comm, op: str, algorithm: str, protocol: str, graph: Graph) -> float:
    """NCCL's bus bandwidth (GB/s) of one (algorithm, protocol) under ``comm.tuner``'s release;
    0 where NCCL would not use it."""
    t = comm.tuner
    arch, col = comm.arch, tuning.nodes_column(comm.n_nodes)
    n_nodes, ppn = comm.n_nodes, comm.n_ranks / comm.n_nodes
    collnet = algorithm.startswith("collnet")
    bw = graph.bw_intra if (n_nodes <= 2 or collnet) else graph.bw_inter
    channels = graph.channels
    if algorithm in ("nvls", "nvls_tree"):
        if t.nvls == "efficiency":  # 2.28+
            if graph.channels < 2:
                return 0.0
            intra = graph.bw_intra * t.nvls_efficiency[arch] * (graph.channels - 1) / graph.channels
            intra *= 2.0 if op == "all_reduce" else (ppn - 1) / ppn
            inter = graph.bw_inter * (2 if (n_nodes <= 2 and algorithm == "nvls_tree") else 1)
            cap = t.nvls_tree_max_bw[arch][col] if algorithm == "nvls_tree" else math.inf
            bw = min(intra, inter if n_nodes > 1 else math.inf, cap)
        elif t.nvls == "min":  # 2.19-2.27
            if algorithm == "nvls" and op != "all_reduce" and t.version >= (2, 27, 0):
                bw = min(graph.bw_intra * (ppn - 1) / ppn, graph.bw_inter * 0.9)
            elif algorithm == "nvls":
                bw = min(graph.bw_intra, graph.bw_inter)
            else:
                bw = min(graph.bw_intra, graph.bw_inter if n_nodes <= 2 else graph.bw_inter / 2)
        elif t.nvls == "2.17":  # the ring graph's channels at its intra-node speed
            ring = ring_graph(comm)
            bw, channels = ring.bw_intra, ring.channels
    bus = channels * bw
    blocks = graph.blocks if channels == graph.channels else channels
    if arch in t.bus_cap:
        bus = min(bus, t.bus_cap[arch])
    per_op = extra(t, "ring_ll128_max_bw_per_op")
    if n_nodes == 1:
        ll_max = t.ll_max_bw.get(arch, (math.inf,) * 3)[col]
    else:
        ll_max = t.ll_max_bw_multinode.get("amd" if comm.fabric.cpu == "amd" else "intel", (math.inf,) * 3)[col]
    if algorithm == "ring" and protocol == "ll":
        share = tuning.RING_LL_FACTOR
        if t.ring_ll == "quarter":
            share = 0.25 if (n_nodes > 1 or op in ("all_reduce", "reduce")) else 1.0 / 3.0
        bus = min(ll_max, bus * share)
    if algorithm == "ring" and protocol == "ll128":
        per_channel = per_op[op] if per_op else t.ring_ll128_max_bw[arch][col]
        share = t.ll128_one_ppn if ppn < 2 else tuning.RING_LL128_FACTOR
        bus = min(bus * share, blocks * per_channel)
    if algorithm == "tree" and op == "all_reduce":
        if t.tree_absolute_max_bw is not None:  # 2.7: whole-communicator caps
            caps = t.tree_absolute_max_bw[0 if n_nodes <= 2 else 1]
            bus = min(bus * t.tree_factor, caps[1] if (protocol == "ll128" and arch == "ampere") else caps[0])
        else:
            bus = min(bus * t.tree_factor, blocks * t.tree_max_bw[arch][col])
    if algorithm == "tree" and protocol == "ll":
        bus = min(bus * t.tree_ll_factor, ll_max)
    if algorithm == "tree" and protocol == "ll128":
        factor = tuning.TREE_LL128_ONE_NODE_FACTOR if n_nodes == 1 else t.tree_ll128_multinode_factor
        per_channel = per_op[op] if per_op else t.tree_ll128_max_bw[arch][col]
        bus = min(bus * factor, blocks * per_channel * t.tree_ll128_cap_factor)
    if algorithm == "pat":
        bus *= t.pat_factor
    if collnet and protocol != "simple":
        return 0.0
    if algorithm == "collnet_direct":
        if op in ("all_gather", "reduce_scatter"):
            bus = ppn * min(graph.bw_intra, graph.bw_inter * 0.9)
        else:
            factor = ppn / graph.channels
            bus /= factor - (factor - 1) / 2
            if comm.fabric.gpu.compute_capability >= 90:
                bus *= t.collnet_hopper_factor
    if algorithm == "collnet_chain":
        bus *= t.collnet_chain_factor
    if algorithm in ("nvls", "collnet_direct") and op in ("all_gather", "reduce_scatter") and n_nodes > 1:
        return 0.0
    return bus


def _latency(comm: Comm, op: str, algorithm: str, protocol: str, graph: Graph) -> float:
    """NCCL's latency (us) of one (algorithm, protocol) under ``comm.tuner``'s release."""
    t = comm.tuner
    p = tuning.protocol_index(protocol)
    n, n_nodes = comm.n_ranks, comm.n_nodes
    ppn = n // n_nodes
    nic_extra = comm.fabric.nic.latency_us
    intra_lat = t.hop_latency[graph.link_intra][algorithm][p]
    if n_nodes > 1 and protocol == "ll":
        intra_lat *= t.ll_intra_multinode
    inter_algorithm = "tree" if (comm.ppn == 1 and t.ppn1_tree_net_latency) else algorithm
    inter_lat = t.hop_latency["net"][inter_algorithm][p] + nic_extra
    if protocol == "simple":
        inter_lat += nic_extra  # the flush after a Simple receive
    base = t.base_latency[algorithm][p]
    if algorithm == "ring":
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        if op in ("broadcast", "reduce"):
            return base + t.hop_latency["net" if n_nodes > 1 else graph.link_intra]["ring"][p]
        overhead = 0.0
        if n_nodes > 1 and t.net_overhead:
            overhead = tuning.NET_OVERHEAD_US[comm.fabric.cpu] * (3 if protocol == "simple" else 1)
        intra_lat = max(intra_lat, overhead)
        if n_nodes == 1:
            inter_steps = 0
        else:
            inter_steps = ring_network_steps(t, op, n_nodes, ppn)
        return base + (steps - inter_steps) * intra_lat + inter_steps * inter_lat
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra_lat + _log2i(n_nodes) * inter_lat) if op == "all_reduce" else base
    if algorithm == "collnet_direct":
        return base + 2 * (min(1, ppn - 1) * intra_lat + (ppn - 1) * t.collnet_serialization_us) + inter_lat
    if algorithm == "collnet_chain":
        return base + 2 * (ppn - 1) * intra_lat + (inter_lat if t.collnet_chain_net_latency else 0.0)
    if algorithm == "nvls":
        if t.nvls in ("2.17", "2.18"):
            return base + (t.hop_latency["net"]["nvls"][p] if n_nodes > 1 else 0.0)
        return intra_lat + (inter_lat if n_nodes > 1 else 0.0)
    if algorithm == "nvls_tree":
        if t.nvls == "2.18":
            return base + 2 * (n_nodes - 1) * t.hop_latency["net"]["nvls_tree"][p]
        return base + intra_lat + 2 * _log2i(n_nodes) * inter_lat
    return base + _log2i(n_nodes) * (inter_lat / 3.5) + n * 2.8  # pat


def _allowed(comm: Comm, op: str, algorithm: str, protocol: str) -> bool:
    """Which (algorithm, protocol) NCCL considers for ``op`` on ``comm`` (tuning.cc, enqueue.cc),
    in ``comm.tuner``'s release."""
    t = comm.tuner
    if not t.has(algorithm):
        return False
    if op in ("broadcast", "reduce") and algorithm != "ring":
        return False
    if op in ("all_gather", "reduce_scatter") and algorithm not in ("pat", "ring", "nvls", "collnet_direct"):
        return False
    if op in ("all_gather", "reduce_scatter") and algorithm == "nvls" and not t.nvls_ag_rs:
        return False
    if op in ("all_gather", "reduce_scatter") and algorithm == "collnet_direct" and t.version < (2, 20, 0):
        return False
    if op == "all_reduce" and algorithm == "pat":
        return False
    if algorithm in ("nvls", "nvls_tree", "collnet_direct", "collnet_chain", "pat") and protocol != "simple":
        return False
    if algorithm == "pat" and comm.n_nodes != comm.n_ranks:
        return False  # PAT: one GPU per node
    if algorithm == "nvls_tree" and comm.n_nodes == 1:
        return False
    if algorithm == "nvls" and comm.n_nodes > 1 and not comm.fabric.network.sharp:
        return False
    if algorithm in ("nvls", "nvls_tree") and op != "all_reduce" and comm.ppn > tuning.MAX_NVLS_ARITY:
        return False
    if algorithm.startswith("collnet") and comm.ppn > tuning.MAX_DIRECT_ARITY + 1:
        return False
    if algorithm == "collnet_direct" and not comm.fabric.nvswitch:
        return False
    if protocol == "ll128" and (not comm.fabric.nvlink or comm.arch not in t.ll128_archs):
        return False  # LL128 needs NVLink (or NVB) paths inside a node, and a GPU its release enables it on
    return True


def _graph(comm: Comm, algorithm: str) -> Optional[Graph]:
    if algorithm in ("nvls", "nvls_tree"):
        return nvls_graph(comm)
    if algorithm == "collnet_direct":
        return collnet_graph(comm)
    if algorithm == "collnet_chain":
        return tree_graph(comm) if collnet_graph(comm) is not None else None
    return ring_graph(comm) if algorithm == "ring" else tree_graph(comm)


def _algorithm_bandwidth(comm: Comm, op: str, algorithm: str, protocol: str, graph: Graph) -> float:
    """NCCL's algorithm bandwidth (GB/s of nccl-tests size); 0 where NCCL would not use it."""
    bus = _bus_bandwidth(comm, op, algorithm, protocol, graph)
    if bus <= 0:
        return 0.0
    n, t = comm.n_ranks, comm.tuner
    gather = op in ("all_gather", "reduce_scatter")
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1 if gather else n
    if algorithm == "ring" or (algorithm in ("nvls", "nvls_tree") and not gather and t.nvls == "efficiency"):
        return bus * n / steps
    if algorithm in ("nvls", "nvls_tree") and t.nvls != "efficiency":  # NCCL's ratios before 2.28
        if gather and t.version >= (2, 23, 0):
            return bus
        if t.nvls == "min":
            return bus * 5.0 / 6.0
        if algorithm == "nvls_tree":  # 2.18
            return bus * 0.7 * comm.n_nodes / (2 * (comm.n_nodes - 1))
        return bus * 0.75
    return bus * 0.5 if not gather else bus


def options(comm: Comm, op: str) -> list:
    """Every (algorithm, protocol) NCCL would consider for ``op``, with its latency and bandwidth."""
    if op not in COLLECTIVES:
        raise TopologyError("op", f"NCCL's tuner prices {', '.join(COLLECTIVES)}, not {op!r}")
    found = []
    for algorithm in tuning.ALGORITHMS:
        for protocol in tuning.PROTOCOLS:
            if _allowed(comm, op, algorithm, protocol):
                option = _option(comm, op, algorithm, protocol)
                if option is not None:
                    found.append(option)
    return found


def _option(comm: Comm, op: str, algorithm: str, protocol: str) -> Optional[Option]:
    """One (algorithm, protocol) as ``comm.tuner``'s release prices it, or None where it has no graph
    or no bandwidth."""
    graph = _graph(comm, algorithm)
    if graph is None:
        return None
    bandwidth = _algorithm_bandwidth(comm, op, algorithm, protocol, graph)
    if bandwidth <= 0:
        return None
    channels = nvls_channels(comm) if algorithm in ("nvls", "nvls_tree") else comm_channels(comm, ring_graph(comm))
    link = "net" if comm.n_nodes > 1 else graph.link_intra
    return Option(op, algorithm, protocol, _latency(comm, op, algorithm, protocol, graph), bandwidth, channels, link)


def ring_network_steps(t, op: str, n_nodes: int, ppn: int) -> int:
    """The network steps in a ring's latency under tuner ``t``'s count (``inter_steps``): for an
    all-reduce ``2(n-1)`` (NCCL up to 2.11 and from 2.23), ``2n`` (2.12 to 2.22), or, for our
    prediction (``"path"``), ``2n`` where nodes hold several ranks and ``2(n-1)`` where each
    holds one; ``n-1`` for all-gather and reduce-scatter (every release, and ours). Why
    ``path``: a small message's slowest rank waits for a chain of ``2(ranks-1)`` consecutive
    ring links (the whole ring twice but two links), which crosses each of the ``n`` network
    links twice, less at most one, once a node holds two ranks, and exactly ``2(n-1)`` times
    where every link is a network link. Of NCCL's own counts we take 2.12-2.22's ``2n`` (one
    above the chain's ``2n-1``; the current ``2(n-1)`` is one below): the only multi-node ring
    latency series we have (V100 p3dn over EFA at 2, 4 and 8 nodes: 163, 319, 631 us at 8 B)
    grows as ``2n`` does (1 : 2 : 4; ``2n-1``: 1 : 2.3 : 5; ``2(n-1)``: 1 : 3 : 7), so that
    choice between NCCL's counts was made by those tables. The gathers' chain would cross ``n``
    network links, not ``n-1``; on the public tables counting ``n`` moved figures both ways
    (spec-only 28.2 to 28.0 %, cross-scale 13.7 to 14.3 %), so we keep NCCL's."""
    if n_nodes <= 1:
        return 0
    if op != "all_reduce":
        return n_nodes - 1
    if t.inter_steps == "2n" or (t.inter_steps == "path" and ppn >= 2):
        return 2 * n_nodes
    return 2 * (n_nodes - 1)


@functools.lru_cache(maxsize=None)
def pricing_tuner():
    """The tables every release's choice is timed with (:func:`priced`): the newest release's,
    with the ring's network steps counted along its critical path (``ring_network_steps``)."""
    return dataclasses.replace(tuner(LATEST), inter_steps="path")


def priced(comm: Comm, option: Option) -> tuple:
    """``(comm, option)`` to time ``option`` with: the newest release's tables (its per-algorithm
    bandwidths and latencies are NCCL's best account of what the hardware does; an older
    release's tables decide only what that release picks) with the ring's network steps on
    its critical path (``pricing_tuner``), or the release's own where the newest has no such
    option."""
    newest = comm.with_tuner(pricing_tuner())
    again = _option(newest, option.op, option.algorithm, option.protocol)
    return (newest, again) if again is not None else (comm, option)


def bandwidth_on(comm: Comm, option: Option, channels: int) -> float:
    """``option``'s bandwidth when NCCL launches only ``channels`` of its channels: the tuner's
    formula on a graph of proportionally fewer channels, so per-channel ceilings shrink with
    them and whole-GPU ones (LL's) do not. CollNet direct keeps its heads (the tuner's
    ``ppn / heads`` factor is the graph's, not the launch's), each on fewer channels: its
    bandwidth scales with the channels."""
    if channels == option.channels:
        return option.bandwidth_gbs
    if option.algorithm == "collnet_direct" and channels < option.channels:
        return option.bandwidth_gbs * channels / option.channels  # same heads, fewer channels each
    graph = _graph(comm, option.algorithm)
    if channels > option.channels:  # NCCL_MIN_NCHANNELS: more blocks on the same links
        more = dataclasses.replace(graph, cap_channels=graph.channels * channels / option.channels)
        return _algorithm_bandwidth(comm, option.op, option.algorithm, option.protocol, more)
    fewer = dataclasses.replace(graph, channels=graph.channels * channels / option.channels)
    return _algorithm_bandwidth(comm, option.op, option.algorithm, option.protocol, fewer)


def network_share(comm: Comm, option: Option, channels: int) -> float:
    """The share of ``option``'s transfer time that the network bounds (0 inside a node): how
    much longer it takes when the NICs run at half speed (``S/B' = S/B (1 + share)``), on the
    graph the search would find then (every speed a NIC set halves; NVLink's do not), so that
    a per-channel ceiling or NVLink that binds first leaves the network's rate out of it."""
    if comm.n_nodes == 1 or option.algorithm == "p2p":
        return 0.0
    nics_only = option.algorithm in ("nvls", "nvls_tree", "collnet_direct")
    share, graph = _half_speed_share(comm, option, channels, halve_intra=not nics_only, stalled=0.0)
    if option.algorithm == "ring":
        share *= ring_nic_share(comm, graph, channels)
    return share


def _half_speed_share(comm: Comm, option: Option, channels: int, halve_intra: bool, stalled: float) -> tuple:
    """How much longer ``option``'s transfer takes on ``channels`` when its graph's network
    speed, and with ``halve_intra`` its NVLink (PCIe) speed too, are halved: the share of the
    time those speeds set, within [0, 1] (``stalled`` where the halved graph moves nothing);
    and the graph on those channels."""
    graph = _graph(comm, option.algorithm)
    if channels < option.channels:
        graph = dataclasses.replace(graph, channels=graph.channels * channels / option.channels)
    full = _algorithm_bandwidth(comm, option.op, option.algorithm, option.protocol, graph)
    half = dataclasses.replace(graph, bw_inter=graph.bw_inter / 2)
    if halve_intra:
        half = dataclasses.replace(half, bw_intra=graph.bw_intra / 2)
    slow = _algorithm_bandwidth(comm, option.op, option.algorithm, option.protocol, half)
    return (stalled if slow <= 0 else min(1.0, max(0.0, full / slow - 1.0))), graph


def link_share(comm: Comm, option: Option, channels: int) -> float:
    """The share of ``option``'s transfer time that the links' rates set, NVLink (PCIe) and
    network together: how much longer it takes when every link runs at half speed (both graph
    speeds halved). The rest (``1 - share``) is set by a per-channel ceiling of NCCL's kernels
    (``TREE_MAX_BW``, LL128's and LL's ceilings per channel or per GPU): a kernel's throughput,
    which a faster or slower NVLink or NIC does not move, so neither link's measured efficiency
    acts on it (``predict``). Where a ceiling binds, NCCL's formula takes the smaller of it and
    the links' bandwidth, and so do we; NCCL does not split the time."""
    if option.algorithm == "p2p":
        return 1.0
    return _half_speed_share(comm, option, channels, halve_intra=True, stalled=1.0)[0]


def ring_nic_share(comm: Comm, graph: Graph, channels: int) -> float:
    """Whether a ring across nodes waits on its NICs (1) or on the NVLink inside its nodes (0):
    ``clamp(2 b / c - 1, 0, 1)``, ``b`` the ring's bus bandwidth (every channel leaves each node
    once, at its speed, on the channels launched) and ``c`` what the node's NICs carry at the
    speed NCCL's search gives a channel on one NIC, one channel per NIC up to ``node_nics``:
    ``b`` at ``c`` is NIC-bound (halving the NICs halves it), ``b`` at ``c / 2`` or below is not.

    NCCL's search caps a ring channel's speed at one NIC's (``nic_path``), so halving the NICs
    halves every ring in its model (``network_share``'s account, 1). Where a node has far more
    NICs than the ring has channels (a GB200/GB300 NVLink domain of 64 or 72 GPUs, each with its
    own NIC, joined to another by a 30-channel ring) the channels' NICs are idle half the time
    and NVLink sets the pace: CoreWeave's 128-GPU GB200 ring delivers 810 GB/s of bus bandwidth,
    above 15 NICs' 750 and at NVLink's rate, not the NICs'. Departure: the channels are taken to
    spread over distinct NICs (NCCL's search places them; we do not follow it NIC by NIC)."""
    if comm.n_nodes < 2:
        return 0.0
    speeds = comm.tuner.speeds_inter[tuning.speed_row(comm.fabric.gpu.compute_capability)]
    path = nic_path(comm)
    nic = next((s for s in speeds if s <= path + 1e-9), path)
    bus = graph.channels * graph.bw_inter  # the graph on the launched channels (network_share's)
    capacity = min(comm.node_nics, max(channels, 1)) * nic
    return min(1.0, max(0.0, 2.0 * bus / capacity - 1.0)) if capacity > 0 else 1.0


def nvls_traffic_factor(comm: Comm, option: Option) -> float:
    """How much faster (> 1) or slower (< 1) NVLS all-reduce inside one NVLink domain moves its
    bytes than NCCL's estimate says: the ratio of what each GPU's NVLink carries to NCCL's
    account of it (1 for every other case).

    In NVLS all-reduce each GPU reduces its ``1/n`` share through the switch (``multimem.ld_reduce``:
    the switch reads every GPU's copy of that share, so each GPU's NVLink sends the whole buffer
    ``S`` once over all shares and receives its reduced ``S/n``) and multicasts the result
    (``multimem.st``: it sends ``S/n`` and receives every share, ``S``). Each direction of a GPU's
    NVLink thus carries ``S (n + 1) / n``, and the bus bandwidth is ``2 (n - 1) / (n + 1)`` times
    the NVLink rate, times NVLink SHARP's efficiency (NCCL's ``nvlsEfficiency``). NCCL's tuner
    (2.28+, tuning.cc) prices it as ``2 (h - 1) / h`` times its NVLS graph's ``h`` heads at the
    search's speed step (``heads x speed <= links x SMxx_NVLINK_BW``, so quantised below the
    NVLink: Hopper's 8 x 40 of 18 x 20.6 GB/s). Here the time takes the NVLink rate as NCCL
    counts it (links x ``SMxx_NVLINK_BW`` of the newest release, unquantised) and the traffic of
    ``n`` ranks; the choice stays NCCL's. Only where every rank is a head (``h = n``, at most
    NCCL's 32): beyond, how NCCL spreads the shares over its heads is not this law, and NCCL's
    estimate stands (GB300's 64 GPUs). Departure: the switch's multicast fan-out is taken as
    free.
    """
    if option.algorithm != "nvls" or option.op != "all_reduce" or comm.n_nodes != 1 or comm.n_ranks < 2:
        return 1.0
    graph = nvls_graph(comm)
    if graph is None or graph.channels < 2 or graph.channels != comm.n_ranks:
        return 1.0
    n, h = comm.n_ranks, graph.channels
    ours = intra_total(comm) * 2.0 * (n - 1) / (n + 1)
    nccl = graph.channels * graph.bw_intra * 2.0 * (h - 1) / h
    return ours / nccl


def estimate_parts(comm: Comm, option: Option, nbytes: float) -> tuple:
    """NCCL's estimate (``ncclTopoGetAlgoTime``) as ``(latency_us, transfer_us)``."""
    t = comm.tuner
    bw, lat = option.bandwidth_gbs, option.latency_us
    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    table = t.tree_correction[option.protocol]
    if option.op == "all_reduce" and 0 <= log_size < len(table):
        blackwell_x86 = comm.arch == "blackwell" and comm.fabric.cpu != "arm" and t.nvls_tree_blackwell_correction
        if option.algorithm == "tree" or (option.algorithm == "nvls_tree" and blackwell_x86):
            bw *= table[log_size]
    if option.algorithm == "ring" and option.protocol == "simple" and comm.n_nodes > 1 and option.op == "all_reduce":
        if t.plateau == "per_channel":
            plateau = nbytes / (option.channels * comm.n_ranks) >= 64
        else:
            plateau = nbytes >= comm.n_ranks / 16.0 * 65536
        if plateau:
            threshold, below, above = t.plateau_factor
            lat *= below if comm.fabric.gpu.compute_capability < threshold else above
    return lat, nbytes / (1000.0 * bw)


def nccl_estimate_us(comm: Comm, option: Option, nbytes: float) -> float:
    """NCCL's own time estimate, the one it chooses by."""
    return sum(estimate_parts(comm, option, nbytes))


def choose(comm: Comm, op: str, nbytes: float, algorithms=None, protocols=None) -> Option:
    """The option NCCL picks for ``nbytes``: the cheapest estimate among those allowed.

    ``algorithms`` / ``protocols`` (sets of names, None for all) restrict the choice as
    ``NCCL_ALGO`` / ``NCCL_PROTO`` do.
    """
    every = options(comm, op)
    candidates = [o for o in every if (algorithms is None or o.algorithm in algorithms)
                  and (protocols is None or o.protocol in protocols)]
    if not candidates:
        forced = " and ".join(f"{what} {'/'.join(sorted(names))}" for what, names in
                              (("algorithm", algorithms), ("protocol", protocols)) if names is not None)
        known = sorted({f"{o.algorithm}/{o.protocol}" for o in every})
        raise TopologyError("algorithm" if algorithms is not None else "protocol",
                            f"NCCL has no {forced} for {op} on this communicator; it has {', '.join(known)}")
    return min(candidates, key=lambda o: nccl_estimate_us(comm, o, nbytes))


def nvls_chunk(comm: Comm, option: Option, nbytes: float) -> tuple:
    """``(chunk, largest chunk, concurrent chunks)`` NCCL's NVLS / NVLS tree kernels use for
    ``nbytes`` (calcCollChunking), or None for other algorithms."""
    if option.algorithm not in ("nvls", "nvls_tree"):
        return None
    graph = nvls_graph(comm)
    ops = option.channels * graph.channels
    if option.algorithm == "nvls":
        largest = tuning.NVLS_CHUNK
        if comm.n_nodes > 1 and option.bandwidth_gbs * 2 * (comm.n_ranks - 1) / comm.n_ranks < 150:
            largest = tuning.NVLS_SLOW_NET_CHUNK
        steps = tuning.NVLS_CHUNK_STEPS
    else:
        largest = tuning.NVLS_TREE_MAX_CHUNK_FROM_4_NODES if comm.n_nodes >= 4 else tuning.NVLS_CHUNK
        steps = tuning.NVLS_TREE_CHUNK_STEPS
    chunk = largest
    for times, smaller in steps:
        if nbytes < times * ops * chunk and chunk > smaller:
            chunk = smaller
    return chunk, largest, ops


def chunk_slowdown(comm: Comm, option: Option, nbytes: float) -> float:
    """How much longer NVLS moves its bytes in the small chunks it uses for ``nbytes`` than in
    its largest (1 for other algorithms): every chunk pays a synchronisation ``tau`` on top of
    its bytes at one lane's share ``b`` of the bandwidth, so a chunk ``c`` runs at
    ``c / (c + tau b)`` of the lane's speed. ``tau``: one reduce and one multicast step over
    NVLink, twice NCCL's NVLink step (tuning.cc, ring/simple 3.4 us). The per-chunk view is
    ours, not NCCL's."""
    found = nvls_chunk(comm, option, nbytes)
    if found is None:
        return 1.0
    chunk, largest, ops = found
    tau_b = NVLS_CHUNK_SYNC_US * option.bandwidth_gbs * 1e3 / ops
    return (1 + tau_b / chunk) / (1 + tau_b / largest)


def pipeline_fill_us(comm: Comm, option: Option, nbytes: float, bandwidth_gbs: float) -> float:
    """The time NVLS's pipeline takes to fill: a chunk passes ``depth`` stages one after the other
    (reduce through the switch, then multicast; NVLS tree's ``2 log2 nodes`` network hops up and
    down the tree, the reduction folded into the first and the multicast into the last), and
    only once the first chunk is through is every stage busy, so
    ``(depth - 1) x chunk / b`` comes on top of the bytes at full speed (``b`` one lane's
    bandwidth). 0 for algorithms whose every link is busy from the start (rings); trees' is
    :func:`tree_chain_fill_us`."""
    found = nvls_chunk(comm, option, nbytes)
    if found is None:
        return 0.0
    chunk, _, ops = found
    depth = 1 + 2 * _log2i(comm.n_nodes) if option.algorithm == "nvls_tree" else 2
    lane_bytes_per_us = bandwidth_gbs * 1e3 / ops
    return (depth - 1) * min(chunk, nbytes / ops) / lane_bytes_per_us


TREE_SIMPLE_CHUNK = 4 * 2**20 // 8  # NCCL's Simple buffer (DEFAULT_BUFFSIZE, 4 MiB) over NCCL_STEPS (8)


def tree_chain_fill_us(comm: Comm, option: Option, nbytes: float, channels: int, release: tuple) -> float:
    """The time a tree all-reduce's Simple pipeline takes to fill: the first chunk climbs the
    chain of ``ppn`` GPUs of its node and ``log2 nodes`` network levels, and comes down again,
    each hop a whole chunk (Simple forwards a step only once it has arrived): ``2 (ppn - 1)``
    NVLink hops and ``2 log2 nodes`` network hops of ``t_i`` each. In steady state every chunk
    costs the slowest link two hops (it carries the chunk up and back down: a tree's algorithm
    bandwidth is half its bus bandwidth), which the transfer ``S / B`` counts; the rest of the
    first chunk's trip, ``sum t_i - 2 max t_i``, is the fill (none for one GPU on each of two
    nodes, whose one chunk goes up and down once). A hop moves a chunk at its channel's share of
    the link: a GPU's NVLink over the channels launched, a NIC (one per channel, as many as the
    node has). The chunk is NCCL's Simple step, 512 KiB (``calcCollChunking``: a tree's chunk
    is one step); releases before 2.20 halve it while a
    channel holds fewer than ``8 x depth`` (then ``4 x``, ``1 x``) chunks, down to 128, 64 and
    32 KiB. NCCL's estimate has no such term (its per-hop latency is a constant); LL and LL128
    forward line by line, so theirs is taken as nothing. 0 for other algorithms."""
    if option.algorithm != "tree" or option.protocol != "simple" or option.op != "all_reduce" or comm.n_nodes < 2:
        return 0.0
    ppn, levels = comm.ppn, _log2i(comm.n_nodes)
    channels = max(channels, 1)
    chunk = float(TREE_SIMPLE_CHUNK)
    if release < (2, 20, 0):
        depth = ppn - 1 + levels + 1
        for times, floor in ((8, 131072), (4, 65536), (1, 32768)):
            while nbytes / (channels * chunk) < depth * times and chunk > floor:
                chunk /= 2
    chunk = min(chunk, nbytes / channels)
    nvlink = chunk / (intra_total(comm) * 1e3 / channels)
    nic = chunk / (nic_path(comm) * 1e3 * min(1.0, comm.node_nics / channels))
    hops = [nvlink] * (2 * (ppn - 1)) + [nic] * (2 * levels)
    return max(0.0, sum(hops) - 2 * max(hops)) if hops else 0.0


def channels_used(comm: Comm, option: Option, nbytes: float, version: Optional[tuple] = None) -> int:
    """Channels NCCL launches for ``nbytes`` (enqueue.cc topoGetAlgoInfo) under release ``version``
    (default ``comm.tuner``'s).

    Rings and trees drop one channel while ``nbytes < channels x threads x threshold``
    (``NCCL_*_THREAD_THRESHOLD``, ring LL's times the ranks). CollNet direct's threshold is
    512 bytes per thread and head (tuning.cc), counted over ``nHeads``, and it steps down
    only to 16, 8, 4, 2 and 1 channels in turn, halving the threshold at 1.5 times each step
    (``ncSwitch``); CollNet chain uses the ring/tree rule with the same 512. NVLS keeps all its
    channels."""
    if option.algorithm in ("nvls", "nvls_tree"):
        return option.channels
    version = comm.tuner.version if version is None else version
    channels = option.channels
    if option.algorithm.startswith("collnet"):
        threads = max(v for since, v in tuning.COLLNET_MAX_THREADS.items() if version >= since)
        threshold = tuning.COLLNET_THREAD_THRESHOLD
    else:
        threads = tuning.MAX_THREADS[option.protocol]
        threshold = tuning.THREAD_THRESHOLD[option.protocol]
        if option.algorithm == "ring" and option.protocol == "ll":
            threshold *= comm.n_ranks
    if option.algorithm == "collnet_direct":
        heads = collnet_graph(comm).channels
        switch, below = 16, True
        while switch >= 1 and below:
            while True:
                below = nbytes < channels * threads * heads * threshold
                if not (below and channels > switch):
                    break
                if channels == switch + switch // 2:
                    threshold //= 2
                channels -= 1
            switch //= 2
        return channels
    while nbytes < channels * threads * threshold and channels >= 2:
        channels -= 1
    return channels


# -- our prediction ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicted:
    """The time we predict for one collective (``latency_us + transfer_us``), with NCCL's choice
    behind it and the channels it runs on.

    ``hops``, ``kind``, ``local_us`` and ``net_us`` say how the time was made, for fitting the
    measured constants (``measured.py``): ``hops`` network hops of NIC kind ``kind``, and the
    transfer at the specs' rates split into what the NVLink (PCIe) inside a node bounds
    (``local_us``), what the network bounds (``net_us``), combined by ``combine`` (``sum``, or
    ``max`` where the two run at once), and what neither link's rate sets (``ceiling_us``: a
    per-channel ceiling of NCCL's kernels, ``link_share``); ``base_latency_us`` is the latency
    before the measured constants.
    """

    option: Option
    latency_us: float
    transfer_us: float
    channels: int
    hops: float = 0.0
    kind: str = ""
    local_us: float = 0.0
    net_us: float = 0.0
    combine: str = "sum"
    base_latency_us: float = 0.0
    ceiling_us: float = 0.0

    @property
    def time_us(self) -> float:
        return self.latency_us + self.transfer_us


def net_hops(comm: Comm, option: Option) -> float:
    """The network hops in ``option``'s latency (``_latency``'s inter-node steps), each of which
    pays a NIC kind's measured hop latency."""
    n_nodes = comm.n_nodes
    if n_nodes == 1:
        return 0.0
    algorithm, op = option.algorithm, option.op
    if algorithm == "ring":
        if op in ("broadcast", "reduce"):
            return 1.0
        return float(ring_network_steps(comm.tuner, op, n_nodes, comm.ppn))
    if algorithm in ("tree", "nvls_tree"):
        return 2.0 * _log2i(n_nodes)
    if algorithm == "pat":
        return float(_log2i(n_nodes))
    return 1.0  # nvls, collnet: one trip through the switch


def local_link(comm: Comm, algorithm: str) -> str:
    """The link class whose measured efficiency (``measured.link_efficiency``) the part of
    ``algorithm``'s time inside a node runs at: ``nvls`` for NVLS and NVLS tree on NVLink, the
    node's own link class (``nvlink``, ``pci``) otherwise.

    NVLS moves its bytes inside a node through the NVSwitch's multicast and in-switch reduction
    (``multimem.ld_reduce`` / ``multimem.st``, NVLink SHARP), not through the copy loops of ring
    and tree kernels from one GPU's buffer into another's: NCCL prices it apart, at
    ``nvlsEfficiency`` of the NVLink rate since 2.28 (``tuning.cc``), where a ring gets the
    search's per-channel speed. What one of them achieves on a machine says nothing of the
    other, so a calibration keeps them apart: an 8-GPU table that ran NVLS informs no ring's
    NVLink rate, and a two-rack NVLS tree (whose NVLink share carried the whole misfit of its
    MNNVL pipeline, 0.75) no longer slows the 4-GPU ring of the same GB300 rack by 20 %."""
    if algorithm in ("nvls", "nvls_tree") and comm.link_intra == "nvlink":
        return "nvls"
    return comm.link_intra


def predict(comm: Comm, op: str, nbytes: float, algorithms=None, protocols=None, calibration=None) -> Predicted:
    """NCCL's choice for ``nbytes``, timed as ``L' + S / B'`` (see the module docstring).

    ``L' = (NCCL's L + kernel + hops x hop latency) x latency factor``; ``S / B'`` is NCCL's
    transfer time on the channels it launches, slowed by NVLS's small chunks and with NVLS's
    pipeline fill, its part inside a node over the achieved fraction of the NVLink (PCIe) rate
    and its part across nodes over that of the network's, and over the bandwidth factor. Kernel, hop latency and achieved rate are the measured constants of
    ``calibration.constants`` (``measured.py``; the public estimates without a calibration),
    the two factors the calibration's own (1 without), so a fit sees ``T = f L + X / e``.
    """
    if comm.n_ranks == 1:
        return Predicted(Option(op, "ring", "simple", 0.0, math.inf, 1, comm.link_intra), 0.0, 0.0, 1)
    measured = public() if calibration is None else calibration.constants
    chosen = choose(comm, op, nbytes, algorithms, protocols)
    release = comm.tuner.version
    comm, option = priced(comm, chosen)
    used = channels_used(comm, option, nbytes, release)
    if calibration is not None and calibration.min_channels and option.algorithm in ("ring", "tree"):
        used = max(used, calibration.min_channels)
    efficiency, latency_factor = (1.0, 1.0) if calibration is None else calibration.factors_for(
        option.link, option.algorithm, option.protocol, comm.n_nodes)
    bandwidth = bandwidth_on(comm, option, used) * nvls_traffic_factor(comm, option)
    latency, transfer = estimate_parts(comm, dataclasses.replace(option, bandwidth_gbs=bandwidth), nbytes)
    transfer = (transfer * chunk_slowdown(comm, option, nbytes) + pipeline_fill_us(comm, option, nbytes, bandwidth)
                + tree_chain_fill_us(comm, option, nbytes, used, release))
    nic = comm.fabric.nic
    hops = net_hops(comm, option)
    links = link_share(comm, option, used)
    share = min(network_share(comm, option, used), links)
    local, net, ceiling = transfer * (links - share), transfer * share, transfer * (1.0 - links)
    measured_latency = latency + measured.kernel(comm.arch) + hops * measured.hop(nic.kind, nic.transport)
    measured_transfer = local / measured.local_efficiency(local_link(comm, option.algorithm)) + net / measured.net_efficiency(
        nic.kind, nic.transport) + ceiling
    return Predicted(chosen, measured_latency * latency_factor, measured_transfer / efficiency, used,
                     hops, nic.kind, local, net, "sum", latency, ceiling)
