"""The first stage of every prediction: a trace loaded, its dependency graph and its iterations.

``TraceStudy.from_trace`` reads a Kineto trace or a capture bundle (``collectors/load.py``),
builds Daydream's dependency graph from it (``sim/build.py``), both kept for the next command on
the same trace (``whatif/graph_cache.py``), and finds its iterations
(``collectors/iterations.py``). The graph is never modified: the passes of
``whatif/pipeline.py`` return new ones. Its replay, the unmodified graph simulated, is made the
first time it is asked for, and kept.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import pandas as pd

from whatif.collectors.iterations import find_iterations, whole_trace_note
from whatif.collectors.kineto import KinetoTrace
from whatif.report.iterations import iteration_report
from whatif.sim.engine import Schedule, simulate
from whatif.sim.graph import TaskGraph

from .graph_cache import read_and_build


@dataclass
class TraceStudy:
    """A loaded trace with its dependency graph and iterations."""

    trace: KinetoTrace
    graph: TaskGraph
    iterations: pd.DataFrame

    @classmethod
    def from_trace(cls, path: Path, iteration: Optional[str] = None) -> "TraceStudy":
        """``path`` (a trace file or a bundle folder) loaded; ``iteration`` is the annotation that
        marks an iteration (default: ``ProfilerStep#N``). A trace without ``ProfilerStep#N``
        ranges is one iteration, which is said on stderr with the annotations that could split it
        (``collectors.iterations.whole_trace_note``)."""
        trace, graph = read_and_build(path)
        iterations = find_iterations(trace, iteration)
        note = whole_trace_note(trace, iterations) if iteration is None else ""
        if note:
            print(f"whatif: note: {note}", file=sys.stderr)
        return cls(trace, graph, iterations)

    @cached_property
    def replay(self) -> Schedule:
        """The unmodified graph simulated."""
        return simulate(self.graph)

    def replay_report(self) -> pd.DataFrame:
        """Every iteration measured against replayed (``report.iterations.iteration_report``)."""
        return iteration_report(self.replay, self.iterations)
