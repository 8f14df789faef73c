"""One entry point for users: a trace, its graph, and the what-ifs asked of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from whatif.collectors.iterations import find_iterations
from whatif.collectors.kineto import KinetoTrace
from whatif.collectors.load import load_trace
from whatif.report.iterations import iteration_report
from whatif.sim.build import build_graph
from whatif.sim.engine import Schedule, simulate
from whatif.sim.graph import GraphError, TaskGraph
from whatif.sim.passes.optimizations import apply_optimization


@dataclass
class WhatIf:
    """A set of changes to apply to the graph, in this order: optimizations, scalings, removals.

    ``scale`` maps a regular expression to a duration factor; ``remove`` lists regular
    expressions. Patterns match a task's name and the operators and annotations around it.
    """

    optimizations: Sequence[str] = ()
    scale: Sequence[tuple[str, float]] = ()
    remove: Sequence[str] = ()

    def apply(self, graph: TaskGraph) -> TaskGraph:
        for spec in self.optimizations:
            graph = apply_optimization(graph, spec)
        graph = graph.copy()
        for pattern, factor in self.scale:
            graph.scale(graph.select(pattern=pattern), factor)
        for pattern in self.remove:
            graph.remove(graph.select(pattern=pattern))
        return graph


@dataclass
class TraceStudy:
    """A loaded trace with its dependency graph, iterations and replayed schedule."""

    trace: KinetoTrace
    graph: TaskGraph
    iterations: pd.DataFrame
    replay: Schedule = field(init=False)

    def __post_init__(self):
        self.replay = simulate(self.graph)

    @classmethod
    def from_trace(cls, path: Path, iteration: Optional[str] = None) -> "TraceStudy":
        trace = load_trace(path)
        return cls(trace, build_graph(trace), find_iterations(trace, iteration))

    def replay_report(self) -> pd.DataFrame:
        return iteration_report(self.replay, self.iterations)

    def predict(self, what_if: WhatIf) -> tuple[Schedule, pd.DataFrame]:
        """The schedule of the transformed graph and its per-iteration report, with the
        unmodified replay's prediction beside it (``replay_ms``) and the speed-up over it.
        There is no error column: nothing measured the transformed run."""
        schedule = simulate(what_if.apply(self.graph))
        report = iteration_report(schedule, self.iterations).drop(columns=["error_pct"])
        emptied = report.loc[report["predicted_ms"].isna(), "name"].tolist()
        if emptied:
            raise GraphError(
                f"the what-if removed every task of iteration {emptied[0]!r}"
                + (f" and {len(emptied) - 1} more" if len(emptied) > 1 else "")
                + "; nothing is left to predict"
            )
        report.insert(2, "replay_ms", self.replay_report()["predicted_ms"].to_numpy())
        report["speedup"] = report["replay_ms"] / report["predicted_ms"]
        return schedule, report


__all__ = ["TraceStudy", "WhatIf", "GraphError"]
