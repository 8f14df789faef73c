"""A collective as data: steps of concurrent point-to-point transfers.

A :class:`Plan` is what a collective algorithm does on the wire, independent of how long it
takes: a list of steps, each a set of transfers ``(src, dst, nbytes)`` between endpoints of a
:class:`~whatif.topology.cluster.Cluster` that run at the same time. A step starts when every
transfer of the step before it has arrived. ``collectives.py`` writes plans, ``network.py``
times them; :func:`nic_traffic` counts what crosses each NIC, which needs no timing at all.

Steps keep their transfers as three numpy arrays, because a 512-GPU ring all-reduce has a
thousand steps of 512 transfers; identical steps share the same arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union

import numpy as np

from .cluster import Cluster
from .units import TopologyError


def _frozen(values, dtype) -> np.ndarray:
    array = np.array(values, dtype=dtype, copy=True).reshape(-1)
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class Step:
    """Concurrent transfers: transfer ``i`` sends ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "src", _frozen(self.src, np.int64))
        object.__setattr__(self, "dst", _frozen(self.dst, np.int64))
        nbytes = _frozen(np.broadcast_to(np.asarray(self.nbytes, dtype=np.float64), self.src.shape), np.float64)
        object.__setattr__(self, "nbytes", nbytes)
        if self.dst.shape != self.src.shape:
            raise TopologyError("step", f"{len(self.src)} sources but {len(self.dst)} destinations")
        if len(nbytes) and not (np.all(np.isfinite(nbytes)) and nbytes.min() >= 0):
            raise TopologyError("step", "transfer sizes must be finite and not negative")

    @classmethod
    def of(cls, transfers: Iterable) -> "Step":
        """A step from ``(src, dst, nbytes)`` tuples."""
        rows = list(transfers)
        if not rows:
            return cls(np.empty(0), np.empty(0), np.empty(0))
        src, dst, nbytes = zip(*rows)
        return cls(src, dst, nbytes)

    def transfers(self) -> list:
        """The transfers as ``(src, dst, nbytes)`` tuples."""
        return list(zip(self.src.tolist(), self.dst.tolist(), self.nbytes.tolist()))

    def __len__(self) -> int:
        return len(self.src)

    @property
    def total_bytes(self) -> float:
        return float(self.nbytes.sum())


@dataclass(frozen=True, eq=False)
class Plan:
    """The steps of one collective on ``size_bytes`` bytes per GPU, produced by ``algorithm``."""

    algorithm: str
    size_bytes: float
    steps: tuple

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def total_bytes(self) -> float:
        """Bytes sent over all links by all transfers."""
        return float(sum(step.total_bytes for step in self.steps))

    @property
    def n_transfers(self) -> int:
        return sum(len(step) for step in self.steps)


@dataclass(frozen=True)
class NicTraffic:
    """Bytes and transfers through each machine's NIC, per direction, indexed by machine."""

    egress_bytes: np.ndarray
    ingress_bytes: np.ndarray
    egress_transfers: np.ndarray
    ingress_transfers: np.ndarray

    @property
    def max_bytes(self) -> float:
        """Bytes through the busiest NIC direction."""
        return float(max(self.egress_bytes.max(initial=0.0), self.ingress_bytes.max(initial=0.0)))


def nic_traffic(what: Union[Plan, Step], cluster: Cluster) -> NicTraffic:
    """What ``what`` (a plan or one step) sends through each NIC of ``cluster``.

    Only transfers between machines cross NICs; the sender's NIC carries them out, the
    receiver's in.
    """
    steps = what.steps if isinstance(what, Plan) else (what,)
    m = cluster.n_machines
    out_b, in_b = np.zeros(m), np.zeros(m)
    out_n, in_n = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for step in steps:
        src_m, dst_m = cluster.machine_of(step.src), cluster.machine_of(step.dst)
        cross = src_m != dst_m
        out_b += np.bincount(src_m[cross], step.nbytes[cross], minlength=m)
        in_b += np.bincount(dst_m[cross], step.nbytes[cross], minlength=m)
        out_n += np.bincount(src_m[cross], minlength=m)
        in_n += np.bincount(dst_m[cross], minlength=m)
    return NicTraffic(out_b, in_b, out_n, in_n)
