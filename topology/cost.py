"""What a collective costs on a cluster: the one interface the simulation prices communication by.

ASTRA-sim splits a training simulator into a system layer (what is communicated, when, and in
which order) and a network layer (how long the bytes take on the wire). Here ``sim`` is the
system layer and ``topology`` the network layer, and they meet only in this module and in
:class:`~.network.Network` (which runs a :class:`~.plan.Plan` on links shared with the
collectives in flight beside it):

* :func:`collective_cost` prices one collective of ``nbytes`` on an otherwise idle cluster,
  naming the algorithm, protocol and channels that price came from;
* :func:`collective_plan` gives the transfers the same collective makes, for the network.

Which models price it is decided in one place, :func:`_models`, by the op and the cluster's
``backend`` (``cluster.py``: ``nccl`` for a GPU fabric, named with ``machine:`` or the fabric
keys, or asked for with ``backend: nccl``; ``gloo`` for every cluster described by its two
links alone):

* ``nccl``: NCCL's algorithms (ring, tree, NVLS, NVLS tree, CollNet direct and chain, PAT),
  protocols (LL, LL128, Simple), channels and choice (``nccl/model.py``; ``nccl/p2p.py`` for
  send/recv and all-to-all, as point-to-point ``p2p``) on the cluster's fabric (``fabric.py``),
  and the transfers of each algorithm (``nccl/plans.py``). ``algorithm`` and ``protocol`` take
  ``NCCL_ALGO`` / ``NCCL_PROTO`` syntax (``ring``, ``ring,tree``, ``^nvls``) and default to
  the cluster's ``nccl: {algorithm, protocol}``, else NCCL's own choice. NCCL_ALGO does not
  touch point-to-point operations, as in NCCL.
* ``gloo`` (CPU workers over TCP, and every GPU cluster written before the fabric keys): the
  closed forms and plans of ``collectives.py`` on the two links, today's numbers bit for bit.
  All-reduce by ``ring`` (the default) or ``hierarchical``; the other ops by Gloo's schedules
  (``ring`` all-gather, ``ring_allreduce`` reduce-scatter, as ``ProcessGroupGloo`` runs it,
  ``direct`` broadcast, reduce and all-to-all, ``p2p`` send/recv), each on the links' figures
  for that op where they were calibrated (``Link.for_op``), and never less than a floor the
  links carry for it (``Link.floors_us``: the host's cost of one small collective, which the
  plans, timed on the shared network for parameter servers alone, leave out). One protocol,
  ``tcp``, and one channel.
* a parameter server's ``push`` (every GPU sends its shard to each server) and ``pull`` (each
  server sends the updated shard back), on either backend: each is one of the two steps of
  ``collectives.plan_parameter_server`` and half its closed form (the two steps, one each way,
  load their busiest links alike), on the cluster's links; on a fabric those are a GPU's
  NVLink and its machine's NICs together (``Fabric.legacy_links``), since NCCL runs no
  parameter server (BytePS and ps-lite move shards over their own RDMA or TCP transport, whose
  name is the protocol: the NIC's transport on a fabric, ``tcp`` otherwise). Algorithms:
  ``parameter_server`` (servers on the worker machines), ``parameter_server/colocated`` (the
  same) or ``parameter_server/dedicated`` (on the cluster's server machines).

``nbytes`` means what nccl-tests' "size" column means for the operation: the whole buffer for
all-reduce, broadcast and reduce (and a parameter server's tensor); the gathered (all-gather)
or scattered (reduce-scatter) buffer, ``n`` times a rank's share; a rank's whole send buffer for
all-to-all; what each rank sends for send/recv. ``ranks`` are GPU ids (None: every GPU), so a
tensor-parallel group inside a node and a data-parallel group across nodes are priced apart:
on NCCL as a communicator of those GPUs; on the link models as the smaller cluster they make
(as many ranks on every machine they use), whose plans name the original GPUs and hosts.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .cluster import Cluster
from .collectives import (
    GLOO_OPS,
    allreduce_time_us,
    gloo_time_us,
    links_used,
    parameter_server_time_us,
    plan_allreduce,
    plan_gloo,
    plan_parameter_server,
)
from .nccl import p2p
from .nccl.graphs import Comm
from .nccl.model import predict
from .nccl.plans import plan_nccl
from .nccl.tuning import OPS, parse_choices
from .plan import Plan, Step
from .units import TopologyError

PARAMETER_SERVER_OPS = ("push", "pull")
COLLECTIVE_OPS = OPS + PARAMETER_SERVER_OPS
GLOO_PROTOCOL = "tcp"
_GLOO_ALL_REDUCE = ("ring", "hierarchical")
_PARAMETER_SERVER = ("parameter_server", "parameter_server/colocated", "parameter_server/dedicated")
_PARAMETER_SERVER_STEP = {"push": 0, "pull": 1}


@dataclass(frozen=True)
class CollectiveCost:
    """One collective's time on an idle cluster, and how the library runs it."""

    op: str            # one of COLLECTIVE_OPS
    nbytes: float      # as nccl-tests' "size" column for that op
    time_us: float
    algorithm: str     # NCCL's (ring, tree, nvls, nvls_tree, collnet_direct, collnet_chain, pat, p2p), Gloo's, parameter_server...
    protocol: str      # NCCL's (ll, ll128, simple), tcp, or a parameter server's transport
    channels: int


