"""NCCL's tuner as each release has it: which algorithms exist and how the tuner prices them.

NCCL picks an algorithm and protocol by its own estimate (``src/graph/tuning.cc``), and that
estimate has changed from release to release: new algorithms (LL128 in 2.5, CollNet in 2.6,
CollNet chain in 2.14, NVLS in 2.17, NVLS tree in 2.18, PAT in 2.23), new constants (the ring's
LL share went from a quarter to a half in 2.21, tree/Simple's per-hop latency from 28 us to 4 in
2.23, NVLS from ``min(bwIntra, bwInter)`` to NVLink SHARP's efficiency in 2.28), new rows for
new GPUs (Hopper's in 2.17 and 2.21, Blackwell's in 2.25 and 2.28), and the speeds its topology
search tries (``src/graph/search.cc``: Hopper's own in 2.17, Blackwell's in 2.25, 96 GB/s NICs in
2.28). So the same cluster runs a 256 KiB all-reduce as a ring with 2.18 and as a tree with 2.23.

:func:`tuner` gives a release's :class:`Tuner`: the newest tables (those of ``tuning.py``, NCCL
2.30) with every later change undone. :data:`HISTORY` lists the changes, each with the first
release that has it and what the tables held before, read release by release in the NVIDIA/nccl
repository (``git log -p -- src/graph/tuning.cc src/graph/search.cc src/graph/topo.h
src/graph/connect.cc src/transport/nvls.cc``).

Departures: NCCL 2.4 had no tuner (it chose LL by a size threshold and the tree by a
bandwidth/latency crossover); we give it 2.5's tables without LL128, which it did not have.
Changes that only touch what these models do not price (CUDA-graph and aggregation counts,
the Power CPUs' latencies, net-device offload) are left out, and so are releases' rounding
changes of a constant within 1 %.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..units import TopologyError
from . import tuning

LATEST = (2, 30, 7)
OLDEST = (2, 4, 0)


def parse_version(value: Any, key: str = "nccl.version") -> tuple:
    """``(major, minor, patch)`` of ``2.26.2``, ``2.26.2-1``, ``"2.26"`` or ``22602`` (NCCL_VERSION_CODE)."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, bool):
        raise TopologyError(key, f"expected an NCCL version like 2.26.2, got {value!r}")
    if isinstance(value, int) and value >= 10000:  # NCCL_VERSION_CODE: 22602
        return (value // 10000, value // 100 % 100, value % 100)
    text = str(value).strip().lower().lstrip("v")
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[-+].*)?", text)
    if not match:
        raise TopologyError(key, f"expected an NCCL version like 2.26.2, got {value!r}")
    version = (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))
    if version < OLDEST:
        raise TopologyError(key, f"NCCL {text} predates the releases modelled (2.4 and later)")
    return min(version, LATEST) if version[:2] > LATEST[:2] else version


def version_text(version: tuple) -> str:
    return ".".join(str(v) for v in version)


