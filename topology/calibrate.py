"""Calibration from nccl-tests tables: what the fabric delivers that its specs cannot say.

The NCCL model (``nccl/model.py``) prices a collective as ``T = L + S / B`` for the
(algorithm, protocol) NCCL picks, ``L`` and ``B`` from NCCL's tables and the fabric's specs.
:func:`fit_tables` first fits the cluster's physical constants (``nccl/measured.py``'s
:func:`~whatif.topology.nccl.measured.fit` on the tables' latency- and bandwidth-bound rows, the
public estimates as the prior): the kernel start, one network hop's latency for its NIC kind,
and the fraction of the line rate its NICs and its NVLink (PCIe) deliver, each acting on the
part of a row's time it governs. They are the same at every scale, so a calibration at one
scale carries to another through them. On top of them, measurements know two more things per
link class and (algorithm, protocol), for trees also per node-count class
(``per_algorithm``, :func:`factor_nodes`): the fraction of
``B`` this fabric really delivers (NIC firmware, PCIe settings, congestion, a slower switch) and
how much longer its steps take than NCCL's constants (a slower network stack, EFA, sockets).
:func:`fit_tables` finds them::

    T_measured ~ f L + S / (e B)   for every row NCCL runs with that (algorithm, protocol)

by least squares on the relative error with a soft-L1 loss (``_solve``: robust to a noisy row
and to the few rows a protocol holds between two switches), and writes them as the fabric's
:class:`~whatif.topology.fabric.Calibration` (``e`` = ``bandwidth``, ``f`` = ``latency``), on top
of the cluster's measured constants (``nccl/measured.py``). The algorithms and protocols the
tables did not exercise get no factor: the link's own efficiency is a measured constant,
fitted first, and what each (algorithm, protocol) leaves is that algorithm's misfit on these
communicators, not the link's (a geometric mean of them, the ``*`` row earlier calibrations
wrote, carried one algorithm's misfit to another: an 8-GPU GB300 table's LL factor of 1.6
made its 4-GPU ring 15 % fast), so a calibration at one scale carries to another through the
constants where NCCL picks differently. A ``*`` row written by hand still applies
(``Calibration.factors_for``). Which rows belong to which (algorithm,
protocol) is NCCL's choice on its own uncalibrated estimate, as in NCCL itself. ``e`` is kept
within [0.05, 2], ``f`` within [0.2, 20]. Rows the benchmark's host thread set (several GPUs
on one thread, or all-to-all's ``2n`` calls an iteration) say nothing of the fabric and are
left out: those whose host time, at the constants' estimate, exceeds the GPU's and which ran no
faster than it (a row faster than the host estimate proves that estimate too high for this
machine, and its time the GPU's: GB300's Grace ran 64 ranks' 128 calls in 32 us, not 62). So
are rows one of nccl-tests' two runs contradicts (:func:`spikes`): a 1 MiB row of 317 us,
above the 227 us of 2 MiB, had set a 32-GPU H100 table's kernel start to 0 and its InfiniBand
hop to 51 us.

Each table's communicator is its ranks (``Table.n_ranks``) on as many of the cluster's machines
as its hosts (or, without ``Rank`` lines, packed machine by machine): one cluster description
serves tables at several scales.

:func:`diagnose` compares a table's largest rows with what the specs say the fabric should
deliver, and says so plainly when it is far below.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .cluster import Cluster
from .fabric import Calibration, Fabric, node_class
from .nccl import p2p
from .nccl.measured import SPEC, Measured
from .nccl.measured import fit as fit_measured
from .nccl.measured import Row as MeasuredRow
from .nccl.graphs import Comm
from .nccl.model import local_link, predict
from .nccl_tests import Table, bus_factor
from .units import TopologyError, as_gbps, as_gigabytes_per_s

EFFICIENCY_RANGE = (0.05, 2.0)
LATENCY_RANGE = (0.2, 20.0)
UNDERPERFORMING = 0.6  # a table below this fraction of the specs' bus bandwidth is diagnosed
DIAGNOSED_BYTES = 16 * 2**20  # ... at its largest row, if that is at least this big
TREE_SHAPED = ("tree", "nvls_tree")  # algorithms whose shape across nodes changes from two nodes to three
TWIN_RATIO = 1.5  # a row whose out-of-place and in-place runs differ by more: one run was disturbed


@dataclass(frozen=True)
class FittedRow:
    table: str
    line: int
    size_bytes: float
    measured_us: float
    predicted_us: float
    algorithm: str
    protocol: str

    @property
    def error_pct(self) -> float:
        return (self.predicted_us - self.measured_us) / self.measured_us * 100


@dataclass(frozen=True)
class Fit:
    """The calibrated cluster, every row's prediction after the fit, the diagnoses, and the rows
    left out of the fit as one of their two runs contradicts (:func:`spikes`): ``(table path,
    size in bytes)``."""

    cluster: Cluster
    rows: tuple
    groups: tuple    # (link, algorithm, protocol, bandwidth factor, latency factor, rows, node class)
    diagnoses: tuple
    left_out: tuple = ()


def table_comm(fabric: Fabric, table: Table) -> tuple:
    """``(fabric, comm)`` for ``table``: its ranks on enough of the fabric's machines."""
    n = table.n_ranks or fabric.n_gpus
    hosts = table.hosts
    per_host = n // hosts if hosts and n % hosts == 0 else None
    if per_host and per_host <= fabric.gpus_per_machine:
        machines = hosts
        ranks = [m * fabric.gpus_per_machine + g for m in range(hosts) for g in range(per_host)]
    else:
        machines = math.ceil(n / fabric.gpus_per_machine)
        ranks = list(range(n))
    domain = fabric.nvlink_domain
    if domain > fabric.gpus_per_machine:
        machines = math.ceil(machines * fabric.gpus_per_machine / domain) * domain // fabric.gpus_per_machine
    sized = dataclasses.replace(fabric, machines=max(machines, 1))
    return sized, Comm.of(sized, ranks)


