"""whatif: predict what an optimization or a cluster would do to DNN training time, from a
profiler trace of one GPU (Daydream's dependency graph, simulated with SimPy)."""

from whatif.collectors.kineto import TraceError
from whatif.collectors.load import load_trace
from whatif.sim.build import build_graph
from whatif.sim.engine import Policy, simulate
from whatif.sim.graph import GraphError, TaskGraph, TaskKind
from whatif.study import TraceStudy, WhatIf

__all__ = [
    "GraphError",
    "Policy",
    "TaskGraph",
    "TaskKind",
    "TraceError",
    "TraceStudy",
    "WhatIf",
    "build_graph",
    "load_trace",
    "simulate",
]