@dataclass(frozen=True)
class Tuner:
    """One NCCL release's tuning tables and rules (see the module docstring).

    Tables are keyed like ``tuning.py``'s. Rules name the formula a release used where the
    formula itself changed:

    * ``ring_ll``: ``"half"`` (2.21+: LL moves half the bus bandwidth) or ``"quarter"`` (a
      quarter for all-reduce or across nodes, a third otherwise).
    * ``ll128_one_ppn``: the ring/LL128 share with one GPU per node (0.7 until 2.22).
    * ``nvls``: ``"efficiency"`` (2.28+), ``"min"`` (2.19-2.27: ``min(bwIntra, bwInter)`` and
      5/6), ``"2.18"``, ``"2.17"`` (ring graph's speed, 3/4), or ``""`` (no NVLS).
    * ``plateau``: ``"per_channel"`` (2.18+: bytes per channel and rank >= 64) or
      ``"bytes"`` (bytes >= ranks/16 x 64 KiB), times ``plateau_factor``'s factor for the GPU.
    """

    version: tuple
    base_latency: dict
    hop_latency: dict
    ll_max_bw: dict
    ll_max_bw_multinode: dict
    ring_ll128_max_bw: dict
    tree_ll128_max_bw: dict
    tree_max_bw: dict
    nvls_tree_max_bw: dict
    nvls_efficiency: dict
    tree_correction: dict
    speeds_intra: dict
    speeds_inter: dict
    nvlink_bw: dict              # SMxx_NVLINK_BW per compute capability row, GB/s per link
    nvls_channels: dict
    algorithms: tuple            # what the release has at all
    ll128_archs: tuple           # where LL128 is on by default
    ring_ll: str = "half"
    ll128_one_ppn: float = tuning.RING_LL128_FACTOR
    tree_factor: float = tuning.TREE_ALLREDUCE_FACTOR
    tree_ll_factor: float = tuning.TREE_LL_FACTOR
    tree_ll128_multinode_factor: float = tuning.LL128_FACTOR
    tree_ll128_cap_factor: float = 1.0   # 2.7: LL128 tree capped at 7/9 of the ring's ceiling
    tree_absolute_max_bw: Optional[tuple] = None   # 2.7: (one or two nodes, more) x (LL/Simple, LL128 on A100)
    pat_factor: float = tuning.PAT_FACTOR
    collnet_chain_factor: float = 1.0
    collnet_hopper_factor: float = tuning.COLLNET_HOPPER_FACTOR
    collnet_serialization_us: float = 0.4
    bus_cap: dict = field(default_factory=dict)  # 2.7-2.17: a whole-GPU cap by architecture
    ll_intra_multinode: float = 1.0       # until 2.17 LL's intra-node steps cost 1.8x across nodes
    net_overhead: bool = True             # 2.18+: rings pay the network post overhead per step
    ppn1_tree_net_latency: bool = True    # 2.23+: with one GPU a node, rings use the tree's net latency
    inter_steps: str = "2(n-1)"           # 2.12-2.22: "2n" for an all-reduce ring (model.ring_network_steps)
    collnet_chain_net_latency: bool = True
    nvls: str = "efficiency"
    nvls_ag_rs: bool = True               # NVLS for all-gather / reduce-scatter on one node
    nvls_tree_blackwell_correction: bool = True  # 2.29+: tree correction on NVLS tree (Blackwell, x86)
    plateau: str = "per_channel"
    plateau_factor: tuple = (80, 1.9, 1.4)  # (compute capability, below it, from it on)
    hopper_channel_doubling: bool = True  # 2.20+: Hopper doubles fewer than 16 fast channels across nodes

    @property
    def label(self) -> str:
        return version_text(self.version)

    def has(self, algorithm: str) -> bool:
        return algorithm in self.algorithms


def _latest() -> dict:
    return dict(
        base_latency=dict(tuning.BASE_LATENCY_US),
        hop_latency=copy.deepcopy(tuning.HOP_LATENCY_US),
        ll_max_bw=dict(tuning.LL_MAX_BW),
        ll_max_bw_multinode=dict(tuning.LL_MAX_BW_MULTINODE),
        ring_ll128_max_bw=dict(tuning.RING_LL128_MAX_BW),
        tree_ll128_max_bw=dict(tuning.TREE_LL128_MAX_BW),
        tree_max_bw=dict(tuning.TREE_MAX_BW),
        nvls_tree_max_bw=dict(tuning.NVLS_TREE_MAX_BW),
        nvls_efficiency=dict(tuning.NVLS_EFFICIENCY),
        tree_correction=dict(tuning.TREE_CORRECTION),
        speeds_intra=dict(tuning.SPEEDS_INTRA),
        speeds_inter=dict(tuning.SPEEDS_INTER),
        nvlink_bw={"volta": 20.0, "ampere": 20.0, "hopper": 20.6, "blackwell": 40.1},
        nvls_channels=dict(tuning.NVLS_CHANNELS),
        algorithms=tuning.ALGORITHMS,
        ll128_archs=tuning.ARCHS,
    )


