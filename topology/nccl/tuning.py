"""NCCL's tuning constants, as tables: the facts the cost models of ``model.py`` stand on.

Every number here is NCCL's, from ``src/graph/tuning.cc`` (``ncclTunerConstantsDefaults`` and
the refinements in ``ncclTopoTuneModel``), ``src/graph/search.cc`` (the speeds its topology
search tries), ``src/include/device.h`` and ``src/include/comm.h`` (threads and thresholds),
``src/transport/nvls.cc`` (NVLS channels), as of NCCL 2.30. Earlier releases' tables differ;
``versions.py`` holds the history and builds any release's from these. Bandwidths are NCCL's
GB/s (1e9 bytes/s), latencies microseconds. Names, not NCCL's integers, index the tables;
:func:`parse_choice` reads them as ``NCCL_ALGO`` / ``NCCL_PROTO`` write them.
"""

from __future__ import annotations

import difflib
from typing import Optional

from ..units import TopologyError

NCCL_VERSION = "2.30"

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")
LINK_CLASSES = ("nvlink", "pci", "net")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv")

# baseLatencies[algorithm][protocol]: a collective's fixed cost (kernel start, first step).
BASE_LATENCY_US = {
    "tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4),
    "collnet_direct": (0, 0, 0), "collnet_chain": (0, 0, 0),
    "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (8.0, 8.0, 8.0),
}

# hwLatencies[link class][algorithm][protocol]: the latency of one step over that link.
HOP_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0), "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31.0),
            "collnet_chain": (0, 0, 30.0), "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 20.9), "pat": (0, 0, 14.0)},
}

# Compute-capability rows of the per-channel tables: Volta, Ampere, Hopper, Blackwell.
ARCHS = ("volta", "ampere", "hopper", "blackwell")

# llMaxBws[row][nodes 1 / 2 / more]: the LL protocol's ceiling. One node: the GPU's row; more
# nodes: the CPU's (row 0 Intel, row 1 AMD).
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
             "hopper": (141.0, 45.0, 35.0), "blackwell": (282.0, 90.0, 70.0)}
LL_MAX_BW_MULTINODE = {"intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)}

# Per-channel ceilings [arch][nodes 1 / 2 / more].
RING_LL128_MAX_BW = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3, "blackwell": (40.0,) * 3}
TREE_LL128_MAX_BW = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}
TREE_MAX_BW = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
               "blackwell": (70.0, 42.8, 24.0)}
NVLS_TREE_MAX_BW = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (0.0, 57.7, 45.5),
                    "blackwell": (0.0, 96.0, 80.0)}
NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}

# Protocol refinements of ncclTopoTuneModel, as factors on the bus bandwidth.
RING_LL_FACTOR = 0.5            # LL moves 8 bytes of data in 16 (4 of flags)
LL128_FACTOR = 120.0 / 128.0    # LL128 moves 120 bytes of data in 128; NCCL writes 0.92
RING_LL128_FACTOR = 0.92
TREE_ALLREDUCE_FACTOR = 0.92
TREE_LL_FACTOR = 1.0 / 3.8
TREE_LL128_ONE_NODE_FACTOR = 7.0 / 9.0
PAT_FACTOR = 0.75
COLLNET_HOPPER_FACTOR = 0.85
RING_PLATEAU = {"volta": 1.9, "ampere": 1.4, "hopper": 1.4, "blackwell": 1.4}  # ring/simple latency beyond one node

# Tree all-reduce's bandwidth correction by message size (treeCorrectionFactor[protocol][log2(bytes/64)]).
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}

# The speeds (GB/s per channel) NCCL's topology search tries, fastest first (search.cc).
SPEEDS_INTRA = {
    "sm80": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    "sm90": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    "sm100": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
SPEEDS_INTER = {
    "sm80": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    "sm90": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    "sm100": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
              1.2, 0.24, 0.12),
}

