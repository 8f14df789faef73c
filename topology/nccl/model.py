"""Collectives as NCCL runs them: every algorithm and protocol's cost, and NCCL's choice.

One formula prices every (algorithm, protocol) of a collective on a communicator::

    T(S) = L + S / B

``L`` a latency and ``B`` an algorithm bandwidth (bytes of the collective's nccl-tests "size"
per second), both from the tables of ``tuning.py`` and the channels of ``graphs.py``, exactly
as NCCL's tuner computes them (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``, NCCL 2.23-2.30):

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
:func:`choose`; ``NCCL_ALGO`` / ``NCCL_PROTO`` become ``algorithm`` / ``protocol``.

Where we depart from NCCL's estimate, in :func:`predict` (the time we report; the choice stays
NCCL's, made on NCCL's estimate, as NCCL itself makes it):

* *channels in use.* For small messages NCCL launches fewer channels (``topoGetAlgoInfo``: while
  ``bytes < channels x threads x threshold`` one fewer); we price them with the tuner's own
  formula on that many channels (:func:`bandwidth_on`), so per-channel ceilings shrink with them.
* *NVLS chunks and pipeline.* NVLS and NVLS tree cut small messages into small chunks
  (``calcCollChunking``), each paying a synchronisation, and take one chunk time per stage to
  fill their pipeline (:func:`chunk_slowdown`, :func:`pipeline_fill_us`).
* *kernel start*, the same for every algorithm, so NCCL leaves it out: ``KERNEL_START_US``.
* *the fabric's own efficiency*, per link class and (algorithm, protocol), and a latency factor:
  1 from specs, fitted by ``whatif calibrate nccl-tests`` (``calibration`` of the fabric).

Not modelled: NCCL's version-to-version changes (the tables are 2.23-2.30's; 2.19-2.22 priced
NVLS and Tree/Simple differently and choose differently on some machines), user-buffer
registration, CUDA graphs, and congestion from other jobs. Point-to-point (send/recv,
all-to-all) is not in NCCL's tuner; see ``p2p.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..units import TopologyError
from . import tuning
from .graphs import Comm, Graph, collnet_graph, comm_channels, nvls_channels, nvls_graph, ring_graph, tree_graph

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")

# What NCCL's latencies leave out because it is the same for every algorithm: the kernel's
# start on the GPU and its first work descriptor. Ours, not NCCL's: 4 us, from the pooled
# smallest rows of the public tables (bench/nccl_accuracy.py), never from one table.
KERNEL_START_US = 4.0
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
    """NCCL's bus bandwidth (GB/s) of one (algorithm, protocol); 0 where NCCL would not use it."""
    arch, col = comm.arch, tuning.nodes_column(comm.n_nodes)
    n_nodes, ppn = comm.n_nodes, comm.n_ranks / comm.n_nodes
    collnet = algorithm.startswith("collnet")
    bw = graph.bw_intra if (n_nodes <= 2 or collnet) else graph.bw_inter
    if algorithm in ("nvls", "nvls_tree"):
        if graph.channels < 2:
            return 0.0
        intra = graph.bw_intra * tuning.NVLS_EFFICIENCY[arch] * (graph.channels - 1) / graph.channels
        intra *= 2.0 if op == "all_reduce" else (ppn - 1) / ppn
        inter = graph.bw_inter * (2 if (n_nodes <= 2 and algorithm == "nvls_tree") else 1)
        cap = tuning.NVLS_TREE_MAX_BW[arch][col] if algorithm == "nvls_tree" else math.inf
        bw = min(intra, inter if n_nodes > 1 else math.inf, cap)
    bus = graph.channels * bw
    if n_nodes == 1:
        ll_max = tuning.LL_MAX_BW[arch][col]
    else:
        ll_max = tuning.LL_MAX_BW_MULTINODE["amd" if comm.fabric.cpu == "amd" else "intel"][col]
    if algorithm == "ring" and protocol == "ll":
        bus = min(ll_max, bus * tuning.RING_LL_FACTOR)
    if algorithm == "ring" and protocol == "ll128":
        bus = min(bus * tuning.RING_LL128_FACTOR, graph.channels * tuning.RING_LL128_MAX_BW[arch][col])
    if algorithm == "tree" and op == "all_reduce":
        bus = min(bus * tuning.TREE_ALLREDUCE_FACTOR, graph.channels * tuning.TREE_MAX_BW[arch][col])
    if algorithm == "tree" and protocol == "ll":
        bus = min(bus * tuning.TREE_LL_FACTOR, ll_max)
    if algorithm == "tree" and protocol == "ll128":
        factor = tuning.TREE_LL128_ONE_NODE_FACTOR if n_nodes == 1 else tuning.LL128_FACTOR
        bus = min(bus * factor, graph.channels * tuning.TREE_LL128_MAX_BW[arch][col])
    if algorithm == "pat":
        bus *= tuning.PAT_FACTOR
    if collnet and protocol != "simple":
        return 0.0
    if algorithm == "collnet_direct":
        if op in ("all_gather", "reduce_scatter"):
            bus = ppn * min(graph.bw_intra, graph.bw_inter * 0.9)
        else:
            factor = ppn / graph.channels
            bus /= factor - (factor - 1) / 2
            if comm.fabric.gpu.compute_capability >= 90:
                bus *= tuning.COLLNET_HOPPER_FACTOR
    if algorithm in ("nvls", "collnet_direct") and op in ("all_gather", "reduce_scatter") and n_nodes > 1:
        return 0.0
    return bus