def collective_cost(cluster: Cluster, op: str, nbytes: float, *, ranks: Optional[Sequence[int]] = None,
                    algorithm: Optional[str] = None, protocol: Optional[str] = None) -> CollectiveCost:
    """The time ``op`` on ``nbytes`` among ``ranks`` takes on an otherwise idle ``cluster``;
    ``algorithm`` / ``protocol`` force a choice. The models are pure functions of these, so a
    cost is kept (:func:`_kept_cost`) and a grid's points, which price the same collectives on
    the same cluster again and again, compute each once; a cluster that cannot be hashed is
    priced each time."""
    op, nbytes = _check(op, nbytes)
    if ranks is not None:
        ranks = tuple(int(r) for r in ranks)
    try:
        return _kept_cost(cluster, op, nbytes, ranks, algorithm, protocol)
    except TypeError as err:
        if "unhashable" not in str(err):
            raise
    return _models(cluster, op).cost(cluster, op, nbytes, ranks, algorithm, protocol)


@functools.lru_cache(maxsize=1 << 14)
def _kept_cost(cluster: Cluster, op: str, nbytes: float, ranks: Optional[tuple], algorithm: Optional[str],
               protocol: Optional[str]) -> CollectiveCost:
    return _models(cluster, op).cost(cluster, op, nbytes, ranks, algorithm, protocol)


def collective_plan(cluster: Cluster, op: str, nbytes: float, *, ranks: Optional[Sequence[int]] = None,
                    algorithm: Optional[str] = None) -> Plan:
    """The transfers ``op`` on ``nbytes`` among ``ranks`` makes, step by step, for link sharing
    in ``network.py``."""
    op, nbytes = _check(op, nbytes)
    return _models(cluster, op).plan(cluster, op, nbytes, ranks, algorithm)


class _Models(NamedTuple):
    cost: Callable[..., CollectiveCost]
    plan: Callable[..., Plan]


def _models(cluster: Cluster, op: str) -> _Models:
    """The family of models that prices ``op`` on ``cluster``: the one place it is chosen."""
    if op in PARAMETER_SERVER_OPS:
        return _Models(_parameter_server_cost, _parameter_server_plan)
    if cluster.backend == "nccl":
        return _Models(_nccl_cost, _nccl_plan)
    return _Models(_gloo_cost, _gloo_plan)


