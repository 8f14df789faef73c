"""A parameter server (Li et al., OSDI 2014; BytePS, Jiang et al., OSDI 2020).

Messages: each gradient is cut into partitions (4 MB) that are pushed to the servers and pulled
back updated: every partition (or P3 slice of one) is a push and a pull that waits for it, each
on a network queue of its own (``topology.collective_cost``'s ``push`` and ``pull``). With
servers on the worker machines every NIC pushes and pulls at once, so by default the two
queues' collectives run on links they share (``topology.Network``).

Synchronisation: layer by layer, the next iteration's forward use of a parameter waits only for
its own pull, which is what lets priorities (P3) help.
"""

from __future__ import annotations

from typing import Optional

from ..gradients import Gradient
from .base import Framework, FrameworkOptions, Message


class ParameterServer(Framework):
    name = "ps"
    phases = ("push", "pull")
    layerwise = True
    queues_overlap = True

    def split(self, gradients: list[Gradient], forward: dict, options: FrameworkOptions) -> list[Message]:
        out = []
        for g in gradients:
            pieces = max(1, int(-(-g.nbytes // options.partition_bytes)))
            for p in range(pieces):
                out.append(
                    Message(f"{g.name} part {p}", g.nbytes / pieces, g.ready_after, forward[id(g)], g.iteration,
                            layers=[forward[id(g)]])
                )
        return out

    def on_the_wire(self, messages: list[Message]) -> list[Message]:
        out = []
        for m in messages:
            out.append(Message(f"push {m.name}", m.nbytes, m.ready_after, m.priority, m.iteration, "push", layers=m.layers))
            out.append(
                Message(f"pull {m.name}", m.nbytes, [], m.priority, m.iteration, "pull", follows=len(out) - 1, layers=m.layers)
            )
        return out

    def collective(self, phase: str, algorithm: str) -> tuple[str, Optional[str]]:
        return phase, None

    def queue(self, phase: str) -> str:
        return f"network {phase}"