def _predict(comm: Comm, op: str, size: float, choice: tuple, calibration: Optional[Calibration]):
    algorithms, protocols = choice
    if op == "send_recv":
        return p2p.send_recv(comm, size, protocols, calibration)
    if op == "all_to_all":
        return p2p.all_to_all(comm, size, protocols, calibration)
    return predict(comm, op, size, algorithms, protocols, calibration)


def calls_per_gpu(op: str, n_ranks: int) -> int:
    """NCCL calls nccl-tests makes per GPU and iteration: a send and a receive per peer for
    all-to-all (``alltoall_perf``), one of each for send/recv, one collective otherwise."""
    return 2 * n_ranks if op == "all_to_all" else 2 if op == "send_recv" else 1


def table_time_us(table: Table, comm: Comm, predicted, measured: Measured) -> float:
    """The time nccl-tests prints for a row we predict as ``predicted`` (its GPU time): at least
    what its host thread spends launching every GPU it drives (``measured.host_us``)."""
    n = table.n_ranks or comm.n_ranks
    return max(predicted.time_us, measured.host_us(table.gpus_per_thread, calls_per_gpu(table.op, n)))


def decompose(table: Table, comm: Comm, choice: tuple = (None, None)) -> list:
    """``table``'s rows as :class:`~whatif.topology.nccl.measured.Row`: each predicted from the
    specs alone (``measured: spec``), split into what the measured constants act on."""
    spec = Calibration(version=comm.fabric.calibration.version, measured=SPEC)
    n = table.n_ranks or comm.n_ranks
    rows = []
    for row in table.rows:
        found = _predict(comm, table.op, row.size_bytes, choice, spec)
        rows.append(MeasuredRow(table.path, comm.arch, row.time_us, found.base_latency_us, found.hops, found.kind,
                                found.local_us, found.net_us, p2p.many_flows(table.op), found.combine,
                                table.gpus_per_thread, calls_per_gpu(table.op, n), found.option.algorithm,
                                local_link(comm, found.option.algorithm), found.ceiling_us))
    return rows


def _solve(latency: np.ndarray, transfer: np.ndarray, measured: np.ndarray) -> tuple:
    """``(e, f, n)`` for ``T = f L + X / e``: least squares on the relative error with a soft-L1
    loss, so that one noisy row, or the few rows a protocol holds between two switches, do not
    set them. A factor is fitted only where some rows make its term at least 5 % of the
    modelled time (``n`` rows for ``e``), and both only from three rows up (else the one of
    what dominates); a factor not fitted stays 1. ``e`` is kept within
    EFFICIENCY_RANGE, ``f`` within LATENCY_RANGE."""
    from scipy.optimize import least_squares

    total = np.maximum(latency + transfer, 1e-12)
    fit_f, n = bool((latency / total >= 0.05).any()), int((transfer / total >= 0.05).sum())
    if len(measured) < 3 and fit_f and n:  # too few rows for two factors: the one of what dominates
        fit_f, n = (True, 0) if latency.sum() >= transfer.sum() else (False, n)
    if not fit_f and not n:
        return 1.0, 1.0, 0
    lo = [LATENCY_RANGE[0]] * fit_f + [1 / EFFICIENCY_RANGE[1]] * bool(n)
    hi = [LATENCY_RANGE[1]] * fit_f + [1 / EFFICIENCY_RANGE[0]] * bool(n)

    def unpack(x: np.ndarray) -> tuple:
        return (x[0] if fit_f else 1.0), (x[-1] if n else 1.0)

    def residuals(x: np.ndarray) -> np.ndarray:
        f, inv_e = unpack(x)
        return (f * latency + inv_e * transfer) / measured - 1.0

    found = least_squares(residuals, [1.0] * (fit_f + bool(n)), bounds=(lo, hi), loss="soft_l1", f_scale=0.05,
                          x_scale="jac", ftol=1e-12, xtol=1e-12, gtol=1e-12)
    f, inv_e = unpack(found.x)
    return float(1.0 / inv_e), float(f), n


