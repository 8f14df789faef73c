"""Collectives on a cluster's two links, each as a plan of transfers and as a closed form.

``plan_*`` functions say what an algorithm sends, step by step (a :class:`~.plan.Plan`, timed
by ``network.py`` with links shared among whatever else is running); ``*_time_us`` functions
give the time the same algorithm takes on an otherwise idle cluster, from a formula. The two
agree when nothing competes (the tests check it), so the formula documents the plan and the
plan generalises the formula to contention.

Notation: ``S`` bytes per GPU, ``m`` machines of ``g`` GPUs, ``n = m g``; ``B_i``, ``L_i`` the
effective bandwidth and latency of the intra-node link, ``B_n``, ``L_n`` of the NIC. A step
costs the latency of its links plus its bytes over the bandwidth it gets; steps run one after
another (each waits for the last transfer of the previous one).

* Ring all-reduce (NCCL; Patarasuk & Yuan 2009): a reduce-scatter then an all-gather around one
  ring of all ``n`` GPUs, ``2(n-1)`` steps in which every GPU sends ``S/n`` to its neighbour.
  The ring visits the GPUs machine by machine, so each step crosses each NIC once each way and
  each GPU's intra-node port once each way::

      T = 2(n-1) * max over links used (L + S / (n B))

  which is the familiar ``2(n-1)/n * S/B + 2(n-1) L`` when one link is both the slowest and
  the one with the largest latency (the NIC, typically).

* Hierarchical all-reduce (Jia et al. 2018, "Highly scalable deep learning training system
  with mixed-precision"; Horovod's hierarchical allreduce): reduce-scatter inside each
  machine (ring of ``g``, shards of ``S/g``), all-reduce of each shard across machines among
  the GPUs with the same local rank (``g`` rings of ``m``, run at once), all-gather inside each
  machine. The ``g`` inter-node rings each send ``S/(gm)`` per step through every NIC, so a NIC
  carries ``S/m`` per step::

      T = 2(g-1) (L_i + S / (g B_i)) + 2(m-1) (L_n + S / (m B_n))

  A NIC carries ``2(m-1)/m S`` instead of the ring's ``2(n-1)/n S`` (about the same), but
  pays ``2(m-1)`` network latencies instead of ``2(n-1)``.

* Parameter server (Li et al., OSDI 2014; BytePS, OSDI 2020): ``P`` servers each own ``S/P``
  of the tensor. Every worker (GPU) pushes its gradient shard to each server in one step, then
  pulls the updated shard back in a second. Servers run on host CPUs, either ``colocated`` on
  the worker machines (server ``k`` on machine ``k mod m``) or on ``dedicated`` server
  machines (server ``k`` on server machine ``k mod D``). Each step's time is set by its most
  loaded link, because all transfers on a link are equal in size and share it equally:

  - colocated, ``p`` = most servers on a machine, ``p'`` = fewest: a machine's NIC sends
    ``g (P - p') S/P`` and receives ``p (n - g) S/P``; a host's intra-node port takes
    ``g p S/P`` from its own GPUs::

        T = 2 max(L_n + max(g (P - p'), p (n - g)) S / (P B_n),  L_i + g p S / (P B_i))

  - dedicated, ``q`` = most servers on a server machine: every worker machine's NIC sends
    ``g S``, the busiest server NIC receives ``q n S/P``::

        T = 2 (L_n + max(g, q n / P) S / B_n)

  Exact when servers spread evenly (``P`` a multiple of the machine count); otherwise the
  busiest link's transfers can finish before the others and the formula is a lower bound.
  Server-side summation is not modelled.

The other collectives, as Gloo runs them over these links (``gloo_time_us`` and ``plan_gloo``;
``S`` is nccl-tests' "size" for the operation, see ``cost.py``):

* all-gather: Gloo's ring (``gloo::allgather``, which ``ProcessGroupGloo`` runs for
  ``all_gather_into_tensor`` into a flat buffer it then copies out), ``n-1`` steps in which every
  GPU sends ``S/n`` to its neighbour, like one half of the ring all-reduce: ``T = (n-1) max over
  links used (L + S / (n B))``;
* reduce-scatter: ``ProcessGroupGloo`` has no reduce-scatter of its own: its
  ``reduce_scatter_tensor`` (``reduce_scatter_tensor_coalesced``, torch 2.x) clones the input,
  all-reduces the whole of it and copies out the rank's chunk, so it costs the all-reduce of
  ``S``, ``T = 2(n-1) max over links used (L + S / (n B))``, twice a ring reduce-scatter;
* broadcast and reduce: the root (GPU 0) sends ``S`` to every other GPU at once (receives
  from every one, for reduce), Gloo's one-to-all: its intra-node port carries ``g-1`` of them,
  its NIC ``n-g``: ``T = max(L_i + (g-1) S / B_i, L_n + (n-g) S / B_n)``, each term where it
  has transfers;
* all-to-all: every GPU sends ``S/n`` to every other at once (Gloo posts every pair's send):
  a GPU's intra-node port carries ``g-1`` of them, a NIC ``g (n-g)``:
  ``T = max(L_i + (g-1) S / (n B_i), L_n + g (n-g) S / (n B_n))``;
* send/recv: every GPU sends ``S`` to its neighbour in the ring order, one step:
  ``T = max over links used (L + S / B)``.

Each of these ops is priced on its links as that op sees them (``Link.for_op``): where the
cluster's links carry figures calibrated for the op (``whatif lab calibrate`` times each one,
``lab/probes/collectives.py``), those; else the links' own.
"""

