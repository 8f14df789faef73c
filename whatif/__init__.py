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

import importlib

#: Where each name of the facade lives. A name is imported the first time it is used (PEP 562),
#: so that ``import whatif.collectors.kineto`` (``whatif replay``) does not import the pipeline,
#: the cluster simulation and pandas with it.
_HOME = {
    "Diagnostics": "whatif.collectors.diagnostics",
    "InputWarning": "whatif.collectors.diagnostics",
    "StrictError": "whatif.collectors.diagnostics",
    "collecting": "whatif.collectors.diagnostics",
    "TraceError": "whatif.collectors.kineto",
    "load_trace": "whatif.collectors.load",
    "Prediction": "whatif.pipeline",
    "Request": "whatif.pipeline",
    "WhatIf": "whatif.pipeline",
    "predict": "whatif.pipeline",
    "Scenario": "whatif.scenario",
    "ScenarioError": "whatif.scenario",
    "build_graph": "whatif.sim.build",
    "ClusterConfig": "whatif.sim.distributed",
    "Policy": "whatif.sim.engine",
    "simulate": "whatif.sim.engine",
    "GraphError": "whatif.sim.graph",
    "TaskGraph": "whatif.sim.graph",
    "TaskKind": "whatif.sim.graph",
    "TraceStudy": "whatif.study",
    "Cluster": "whatif.topology",
    "load_cluster": "whatif.topology",
}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'whatif' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted([*globals(), *_HOME])


__all__ = sorted(_HOME)
