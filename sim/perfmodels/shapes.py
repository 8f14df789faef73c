"""What the profiler records of an operator call, read: its shapes, element sizes and scalar arguments.

Shapes are what the PyTorch profiler records with ``record_shapes=True`` (Kineto's ``Input
Dims`` and ``Input type``): per positional input a tensor's shape, ``[]`` for a scalar or a
missing tensor, a list of shapes for a tensor list. Its ``Concrete Inputs`` (torch 2.1 on) add
the scalar arguments, here ``args``: a convolution's stride, padding and which gradients its
backward computes, the dimensions a sum or mean reduces. Without them (older traces),
convolutions are taken as stride 1 with "same" padding and reductions as over every dimension.

:func:`operator_units` finds in a graph's operator table (``graph.ops``) the calls the models
time: the outermost operator of a modelled family on each CPU stack (the DLRM performance model's unit, Lin et al., 2022;
``shared/seeds/002``), with what was recorded of it.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from whatif.collectors.kineto import element_bytes, is_dtype
from ..workload import decode_inputs
from .families import FAMILY_OF


def parse_shapes(dims, types) -> list:
    """Per positional input: a tensor's shape (tuple of ints), a list of shapes (tensor list), or
    None (a scalar, a missing optional tensor, a list of ints), with the element size in bytes."""
    inputs = []
    types = list(types) if types is not None else []
    for i, d in enumerate(dims):
        kind = types[i] if i < len(types) else ""
        size = element_bytes(kind)
        if isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            inputs.append(([tuple(int(v) for v in x) for x in d], size))
        elif isinstance(d, list) and d and all(isinstance(x, (int, float)) for x in d) and kind not in ("ScalarList", ""):
            inputs.append((tuple(int(v) for v in d), size))
        elif isinstance(d, list) and not d and is_dtype(kind):
            inputs.append(((), size))  # a 0-d tensor
        else:
            inputs.append(None)
    return inputs


def parse_args(args) -> list:
    """Per positional input, the value of a scalar argument as Kineto's ``Concrete Inputs``
    writes it (``'[1, 1]'``, ``'True'``, ``'1e-05'``): an int, float, bool or list of them;
    None for a tensor, an absent argument, or one that is not a number (a string, a dtype)."""
    values = []
    for text in args or ():
        text = str(text).strip()
        try:
            value = json.loads(text.replace("True", "true").replace("False", "false")) if text else None
        except ValueError:
            value = None
        ok = isinstance(value, (int, float)) or (isinstance(value, list) and all(isinstance(v, (int, float)) for v in value))
        values.append(value if ok else None)
    return values


def operator_units(ops: pd.DataFrame) -> pd.DataFrame:
    """Every operator of ``ops`` (a graph's operator table) with its unit and decoded inputs.

    Columns: row (the operator's row in ``ops``, which the tasks' ``event`` names), unit (the
    row of the outermost modelled operator around or at it, -1 for none), parent (the row of the
    operator around it on its thread, -1 for none), op, dims, types, args (the decoded recorded
    inputs, ``sim/workload.py``) and dur_us, sorted by thread, start and outermost first.
    """
    order = ops.assign(neg_dur=-ops["dur_us"]).sort_values(["thread", "start_us", "neg_dur"], kind="stable")
    rows = order.index.to_numpy()
    names = order["name"].astype(str).to_numpy()
    threads = order["thread"].astype(str).to_numpy()
    starts = order["start_us"].to_numpy()
    ends = (order["start_us"] + order["dur_us"]).to_numpy()
    unit = np.full(len(rows), -1, dtype=np.int64)
    parent = np.full(len(rows), -1, dtype=np.int64)
    stack: list[int] = []
    thread = None
    for i in range(len(rows)):
        if threads[i] != thread:
            stack, thread = [], threads[i]
        while stack and ends[stack[-1]] <= starts[i] + 1e-6:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
            unit[i] = unit[stack[-1]]
        if unit[i] < 0 and names[i] in FAMILY_OF:
            unit[i] = i
        stack.append(i)
    return pd.DataFrame(
        {
            "row": rows,
            "unit": np.where(unit >= 0, rows[np.maximum(unit, 0)], -1),
            "parent": np.where(parent >= 0, rows[np.maximum(parent, 0)], -1),
            "op": names,
            "dims": [decode_inputs(d) for d in order["input_dims"].tolist()],
            "types": [decode_inputs(t) for t in order["input_types"].tolist()],
            "args": [decode_inputs(a) for a in order["concrete_inputs"].tolist()],
            "dur_us": order["dur_us"].to_numpy(),
        }
    )