from __future__ import annotations

import difflib
import math
from typing import Optional

import numpy as np

from .cluster import Cluster, Link
from .plan import Plan, Step
from .units import TopologyError

PLACEMENTS = ("colocated", "dedicated")


def _check_size(size_bytes: float) -> float:
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float, np.number)):
        raise TopologyError("size_bytes", f"expected a number of bytes, got {size_bytes!r} (parse text with parse_size)")
    if not (math.isfinite(size_bytes) and size_bytes >= 0):
        raise TopologyError("size_bytes", f"must be a finite number of bytes >= 0, got {size_bytes!r}")
    return float(size_bytes)


def _ring_step(rings: np.ndarray, chunk_bytes: float) -> Step:
    """One step of rings running at once: every member of each row sends to the next one."""
    return Step(rings.reshape(-1), np.roll(rings, -1, axis=1).reshape(-1), chunk_bytes)


def _step_time_us(link: Link, nbytes: float) -> float:
    return link.latency_us + nbytes / link.effective_bandwidth_bytes_per_us


def links_used(cluster: Cluster) -> list:
    """The links a ring over every GPU, machine by machine, crosses."""
    return ([cluster.intra_node] if cluster.gpus_per_machine > 1 else []) + ([cluster.inter_node] if cluster.machines > 1 else [])


# -- ring ----------------------------------------------------------------------------------------


def plan_ring_allreduce(cluster: Cluster, size_bytes: float) -> Plan:
    """NCCL-style ring all-reduce of ``size_bytes`` over all GPUs, ordered machine by machine."""
    size = _check_size(size_bytes)
    n = cluster.n_gpus
    if n == 1:
        return Plan("ring", size, ())
    step = _ring_step(np.arange(n).reshape(1, n), size / n)
    return Plan("ring", size, (step,) * (2 * (n - 1)))


def ring_allreduce_time_us(cluster: Cluster, size_bytes: float) -> float:
    """``2(n-1) * max over links used (L + S/(n B))``; see the module docstring."""
    size = _check_size(size_bytes)
    n = cluster.n_gpus
    if n == 1:
        return 0.0
    return 2 * (n - 1) * max(_step_time_us(link, size / n) for link in links_used(cluster))


# -- hierarchical --------------------------------------------------------------------------------


