"""NCCL's collectives as plans of transfers (``plan.py``), for link sharing in ``network.py``.

A plan says which endpoints exchange how many bytes, step after step; it does not carry NCCL's
protocols, channels or latencies, which ``model.py`` prices. ``network.py`` times a plan by the
links it loads, so two collectives at once slow each other where they share a link. What each
algorithm sends (``n`` ranks in ring order, ``S`` the nccl-tests size):

* ring all-reduce: ``2(n-1)`` steps in which every rank sends ``S/n`` to the next (the
  reduce-scatter then the all-gather); all-gather and reduce-scatter ``n-1`` such steps;
  broadcast and reduce one pipelined step in which every rank passes ``S`` along the chain.
* tree all-reduce: the message goes up the tree (every rank sends ``S`` to its parent: within a
  node a chain, between nodes a binary tree of the nodes' first ranks) and back down.
* NVLS: inside a node each GPU reduces its ``1/ppn`` share from every other local GPU and
  multicasts the result back (two steps of ``S/ppn`` between every pair of local GPUs); NVLS
  tree adds the tree between nodes, each node's ``ppn`` heads carrying ``S/ppn`` each.
* CollNet: as NVLS tree, with the switch's reduction standing in for the tree.
* PAT, all-to-all and send/recv: one step of every rank's transfers (PAT as the ring's bytes).
"""

from __future__ import annotations

import numpy as np

from ..fabric import Fabric
from ..plan import Plan, Step


def _ring(ranks: np.ndarray, nbytes: float, steps: int) -> tuple:
    return (Step(ranks, np.roll(ranks, -1), nbytes),) * steps


def _tree(fabric: Fabric, ranks: np.ndarray, nbytes: float) -> tuple:
    """Up (children to parents) and down: a chain inside each node, a binary tree of node leaders."""
    nodes = ranks // fabric.node_size
    src, dst = [], []
    leaders = []
    for node in np.unique(nodes):
        members = ranks[nodes == node]
        leaders.append(members[0])
        src.extend(members[1:].tolist())
        dst.extend(members[:-1].tolist())
    for i in range(1, len(leaders)):
        src.append(leaders[i])
        dst.append(leaders[(i - 1) // 2])
    up = Step(src, dst, nbytes)
    return (up, Step(up.dst, up.src, nbytes)) if len(src) else ()


def _nvls(fabric: Fabric, ranks: np.ndarray, nbytes: float, between_nodes: bool) -> tuple:
    nodes = ranks // fabric.node_size
    src, dst, heads = [], [], []
    for node in np.unique(nodes):
        members = ranks[nodes == node]
        heads.append(members)
        for a in members:
            for b in members:
                if a != b:
                    src.append(a)
                    dst.append(b)
    share = nbytes / max(len(h) for h in heads)
    local = Step(src, dst, share) if src else None
    steps = [local] if local is not None else []
    if between_nodes and len(heads) > 1:
        width = min(len(h) for h in heads)
        up_src, up_dst = [], []
        for i in range(1, len(heads)):
            parent = heads[(i - 1) // 2]
            up_src.extend(heads[i][:width].tolist())
            up_dst.extend(parent[:width].tolist())
        up = Step(up_src, up_dst, nbytes / width)
        steps += [up, Step(up.dst, up.src, nbytes / width)]
    if local is not None:
        steps.append(local)
    return tuple(steps)


def plan_nccl(fabric: Fabric, ranks: np.ndarray, op: str, nbytes: float, algorithm: str) -> Plan:
    """The plan of ``op`` on ``ranks`` run with ``algorithm``; see the module docstring."""
    ranks = np.asarray(ranks, dtype=np.int64)
    n = len(ranks)
    name = f"nccl/{op}/{algorithm}"
    if n == 1:
        return Plan(name, nbytes, ())
    if op == "send_recv":
        return Plan(name, nbytes, _ring(ranks, nbytes, 1))
    if op == "all_to_all":
        src = np.repeat(ranks, n - 1)
        dst = np.concatenate([np.delete(ranks, i) for i in range(n)])
        return Plan(name, nbytes, (Step(src, dst, nbytes / n),))
    if algorithm in ("nvls", "nvls_tree", "collnet_direct", "collnet_chain"):
        return Plan(name, nbytes, _nvls(fabric, ranks, nbytes, between_nodes=True))
    if algorithm == "tree":
        return Plan(name, nbytes, _tree(fabric, ranks, nbytes))
    if op in ("broadcast", "reduce"):
        chain = Step(ranks[:-1], ranks[1:], nbytes) if op == "broadcast" else Step(ranks[1:], ranks[:-1], nbytes)
        return Plan(name, nbytes, (chain,))
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    if algorithm == "pat":
        return Plan(name, nbytes, (Step(ranks, np.roll(ranks, -1), nbytes * (n - 1) / n),))
    return Plan(name, nbytes, _ring(ranks, nbytes / n, steps))
