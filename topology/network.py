"""Moving bytes over a cluster's links in a SimPy simulation, sharing them fairly.

The links. Every machine has a NIC (the cluster's ``inter_node`` link) with an egress and an
ingress capacity, separate because links are full duplex. Every endpoint (a GPU, or a machine's
host CPU where parameter servers run) has its own intra-node port (``intra_node``), again with
egress and ingress. A transfer within a machine crosses the sender's intra-node egress port and
the receiver's intra-node ingress port; a transfer between machines crosses the sender
machine's NIC egress and the receiver machine's NIC ingress. The switch between NICs is
non-blocking, and the hop from a GPU to its NIC is not modelled.

On a GPU fabric (``fabric.py``: ``machine: dgx_h100``, or the fabric keys) a machine's NICs are
one NIC of their summed rate and a GPU's intra-node port is its NVLink at NCCL's modelled rate
(the cluster's ``inter_node`` and ``intra_node``, from ``Fabric.legacy_links``): transfers
between machines share all of a machine's NICs, as NCCL's channels and a parameter server's
many connections spread over them. What that leaves out: rail alignment (a GPU reaches the
network through its own NIC, which caps a single flow at one NIC's rate), a host's PCIe links
(its port runs at the GPUs' NVLink rate), and the switch tiers above the leaves (NCCL's
all-to-all model, ``nccl/p2p.py``, charges their oversubscription; the network does not). An
idle fabric's collective takes NCCL's time (``cost.py``); the network matters where
collectives overlap (a parameter server's pushes and pulls).

Why intra-node capacity is per endpoint rather than per machine or per GPU pair: NCCL's
intra-node bandwidth is a property of a GPU (its NVLinks, its PCIe x16 slot), and a GPU sending
to two peers at once splits it; a per-pair model would let a GPU send to seven peers at seven
times its bandwidth, a per-machine bus would make eight GPUs in a ring share one link. What a
per-endpoint port ignores is a shared PCIe switch or CPU uplink (fold that into ``efficiency``).

The sharing. A transfer first waits its link's latency (once; it is a per-message cost, not a
per-byte one), then streams. Streaming transfers share capacity by processor sharing with
max-min fairness: whenever a transfer starts or ends, rates are recomputed by progressive
filling (raise all rates together; when a link is full, its transfers keep their rate and the
rest go on), so a transfer through NIC egress of A and NIC ingress of B gets the smaller of its
fair shares, and capacity one transfer cannot use goes to the others (max-min flow control,
Bertsekas & Gallager, *Data Networks*, ch. 6).

Speed. The state is a few numpy arrays of active transfers, and SimPy sees one event per batch
of transfers and one per change of rates, never one per transfer: :meth:`Network.transfer_all`
starts many transfers with a single completion event, and a plan's step is one such batch. The
sharing stays exact per transfer (two collectives running at once, or intra- and inter-node
transfers of one step, get their own rates); the price is that a batch reports only when its
last transfer arrives. Transfers of one batch that cross the same two links with the same bytes
and start together stay alike to the end (their rates are equal), so they are kept as one row
with a count (``fair_rates``' ``transfers``): a parameter server's 512 transfers of a step are
about 120 rows. The cost of a rate update grows with the rows in flight (thousands are fine).
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import simpy

from .cluster import Cluster
from .plan import Plan, Step
from .units import TopologyError

_DONE_WITHIN_US = 1e-4  # a transfer this close to its end counts as done (float rounding)


def fair_rates(capacity: np.ndarray, out_link: np.ndarray, in_link: np.ndarray,
               transfers: Optional[np.ndarray] = None) -> np.ndarray:
    """Max-min fair rates of transfers that each cross two links, by progressive filling.

    ``capacity[l]`` is link ``l``'s bandwidth; transfer ``i`` crosses ``out_link[i]`` and
    ``in_link[i]`` (``transfers[i]`` transfers alike where given: the rate is each one's). Each
    round raises every unfrozen rate by the smallest fair share left on any link, then freezes
    the transfers of the links that are now full. Rounds: one per distinct bottleneck level.
    """
    n_links = len(capacity)
    rate = np.zeros(len(out_link))
    left = capacity.astype(np.float64, copy=True)
    active = np.arange(len(out_link))
    while len(active):
        a_out, a_in = out_link[active], in_link[active]
        w = None if transfers is None else transfers[active]  # None: one transfer each
        count = np.bincount(a_out, w, minlength=n_links) + np.bincount(a_in, w, minlength=n_links)
        used = count > 0
        share = np.full(n_links, np.inf)
        share[used] = left[used] / count[used]
        level = share.min()
        rate[active] += level
        left[used] -= count[used] * level
        full = share <= level * (1 + 1e-9)
        active = active[~(full[a_out] | full[a_in])]
    return rate


class Network:
    """The links of ``cluster``, shared by the transfers started on it in ``env``.

    Use it from SimPy processes: ``yield network.transfer(src, dst, nbytes)`` waits for one
    transfer, ``yield network.transfer_all(srcs, dsts, sizes)`` for a batch, ``yield
    network.execute(plan)`` for a whole collective (its value is the duration in us). Any number
    of these may be in flight at once; they share links as described in the module docstring.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster):
        self.env = env
        self.cluster = cluster
        m, e = cluster.n_machines, cluster.n_endpoints
        self._machine = np.asarray(cluster.endpoint_machines)
        self._n_nic_links = 2 * m
        capacity = np.empty(2 * m + 2 * e)
        capacity[: 2 * m] = cluster.inter_node.effective_bandwidth_bytes_per_us
        capacity[2 * m :] = cluster.intra_node.effective_bandwidth_bytes_per_us
        self.capacity_bytes_per_us = capacity
        self.link_bytes = np.zeros(len(capacity))  # bytes started over each link, for reports
        # one row per set of alike transfers in flight (see the module docstring): each one's
        # bytes left and rate, their out and in link, their batch and how many they are
        self._remaining = np.empty(0)
        self._rate = np.empty(0)
        self._links = np.empty((0, 2), dtype=np.int64)
        self._batch = np.empty(0, dtype=np.int64)
        self._count = np.empty(0)
        self._arrivals: list = []
        self._batches: dict = {}
        self._next_batch = 0
        self._last_us = env.now
        self._update_pending = False
        self._timer = 0
        self.rate_updates = 0
        self._routes: dict = {}  # id(step) -> (step, its rows, its bytes by link): plans repeat their steps
        self._pair_rates: dict = {}  # the links of the transfers in flight -> their rates
        self.rate_misses = 0

    # -- public ----------------------------------------------------------------------------------

    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """An event that fires when ``nbytes`` sent now from ``src`` to ``dst`` have arrived."""
        return self.transfer_all([src], [dst], [nbytes])

    def transfer_all(self, src, dst, nbytes) -> simpy.Event:
        """Start transfers ``src[i] -> dst[i]`` of ``nbytes[i]`` now; one event when all arrived.

        ``nbytes`` may be a scalar for equal sizes. A transfer from an endpoint to itself takes
        no time. The event's value is the time it fired.
        """
        src = np.asarray(src, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst, dtype=np.int64).reshape(-1)
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        if not len(src):
            return self.env.event().succeed(self.env.now)
        self._check(src, dst, nbytes)
        route = self._route(src, dst)
        return self._start(_rows(route, nbytes), self._link_bytes(route, nbytes))

    def execute(self, plan: Plan) -> simpy.Process:
        """Run ``plan`` step after step; the process's value is its duration in us."""
        return self.env.process(self._run_steps(plan.steps))

    def nic_bytes(self) -> tuple:
        """Bytes started through each machine's NIC so far: ``(egress, ingress)`` arrays."""
        nic = self.link_bytes[: self._n_nic_links]
        return nic[0::2].copy(), nic[1::2].copy()

    # -- the fluid model -------------------------------------------------------------------------

    def _run_steps(self, steps):
        start = self.env.now
        for step in steps:
            if not len(step):
                continue
            known = self._routes.get(id(step))
            if known is None or known[0] is not step:
                self._check(step.src, step.dst, step.nbytes)
                route = self._route(step.src, step.dst)
                known = self._routes[id(step)] = (step, _rows(route, step.nbytes), self._link_bytes(route, step.nbytes))
            yield self._start(known[1], known[2])
        return self.env.now - start

    def _route(self, src: np.ndarray, dst: np.ndarray) -> tuple:
        """The links and latencies of transfers ``src -> dst``, grouped by when they start streaming.

        Returns ``(out_link, in_link, groups, itself)``: ``groups`` lists ``(latency_us,
        selector, links)`` for the transfers that wait that latency (``links``: their out and in
        links, a row each), ``itself`` marks transfers from an endpoint to itself (or is None).
        """
        m_src, m_dst = self._machine[src], self._machine[dst]
        local = m_src == m_dst
        port = self._n_nic_links
        out_link = np.where(local, port + 2 * src, 2 * m_src)
        in_link = np.where(local, port + 2 * dst + 1, 2 * m_dst + 1)
        itself = src == dst
        lat_intra = self.cluster.intra_node.latency_us
        lat_inter = self.cluster.inter_node.latency_us
        if itself.any():
            local = local & ~itself
        selectors = []
        if lat_intra == lat_inter and not itself.any():
            selectors.append((lat_intra, slice(None)))
        else:
            for latency, mask in ((0.0, itself), (lat_intra, local), (lat_inter, ~(local | itself))):
                if mask.all():
                    selectors.append((latency, slice(None)))
                elif mask.any():
                    selectors.append((latency, np.flatnonzero(mask)))
        links = np.stack((out_link, in_link), axis=1)
        groups = [(latency, sel, links[sel]) for latency, sel in selectors]
        return out_link, in_link, groups, (itself if itself.any() else None)

    def _link_bytes(self, route: tuple, nbytes: np.ndarray) -> tuple:
        """The bytes transfers of ``nbytes`` on ``route`` add to their out links and to their in
        links, each a vector over the links."""
        out_link, in_link, _, itself = route
        if itself is not None:
            nbytes = np.where(itself, 0.0, nbytes)
        n_links = len(self.link_bytes)
        return np.bincount(out_link, nbytes, minlength=n_links), np.bincount(in_link, nbytes, minlength=n_links)

    def _start(self, rows: tuple, link_bytes: tuple) -> simpy.Event:
        """Start a batch given as ``_rows``; its event fires when its last row has arrived."""
        groups, n_rows = rows
        done = self.env.event()
        batch = self._next_batch
        self._next_batch += 1
        self._batches[batch] = [n_rows, done]
        self.link_bytes += link_bytes[0]
        self.link_bytes += link_bytes[1]
        for latency, links, size, count in groups:
            arrival = (links, size.copy(), np.full(len(size), batch), count)
            if latency > 0:
                self.env.timeout(latency).callbacks.append(functools.partial(self._arrive, arrival))
            else:
                self._arrive(arrival)
        return done

    def _check(self, src, dst, nbytes) -> None:
        n = self.cluster.n_endpoints
        low, high = min(src.min(), dst.min()), max(src.max(), dst.max())
        if low < 0 or high >= n:
            bad = low if low < 0 else high
            raise TopologyError(
                "transfer",
                f"endpoint {bad} does not exist; the cluster has {self.cluster.n_gpus} GPUs "
                f"(0..{self.cluster.n_gpus - 1}) and {self.cluster.n_machines} hosts",
            )
        if not (np.all(np.isfinite(nbytes)) and nbytes.min() >= 0):
            raise TopologyError("transfer", "sizes must be finite and not negative")

    def _arrive(self, arrival, _event=None) -> None:
        self._arrivals.append(arrival)
        if not self._update_pending:
            self._update_pending = True
            self.env.timeout(0).callbacks.append(self._update)

    def _on_timer(self, token: int, _event) -> None:
        if token == self._timer:
            self._update()

    def _update(self, _event=None) -> None:
        """Bring the transfers to now, retire the finished, admit the new, recompute rates."""
        self._update_pending = False
        now = self.env.now
        if now > self._last_us and len(self._remaining):
            self._remaining -= self._rate * (now - self._last_us)  # an array of the network's own
        self._last_us = now
        if self._arrivals:
            links, sizes, batches, counts = zip(*self._arrivals)
            self._arrivals = []
            self._links = np.concatenate((self._links, *links))
            self._remaining = np.concatenate((self._remaining, *sizes))
            self._batch = np.concatenate((self._batch, *batches))
            self._count = np.concatenate((self._count, *counts))
            self._rate = np.concatenate((self._rate, np.zeros(sum(len(s) for s in sizes))))

        finished = self._remaining <= self._rate * _DONE_WITHIN_US
        if finished.any():
            self._retire(finished, now)

        self._timer += 1
        if not len(self._remaining):
            return
        self.rate_updates += 1
        self._rate = self._fair_rates()
        next_end = float((self._remaining / self._rate).min())
        self.env.timeout(next_end).callbacks.append(functools.partial(self._on_timer, self._timer))

    def _fair_rates(self) -> np.ndarray:
        """``fair_rates`` of the transfers in flight, kept by their links: a parameter server's
        pushes and pulls put the same transfers in flight again and again."""
        key = self._links.tobytes() + self._count.tobytes()
        rates = self._pair_rates.get(key)
        if rates is None:
            if len(self._pair_rates) >= 4096:
                self._pair_rates.clear()
            rates = self._pair_rates[key] = fair_rates(self.capacity_bytes_per_us, self._links[:, 0],
                                                       self._links[:, 1], self._count)
            self.rate_misses += 1
        return rates

    def _retire(self, finished: np.ndarray, now: float) -> None:
        ids = self._batch[finished]
        if ids[0] == ids[-1] and (ids == ids[0]).all():
            batches, counts = [int(ids[0])], [len(ids)]
        else:
            batches, counts = (a.tolist() for a in np.unique(ids, return_counts=True))
        for batch, count in zip(batches, counts):
            entry = self._batches[batch]
            entry[0] -= count
            if entry[0] == 0:
                del self._batches[batch]
                entry[1].succeed(now)
        keep = ~finished
        self._remaining = self._remaining[keep]
        self._rate = self._rate[keep]
        self._links = self._links[keep]
        self._batch = self._batch[keep]
        self._count = self._count[keep]