def plan_hierarchical_allreduce(cluster: Cluster, size_bytes: float) -> Plan:
    """Intra-node reduce-scatter, inter-node ring all-reduce per local rank, intra-node all-gather."""
    size = _check_size(size_bytes)
    m, g = cluster.machines, cluster.gpus_per_machine
    gpus = np.arange(cluster.n_gpus).reshape(m, g)
    intra = (_ring_step(gpus, size / g),) * (g - 1) if g > 1 else ()
    inter = (_ring_step(gpus.T.copy(), size / (g * m)),) * (2 * (m - 1)) if m > 1 else ()
    return Plan("hierarchical", size, intra + inter + intra)


def hierarchical_allreduce_time_us(cluster: Cluster, size_bytes: float) -> float:
    """``2(g-1)(L_i + S/(g B_i)) + 2(m-1)(L_n + S/(m B_n))``; see the module docstring."""
    size = _check_size(size_bytes)
    m, g = cluster.machines, cluster.gpus_per_machine
    intra = 2 * (g - 1) * _step_time_us(cluster.intra_node, size / g) if g > 1 else 0.0
    inter = 2 * (m - 1) * _step_time_us(cluster.inter_node, size / m) if m > 1 else 0.0
    return intra + inter


# -- parameter server ----------------------------------------------------------------------------