MAX_CHANNELS = 64           # MAXCHANNELS; the ring search stops at half
NVLS_CHANNELS = {"hopper": 16, "blackwell": 32, "blackwell_one_node": 24}  # nvls.cc
MAX_NVLS_ARITY = 32
MAX_DIRECT_ARITY = 7        # CollNet Direct: at most 8 local GPUs

# Threads per channel and the bytes per thread below which NCCL uses fewer channels
# (enqueue.cc topoGetAlgoInfo; comm.h NCCL_*_THREAD_THRESHOLD; device.h NCCL_*_MAX_NTHREADS).
MAX_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
THREAD_THRESHOLD = {"ll": 8, "ll128": 8, "simple": 64}
COLLNET_THREAD_THRESHOLD = 512
# CollNet's threads per channel (tuning.cc ncclTopoTuneModel): NCCL_SIMPLE_MAX_NTHREADS up to
# 2.17, NCCL_MAX_NTHREADS from 2.18.
COLLNET_MAX_THREADS = {(0, 0, 0): 512, (2, 18, 0): 640}

# NVLS chunking (nvls.cc ncclNvlsTuning, enqueue.cc calcCollChunking): the default chunk, the
# smaller chunks NCCL falls back to when a message is small against channels x heads x chunk,
# and NVLS tree's ceiling from four nodes on.
NVLS_CHUNK = 128 * 1024
NVLS_CHUNK_STEPS = ((64, 65536), (8, 32768), (2, 16384))            # (bytes < k x ops x chunk, fall to)
NVLS_TREE_CHUNK_STEPS = ((32, 262144), (16, 131072), (4, 65536), (1, 32768))
NVLS_TREE_MAX_CHUNK_FROM_4_NODES = 65536
NVLS_SLOW_NET_CHUNK = 32768   # NVLS across nodes when its all-reduce bandwidth is below 150 GB/s

NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "arm": 1.0}  # getNetOverhead: per network post


def arch(compute_capability: int) -> str:
    """The row of the per-architecture tables for a compute capability."""
    if compute_capability >= 100:
        return "blackwell"
    if compute_capability >= 90:
        return "hopper"
    if compute_capability >= 80:
        return "ampere"
    return "volta"


def speed_row(compute_capability: int) -> str:
    return "sm100" if compute_capability >= 100 else "sm90" if compute_capability >= 90 else "sm80"


def nodes_column(n_nodes: int) -> int:
    """The column of the per-node tables: one node, two, or more."""
    return min(n_nodes, 3) - 1


def protocol_index(protocol: str) -> int:
    return PROTOCOLS.index(protocol)


_ALIASES = {"nvlstree": "nvls_tree", "collnetdirect": "collnet_direct", "collnetchain": "collnet_chain"}


def _name(value: str, known: tuple, key: str) -> str:
    name = str(value).strip().lower().replace("-", "_")
    name = _ALIASES.get(name.replace("_", ""), name)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TopologyError(key, f"unknown {key} {value!r}; {hint}known: {', '.join(known)}")
    return name


def parse_choice(spec: Optional[str], known: tuple, key: str) -> Optional[frozenset]:
    """The names a ``NCCL_ALGO`` / ``NCCL_PROTO``-style spec allows: ``ring``, ``ring,tree``, or
    ``^nvls,nvls_tree`` (all but those); None (no spec) allows all."""
    if spec is None:
        return None
    text = str(spec).strip()
    exclude = text.startswith("^")
    names = {_name(part, known, key) for part in text.lstrip("^").split(",") if part.strip()}
    if not names:
        raise TopologyError(key, f"names no {key}: {spec!r}")
    return frozenset(set(known) - names) if exclude else frozenset(names)


def parse_choices(algorithm: Optional[str], protocol: Optional[str]) -> tuple:
    """``(algorithms, protocols)`` name sets of NCCL_ALGO / NCCL_PROTO-style specs (``p2p`` is
    the point-to-point operations' algorithm)."""
    return parse_choice(algorithm, ALGORITHMS + ("p2p",), "algorithm"), parse_choice(protocol, PROTOCOLS, "protocol")