def _latency(comm: Comm, op: str, algorithm: str, protocol: str, graph: Graph) -> float:
    """NCCL's latency (us) of one (algorithm, protocol)."""
    p = tuning.protocol_index(protocol)
    n, n_nodes = comm.n_ranks, comm.n_nodes
    ppn = n // n_nodes
    nic_extra = comm.fabric.nic.latency_us
    intra_lat = tuning.HOP_LATENCY_US[graph.link_intra][algorithm][p]
    inter_lat = tuning.HOP_LATENCY_US["net"]["tree" if comm.ppn == 1 else algorithm][p] + nic_extra
    if protocol == "simple":
        inter_lat += nic_extra  # the flush after a Simple receive
    base = tuning.BASE_LATENCY_US[algorithm][p]
    if algorithm == "ring":
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        if op in ("broadcast", "reduce"):
            return base + tuning.HOP_LATENCY_US["net" if n_nodes > 1 else graph.link_intra]["ring"][p]
        overhead = 0.0
        if n_nodes > 1:
            overhead = tuning.NET_OVERHEAD_US[comm.fabric.cpu] * (3 if protocol == "simple" else 1)
        intra_lat = max(intra_lat, overhead)
        inter_steps = 0 if n_nodes == 1 else 2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1
        return base + (steps - inter_steps) * intra_lat + inter_steps * inter_lat
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra_lat + _log2i(n_nodes) * inter_lat) if op == "all_reduce" else base
    if algorithm == "collnet_direct":
        return base + 2 * (min(1, ppn - 1) * intra_lat + (ppn - 1) * 0.4) + inter_lat
    if algorithm == "collnet_chain":
        return base + 2 * (ppn - 1) * intra_lat + inter_lat
    if algorithm == "nvls":
        return intra_lat + (inter_lat if n_nodes > 1 else 0.0)
    if algorithm == "nvls_tree":
        return base + intra_lat + 2 * _log2i(n_nodes) * inter_lat
    return base + _log2i(n_nodes) * (inter_lat / 3.5) + n * 2.8  # pat


def _allowed(comm: Comm, op: str, algorithm: str, protocol: str) -> bool:
    """Which (algorithm, protocol) NCCL considers for ``op`` on ``comm`` (tuning.cc, enqueue.cc)."""
    if op in ("broadcast", "reduce") and algorithm != "ring":
        return False
    if op in ("all_gather", "reduce_scatter") and algorithm not in ("pat", "ring", "nvls", "collnet_direct"):
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
    if protocol == "ll128" and not comm.fabric.nvlink:
        return False  # LL128 needs NVLink (or NVB) paths inside a node
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
    n = comm.n_ranks
    if algorithm == "ring" or (algorithm in ("nvls", "nvls_tree") and op not in ("all_gather", "reduce_scatter")):
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        return bus * n / steps
    return bus * 0.5 if op not in ("all_gather", "reduce_scatter") else bus


def options(comm: Comm, op: str) -> list:
    """Every (algorithm, protocol) NCCL would consider for ``op``, with its latency and bandwidth."""
    if op not in COLLECTIVES:
        raise TopologyError("op", f"NCCL's tuner prices {', '.join(COLLECTIVES)}, not {op!r}")
    found = []
    for algorithm in tuning.ALGORITHMS:
        graph = _graph(comm, algorithm)
        if graph is None:
            continue
        for protocol in tuning.PROTOCOLS:
            if not _allowed(comm, op, algorithm, protocol):
                continue
            bandwidth = _algorithm_bandwidth(comm, op, algorithm, protocol, graph)
            if bandwidth <= 0:
                continue
            channels = nvls_channels(comm) if algorithm in ("nvls", "nvls_tree") else comm_channels(comm, ring_graph(comm))
            link = "net" if comm.n_nodes > 1 else graph.link_intra
            latency = _latency(comm, op, algorithm, protocol, graph)
            found.append(Option(op, algorithm, protocol, latency, bandwidth, channels, link))
    return found


