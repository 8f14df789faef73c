"""The first stage of every prediction: a trace loaded, its dependency graph and its iterations.

``TraceStudy.from_trace`` reads a Kineto trace or a capture bundle (``collectors/load.py``),
builds Daydream's dependency graph from it (``sim/build.py``), both kept for the next command on
the same trace (``whatif/graph_cache.py``), and finds its iterations
(``collectors/iterations.py``). The graph is never modified: the passes of
``whatif/pipeline.py`` return new ones. Its replay, the unmodified graph simulated, is made the
first time it is asked for, and kept (and kept with the graph in the cache, for the next command).
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

from .graph_cache import keep_replay, kept_replay, read_build_and_key


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
        trace, graph, key = read_build_and_key(path)
        iterations = find_iterations(trace, iteration)
        note = whole_trace_note(trace, iterations) if iteration is None else ""
        if note:
            print(f"whatif: note: {note}", file=sys.stderr)
        study = cls(trace, graph, iterations)
        study._kept = (key, graph)  # the graph cache's entry, for as long as the study holds that graph
        return study

    @cached_property
    def replay(self) -> Schedule:
        """The unmodified graph simulated: the one kept with the graph in the cache where there
        is one, else simulated here (and kept there)."""
        key, graph = getattr(self, "_kept", (None, None))
        key = key if graph is self.graph else None
        kept = kept_replay(key, len(self.graph.tasks)) if key else None
        if kept is not None:
            return Schedule(self.graph, kept["start_us"], kept["end_us"], kept["simpy_events"], kept["wall_s"])
        schedule = simulate(self.graph)
        if key:
            keep_replay(key, schedule.start_us, schedule.end_us, schedule.simpy_events, schedule.wall_s)
        return schedule

    def replay_report(self) -> pd.DataFrame:
        """Every iteration measured against replayed (``report.iterations.iteration_report``)."""
        return iteration_report(self.replay, self.iterations)
