"""What a collective costs on a cluster: the one interface the simulation prices communication by.

ASTRA-sim splits a training simulator into a system layer (what is communicated, when, and in
which order) and a network layer (how long the bytes take on the wire). Here ``sim`` is the
system layer and ``topology`` the network layer, and they meet only in this module and in
:class:`~.network.Network` (which runs a :class:`~.plan.Plan` on links shared with the
collectives in flight beside it):

* :func:`collective_cost` prices one collective of ``nbytes`` per GPU on an otherwise idle
  cluster (``collectives.py``'s closed forms), naming the algorithm, protocol and channels
  that price came from;
* :func:`collective_plan` gives the transfers the same collective makes, for the network.

Ops: ``all_reduce`` (algorithms ``ring``, the default, and ``hierarchical``); a parameter
server's ``push`` (every GPU sends its shard to each server) and ``pull`` (each server sends the
updated shard back), each one of the two steps of ``collectives.plan_parameter_server``, with
the algorithm ``parameter_server`` (servers on the worker machines), or
``parameter_server/colocated`` or ``parameter_server/dedicated`` (on the cluster's server
machines). A push and a pull each take half of the closed form's push then pull, whose two
steps, one each way, load their busiest links alike. Every collective runs
over all the cluster's GPUs (``ranks``: None or all of them), as one channel of the plain
(``simple``) protocol.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .cluster import Cluster
from .collectives import allreduce_time_us, parameter_server_time_us, plan_allreduce, plan_parameter_server
from .plan import Plan
from .units import TopologyError

COLLECTIVE_OPS = ("all_reduce", "push", "pull")
PROTOCOLS = ("simple",)
_ALGORITHMS = {
    "all_reduce": ("ring", "hierarchical"),
    "push": ("parameter_server", "parameter_server/colocated", "parameter_server/dedicated"),
    "pull": ("parameter_server", "parameter_server/colocated", "parameter_server/dedicated"),
}
_PARAMETER_SERVER_STEP = {"push": 0, "pull": 1}


@dataclass(frozen=True)
class CollectiveCost:
    """The time one collective takes, and what priced it."""

    op: str
    nbytes: float
    time_us: float
    algorithm: str
    protocol: str
    channels: int


def collective_algorithms(op: str) -> tuple:
    """The algorithms ``op`` can run, its default first (a scenario's ``collective`` names one
    of ``all_reduce``'s)."""
    if op not in COLLECTIVE_OPS:
        raise TopologyError("op", f"unknown collective {op!r}{_hint(op, COLLECTIVE_OPS)}; known: {', '.join(COLLECTIVE_OPS)}")
    return _ALGORITHMS[op]


def collective_cost(
    cluster: Cluster,
    op: str,
    nbytes: float,
    *,
    ranks: Optional[Sequence[int]] = None,
    algorithm: Optional[str] = None,
    protocol: Optional[str] = None,
) -> CollectiveCost:
    """The time ``op`` on ``nbytes`` bytes per GPU takes on an otherwise idle ``cluster``."""
    algorithm = _choose(cluster, op, ranks, algorithm)
    protocol = _protocol(protocol)
    if op == "all_reduce":
        time_us = allreduce_time_us(cluster, nbytes, algorithm)
    else:
        time_us = parameter_server_time_us(cluster, nbytes, placement=_placement(algorithm)) / 2
    return CollectiveCost(op, float(nbytes), time_us, algorithm, protocol, 1)


def collective_plan(
    cluster: Cluster,
    op: str,
    nbytes: float,
    *,
    ranks: Optional[Sequence[int]] = None,
    algorithm: Optional[str] = None,
) -> Plan:
    """The transfers ``op`` on ``nbytes`` bytes per GPU makes, step by step."""
    algorithm = _choose(cluster, op, ranks, algorithm)
    if op == "all_reduce":
        return plan_allreduce(cluster, nbytes, algorithm)
    plan = plan_parameter_server(cluster, nbytes, placement=_placement(algorithm))
    step = _PARAMETER_SERVER_STEP[op]
    return Plan(plan.algorithm, plan.size_bytes, plan.steps[step : step + 1])


def _choose(cluster: Cluster, op: str, ranks, algorithm: Optional[str]) -> str:
    """The algorithm for ``op`` (its default where None), after checking op and ranks."""
    known = collective_algorithms(op)
    if ranks is not None and not np.array_equal(np.sort(np.asarray(ranks)), np.arange(cluster.n_gpus)):
        raise TopologyError("ranks", f"a collective over some of the {cluster.n_gpus} GPUs is not modelled; give all of them or None")
    algorithm = known[0] if algorithm is None else algorithm
    if algorithm not in known:
        raise TopologyError("algorithm", f"unknown {op} algorithm {algorithm!r}{_hint(algorithm, known)}; known: {', '.join(known)}")
    return algorithm


def _placement(algorithm: str) -> str:
    return algorithm.partition("/")[2] or "colocated"


def _protocol(protocol: Optional[str]) -> str:
    protocol = PROTOCOLS[0] if protocol is None else protocol
    if protocol not in PROTOCOLS:
        raise TopologyError("protocol", f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    return protocol


def _hint(name, known) -> str:
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
