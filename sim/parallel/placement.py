"""Where a job's ranks run: rank coordinates -> GPU endpoints, and the process groups.

Megatron-LM's order (``initialize_model_parallel``): the rank's tensor coordinate varies
fastest, then data, then pipeline, so that the ``tensor`` GPUs of a tensor-parallel group are
neighbours, inside one machine's NVLink domain when ``tensor <= gpus_per_machine``, and a
pipeline's stages are the farthest apart. ``placement`` reorders the three (fastest first):
GPU ``g`` has coordinates ``c`` with ``g = c[p0] + n[p0] * (c[p1] + n[p1] * c[p2])``.

A group of a dimension is the GPUs whose other coordinates agree, in the order of that
dimension's coordinate: these are the ``ranks=`` a collective of that dimension is priced on
(``topology.collective_cost``). Expert parallelism is carved out of the data-parallel group as
Megatron does: each data group, in data order, is cut into consecutive runs of ``expert``
GPUs (the expert groups); the GPUs at the same place in those runs form an ``expert_data``
group, which all-reduces the gradients of the experts they share.

Ranks and GPUs are the same numbers here: rank ``g`` runs on GPU endpoint ``g``.

**Groups sharing a NIC.** Every group of a dimension runs the same collective at the same time
(the ranks run one program in lockstep), so where a group spans machines, the other ranks of
its machine, in other groups of the dimension, cross the same NIC with their own collectives:
:func:`nic_sharing` counts them (``gpus_per_machine`` over the group's ranks on the machine),
and :func:`with_nic_shared` gives each group its share of the NIC's bandwidth (every
calibrated op's too), latency unchanged. On the lab's 2 machines x 2 workers, FSDP+TP's two
data-parallel groups each cross the NIC: each all-gather and reduce-scatter gets half of it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import DIMENSIONS, Parallelism, ParallelismError

#: The dimensions :func:`groups` returns, in this order.
GROUP_DIMENSIONS = ("tensor", "data", "pipeline", "expert", "expert_data")


def coordinates(par: Parallelism) -> dict[str, np.ndarray]:
    """Per dimension, the coordinate of every rank (GPU id ``0 .. world - 1``)."""
    ranks = np.arange(par.world, dtype=np.int64)
    coords, stride = {}, 1
    for dimension in par.placement:
        size = par.size(dimension)
        coords[dimension] = (ranks // stride) % size
        stride *= size
    return coords


def groups(par: Parallelism, cluster) -> dict[str, list[tuple[int, ...]]]:
    """For every dimension (:data:`GROUP_DIMENSIONS`), its process groups as tuples of GPU ids;
    every GPU is in exactly one group of each dimension. Refuses a cluster whose GPU count is
    not the job's ranks."""
    n_gpus = int(cluster.n_gpus)
    if par.world != n_gpus:
        raise ParallelismError(
            "parallelism",
            f"data x tensor x pipeline = {par.data} x {par.tensor} x {par.pipeline} = {par.world} ranks, "
            f"but the cluster has {n_gpus} GPUs",
        )
    coords = coordinates(par)
    out: dict[str, list[tuple[int, ...]]] = {}
    for dimension in DIMENSIONS:
        others = [d for d in DIMENSIONS if d != dimension]
        key = coords[others[0]] * par.world + coords[others[1]]
        out[dimension] = _grouped(key, coords[dimension])
    data_key = coords["tensor"] * par.world + coords["pipeline"]
    block = coords["data"] // par.expert  # which run of `expert` consecutive data ranks
    within = coords["data"] % par.expert
    out["expert"] = _grouped(data_key * par.world + block, within)
    out["expert_data"] = _grouped(data_key * par.world + within, block)
    return out


def ranks_of(all_groups: dict[str, list[tuple[int, ...]]], rank: int) -> dict[str, tuple[int, ...]]:
    """The groups ``rank`` belongs to, by dimension: what a pass's ``ranks_of`` argument is."""
    return {dimension: next(g for g in gs if rank in g) for dimension, gs in all_groups.items()}


def _grouped(key: np.ndarray, order: np.ndarray) -> list[tuple[int, ...]]:
    """The ranks sharing a ``key``, each group sorted by ``order``; groups by their first rank."""
    ranks = np.lexsort((order, key))
    bounds = np.flatnonzero(np.diff(key[ranks])) + 1
    found = [tuple(int(r) for r in chunk) for chunk in np.split(ranks, bounds)]
    return sorted(found, key=lambda g: min(g))


def nic_sharing(cluster, ranks) -> int:
    """How many groups of one dimension cross the NIC of the machine of ``ranks[0]`` at once
    (see the module doc): 1 where the group stays inside a machine or fills its machines."""
    ids = np.asarray(list(ranks), dtype=np.int64)
    if len(ids) <= 1 or cluster.machines <= 1:
        return 1
    machine = cluster.machine_of(ids)
    if len(np.unique(machine)) <= 1:
        return 1
    on_mine = int(np.count_nonzero(machine == machine[0]))
    return max(1, int(cluster.gpus_per_machine) // on_mine)


def with_nic_shared(cluster, sharing: int):
    """``cluster`` whose inter-node link gives one of ``sharing`` concurrent groups its share:
    the link's bandwidth and every calibrated op's over ``sharing``; ``cluster`` itself for 1."""
    if sharing <= 1:
        return cluster
    link = cluster.inter_node
    shared = replace(link, bandwidth_bytes_per_us=link.bandwidth_bytes_per_us / sharing,
                     collectives=tuple((op, bandwidth / sharing, latency, efficiency)
                                       for op, bandwidth, latency, efficiency in link.collectives))
    return replace(cluster, inter_node=shared)