def fit_tables(tables: Sequence[Table], cluster: Cluster, choices: Optional[Sequence[tuple]] = None,
               source: str = "", per_algorithm: bool = True) -> Fit:
    """Fit the fabric's calibration to ``tables``; ``choices`` are per-table ``(algorithms,
    protocols)`` name sets (None: NCCL's own choice), as the runs' NCCL_ALGO / NCCL_PROTO set them."""
    if cluster.backend != "nccl" or cluster.fabric is None:
        raise TopologyError("backend", "calibrating from nccl-tests needs an NCCL cluster (a machine: or gpu: key)")
    if not tables:
        raise TopologyError("tables", "give at least one nccl-tests output")
    choices = list(choices) if choices is not None else [(None, None)] * len(tables)
    version, constants = cluster.fabric.calibration.version, cluster.fabric.calibration.measured
    spec = dataclasses.replace(cluster.fabric, calibration=Calibration(version=version, measured=constants))
    comms = [table_comm(spec, table)[1] for table in tables]
    noise = [spikes(table) for table in tables]
    steady = [dataclasses.replace(table, rows=tuple(r for r in table.rows if r not in noisy))
              for table, noisy in zip(tables, noise)]
    decomposed = [r for table, comm, choice in zip(steady, comms, choices) for r in decompose(table, comm, choice)]
    priors = fit_measured(decomposed, source or "whatif calibrate nccl-tests", fit_efficiency=True,
                          prior=spec.calibration.constants)
    base = Calibration(version=version, measured=priors)
    groups: dict = {}
    for table, comm, choice in zip(steady, comms, choices):
        for row in table.rows:
            found = _predict(comm, table.op, row.size_bytes, choice, base)
            host = table_time_us(table, comm, found, priors)
            if host > found.time_us and row.time_us >= host:
                continue  # the benchmark's host thread, not the fabric, set this row's time
            key = (found.option.link, found.option.algorithm, found.option.protocol,
                   factor_nodes(found.option.algorithm, comm.n_nodes))
            groups.setdefault(key, []).append((found.latency_us, found.transfer_us, row.time_us))
    fitted = []
    for key, items in sorted(groups.items()) if per_algorithm else ():
        latency, transfer, measured = (np.array(column, dtype=float) for column in zip(*items))
        e, f, _ = _solve(latency, transfer, measured)
        fitted.append((*key[:3], e, f, len(items), key[3]))
    calibration = Calibration(tuple((*row[:5], row[6]) for row in fitted), source, version, priors)
    calibrated = dataclasses.replace(cluster, fabric=dataclasses.replace(cluster.fabric, calibration=calibration))
    rows, diagnoses = [], []
    for table, comm, choice, noisy in zip(tables, comms, choices, noise):
        for row in table.rows:
            found = _predict(comm, table.op, row.size_bytes, choice, calibration)
            rows.append(FittedRow(table.path, row.line, row.size_bytes, row.time_us,
                                  table_time_us(table, comm, found, priors), found.option.algorithm,
                                  found.option.protocol))
        note = diagnose(table, comm, choice)
        if note:
            diagnoses.append(note)
        if noisy:
            diagnoses.append(f"{table.path}: {len(noisy)} row{'s' * (len(noisy) > 1)} left out of the fit "
                             f"({', '.join(_size(r.size_bytes) for r in noisy)}): the out-of-place and in-place runs "
                             f"differ by more than {TWIN_RATIO}x, so one of them met something else")
    left_out = tuple((table.path, r.size_bytes) for table, noisy in zip(tables, noise) for r in noisy)
    return Fit(calibrated, tuple(rows), tuple(fitted), tuple(diagnoses), left_out)