def _check(op: str, nbytes) -> tuple:
    if op not in COLLECTIVE_OPS:
        raise TopologyError("op", f"unknown collective {op!r}{_hint(op, COLLECTIVE_OPS)}; known: {', '.join(COLLECTIVE_OPS)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float, np.number)) or not (math.isfinite(nbytes) and nbytes >= 0):
        raise TopologyError("nbytes", f"must be a finite number of bytes >= 0, got {nbytes!r}")
    return op, float(nbytes)


def _hint(name, known) -> str:
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _named(value: Optional[str], known: tuple, key: str, what: str) -> str:
    """``value`` (None: the first of ``known``) if it is one of ``known``."""
    name = known[0] if value is None else str(value)
    if name not in known:
        raise TopologyError(key, f"{what} {', '.join(known)}, not {value!r}{_hint(value, known)}")
    return name


# -- nccl ----------------------------------------------------------------------------------------


def _nccl_cost(cluster: Cluster, op: str, nbytes: float, ranks, algorithm, protocol) -> CollectiveCost:
    fabric = cluster.fabric
    comm = Comm.of(fabric, ranks)
    settings = fabric.calibration
    if op in ("send_recv", "all_to_all"):
        if algorithm is not None and algorithm != "p2p" and not _leaves_p2p(algorithm):
            raise TopologyError("algorithm", f"NCCL runs {op} as point-to-point sends (p2p), not {algorithm!r}")
        _, protocols = parse_choices(None, protocol if protocol is not None else settings.protocol or None)
        run = p2p.send_recv if op == "send_recv" else p2p.all_to_all
        found = run(comm, nbytes, protocols, settings)
    else:
        algorithms, protocols = parse_choices(algorithm if algorithm is not None else settings.algorithm or None,
                                              protocol if protocol is not None else settings.protocol or None)
        found = predict(comm, op, nbytes, algorithms, protocols, settings)
    return CollectiveCost(op, nbytes, found.time_us, found.option.algorithm, found.option.protocol, found.channels)


def _leaves_p2p(algorithm: str) -> bool:
    """Whether an ``NCCL_ALGO`` exclusion (``^nvls,nvls_tree``) leaves point-to-point alone: it
    names the collectives' algorithms NCCL may not use, which send/recv and all-to-all never do."""
    return algorithm.startswith("^") and "p2p" not in {a.strip().lower() for a in algorithm[1:].split(",")}


def _nccl_plan(cluster: Cluster, op: str, nbytes: float, ranks, algorithm) -> Plan:
    chosen = _nccl_cost(cluster, op, nbytes, ranks, algorithm, None)
    return plan_nccl(cluster.fabric, np.asarray(Comm.of(cluster.fabric, ranks).ranks), op, nbytes, chosen.algorithm)


# -- gloo ----------------------------------------------------------------------------------------


def _gloo_algorithm(op: str, algorithm: Optional[str]) -> str:
    known = _GLOO_ALL_REDUCE if op == "all_reduce" else (GLOO_OPS[op],)
    return _named(algorithm, known, "algorithm", f"the gloo backend runs {op} as")


def _gloo_cost(cluster: Cluster, op: str, nbytes: float, ranks, algorithm, protocol) -> CollectiveCost:
    name = _gloo_algorithm(op, algorithm)
    _named(protocol, (GLOO_PROTOCOL,), "protocol", "the gloo backend has one protocol,")
    sub, _ = _sub_cluster(cluster, ranks)
    time_us = allreduce_time_us(sub, nbytes, name) if op == "all_reduce" else gloo_time_us(sub, op, nbytes)
    if sub.n_gpus > 1:  # no less than the floor of the links it crosses (``Link.floors_us``)
        time_us = max([time_us] + [link.floor_us(op) for link in links_used(sub)])
    return CollectiveCost(op, nbytes, time_us, name, GLOO_PROTOCOL, 1)


def _gloo_plan(cluster: Cluster, op: str, nbytes: float, ranks, algorithm) -> Plan:
    name = _gloo_algorithm(op, algorithm)
    sub, endpoints = _sub_cluster(cluster, ranks)
    return _on(endpoints, plan_allreduce(sub, nbytes, name) if op == "all_reduce" else plan_gloo(sub, op, nbytes))


# -- parameter server ----------------------------------------------------------------------------


def _parameter_server_protocol(cluster: Cluster) -> str:
    return cluster.fabric.nic.transport if cluster.fabric is not None else GLOO_PROTOCOL


def _parameter_server_cost(cluster: Cluster, op: str, nbytes: float, ranks, algorithm, protocol) -> CollectiveCost:
    name = _named(algorithm, _PARAMETER_SERVER, "algorithm", f"a parameter server's {op} runs as")
    transport = _parameter_server_protocol(cluster)
    _named(protocol, (transport,), "protocol", f"a parameter server's {op} goes over")
    sub, _ = _sub_cluster(cluster, ranks)
    time_us = parameter_server_time_us(sub, nbytes, placement=_placement(name)) / 2
    return CollectiveCost(op, nbytes, time_us, name, transport, 1)


def _parameter_server_plan(cluster: Cluster, op: str, nbytes: float, ranks, algorithm) -> Plan:
    name = _named(algorithm, _PARAMETER_SERVER, "algorithm", f"a parameter server's {op} runs as")
    sub, endpoints = _sub_cluster(cluster, ranks)
    plan = plan_parameter_server(sub, nbytes, placement=_placement(name))
    step = _PARAMETER_SERVER_STEP[op]
    return _on(endpoints, Plan(plan.algorithm, plan.size_bytes, plan.steps[step : step + 1]))


def _placement(algorithm: str) -> str:
    return algorithm.partition("/")[2] or "colocated"


# -- ranks on the link models --------------------------------------------------------------------


def _sub_cluster(cluster: Cluster, ranks) -> tuple:
    """The cluster the link models see for ``ranks``, and the endpoint of ``cluster`` each of its
    endpoints stands for (None where ``ranks`` are every GPU: the cluster itself)."""
    if ranks is None:
        return cluster, None
    ids = np.asarray(list(ranks), dtype=np.int64).reshape(-1)
    if not len(ids) or ids.min() < 0 or ids.max() >= cluster.n_gpus or len(np.unique(ids)) != len(ids):
        raise TopologyError("ranks", f"must be distinct GPUs of 0..{cluster.n_gpus - 1}, got {list(ranks)!r}")
    if len(ids) == cluster.n_gpus:
        return cluster, None
    ids = np.sort(ids)
    machines, per_machine = np.unique(cluster.machine_of(ids), return_counts=True)
    if per_machine.min() != per_machine.max():
        raise TopologyError("ranks", f"the link models need as many ranks on every machine they use; got "
                                     f"{', '.join(str(c) for c in per_machine)} on machines {', '.join(str(m) for m in machines)}")
    sub = Cluster(len(machines), int(per_machine[0]), cluster.intra_node, cluster.inter_node,
                  server_machines=cluster.server_machines, name=cluster.name, shared_memory=cluster.shared_memory)
    servers = cluster.n_gpus + cluster.machines + np.arange(cluster.server_machines)
    return sub, np.concatenate([ids, cluster.n_gpus + machines, servers])


def _on(endpoints: Optional[np.ndarray], plan: Plan) -> Plan:
    """``plan`` of a sub-cluster with its endpoints renamed to the cluster's (None: as it is)."""
    if endpoints is None:
        return plan
    renamed: dict = {}  # plans repeat one Step object; rename it once
    for step in plan.steps:
        if id(step) not in renamed:
            renamed[id(step)] = Step(endpoints[step.src], endpoints[step.dst], step.nbytes)
    return Plan(plan.algorithm, plan.size_bytes, tuple(renamed[id(step)] for step in plan.steps))
