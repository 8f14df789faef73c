"""What a graph carries beside its tasks: the traced operators and the record of the job.

A pass must never reopen the trace (Chakra's rule: a node carries what any later stage needs),
so ``sim/build.py``, the one place besides ``collectors/`` that reads a trace, copies onto the
:class:`~whatif.sim.graph.TaskGraph` what the passes use:

* ``graph.ops``, the operator table: one row per operator, annotation and Python frame the
  trace timed on a CPU thread, indexed by the row id that the tasks' ``event`` column names
  (runtime calls and GPU tasks are described by their tasks alone). Columns: ``name``
  (categorical), ``kind`` (``operator``, ``annotation`` or ``python``), ``thread`` (the CPU
  resource it ran on, as the tasks name it: ``cpu PID/TID``), ``start_us`` and ``dur_us`` (on
  the tasks' clock), the recorded inputs as the profiler wrote them (JSON text, or None where it
  recorded none: ``input_dims``, per positional input a tensor's shape, ``[]`` for a scalar, a
  list of shapes for a tensor list; ``input_types``; ``concrete_inputs``, the values of scalar
  arguments), ``message_bytes``, the bytes of the collective message a communication
  operator records (``record_param_comms``' element count times its dtype's size; NaN for the
  others), and ``sequence_nr``, autograd's sequence number (the same on a forward operator and
  on the ``autograd::engine::evaluate_function`` of its backward; -1 where none). The inputs stay text because decoding every one of a large trace's takes longer than
  building its graph; :func:`decode_inputs` decodes what a pass reads.
* ``graph.workload``, a :class:`Workload`: where the trace came from, whether it ran on a GPU,
  and what a capture bundle recorded beside it (parameters, when each gradient became ready,
  the environment, the steps timed without the profiler).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from whatif.collectors.kineto import element_bytes

OPERATOR_KINDS = ("operator", "annotation", "python")
PARAMETER_COLUMNS = ["name", "layer", "shape", "numel", "dtype", "element_size", "requires_grad"]
GRADIENT_READY_COLUMNS = ["step", "parameter", "at_us", "thread"]
LAYER_COLUMNS = ["name", "type", "parameters"]
LAYER_INTERVAL_COLUMNS = ["step", "layer", "pass", "start_us", "end_us", "thread"]


@dataclass
class Workload:
    """The training job a graph was built from, beyond its tasks.

    ``parameters`` has a capture bundle's columns (:data:`PARAMETER_COLUMNS`: ``shape`` a list,
    ``numel``, ``element_size`` in bytes), empty without a bundle; ``gradient_ready``
    (:data:`GRADIENT_READY_COLUMNS`) has a row each time a parameter's post-accumulate-grad
    hook ran: the profiled step, the parameter's name, the moment on the tasks' clock and the
    CPU resource it ran on. ``environment`` is the bundle's (``batch_size``, ``device``, ...);
    ``unprofiled_step_ms`` the wall times of steps run without profiler or hooks, and
    ``process_unprofiled_ms`` the median of each process's, where several captured the job (the
    bundle's ``Bundle.process_unprofiled_ms``; empty otherwise). ``layers``
    (:data:`LAYER_COLUMNS`) lists the bundle's leaf modules in the order the model registers
    them, ``layer_intervals`` (:data:`LAYER_INTERVAL_COLUMNS`) each call of one in a profiled
    step, ``pass`` ``forward`` or ``backward``, on the tasks' clock and CPU resource; both
    empty without a bundle.
    """

    source: str = ""
    has_gpu: bool = False
    parameters: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PARAMETER_COLUMNS))
    gradient_ready: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=GRADIENT_READY_COLUMNS))
    environment: dict = field(default_factory=dict)
    unprofiled_step_ms: list = field(default_factory=list)
    process_unprofiled_ms: list = field(default_factory=list)
    layers: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LAYER_COLUMNS))
    layer_intervals: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LAYER_INTERVAL_COLUMNS))

    @property
    def batch_size(self) -> Optional[int]:
        """The batch size the capture recorded, if it did."""
        value = self.environment.get("batch_size")
        return int(value) if value else None


def empty_operators() -> pd.DataFrame:
    """An operator table without rows (a graph that was not built from a trace)."""
    return pd.DataFrame(
        {
            "name": pd.Categorical([]),
            "kind": pd.Categorical([], categories=OPERATOR_KINDS),
            "thread": pd.Categorical([]),
            "start_us": np.zeros(0),
            "dur_us": np.zeros(0),
            "input_dims": np.zeros(0, dtype=object),
            "input_types": np.zeros(0, dtype=object),
            "concrete_inputs": np.zeros(0, dtype=object),
            "message_bytes": np.zeros(0),
            "sequence_nr": np.zeros(0, dtype=np.int64),
        },
        index=pd.Index(np.zeros(0, dtype=np.int64)),
    )


def decode_inputs(text) -> list:
    """One recorded input list (``input_dims``, ``input_types`` or ``concrete_inputs``) as Python
    lists; empty where none was recorded."""
    if text is None or not len(text):
        return []
    value = json.loads(text)
    return value if isinstance(value, list) else []


def first_input_bytes(ops: pd.DataFrame, row: int) -> Optional[float]:
    """Bytes of the first input an operator recorded (its shape and type); None where the
    trace recorded no shape. A list of tensors (``aten::cat``'s, ``aten::stack``'s) counts
    them all, at 4 bytes an element (the profiler records no dtype for a ``TensorList``)."""
    return first_input_bytes_of(ops.at[row, "input_dims"], ops.at[row, "input_types"])


def first_inputs_bytes(ops: pd.DataFrame, rows: list) -> list:
    """:func:`first_input_bytes` of each of ``rows``, the two columns read once."""
    dims, types = (ops.loc[rows, column].tolist() for column in ("input_dims", "input_types"))
    return [first_input_bytes_of(d, t) for d, t in zip(dims, types)]


def kept_per_texts(function):
    """``function`` of an operator's recorded texts (its ``input_dims``, ``input_types``, ...),
    kept per texts: a trace repeats each layer's shapes every iteration, and the passes read them
    again at every point of a grid. Arguments that cannot be kept (not hashable) are computed
    each time."""
    kept = functools.lru_cache(maxsize=1 << 16)(function)

    @functools.wraps(function)
    def call(*args):
        try:
            return kept(*args)
        except TypeError:  # not texts
            return function(*args)

    return call


@kept_per_texts
def first_input_bytes_of(dims_text, types) -> Optional[float]:
    """:func:`first_input_bytes` of an operator's recorded ``input_dims`` and ``input_types``."""
    try:
        dims = json.loads(dims_text or "null")
    except json.JSONDecodeError:
        return None
    if not dims or not isinstance(dims, list) or not isinstance(dims[0], list) or not dims[0]:
        return None
    first = dims[0]
    if all(isinstance(d, list) for d in first):  # a TensorList (cat, stack): its tensors together
        elements = float(sum(np.prod(d, dtype=float) for d in first))
    elif all(isinstance(d, (int, float)) for d in first):
        elements = float(np.prod(first, dtype=float))
    else:
        return None
    size = 4
    if types is not None:
        try:
            size = element_bytes(json.loads(types)[0])
        except (json.JSONDecodeError, IndexError, TypeError, KeyError):
            pass
    return elements * size