def _rows(route: tuple, nbytes: np.ndarray) -> tuple:
    """The transfers ``nbytes`` on ``route`` as rows of alike transfers: ``(groups, n_rows)``,
    ``groups`` a ``(latency_us, links, bytes, count)`` per latency group, a row for each distinct
    out link, in link and size (a transfer to itself moves no bytes)."""
    _, _, groups, itself = route
    if itself is not None:
        nbytes = np.where(itself, 0.0, nbytes)
    rows, n_rows = [], 0
    for latency, sel, links in groups:
        size = np.asarray(nbytes[sel], dtype=np.float64)
        if len(size) > 1:
            key = np.column_stack((links.astype(np.float64), size))
            unique, first, count = np.unique(key, axis=0, return_index=True, return_counts=True)
            if len(unique) < len(size):
                keep = np.sort(first)  # the rows in the order they were given
                count = count[np.argsort(first)].astype(np.float64)
                links, size = links[keep], size[keep]
            else:
                count = np.ones(len(size))
        else:
            count = np.ones(len(size))
        rows.append((latency, links, size, count))
        n_rows += len(size)
    return rows, n_rows


def simulate_plan(plan: Plan, cluster: Cluster, start_us: float = 0.0) -> float:
    """Duration in us of ``plan`` on ``cluster`` when nothing else uses the links."""
    env = simpy.Environment(initial_time=start_us)
    process = Network(env, cluster).execute(plan)
    env.run(until=process)
    return float(process.value)