# The generic speeds (search.cc speedArrayIntra/Inter) before each architecture had its own.
_SPEEDS_INTRA_2_18 = tuning.SPEEDS_INTRA["sm80"]
_SPEEDS_INTER_2_18 = tuning.SPEEDS_INTER["sm80"]
_SPEEDS_INTRA_2_12 = (44.0, 30.0, 22.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
_SPEEDS_INTER_2_12 = (48.0, 30.0, 24.0, 22.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
_SPEEDS_INTER_2_17 = (48.0, 30.0, 28.0, 24.0, 22.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                      0.24, 0.12)
_SPEEDS_2_7 = (42.0, 24.0, 21.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
_TREE_CORRECTION_2_10 = {k: v[:23] for k, v in tuning.TREE_CORRECTION.items()}  # 64 B to 256 MiB
_TREE_CORRECTION_2_8 = {
    "ll": _TREE_CORRECTION_2_10["ll"],
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, .92, .92),
    "simple": _TREE_CORRECTION_2_10["simple"],
}
_TREE_CORRECTION_2_7 = {
    "ll": _TREE_CORRECTION_2_10["ll"][:22],
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
_HOP_2_19 = {  # hwLat of 2.19-2.22
    "nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0), "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31.0),
            "collnet_chain": (0, 0, 30.0), "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 14.0), "pat": (0, 0, 14.0)},
}
_HOP_2_18 = {  # 2.18.5-2.18.6 (2.18.1-2.18.3 priced tree/Simple at 28 us, as 2.19 did again)
    "nvlink": {**_HOP_2_19["nvlink"], "tree": (0.6, 1.25, 4.0), "collnet_direct": (0, 0, 8.0),
               "collnet_chain": (0, 0, 4.75), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "pci": {**_HOP_2_19["pci"], "tree": (1.0, 1.9, 6.0), "collnet_direct": (0, 0, 8.0), "collnet_chain": (0, 0, 8.0)},
    "net": {**_HOP_2_19["net"], "tree": (5.0, 8.5, 14.0), "collnet_direct": (0, 0, 10.7),
            "collnet_chain": (0, 0, 14.0), "nvls_tree": (0, 0, 19.0)},
}
_HOP_2_17 = {  # 2.10-2.17 (CollNet's Simple 8 us from 2.10; 2.12-2.13 priced ring/Simple across nodes at 28)
    "nvlink": {**_HOP_2_18["nvlink"], "tree": (0.52, 1.25, 28.0), "ring": (0.47, 1.9, 3.4),
               "collnet_direct": (0.5, 1.2, 8.0), "collnet_chain": (0.5, 1.2, 8.0)},
    "pci": {**_HOP_2_18["pci"], "tree": (1.0, 1.9, 28.0), "collnet_direct": (1.0, 1.9, 8.0),
            "collnet_chain": (1.0, 1.9, 8.0)},
    "net": {**_HOP_2_18["net"], "tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 9.6), "collnet_direct": (5.0, 5.0, 10.7),
            "collnet_chain": (5.0, 5.0, 10.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
}
_HOP_2_7 = {  # 2.7 (2.8 moved tree LL128 over NVLink to 1.25 and tree/Simple across nodes to 28)
    "nvlink": {**_HOP_2_17["nvlink"], "tree": (0.52, 1.2, 28.0), "collnet_direct": (0.5, 1.2, 4.0),
               "collnet_chain": (0.5, 1.2, 4.0)},
    "pci": {**_HOP_2_17["pci"], "collnet_direct": (1.0, 1.9, 5.5), "collnet_chain": (1.0, 1.9, 5.5)},
    "net": {**_HOP_2_17["net"], "tree": (5.0, 8.5, 50.0)},
}
_BASE_2_19 = {**tuning.BASE_LATENCY_US, "tree": (6.8, 14.0, 0.0)}
_BASE_2_18 = {**_BASE_2_19, "collnet_direct": (6.8, 14.0, 0), "collnet_chain": (6.8, 14.0, 0),
              "nvls": (0, 0, 23.0), "nvls_tree": (0, 0, 23.0)}
_BASE_2_17 = {**_BASE_2_18, "tree": (4.4, 4.4, 0), "ring": (3.6, 10.0, 8.4), "collnet_direct": (4.4, 4.4, 0),
              "collnet_chain": (4.4, 4.4, 0), "nvls": (0, 0, 40.0), "nvls_tree": (0, 0, 40.0)}

# (first release with the change, {field: what the tables held before it}); newest first.
HISTORY = (
    ((2, 30, 0), {"nvls_tree_max_bw.blackwell": (0.0, 96.0, 43.8),
                  "speeds_intra.sm100": (90.0, 80.0, 70.0, 60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
                  "speeds_inter.sm100": (96.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0,
                                         6.0, 3.0, 2.4, 1.2, 0.24, 0.12)}),
    ((2, 29, 0), {"ring_ll128_max_bw.blackwell": (73.4, 34.6, 73.4), "nvls_tree_blackwell_correction": False,
                  "tree_correction": _TREE_CORRECTION_2_10}),
    ((2, 28, 9), {"hop_latency.net.nvls_tree": (0, 0, 14.0), "ring_ll128_max_bw.blackwell": (73.4,) * 3,
                  "nvls_tree_max_bw.blackwell": (0.0, 96.0, 43.1)}),
    ((2, 28, 0), {"nvls": "min", "tree_ll128_max_bw.blackwell": (73.4, 73.4, 58.0),
                  "tree_max_bw.blackwell": (77.4, 82.8, 72.0), "nvlink_bw.blackwell": 40.0,
                  "speeds_inter.sm100": (47.9, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
                                         2.4, 1.2, 0.24, 0.12)}),
    ((2, 27, 0), {"nvls_channels.blackwell_one_node": 32,
                  "speeds_intra.sm100": (90.0, 80.0, 70.0, 60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 19.0),
                  "speeds_inter.sm100": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
                                         2.4, 1.2, 0.24, 0.12)}),
    ((2, 25, 0), {"ll128_archs": ("volta", "ampere", "hopper"), "nvls_channels.blackwell": 16,
                  "nvls_channels.blackwell_one_node": 16, "blackwell_as_hopper": True}),
    ((2, 24, 0), {"pat_factor": 0.85}),
    ((2, 23, 0), {"base_latency.tree": (6.8, 14.0, 0.0), "hop_latency": _HOP_2_19, "ll128_one_ppn": 0.7,
                  "algorithms": ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree"),
                  "ppn1_tree_net_latency": False, "inter_steps": "2n"}),
    ((2, 21, 0), {"ring_ll": "quarter", "ll_max_bw.hopper": (87.7, 22.5, 19.0),
                  "hop_latency.nvlink.nvls": (0, 0, 23.0), "hop_latency.nvlink.nvls_tree": (0, 0, 23.0)}),
    ((2, 20, 0), {"hopper_channel_doubling": False}),
    ((2, 19, 0), {"base_latency": _BASE_2_18, "hop_latency": _HOP_2_18, "nvls": "2.18", "nvls_ag_rs": False,
                  "nvlink_bw.hopper": 20.0, "collnet_serialization_us": 0.5,
                  "speeds_intra.sm90": (60.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 6.0, 3.0),
                  "speeds_inter.sm90": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
                                        1.2, 0.24, 0.12)}),
    ((2, 18, 5), {"ring_ll128_max_bw.hopper": (36.7,) * 3, "tree_ll128_max_bw.hopper": (36.7,) * 3,
                  "tree_max_bw.hopper": (38.7, 41.4, 33.0), "hop_latency.nvlink.tree": (0.6, 1.25, 28.0),
                  "hop_latency.pci.tree": (1.0, 1.9, 28.0), "hop_latency.net.tree": (5.0, 8.5, 28.0)}),
    ((2, 18, 0), {"base_latency": _BASE_2_17, "hop_latency": _HOP_2_17, "nvls": "2.17", "nvls_ag_rs": True,
                  "algorithms": ("tree", "ring", "collnet_direct", "collnet_chain", "nvls"),
                  "ll_intra_multinode": 1.8, "net_overhead": False, "collnet_hopper_factor": 1.0,
                  "collnet_chain_factor": 0.75, "collnet_chain_net_latency": False, "plateau": "bytes",
                  "plateau_factor": (90, 1.9, 1.5), "bus_cap": {"ampere": 235.0, "hopper": 370.0},
                  "nvlink_bw.ampere": 22.0, "nvlink_bw.volta": 22.0,
                  "speeds_intra.sm80": _SPEEDS_INTRA_2_12, "speeds_inter.sm80": _SPEEDS_INTER_2_17,
                  "speeds_intra.sm90": (66.0, 33.0, 24.0, 20.0, 15.0, 12.0, 6.0, 3.0),
                  "speeds_inter.sm90": (48.0, 45.0, 30.0, 24.0, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)}),
    ((2, 17, 0), {"algorithms": ("tree", "ring", "collnet_direct", "collnet_chain"), "nvls": "",
                  "ll128_archs": ("volta", "ampere"), "hopper_as_volta": True, "plateau_factor": (999, 1.9, 1.9),
                  "bus_cap": {"ampere": 235.0}, "speeds_inter.sm80": _SPEEDS_INTER_2_12}),
    ((2, 14, 0), {"algorithms": ("tree", "ring", "collnet_direct"), "hop_latency.net.ring": (2.7, 4.0, 28.0)}),
    ((2, 12, 0), {"hop_latency.net.ring": (2.7, 4.0, 9.6), "inter_steps": "2(n-1)"}),
    ((2, 10, 0), {"ring_ll128_max_bw_per_op": {"broadcast": 18.8, "reduce": 12.0, "all_gather": 18.3,
                                               "reduce_scatter": 15.2, "all_reduce": 16.9},
                  "tree_max_bw.ampere": (24.0, 22.5, 16.0), "tree_ll128_multinode_factor": 0.915,
                  "hop_latency.nvlink.collnet_direct": (0.5, 1.2, 4.0),
                  "hop_latency.pci.collnet_direct": (1.0, 1.9, 5.5), "collnet_serialization_us": 0.0,
                  "tree_correction": _TREE_CORRECTION_2_8}),
    ((2, 8, 0), {"hop_latency": _HOP_2_7, "ring_ll128_max_bw_per_op": {"broadcast": 18.8, "reduce": 12.0,
                 "all_gather": 18.3, "reduce_scatter": 15.2, "all_reduce": 16.7},
                 "ll_max_bw": {}, "ll_max_bw_multinode": {}, "tree_max_bw": {}, "tree_factor": 0.9,
                 "tree_ll128_cap_factor": 7.0 / 9.0, "tree_absolute_max_bw": ((110.0, 130.0), (80.0, 105.0)),
                 "tree_correction": _TREE_CORRECTION_2_7,
                 "speeds_intra.sm80": _SPEEDS_2_7, "speeds_inter.sm80": _SPEEDS_2_7}),
    ((2, 5, 0), {"ll128_archs": ()}),  # 2.4: no LL128 (and no tuner; see the module docstring)
)

_PSEUDO = ("blackwell_as_hopper", "hopper_as_volta", "ring_ll128_max_bw_per_op")


def _set(tables: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    node = tables
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = copy.deepcopy(value)


@functools.lru_cache(maxsize=None)
def tuner(version: Optional[tuple] = None) -> "Tuner":
    """The tuning tables of NCCL ``version`` (``(2, 26, 2)``; None: the newest, 2.30)."""
    version = LATEST if version is None else parse_version(version)
    tables = _latest()
    extra: dict = {}
    for introduced, before in HISTORY:  # newest first, so the oldest 'before' wins
        if version >= introduced:
            continue
        for path, value in before.items():
            if path.split(".")[0] in _PSEUDO:
                extra[path] = value
            elif "." in path:
                _set(tables, path, value)
            else:
                tables[path] = copy.deepcopy(value)
    if extra.get("blackwell_as_hopper"):  # before 2.25 Blackwell fell in Hopper's rows
        for name in ("ll_max_bw", "ring_ll128_max_bw", "tree_ll128_max_bw", "tree_max_bw", "nvls_tree_max_bw",
                     "nvls_efficiency"):
            if "hopper" in tables[name]:
                tables[name]["blackwell"] = tables[name]["hopper"]
        tables["speeds_intra"]["sm100"] = tables["speeds_intra"]["sm90"]
        tables["speeds_inter"]["sm100"] = tables["speeds_inter"]["sm90"]
    if extra.get("hopper_as_volta"):  # before 2.17 only an A100 had Ampere's rows; later GPUs took Volta's
        for name in ("ll_max_bw", "ring_ll128_max_bw", "tree_ll128_max_bw", "tree_max_bw"):
            if "volta" in tables[name]:
                tables[name]["hopper"] = tables[name]["blackwell"] = tables[name]["volta"]
        for speeds in ("speeds_intra", "speeds_inter"):
            tables[speeds]["sm90"] = tables[speeds]["sm100"] = tables[speeds]["sm80"]
    if "ring_ll128_max_bw_per_op" in extra:
        tables["ring_ll128_max_bw_per_op"] = extra["ring_ll128_max_bw_per_op"]
    fields = {k: v for k, v in tables.items() if k in Tuner.__dataclass_fields__}
    result = Tuner(version=version, **fields)
    object.__setattr__(result, "_extra", {k: v for k, v in tables.items() if k not in Tuner.__dataclass_fields__})
    return result


def extra(t: Tuner, name: str, default: Any = None) -> Any:
    """A release's rule that only some releases have (``ring_ll128_max_bw_per_op``, ``nvls_ag_rs_min``)."""
    return getattr(t, "_extra", {}).get(name, default)