def bandwidth_on(comm: Comm, option: Option, channels: int) -> float:
    """``option``'s bandwidth when NCCL launches only ``channels`` of its channels: the tuner's
    formula on a graph of proportionally fewer channels, so per-channel ceilings shrink with
    them and whole-GPU ones (LL's) do not."""
    if channels >= option.channels:
        return option.bandwidth_gbs
    graph = _graph(comm, option.algorithm)
    fewer = dataclasses.replace(graph, channels=graph.channels * channels / option.channels)
    return _algorithm_bandwidth(comm, option.op, option.algorithm, option.protocol, fewer)


def estimate_parts(comm: Comm, option: Option, nbytes: float) -> tuple:
    """NCCL's estimate (``ncclTopoGetAlgoTime``) as ``(latency_us, transfer_us)``."""
    bw, lat = option.bandwidth_gbs, option.latency_us
    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    if option.op == "all_reduce" and 0 <= log_size < 23:
        blackwell_x86 = comm.arch == "blackwell" and comm.fabric.cpu != "arm"
        if option.algorithm == "tree" or (option.algorithm == "nvls_tree" and blackwell_x86):
            bw *= tuning.TREE_CORRECTION[option.protocol][log_size]
    if (option.algorithm == "ring" and option.protocol == "simple" and comm.n_nodes > 1
            and option.op == "all_reduce" and nbytes / (option.channels * comm.n_ranks) >= 64):
        lat *= tuning.RING_PLATEAU[comm.arch]
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
    bandwidth). 0 for algorithms whose every link is busy from the start (rings) or whose mid
    sizes NCCL's own estimate corrects (trees)."""
    found = nvls_chunk(comm, option, nbytes)
    if found is None:
        return 0.0
    chunk, _, ops = found
    depth = 1 + 2 * _log2i(comm.n_nodes) if option.algorithm == "nvls_tree" else 2
    lane_bytes_per_us = bandwidth_gbs * 1e3 / ops
    return (depth - 1) * min(chunk, nbytes / ops) / lane_bytes_per_us


def channels_used(comm: Comm, option: Option, nbytes: float) -> int:
    """Channels NCCL launches for ``nbytes`` (topoGetAlgoInfo's thread-threshold rule)."""
    if option.algorithm in ("nvls", "nvls_tree", "collnet_direct"):
        return option.channels
    threads = tuning.MAX_THREADS[option.protocol]
    threshold = tuning.THREAD_THRESHOLD[option.protocol]
    if option.algorithm == "ring" and option.protocol == "ll":
        threshold *= comm.n_ranks
    channels = option.channels
    while nbytes < channels * threads * threshold and channels >= 2:
        channels -= 1
    return channels


# -- our prediction ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicted:
    """The time we predict for one collective (``latency_us + transfer_us``), with NCCL's choice
    behind it and the channels it runs on."""

    option: Option
    latency_us: float
    transfer_us: float
    channels: int

    @property
    def time_us(self) -> float:
        return self.latency_us + self.transfer_us


def predict(comm: Comm, op: str, nbytes: float, algorithms=None, protocols=None, calibration=None) -> Predicted:
    """NCCL's choice for ``nbytes``, timed as ``L' + S / B'`` (see the module docstring).

    ``L' = (kernel start + L) x latency factor``; ``S / B'`` is NCCL's transfer time on the
    channels it launches, slowed by NVLS's small chunks and with NVLS's pipeline fill, over the
    bandwidth factor. The two factors come from ``calibration`` (a
    :class:`~whatif.topology.fabric.Calibration`; 1 without), so a fit sees ``T = f L + X / e``.
    """
    if comm.n_ranks == 1:
        return Predicted(Option(op, "ring", "simple", 0.0, math.inf, 1, comm.link_intra), 0.0, 0.0, 1)
    option = choose(comm, op, nbytes, algorithms, protocols)
    used = channels_used(comm, option, nbytes)
    efficiency, latency_factor = (1.0, 1.0) if calibration is None else calibration.factors_for(
        option.link, option.algorithm, option.protocol)
    bandwidth = bandwidth_on(comm, option, used)
    latency, transfer = estimate_parts(comm, dataclasses.replace(option, bandwidth_gbs=bandwidth), nbytes)
    transfer = transfer * chunk_slowdown(comm, option, nbytes) + pipeline_fill_us(comm, option, nbytes, bandwidth)
    return Predicted(option, (KERNEL_START_US + latency) * latency_factor, transfer / efficiency, used)