def server_hosts(cluster: Cluster, servers: Optional[int] = None, placement: str = "colocated") -> np.ndarray:
    """The endpoint (a host) of each parameter server.

    ``servers`` defaults to one per machine of the placement: ``machines`` when colocated,
    ``server_machines`` when dedicated.
    """
    if placement not in PLACEMENTS:
        close = difflib.get_close_matches(str(placement), PLACEMENTS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TopologyError("placement", f"unknown placement {placement!r}; {hint}use one of {', '.join(PLACEMENTS)}")
    if placement == "dedicated":
        if cluster.server_machines == 0:
            raise TopologyError("server_machines", "dedicated parameter servers need server_machines >= 1 in the cluster")
        first, count = cluster.machines, cluster.server_machines
    else:
        first, count = 0, cluster.machines
    if servers is None:
        servers = count
    if isinstance(servers, bool) or not isinstance(servers, (int, np.integer)) or servers < 1:
        raise TopologyError("servers", f"must be a positive whole number, got {servers!r}")
    return cluster.n_gpus + first + np.arange(servers) % count


def plan_parameter_server(
    cluster: Cluster, size_bytes: float, servers: Optional[int] = None, placement: str = "colocated"
) -> Plan:
    """Every GPU pushes ``S/P`` to each of ``P`` servers, then pulls ``S/P`` back from each."""
    size = _check_size(size_bytes)
    hosts = server_hosts(cluster, servers, placement)
    workers = np.arange(cluster.n_gpus)
    shard = size / len(hosts)
    push = Step(np.repeat(workers, len(hosts)), np.tile(hosts, len(workers)), shard)
    pull = Step(push.dst, push.src, shard)
    return Plan(f"parameter_server/{placement}", size, (push, pull))


def parameter_server_time_us(
    cluster: Cluster, size_bytes: float, servers: Optional[int] = None, placement: str = "colocated"
) -> float:
    """Push plus pull, each set by its busiest link; see the module docstring."""
    size = _check_size(size_bytes)
    p_servers = len(server_hosts(cluster, servers, placement))
    m, g, n = cluster.machines, cluster.gpus_per_machine, cluster.n_gpus
    nic, intra = cluster.inter_node, cluster.intra_node
    shard = size / p_servers
    if placement == "dedicated":
        most = math.ceil(p_servers / cluster.server_machines)
        return 2 * _step_time_us(nic, max(g * size, most * n * shard))
    most, fewest = math.ceil(p_servers / m), p_servers // m
    phase = _step_time_us(intra, g * most * shard)
    if m > 1:
        nic_bytes = max(g * (p_servers - fewest), most * (n - g)) * shard
        phase = max(phase, _step_time_us(nic, nic_bytes))
    return 2 * phase


# -- the other collectives, as Gloo runs them ----------------------------------------------------

GLOO_OPS = {"all_gather": "ring", "reduce_scatter": "ring_allreduce", "broadcast": "direct", "reduce": "direct",
            "all_to_all": "direct", "send_recv": "p2p"}  # each op's one schedule


def plan_gloo(cluster: Cluster, op: str, size_bytes: float) -> Plan:
    """The transfers of ``op`` (one of :data:`GLOO_OPS`) over every GPU; see the module docstring."""
    size = _check_size(size_bytes)
    n = cluster.n_gpus
    name = f"{GLOO_OPS[op]}/{op}"
    if n == 1:
        return Plan(name, size, ())
    gpus = np.arange(n)
    if op == "reduce_scatter":
        steps = plan_ring_allreduce(cluster, size).steps
    elif op == "all_gather":
        steps = (_ring_step(gpus.reshape(1, n), size / n),) * (n - 1)
    elif op == "send_recv":
        steps = (_ring_step(gpus.reshape(1, n), size),)
    elif op == "all_to_all":
        src = np.repeat(gpus, n - 1)
        steps = (Step(src, (src + np.tile(np.arange(1, n), n)) % n, size / n),)
    else:  # one-to-all from GPU 0, or all-to-one into it
        root, others = np.zeros(n - 1, dtype=np.int64), gpus[1:]
        steps = (Step(root, others, size) if op == "broadcast" else Step(others, root, size),)
    return Plan(name, size, steps)


def gloo_time_us(cluster: Cluster, op: str, size_bytes: float) -> float:
    """The closed form of :func:`plan_gloo`'s schedule on an idle cluster; see the module docstring."""
    size = _check_size(size_bytes)
    n, g = cluster.n_gpus, cluster.gpus_per_machine
    if n == 1:
        return 0.0
    links = [link.for_op(op) for link in links_used(cluster)]
    if op in ("all_gather", "reduce_scatter"):
        steps = 2 * (n - 1) if op == "reduce_scatter" else n - 1  # reduce-scatter: Gloo's all-reduce
        return steps * max(_step_time_us(link, size / n) for link in links)
    if op == "send_recv":
        return max(_step_time_us(link, size) for link in links)
    chunk = size / n if op == "all_to_all" else size
    intra_count, nic_count = (g - 1, g * (n - g)) if op == "all_to_all" else (g - 1, n - g)
    terms = [_step_time_us(cluster.intra_node.for_op(op), intra_count * chunk)] if intra_count else []
    terms += [_step_time_us(cluster.inter_node.for_op(op), nic_count * chunk)] if nic_count else []
    return max(terms)


# -- by name -------------------------------------------------------------------------------------

_PLANS = {
    "ring": plan_ring_allreduce,
    "hierarchical": plan_hierarchical_allreduce,
    "parameter_server": plan_parameter_server,
}
_TIMES = {
    "ring": ring_allreduce_time_us,
    "hierarchical": hierarchical_allreduce_time_us,
    "parameter_server": parameter_server_time_us,
}
ALGORITHMS = tuple(_PLANS)


def _algorithm(name: str) -> str:
    name = {"ps": "parameter_server"}.get(name, name)
    if name not in _PLANS:
        close = difflib.get_close_matches(str(name), ALGORITHMS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TopologyError("algorithm", f"unknown all-reduce algorithm {name!r}; {hint}known: {', '.join(ALGORITHMS)}")
    return name


def plan_allreduce(cluster: Cluster, size_bytes: float, algorithm: str = "ring", **options) -> Plan:
    """The plan of ``algorithm`` (``ring``, ``hierarchical``, ``parameter_server``/``ps``)."""
    return _PLANS[_algorithm(algorithm)](cluster, size_bytes, **options)


def allreduce_time_us(cluster: Cluster, size_bytes: float, algorithm: str = "ring", **options) -> float:
    """The closed-form time of ``algorithm`` on an idle cluster."""
    return _TIMES[_algorithm(algorithm)](cluster, size_bytes, **options)
