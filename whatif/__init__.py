"""whatif: predict what an optimization or a cluster would do to DNN training time, from a
profiler trace of one GPU (Daydream's dependency graph, simulated with SimPy).

Where the code is. The package is put together from the repository's top-level folders by
``pyproject.toml``'s ``package-dir``, so ``whatif.sim.engine`` is ``sim/engine.py`` (there is no
``whatif/sim/``)::

    whatif.collectors  collectors/  getting data in: traces, bundles, iterations, capture; XSP
    whatif.topology    topology/    clusters, links (presets as data), collectives and their cost
    whatif.sim         sim/         graph, passes, engine, policies, critical path, frameworks,
                                    the cluster simulation, operator performance models
    whatif.report      report/      iteration tables, cluster breakdown, plots, timelines
    whatif             whatif/      this facade: the pipeline, scenarios, the command line
    whatif.lab         lab/         real runs on an emulated cluster (the simulator never
                                    imports it)

How a prediction flows (``whatif/pipeline.py``, one function for every command)::

    trace or bundle --collectors--> events --sim.build--> TaskGraph
        --sim.passes--> worker graph --sim.distributed, topology--> cluster graph
        --sim.engine--> Schedule --report--> tables, plots, timelines

The user's API is below: load a trace (:class:`TraceStudy`), ask the pipeline (:class:`Request`,
:func:`predict`, a :class:`Prediction`), or write the request as a scenario
(:class:`Scenario`); :func:`simulate` runs any :class:`TaskGraph` a pass returns. Input a
prediction leaves out (events with a negative duration, a pattern that matches nothing) comes as
an :class:`InputWarning` through Python's ``warnings``, or, inside ``with collecting(d)``, into
the :class:`Diagnostics` ``d`` (``Diagnostics(strict=True)`` raises :class:`StrictError`).
"""

from whatif.collectors.diagnostics import Diagnostics, InputWarning, StrictError, collecting
from whatif.collectors.kineto import TraceError
from whatif.collectors.load import load_trace
from whatif.pipeline import Prediction, Request, WhatIf, predict
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.build import build_graph
from whatif.sim.distributed import ClusterConfig
from whatif.sim.engine import Policy, simulate
from whatif.sim.graph import GraphError, TaskGraph, TaskKind
from whatif.study import TraceStudy
from whatif.topology import Cluster, load_cluster

__all__ = [
    "Cluster",
    "ClusterConfig",
    "Diagnostics",
    "GraphError",
    "InputWarning",
    "Policy",
    "Prediction",
    "Request",
    "Scenario",
    "ScenarioError",
    "StrictError",
    "TaskGraph",
    "TaskKind",
    "TraceError",
    "TraceStudy",
    "WhatIf",
    "build_graph",
    "collecting",
    "load_cluster",
    "load_trace",
    "predict",
    "simulate",
]
