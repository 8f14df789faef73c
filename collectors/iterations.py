"""Where the training iterations are in a trace.

The PyTorch profiler marks each step with a ``ProfilerStep#N`` range on the thread that called
``prof.step()``; a user may instead name their own ``record_function`` range; a trace with
neither (a hand-cut capture of one iteration) is one span from its first to its last event.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import pandas as pd

from .kineto import EventKind, KinetoTrace, TraceError

WHOLE_TRACE = "whole trace"
#: How far one iteration may begin before the one before it ends (timestamp rounding)
OVERLAP_TOLERANCE_US = 1.0


def find_iterations(trace: KinetoTrace, name: Optional[str] = None) -> pd.DataFrame:
    """The iteration spans: columns name, thread (None for the whole trace), start_us, end_us.

    ``name`` is a regular expression matched against annotation and operator names; without
    it, ``ProfilerStep#N`` ranges are used where the trace has them.
    """
    ev = trace.events
    ranges = ev[ev["kind"].isin([int(EventKind.ANNOTATION), int(EventKind.CPU_OP)])]
    if name is not None:
        try:
            regex = re.compile(name)
        except re.error as err:
            raise TraceError(trace.path, f"iteration name {name!r} is not a valid regular expression ({err})") from None
        hits = [c for c in ranges["name"].cat.categories if regex.search(c)]
        chosen = ranges[ranges["name"].isin(hits)]
        if chosen.empty:
            raise TraceError(trace.path, f"no annotation or operator named {name!r} (the iteration to use)")
    else:
        chosen = ranges[ranges["name"].str.startswith("ProfilerStep#", na=False)]
        if chosen.empty:
            cpu_or_gpu = ev[~ev["kind"].isin([int(EventKind.CUDA_SYNC), int(EventKind.GPU_ANNOTATION)])]
            start = float(cpu_or_gpu["ts_us"].min())
            end = float((cpu_or_gpu["ts_us"] + cpu_or_gpu["dur_us"]).max())
            return pd.DataFrame({"name": [WHOLE_TRACE], "thread": [None], "start_us": [start], "end_us": [end]})
    chosen = chosen.sort_values("ts_us", kind="stable")
    spans = pd.DataFrame(
        {
            "name": chosen["name"].astype(str).to_numpy(),
            "thread": chosen["thread"].astype(str).to_numpy(),
            "start_us": chosen["ts_us"].to_numpy(),
            "end_us": (chosen["ts_us"] + chosen["dur_us"]).to_numpy(),
        }
    )
    _refuse_overlaps(trace, spans)
    return spans


def _refuse_overlaps(trace: KinetoTrace, spans: pd.DataFrame) -> None:
    """Iterations overlap where one starts before the one before it ends: a step cannot be
    replayed as measured then, as each task would count in two of them."""
    start, end = spans["start_us"].to_numpy(), spans["end_us"].to_numpy()
    ended = np.maximum.accumulate(end)
    overlaps = np.flatnonzero(start[1:] < ended[:-1] - OVERLAP_TOLERANCE_US) + 1
    if len(overlaps):
        i = int(overlaps[0])
        before = int(np.flatnonzero(end[:i] > start[i] + OVERLAP_TOLERANCE_US)[-1])
        names = spans["name"].tolist()
        more = f" ({len(overlaps)} overlaps in all)" if len(overlaps) > 1 else ""
        raise TraceError(trace.path, f"ts/dur: iteration {names[i]!r} starts {end[before] - start[i]:.1f} us before "
                                     f"{names[before]!r} ends{more}; overlapping iterations cannot be replayed as "
                                     "measured (name other ranges with --iteration NAME)")
