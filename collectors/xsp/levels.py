"""The levels of XSP's leveled, across-stack profiling, and the records a run at each level writes.

XSP (Li et al., "XSP: Across-Stack Profiling and Analysis of Machine Learning Models on GPUs",
IPDPS 2020; ``shared/seeds/003``) observes that every profiler inflates the latencies of the
levels above the one it looks at: the torch profiler's per-operator bookkeeping lands inside
each layer and each step. Its answer is leveled measurement: run the workload once per level of
the stack, the profiler of that level (and, to correlate, of the levels above it) switched on,
and take each level's latencies from the least intrusive run that measures them. The levels here:

- ``model``: the step time alone, ``time.perf_counter_ns`` between
  :meth:`~whatif.collectors.xsp.measure.LeveledProfile.step` calls; no hooks, no profiler.
- ``layer``: every leaf module's forward, from its forward pre-hook to its forward hook, and its
  backward: the autograd nodes its forward created, each timed from a node pre-hook to a node
  hook (nodes of its inputs, of earlier calls and gradient accumulations are not its own). The
  Python hooks, about 10 us a node, make this level slower than the model level.
- ``operator``: the torch profiler on CPU activities with ``record_shapes``, as the captures the
  simulator replays are taken. Operators are the outermost operator ranges of each thread; in
  backward, each ``autograd::engine::evaluate_function`` range. When the layer level is profiled
  as well, each leaf module's forward runs inside a ``whatif.layer: NAME`` range and its backward
  ranges are recognised by the sequence numbers of the nodes its forward created, so operators
  hang under their layers; otherwise (``--levels model,operator``) the run carries no hooks and
  its overhead is the profiler's alone.
- ``kernel``: the profiler with CUDA activities as well; each kernel, copy and memset hangs under
  the operator whose runtime call launched it. Only where a GPU is present; elsewhere the level
  is recorded as not run, with the reason.

Each run writes ``LEVEL.json`` (and the profiler levels ``LEVEL.pt.trace.json.gz``; a level run
again in a later round ``LEVEL.ROUND.json``) into one folder, the profile's; :func:`read_runs`
reads them back. The run is chosen through the environment variables named here, which
``whatif profile`` sets for each run of a script.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional, Union

from ..capture import CaptureError

LEVELS = ("model", "layer", "operator", "kernel")  # least to most intrusive
LEVEL_ENV = "WHATIF_PROFILE_LEVEL"
LEVELS_ENV = "WHATIF_PROFILE_LEVELS"  # every level of the session: which ones a run correlates with
OUT_ENV = "WHATIF_PROFILE_OUT"
STEPS_ENV = "WHATIF_PROFILE_STEPS"
WARMUP_ENV = "WHATIF_PROFILE_WARMUP"
ROUND_ENV = "WHATIF_PROFILE_ROUND"
RUN_FORMAT = "whatif-leveled-run"
VERSION = 1
LAYER_RANGE = "whatif.layer: "
PROFILER_LEVELS = ("operator", "kernel")  # the levels that run the torch profiler


class ProfileError(CaptureError):
    """A leveled profile that cannot go on; the message is one line saying why."""


def parse_levels(text: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """The levels named in ``text`` ("model,operator" or a list), in order of intrusion."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in LEVELS]
    if unknown:
        raise ProfileError(f"unknown level {unknown[0]!r}: the levels are {', '.join(LEVELS)}")
    if not names:
        raise ProfileError(f"no levels given: name some of {', '.join(LEVELS)}")
    return tuple(level for level in LEVELS if level in names)


def read_runs(folder: Union[str, Path]) -> dict[str, list[dict]]:
    """The level records in ``folder``: per level, least intrusive first, its rounds in order."""
    folder = Path(folder)
    runs = {}
    for level in LEVELS:
        paths = sorted(folder.glob(f"{level}*.json"), key=lambda p: round_of(p.name) or 0)
        records = []
        for path in (p for p in paths if round_of(p.name) is not None):
            try:
                record = json.loads(path.read_text())
            except (ValueError, RecursionError):
                raise ProfileError(f"{path}: not JSON") from None
            if not isinstance(record, dict) or (record.get("format"), record.get("version"), record.get("level")) != (RUN_FORMAT, VERSION, level):
                raise ProfileError(f"{path}: not a {RUN_FORMAT} record of the {level} level, version {VERSION}")
            records.append(record)
        if records:
            runs[level] = records
    if not runs:
        raise ProfileError(f"{folder}: no leveled profile in it (none of {', '.join(level + '.json' for level in LEVELS)})")
    return runs


_OUR_FILE = re.compile(rf"^({'|'.join(LEVELS)})(\.(\d+))?(\.json|\.pt\.trace\.json\.gz)$")


def round_of(name: str) -> Optional[int]:
    """The round a level's record or trace file holds (``LEVEL.json``: 0, ``LEVEL.R.json``: R),
    or None for a file that is neither."""
    match = _OUR_FILE.match(name)
    return None if match is None else int(match.group(3) or 0)
