"""The unit an operator performance model times, found in a graph's operator table.

A model times one call of an operator of a modelled family, inclusive of the dispatch and the
helper operators it calls, as a microbenchmark of the same call does (``sim/perfmodels.py``).
In a trace, that is the outermost operator of a modelled family on each CPU stack: the unit
of every operator nested inside it. The passes that rescale or price operator calls by their
shapes (batch size, memory traffic) read the graph's operators through this view.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..perfmodels import FAMILY_OF
from ..workload import decode_inputs


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
