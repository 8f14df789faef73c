"""What a data-parallel framework is to the cluster simulation, and the pieces frameworks share.

A framework (one module each beside this one, named in the registry of ``__init__.py``) holds
in one place everything that differs between DDP, Horovod and a parameter server:

* its **messages**: what it sends for one iteration's gradients, in the order they become ready
  (DDP's buckets, Horovod's tensors, a parameter server's partitions), each a :class:`Message`;
  with the P3 policy (Jayarajan et al., MLSys 2019) every message is cut into slices of at
  most ``slice_bytes`` and, as in P3's MXNet implementation, parameters are synchronised layer
  by layer;
* where they go: the **collective** each phase of a message runs (``topology.collective_cost``:
  ``all_reduce``, or a parameter server's ``push`` and ``pull``) and the network **queue** it
  waits in;
* its **queue policy**, wrapped around the generic ones of ``sim/policies.py`` (FIFO, P3's
  priorities): Horovod's cycle and fusion;
* its **synchronisation points**: which task of the worker graph waits for a message (the
  optimizer's first kernel, ``optimizer.step()`` on the CPU, or the next forward use of a layer;
  ``sync_points.py`` finds them);
* its **copies** on CPU workers (``copies.py``) and its own **CPU costs** (Horovod's background
  loop).

``sim/distributed.py`` stitches the worker graphs to the network by asking the framework; it
names no framework itself.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd

from whatif.topology import Cluster, TopologyError, parse_latency, parse_size

from ..engine import Policy
from ..gradients import Gradient, Gradients
from ..graph import TaskGraph
from .sync_points import SyncPoints


@dataclass(frozen=True)
class FrameworkOptions:
    """The knobs of the frameworks, with their documented defaults."""

    bucket_cap_bytes: float = 25 * 1024 * 1024
    first_bucket_bytes: float = 1 * 1024 * 1024
    fusion_buffer_bytes: float = 64 * 1024 * 1024
    cycle_time_us: float = 5000.0
    partition_bytes: float = 4 * 1024 * 1024
    slice_bytes: float = 1 * 1024 * 1024

    #: The names a scenario's ``framework_options`` gives them: ``cycle_time`` is a duration
    #: (``5ms``), the rest sizes (``25MB``).
    CONFIG_KEYS = {
        "bucket_cap": "bucket_cap_bytes",
        "first_bucket": "first_bucket_bytes",
        "fusion_buffer": "fusion_buffer_bytes",
        "cycle_time": "cycle_time_us",
        "partition": "partition_bytes",
        "slice": "slice_bytes",
    }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], key: str = "framework_options") -> "FrameworkOptions":
        """The options a mapping of :data:`CONFIG_KEYS` sets, the defaults for the rest; a bad
        value is a :class:`~whatif.topology.TopologyError` naming its key under ``key``."""
        values = {}
        for name, value in config.items():
            if name not in cls.CONFIG_KEYS:
                close = difflib.get_close_matches(str(name), list(cls.CONFIG_KEYS), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(cls.CONFIG_KEYS)}"
                raise TopologyError(f"{key}.{name}", f"unknown key{hint}")
            where = f"{key}.{name}"
            values[cls.CONFIG_KEYS[name]] = parse_latency(value, where) if name == "cycle_time" else parse_size(value, where)
        for field_name, value in values.items():
            if value <= 0:
                raise TopologyError(key, f"{field_name} must be positive")
        return cls(**values)


@dataclass
class Message:
    """A piece of communication: ready after every task in ``ready_after`` (per worker graph);
    ``priority`` is the forward-pass position of its first parameter (0 = needed first)."""

    name: str
    nbytes: float
    ready_after: list[int]
    priority: int
    iteration: int
    phase: str = "allreduce"  # or "push" / "pull"
    follows: Optional[int] = None  # index of the message this one must wait for (pull after push)
    layers: list[int] = field(default_factory=list)  # forward positions of its gradients


class Framework:
    """A data-parallel framework: an all-reduce framework unless a subclass says otherwise.

    Class attributes: ``name`` (its name in the registry and in scenarios); ``phases`` (the
    phases its messages go through, each on a queue of its own); ``layerwise`` (the next forward
    use of a layer waits for that layer's messages, not the optimizer for all of them);
    ``queues_overlap`` (its queues run collectives at the same time, so by default they are
    timed on shared links); ``spins_while_waiting`` (the training thread polls, keeping its
    core busy, while it waits for communication); ``optimizer_waits_on_gpu`` (what waits for
    the messages is the optimizer's first kernel, not ``optimizer.step()`` on the CPU).
    """

    name: str = ""
    phases: tuple = ("allreduce",)
    layerwise: bool = False
    queues_overlap: bool = False
    spins_while_waiting: bool = False
    optimizer_waits_on_gpu: bool = False

    # -- messages ---------------------------------------------------------------------------------

    def messages(self, gradients: list[Gradient], options: FrameworkOptions, sliced: bool) -> list[Message]:
        """One iteration's messages, in the order the framework hands them to the network."""
        if not gradients:
            return []
        count = len(gradients)
        forward = {id(g): count - 1 - i for i, g in enumerate(gradients)}  # last ready = first layer
        messages = self.split(gradients, forward, options)
        if sliced:
            messages = slices(messages, options.slice_bytes)
        return self.on_the_wire(messages)

    def split(self, gradients: list[Gradient], forward: dict, options: FrameworkOptions) -> list[Message]:
        """The gradients as messages; ``forward`` maps a gradient's ``id`` to its forward position."""
        raise NotImplementedError

    def on_the_wire(self, messages: list[Message]) -> list[Message]:
        """The messages as the network sees them, each phase of each a message of its own."""
        return messages

    # -- the network --------------------------------------------------------------------------------

    def collective(self, phase: str, algorithm: str) -> tuple[str, Optional[str]]:
        """The collective (``topology.collective_cost``'s op) and its algorithm for a message of
        ``phase``; ``algorithm`` is the one the user chose for all-reduces."""
        return "all_reduce", algorithm

    def queue(self, phase: str) -> str:
        """The network resource that messages of ``phase`` queue on."""
        return "network"

    def queue_policy(self, inner: Policy, nbytes: Sequence[float], priced: Sequence[float], options: FrameworkOptions,
                     cost_us: Callable[[float], float], pass_bytes_per_us: Optional[float], sliced: bool) -> Policy:
        """The policy of a queue, around ``inner`` (FIFO, or P3's priorities): ``nbytes`` and
        ``priced`` are each message's bytes and the bytes it costs (more under CPU contention)."""
        return inner

    # -- the worker ---------------------------------------------------------------------------------

    def waiter(self, sync: SyncPoints, iteration: int, message: Message, layerwise: bool, layers: int) -> Optional[int]:
        """The task of the worker graph that waits for ``message`` of ``iteration`` (None: only
        the end of the training step); ``layers`` is the iteration's number of gradients."""
        if layerwise:
            return sync.next_forward_use(iteration, message, layers)
        return sync.optimizer(iteration, on_gpu=self.optimizer_waits_on_gpu)

    def add_copies(self, worker: TaskGraph, gradients: Gradients, sync: SyncPoints, iterations: pd.DataFrame,
                   pass_bytes_per_us: Optional[float], layerwise: bool) -> tuple[TaskGraph, Gradients, dict]:
        """The worker with the framework's copies of the gradients on a CPU worker (``copies.py``;
        ``pass_bytes_per_us`` None: not simulated), its gradients as the network gets them, and
        the tasks that wait for an iteration's communication instead of :meth:`waiter`'s, by
        iteration."""
        return worker, gradients, {}

    def add_cpu_costs(self, worker: TaskGraph, cluster: Cluster, options: FrameworkOptions) -> TaskGraph:
        """The worker with the CPU time the framework's own threads take from it."""
        return worker


def slices(messages: list[Message], slice_bytes: float) -> list[Message]:
    """P3's slices: every message cut into equal pieces of at most ``slice_bytes``."""
    out = []
    for m in messages:
        pieces = max(1, int(-(-m.nbytes // slice_bytes)))
        for p in range(pieces):
            out.append(
                Message(f"{m.name} slice {p}", m.nbytes / pieces, m.ready_after, m.priority, m.iteration, layers=m.layers)
            )
    return out
