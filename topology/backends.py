"""The seam the simulation calls: what one collective costs on a cluster, and what it sends.

:func:`collective_cost` answers "how long does this collective take on an idle cluster, and how
would the library run it"; :func:`collective_plan` gives the same collective as a
:class:`~whatif.topology.plan.Plan` of transfers, for ``network.py`` to share links among
concurrent collectives. The cluster's ``backend`` picks the family of models:

* ``nccl`` (GPU clusters): the algorithms, protocols and choice of NCCL (``nccl/model.py``,
  ``nccl/p2p.py``) on the cluster's fabric (``fabric.py``).
* ``gloo`` (CPU workers over TCP, the lab): today's closed forms and plans of
  ``collectives.py`` with the links' latency and efficiency, bit for bit: ring (default),
  hierarchical and parameter-server all-reduce. The other operations are Gloo's simple
  schedules on the same links (``_gloo_time_us``).

``nbytes`` means what nccl-tests' "size" column means for the operation: the whole buffer for
all-reduce, broadcast and reduce; the gathered (all-gather) or scattered (reduce-scatter)
buffer, ``n`` times a rank's share; a rank's whole send buffer for all-to-all; what each rank
sends for send/recv. ``ranks`` are GPU endpoint ids (None: every GPU), so a tensor-parallel
group inside a node and a data-parallel group across nodes are priced apart.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .cluster import Cluster
from .collectives import allreduce_time_us, plan_allreduce
from .nccl import p2p
from .nccl.graphs import Comm
from .nccl.model import predict
from .nccl.plans import plan_nccl
from .nccl.tuning import ALGORITHMS, OPS, PROTOCOLS
from .plan import Plan, Step
from .units import TopologyError

GLOO_ALGORITHMS = ("ring", "hierarchical", "parameter_server")


@dataclass(frozen=True)
class CollectiveCost:
    """One collective's predicted time on an idle cluster, and how the library runs it."""

    op: str            # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, send_recv
    nbytes: float      # as nccl-tests' "size" column for that op
    time_us: float
    algorithm: str     # ring, tree, nvls, nvls_tree, collnet_direct, collnet_chain, pat, p2p, or gloo's
    protocol: str      # ll, ll128, simple (or "tcp" for the CPU backend)
    channels: int


