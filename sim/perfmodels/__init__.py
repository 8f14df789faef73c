"""Operator performance models: how long an operator takes at shapes never traced.

Following the DLRM performance model (Lin et al., 2022; ``shared/seeds/002``), operators are
grouped into families and each family gets a model from input shapes to duration on one device:

- a heuristic roofline for the regular ones (GEMM-like, convolution, element-wise, normalisation,
  attention): ``t = overhead + max(FLOPs / (peak * e_compute), bytes / (bandwidth * e_memory))``,
  with the device's peak compute and memory bandwidth measured by the microbenchmark sweep
  and the overhead and the two efficiencies fitted per operator (per family where an operator
  has too few samples) by least squares in log space, so a 5 us operator weighs as much as a
  5 ms one. GEMMs and convolutions, which move their operands before computing on them, add the
  two terms instead of taking their max. Normalisations, reductions, pooling, batched GEMMs and
  PyTorch's own convolution kernel add ``loops * per_loop``: their kernels restart a loop per
  row, channel, image plane, matrix or image, and a layer norm over rows of 32 values spends as
  long starting rows as reading them;
- then, in every family, gradient-boosted trees (LightGBM) learn the roofline's residual
  ``log(measured / roofline)`` from the shapes: what FLOPs and bytes do not say (a GEMM with a
  narrow side, a batch norm over 1 x 1 images, a working set larger than the last-level cache,
  an embedding's index pattern). They are kept where they beat the roofline on training samples
  they were not fitted on (each quarter predicted from the other three; on a few noisy samples
  trees learn the noise).
  Learning the residual rather than the duration keeps the roofline's scaling outside the
  shapes the trees saw, where trees alone would predict a constant.

The package, bottom up (each module imports only those above it, and none imports torch or
starts a benchmark when imported):

- :mod:`~whatif.sim.perfmodels.shapes`: a recorded call's shapes and scalar arguments, and the
  operator calls of a trace that a model times;
- :mod:`~whatif.sim.perfmodels.work`: the operator families, and the FLOPs, bytes, loops and
  kernel path of a call;
- :mod:`~whatif.sim.perfmodels.device`: the device at hand, as a models file names it;
- :mod:`~whatif.sim.perfmodels.models`: :class:`~whatif.sim.perfmodels.models.Roofline`,
  :class:`~whatif.sim.perfmodels.models.FamilyModel`,
  :class:`~whatif.sim.perfmodels.models.PerfModels` and the JSON models file;
- :mod:`~whatif.sim.perfmodels.fit`: fitting from samples (the sweep's, a CPU trace's), and the
  held-out evaluation;
- :mod:`~whatif.sim.perfmodels.cache`: this machine's default models, cached;
- :mod:`~whatif.sim.perfmodels.sweep`: the torch microbenchmarks the models are fitted from,
  layered on top: only the commands that fit (``whatif perfmodel fit``) import it;
  :mod:`~whatif.sim.perfmodels.sweep_cases` draws the calls it times.
"""
