"""The optimizations by name, for ``--optimization NAME``, a scenario's ``optimizations:`` and
``whatif advise``: Daydream's built-ins (``optimizations.py``) and its other recipes
(``recipes.py``), each a pass that takes a graph and returns the transformed copy.
"""

from __future__ import annotations

import difflib
from typing import Callable, Optional

import numpy as np

from ..graph import GraphError, TaskGraph
from .optimizations import automatic_mixed_precision, faster_cpu, faster_gpu, fused_optimizer, no_data_loading
from .recipes import (blueconnect, gist_encoding, gradient_compression, metaflow_fusion, restructured_batch_norm,
                      vdnn_offload)

OPTIMIZATIONS: dict[str, Callable] = {
    "amp": automatic_mixed_precision,
    "fused-optimizer": fused_optimizer,
    "faster-gpu": faster_gpu,
    "faster-cpu": faster_cpu,
    "no-dataloader": no_data_loading,
    "restructure-bn": restructured_batch_norm,
    "gradient-compression": gradient_compression,
    "vdnn": vdnn_offload,
    "gist": gist_encoding,
    "metaflow-fusion": metaflow_fusion,
    "blueconnect": blueconnect,
}
#: what users also call an optimization, for the hint of an unknown name (not accepted as names:
#: one spelling each keeps scenarios and reports comparable)
ALSO_CALLED = {"fused-adam": "fused-optimizer", "fused-adamw": "fused-optimizer", "fused-sgd": "fused-optimizer",
               "apex": "fused-optimizer", "mixed-precision": "amp", "fp16": "amp", "bf16": "amp", "half": "amp",
               "autocast": "amp", "compression": "gradient-compression", "powersgd": "gradient-compression",
               "offload": "vdnn", "activation-offload": "vdnn"}
#: the optimizations that take a value (``NAME=VALUE``), what it is, and its least value
VALUED = {"faster-gpu": ("speed-up", 0.0), "faster-cpu": ("speed-up", 0.0),
          "gradient-compression": ("compression ratio", 1.0)}


def optimization_name(spec: str) -> str:
    """The registry's spelling of the name in ``NAME`` or ``NAME=VALUE`` (``Fused_Optimizer``:
    ``fused-optimizer``), whether or not it names an optimization."""
    return str(spec).partition("=")[0].strip().lower().replace("_", "-")


def parse_optimization(spec: str) -> tuple[str, Optional[float]]:
    """``NAME`` or ``NAME=VALUE`` (e.g. ``faster-gpu=2``) as a name of :data:`OPTIMIZATIONS`
    and its value (None: none given); a :class:`GraphError` where it is not one."""
    name, value = optimization_name(spec), str(spec).partition("=")[2]
    if name not in OPTIMIZATIONS:
        close = [ALSO_CALLED[name]] if name in ALSO_CALLED else difflib.get_close_matches(name, OPTIMIZATIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise GraphError(f"unknown optimization {spec!r}; {hint}choose from {', '.join(OPTIMIZATIONS)}")
    if not value:
        return name, None
    try:
        argument = float(value)
    except ValueError:
        raise GraphError(f"optimization {name}: {value!r} is not a number") from None
    if name not in VALUED:
        raise GraphError(f"optimization {name} takes no value")
    what, least = VALUED[name]
    if not (np.isfinite(argument) and argument > least or argument == least > 0):
        bound = f"at least {least:g}" if least > 0 else "positive"
        raise GraphError(f"optimization {spec!r}: the {what} must be a {bound} finite number")
    return name, argument


def apply_optimization(graph: TaskGraph, spec: str) -> TaskGraph:
    """``graph`` with ``NAME`` or ``NAME=VALUE`` (e.g. ``faster-gpu=2``) from :data:`OPTIMIZATIONS` applied."""
    name, argument = parse_optimization(spec)
    return OPTIMIZATIONS[name](graph) if argument is None else OPTIMIZATIONS[name](graph, argument)
