"""XSP: leveled, across-stack profiling of a training step (Li et al., "XSP: Across-Stack
Profiling and Analysis of Machine Learning Models on GPUs", IPDPS 2020; ``shared/seeds/003``).

Every profiler slows down the levels above the one it looks at, so the workload runs once per
level of the stack and each level's latencies come from the least intrusive run that measures
them. By concept:

- :mod:`~whatif.collectors.xsp.levels`: the levels (model, layer, operator, kernel), the
  environment that chooses a run's level, and the record files a run writes and their reading.
- :mod:`~whatif.collectors.xsp.measure`: :class:`~whatif.collectors.xsp.measure.LeveledProfile`,
  the measuring at one level inside the training process.
- :mod:`~whatif.collectors.xsp.view`: the runs correlated into one hierarchy model -> layer ->
  operator -> kernel, and each level's overhead.
- :mod:`~whatif.collectors.xsp.session`: ``whatif profile``'s runs of a script at every level,
  and :func:`~whatif.collectors.xsp.session.run_levels` in one process.

The simulator does not use this package; ``whatif profile`` (``whatif/commands/capture.py``) is its
command line.
"""
