"""Data-parallel frameworks: what they send for a step's gradients, and what waits for it.

Each framework turns one iteration's gradients (in the order they become ready) into messages
for the communication queue:

* PyTorch DDP (Li et al., VLDB 2020): gradients go into buckets in the order they become ready
  (the reverse of parameter order), 25 MB each except a first bucket of 1 MB; a bucket is
  all-reduced as soon as its last gradient is ready, on a separate stream that overlaps the rest
  of backward. The optimizer's kernels wait for every bucket.
* Horovod (Sergeev & Del Balso, 2018): every gradient is a message; its background thread wakes
  once per cycle (5 ms) and fuses what is ready on every worker into one all-reduce of at most
  the fusion buffer (64 MB). ``optimizer.step()`` blocks the CPU until all are done. The fusion
  itself is a queue policy (``sim.policies.HorovodCycle``).
* Parameter server (BytePS, Jiang et al., OSDI 2020): each gradient is cut into partitions
  (4 MB) that are pushed to the servers and pulled back updated; the next iteration's forward
  use of a parameter waits only for its own pull, which is what lets priorities help.

With the P3 policy (Jayarajan et al., MLSys 2019) messages are cut into slices and, as in its
MXNet implementation, parameters are synchronised layer by layer: the next forward pass of a
layer waits only for that layer's slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .gradients import Gradient

MB = 1e6


@dataclass(frozen=True)
class FrameworkOptions:
    """The knobs of the frameworks, with their documented defaults."""

    bucket_cap_bytes: float = 25 * 1024 * 1024
    first_bucket_bytes: float = 1 * 1024 * 1024
    fusion_buffer_bytes: float = 64 * 1024 * 1024
    cycle_time_us: float = 5000.0
    partition_bytes: float = 4 * 1024 * 1024
    slice_bytes: float = 1 * 1024 * 1024


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


FRAMEWORKS = ("ddp", "horovod", "ps")


def plan_messages(
    gradients: list[Gradient], framework: str, options: FrameworkOptions, sliced: bool
) -> list[Message]:
    """One iteration's messages, in the order the framework hands them to the network."""
    if not gradients:
        return []
    count = len(gradients)
    forward = {id(g): count - 1 - i for i, g in enumerate(gradients)}  # last ready = first layer
    if framework == "ddp":
        messages = _ddp_buckets(gradients, forward, options)
    elif framework == "horovod":
        messages = [
            Message(g.name, g.nbytes, g.ready_after, forward[id(g)], g.iteration, layers=[forward[id(g)]])
            for g in gradients
        ]
    elif framework == "ps":
        messages = _partitions(gradients, forward, options.partition_bytes)
    else:
        raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    if sliced:
        messages = _slices(messages, options.slice_bytes)
    if framework == "ps":
        messages = _push_then_pull(messages)
    return messages


def _ddp_buckets(gradients: list[Gradient], forward: dict, options: FrameworkOptions) -> list[Message]:
    # as PyTorch's Reducer: a bucket closes once it holds at least its cap, keeping the gradient
    # that took it over
    buckets: list[list[Gradient]] = [[]]
    cap = options.first_bucket_bytes
    size = 0.0
    for g in gradients:
        buckets[-1].append(g)
        size += g.nbytes
        if size >= cap:
            buckets.append([])
            size = 0.0
            cap = options.bucket_cap_bytes
    buckets = [b for b in buckets if b]
    return [
        Message(
            f"bucket {i}",
            sum(g.nbytes for g in bucket),
            sorted({t for g in bucket for t in g.ready_after}),
            min(forward[id(g)] for g in bucket),
            bucket[0].iteration,
            layers=[forward[id(g)] for g in bucket],
        )
        for i, bucket in enumerate(buckets)
    ]


def _partitions(gradients: list[Gradient], forward: dict, partition_bytes: float) -> list[Message]:
    out = []
    for g in gradients:
        pieces = max(1, int(-(-g.nbytes // partition_bytes)))
        for p in range(pieces):
            out.append(
                Message(
                    f"{g.name} part {p}",
                    g.nbytes / pieces,
                    g.ready_after,
                    forward[id(g)],
                    g.iteration,
                    layers=[forward[id(g)]],
                )
            )
    return out


def _slices(messages: list[Message], slice_bytes: float) -> list[Message]:
    out = []
    for m in messages:
        pieces = max(1, int(-(-m.nbytes // slice_bytes)))
        for p in range(pieces):
            out.append(
                Message(f"{m.name} slice {p}", m.nbytes / pieces, m.ready_after, m.priority, m.iteration, layers=m.layers)
            )
    return out


def _push_then_pull(messages: list[Message]) -> list[Message]:
    out = []
    for m in messages:
        out.append(Message(f"push {m.name}", m.nbytes, m.ready_after, m.priority, m.iteration, "push", layers=m.layers))
        out.append(
            Message(f"pull {m.name}", m.nbytes, [], m.priority, m.iteration, "pull", follows=len(out) - 1, layers=m.layers)
        )
    return out
