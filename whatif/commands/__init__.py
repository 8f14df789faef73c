"""The ``whatif`` commands, one module per group of them.

A command module has ``add_parsers(subparsers)``, which adds its commands to ``whatif``'s
subparsers, and ``run(args)``, which runs the one parsed and returns the exit status; where it
raises errors of its own that the user should see as one line, it lists them in ``ERRORS``.
``whatif/cli.py`` registers the modules, a line each (the lab's ``lab/cli.py`` too):

* ``simulate``: ``replay`` and ``simulate``, one trace predicted for one worker;
* ``perfmodel``: ``perfmodel fit`` and ``perfmodel report``, the operator models;
* ``explain``: ``critical-path`` and ``overheads``, what a trace's time is made of;
* ``predict``: a scenario's grid of clusters;
* ``capture``: ``collect`` and ``profile``, which run a training script and record it.

The predictions go through ``whatif/pipeline.py``; the tables come from ``report/``.
"""

from __future__ import annotations

from pathlib import Path

from whatif.collectors.diagnostics import plural

#: Above this many workers' graphs simulated over a scenario's grid (summed over its
#: configurations), ``whatif predict`` and ``whatif advise`` ask for ``--yes``: a few thousand take
#: minutes. Identical workers are simulated once, so this counts graphs, not GPUs.
MAX_GRID_WORKERS = 2048


class UsageError(Exception):
    """A command-line value that is well-formed for argparse but means nothing."""


def add_trace_options(parser, ranks: bool = False) -> None:
    """The argument and options of the commands that read one trace (``ranks``: or a job's
    per-rank traces, a folder of them or several files)."""
    if ranks:
        parser.add_argument("trace", type=Path, nargs="+", help="PyTorch profiler (Kineto) trace (.json or .json.gz), "
                            "or a bundle folder; or a job's per-rank traces: a folder of them, or several files")
    else:
        parser.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder")
    parser.add_argument("--iteration", metavar="NAME", help="annotation that marks an iteration (default: ProfilerStep#N)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--timeline", type=Path, metavar="OUT.json.gz",
                        help="write the simulated timeline (a gzip-compressed Chrome trace: Perfetto opens it)")


def refuse_inputs(path: Path, inputs: tuple) -> None:
    """Refuse to write ``path`` where it is one of the command's ``inputs``, by any spelling."""
    if any(path.resolve() == Path(p).resolve() for p in inputs):
        raise UsageError(f"{path}: refusing to overwrite an input file")


def simulated_graphs(config) -> int:
    """How many workers' graphs one configuration simulates: the kinds of worker that decide
    (``sim/distributed.py``'s ``simulated_workers``: one where every worker is alike, every one
    with ``replicate: true``), or for a parallel job rank 0's graph, which holds every pipeline
    stage."""
    from whatif.sim.distributed import simulated_workers  # the simulator's imports, only when asked
    from whatif.sim.parallel import is_parallel_job

    if is_parallel_job(config.parallelism):
        return config.parallelism.pipeline

    return len(simulated_workers(config))


def check_grid_size(path: Path, scenario, yes: bool) -> None:
    """Refuse a scenario whose grid simulates more than :data:`MAX_GRID_WORKERS` workers' graphs
    in all (:func:`simulated_graphs`; a multi-rank job's every rank), before any of it runs,
    unless ``yes`` (the command's ``--yes``)."""
    if scenario.job_traces:
        graphs = sum(point.cluster.n_gpus for point in scenario.points)
    else:
        graphs = sum(simulated_graphs(config) for config in scenario.request().clusters)
    if graphs > MAX_GRID_WORKERS and not yes:
        gpus = sum(point.cluster.n_gpus for point in scenario.points)
        raise UsageError(f"{path}: the grid simulates {graphs} workers' graphs ({gpus} GPUs) over "
                         f"{plural(len(scenario.points), 'configuration')}, more than {MAX_GRID_WORKERS} "
                         "(minutes to hours); pass --yes to run it anyway")