def factor_nodes(algorithm: str, n_nodes: int) -> str:
    """The node-count class a factor fitted on ``algorithm`` across ``n_nodes`` nodes is kept to
    (:func:`~whatif.topology.fabric.node_class`; "" for any). A ring is the same cycle at every
    node count, so what it misses carries; a tree is not: across two nodes NCCL's two trees are
    each one edge between them and its tuner reads its two-node ceilings (``tuning.cc``'s N2
    column), from three nodes a node's NIC serves a parent and two children under the N4 column,
    so a tree's misfit on two nodes says nothing of it on more, nor the other way."""
    return node_class(n_nodes) if algorithm in TREE_SHAPED else ""


def spikes(table: Table) -> tuple:
    """The rows of ``table`` that one of its two runs contradicts: nccl-tests times the same
    collective out of place and in place, one after the other, and where the two differ by more
    than TWIN_RATIO one of them met something else (another job, a retransmission, a page
    fault), not the collective's own cost. Model-free: no prediction is involved."""
    return tuple(row for row in table.rows if row.in_place_us
                 and max(row.time_us, row.in_place_us) > TWIN_RATIO * min(row.time_us, row.in_place_us))


def disturbed(table: Table) -> str:
    """A plain sentence when ``table``'s run as a whole was disturbed ('' if not), from the table
    alone: a collective moves every byte of a smaller one and more, so NCCL never takes
    markedly longer for a size than for twice or more that size; where a row does by more than
    TWIN_RATIO in both its runs (out of place and, where printed, in place: not a spike of one
    run), something outside the collective set the times. Rows one run contradicts (``spikes``)
    do not count, they are noise of one run."""
    steady = sorted((r for r in table.rows if r not in spikes(table)), key=lambda r: r.size_bytes)
    worst = None
    for i, row in enumerate(steady):
        for later in steady[i + 1:]:
            if later.size_bytes < 2 * row.size_bytes:
                continue
            ratios = [row.time_us / later.time_us]
            if row.in_place_us and later.in_place_us:
                ratios.append(row.in_place_us / later.in_place_us)
            if min(ratios) > TWIN_RATIO and (worst is None or min(ratios) > min(worst[0])):
                worst = (ratios, row, later)
    if worst is None:
        return ""
    ratios, row, later = worst
    runs = " and ".join(f"{r:.1f}x" for r in ratios) + (" (out of place and in place)" if len(ratios) > 1 else "")
    return (f"{table.path}: this run looks disturbed: {_size(row.size_bytes)} took {runs} as long as "
            f"{_size(later.size_bytes)}, which a collective's own cost never does; rerun it with the nodes and "
            f"the network otherwise idle")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def diagnose(table: Table, comm: Comm, choice: tuple = (None, None)) -> str:
    """A plain sentence when ``table``'s largest row is far below what the specs promise ('' if not)."""
    row = max(table.rows, key=lambda r: r.size_bytes)
    if row.size_bytes < DIAGNOSED_BYTES:
        return ""  # a latency sweep says nothing of the bandwidth
    n = table.n_ranks or comm.n_ranks
    spec = _predict(comm, table.op, row.size_bytes, choice, Calibration(version=comm.fabric.calibration.version,
                                                                         measured=SPEC))
    measured_bus = row.size_bytes / row.time_us / 1e3 * bus_factor(table.op, n)
    spec_bus = row.size_bytes / spec.time_us / 1e3 * bus_factor(table.op, n)
    ratio = measured_bus / spec_bus
    if ratio >= UNDERPERFORMING:
        return ""
    fabric = comm.fabric
    if comm.n_nodes > 1:
        nics = comm.node_nics * (fabric.nics_per_machine // fabric.gpus_per_machine if fabric.fused else 1)
        bound = f"{nics} x {as_gbps(fabric.nic.bandwidth_bytes_per_us):.0f} Gb/s NICs"
        advice = "check NICs and routing"
    else:
        link = f"{as_gigabytes_per_s(fabric.gpu.nvlink_total_bytes_per_us):.0f} GB/s NVLink" if fabric.nvlink else "PCIe"
        bound = f"{comm.ppn} {fabric.gpu.name} GPUs' {link}"
        advice = "check NVLink/PCIe health and GPU clocks (nvidia-smi topo -m, nvidia-smi -q)"
    return (f"{table.path}: this network delivers {ratio * 100:.0f} % of the {spec.option.algorithm} bound of {bound} "
            f"({measured_bus:.0f} of {spec_bus:.0f} GB/s bus bandwidth at {row.size_bytes / 2**20:.0f} MiB): {advice}")