def _check(op: str, nbytes) -> tuple:
    if op not in OPS:
        close = difflib.get_close_matches(str(op), OPS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TopologyError("op", f"unknown operation {op!r}; {hint}known: {', '.join(OPS)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float, np.number)) or not (math.isfinite(nbytes) and nbytes >= 0):
        raise TopologyError("nbytes", f"must be a finite number of bytes >= 0, got {nbytes!r}")
    return op, float(nbytes)


_ALIASES = {"nvlstree": "nvls_tree", "collnetdirect": "collnet_direct", "collnetchain": "collnet_chain",
            "ps": "parameter_server", "parameterserver": "parameter_server"}


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
    """``(algorithms, protocols)`` name sets of NCCL_ALGO / NCCL_PROTO-style specs."""
    return parse_choice(algorithm, ALGORITHMS + ("p2p",), "algorithm"), parse_choice(protocol, PROTOCOLS, "protocol")


def collective_cost(cluster: Cluster, op: str, nbytes: float, *, ranks: Optional[Sequence[int]] = None,
                    algorithm: Optional[str] = None, protocol: Optional[str] = None) -> CollectiveCost:
    """``op`` on ``nbytes`` among ``ranks`` of ``cluster``; ``algorithm``/``protocol`` force a choice."""
    op, nbytes = _check(op, nbytes)
    if cluster.backend == "gloo":
        if protocol not in (None, "tcp"):
            raise TopologyError("protocol", f"the gloo backend has one protocol, tcp; got {protocol!r}")
        name = _name(algorithm, GLOO_ALGORITHMS, "algorithm") if algorithm is not None else "ring"
        sub = _gloo_cluster(cluster, ranks)
        return CollectiveCost(op, nbytes, _gloo_time_us(sub, op, nbytes, name), name, "tcp", 1)
    comm = Comm.of(cluster.fabric, ranks)
    algorithms, protocols = parse_choices(algorithm, protocol)
    if op in ("send_recv", "all_to_all"):
        if algorithms is not None and "p2p" not in algorithms and len(algorithms) == 1:
            raise TopologyError("algorithm", f"NCCL runs {op} as point-to-point sends (p2p), not {algorithm!r}")
        found = (p2p.send_recv if op == "send_recv" else p2p.all_to_all)(comm, nbytes, protocols, cluster.fabric.calibration)
    else:
        found = predict(comm, op, nbytes, algorithms, protocols, cluster.fabric.calibration)
    return CollectiveCost(op, nbytes, found.time_us, found.option.algorithm, found.option.protocol, found.channels)


def collective_plan(cluster: Cluster, op: str, nbytes: float, *, ranks: Optional[Sequence[int]] = None,
                    algorithm: Optional[str] = None) -> Plan:
    """The transfers of ``op`` (as NCCL or Gloo would run it), for link sharing in ``network.py``."""
    op, nbytes = _check(op, nbytes)
    if cluster.backend == "gloo":
        name = _name(algorithm, GLOO_ALGORITHMS, "algorithm") if algorithm is not None else "ring"
        if op == "all_reduce" and ranks is None:
            return plan_allreduce(cluster, nbytes, name)
        return _gloo_plan(cluster, op, nbytes, _ranks(cluster, ranks))
    cost = collective_cost(cluster, op, nbytes, ranks=ranks, algorithm=algorithm)
    return plan_nccl(cluster.fabric, _ranks(cluster, ranks), op, nbytes, cost.algorithm)


# -- gloo ----------------------------------------------------------------------------------------


def _ranks(cluster: Cluster, ranks) -> np.ndarray:
    if ranks is None:
        return np.arange(cluster.n_gpus)
    ids = np.asarray(list(ranks), dtype=np.int64).reshape(-1)
    if not len(ids) or ids.min() < 0 or ids.max() >= cluster.n_gpus or len(np.unique(ids)) != len(ids):
        raise TopologyError("ranks", f"must be distinct GPUs of 0..{cluster.n_gpus - 1}, got {list(ranks)!r}")
    return ids


def _gloo_cluster(cluster: Cluster, ranks) -> Cluster:
    """The cluster the closed forms see: ``ranks`` as whole machines of equally many workers."""
    if ranks is None:
        return cluster
    ids = _ranks(cluster, ranks)
    _, per_machine = np.unique(cluster.machine_of(ids), return_counts=True)
    if per_machine.min() != per_machine.max():
        raise TopologyError("ranks", "the gloo models need as many ranks on every machine they use")
    return Cluster(len(per_machine), int(per_machine[0]), cluster.intra_node, cluster.inter_node,
                   name=cluster.name, shared_memory=cluster.shared_memory)


def _gloo_time_us(cluster: Cluster, op: str, nbytes: float, algorithm: str) -> float:
    """Gloo's schedules on the two links; all-reduce is ``collectives.py``'s, unchanged.

    With ``n`` workers and each step set by its slowest link (``L + bytes / B``): all-gather
    and reduce-scatter are rings of ``n-1`` steps of ``S/n``; broadcast and reduce ``n-1``
    sends of ``S`` from (to) the root; all-to-all ``n-1`` exchanges of ``S/n``; send/recv one
    transfer of ``S``.
    """
    n = cluster.n_gpus
    if op == "all_reduce":
        return allreduce_time_us(cluster, nbytes, algorithm)
    if algorithm != "ring":
        raise TopologyError("algorithm", f"the gloo backend runs {op} as a ring, not {algorithm!r}")
    if n == 1:
        return 0.0
    links = ([cluster.intra_node] if cluster.gpus_per_machine > 1 else []) + ([cluster.inter_node] if cluster.machines > 1 else [])
    chunk = {"all_gather": nbytes / n, "reduce_scatter": nbytes / n, "all_to_all": nbytes / n,
             "broadcast": nbytes, "reduce": nbytes, "send_recv": nbytes}[op]
    steps = 1 if op == "send_recv" else n - 1
    return steps * max(link.latency_us + chunk / link.effective_bandwidth_bytes_per_us for link in links)


def _gloo_plan(cluster: Cluster, op: str, nbytes: float, ranks: np.ndarray) -> Plan:
    """The transfers of :func:`_gloo_time_us`'s schedules among ``ranks`` (ring order)."""
    n = len(ranks)
    if n == 1:
        return Plan(f"gloo/{op}", nbytes, ())
    nxt = np.roll(ranks, -1)
    if op == "all_reduce":
        steps = (Step(ranks, nxt, nbytes / n),) * (2 * (n - 1))
    elif op in ("all_gather", "reduce_scatter"):
        steps = (Step(ranks, nxt, nbytes / n),) * (n - 1)
    elif op == "all_to_all":
        steps = tuple(Step(ranks, np.roll(ranks, -k), nbytes / n) for k in range(1, n))
    elif op == "send_recv":
        steps = (Step(ranks, nxt, nbytes),)
    else:  # broadcast from / reduce to the first rank
        others = ranks[1:]
        steps = tuple(Step([ranks[0]], [dst], nbytes) if op == "broadcast" else Step([dst], [ranks[0]], nbytes) for dst in others)
    return Plan(f"gloo/{op}", nbytes, steps)


__all__ = ["CollectiveCost", "collective_cost", "collective_plan"]
