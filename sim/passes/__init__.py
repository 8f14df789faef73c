"""Passes: transformations of a dependency graph, each taking a graph and returning a new one.

A pass reads only the graph (its tasks and edges, and the operators and the job's record it
carries, ``sim/workload.py``) and its own parameters, never the trace. One module per family:

* ``optimizations``: Daydream's what-ifs (mixed precision, a fused optimizer, a faster GPU, no
  data loading) and the registry of named optimizations that ``--optimization NAME`` and a
  scenario's ``optimizations:`` look up;
* ``batch_size``: the iteration rebuilt at another batch size (the DLRM performance model);
* ``profiler_overhead``: the profiler's own cost taken out of a profiled trace;
* ``shared_memory``: each CPU task's memory traffic, and its slowdown beside peers that share
  its memory system;
* ``stream_waits``: the waits of one GPU stream for another that the trace did not record, where
  a collective's delay must reach the compute stream (the ranks of a job);
* ``operator_units``: not a pass, the view of the operator table that the shape-driven passes
  read (the unit an operator performance model times).
"""
