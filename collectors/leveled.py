"""Leveled, across-stack profiling: one hierarchy of latencies, each measured as little disturbed as possible.

XSP (Li et al., "XSP: Across-Stack Profiling and Analysis of Machine Learning Models on GPUs",
IPDPS 2020) observes that every profiler inflates the latencies of the levels above the one it
looks at: the torch profiler's per-operator bookkeeping lands inside each layer and each step.
Its answer is leveled measurement: run the workload once per level of the stack, the profiler
of that level (and, to correlate, of the levels above it) switched on, and take each level's
latencies from the least intrusive run that measures them. The levels here:

- ``model``: the step time alone, ``time.perf_counter_ns`` between :meth:`LeveledProfile.step`
  calls; no hooks, no profiler.
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
again in a later round ``LEVEL.ROUND.json``) into one folder; :func:`build_view` reads the folder
into the hierarchy model -> layer -> operator -> kernel and the overhead of each level, its step
time against the model level's.
Operators outside every leaf module (the loss, the optimizer, functional code in a non-leaf
``forward``) hang under the model directly, as do their kernels. A layer's latency and its
operators' come from different runs, so their sum can exceed it where the profiler's
bookkeeping inside the operators outweighs the hooks' own time in the layer run.

``whatif profile -- python SCRIPT.py`` reruns a script that uses :class:`LeveledProfile` once per
level, with the level, folder and steps in environment variables that override the script's own
arguments, as ``whatif collect`` does for :class:`~whatif.collectors.capture.Capture`;
:func:`run_levels` runs every level in one process. Both can alternate the levels in rounds,
whose steps the view pools, so that a shared machine's bursts of other work slow every level
alike.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from .capture import CaptureError, count_setting, cpu_model, script_of
from .iterations import find_iterations
from .kineto import EventKind, TraceError
from .load import load_trace

LEVELS = ("model", "layer", "operator", "kernel")  # least to most intrusive
LEVEL_ENV = "WHATIF_PROFILE_LEVEL"
LEVELS_ENV = "WHATIF_PROFILE_LEVELS"  # every level of the session: which ones a run correlates with
OUT_ENV = "WHATIF_PROFILE_OUT"
STEPS_ENV = "WHATIF_PROFILE_STEPS"
WARMUP_ENV = "WHATIF_PROFILE_WARMUP"
ROUND_ENV = "WHATIF_PROFILE_ROUND"
RUN_FORMAT = "whatif-leveled-run"
VIEW_FORMAT = "whatif-leveled-view"
VERSION = 1
VIEW_FILE = "view.json"
TABLE_FILE = "view.csv"
LAYER_RANGE = "whatif.layer: "
_EVALUATE = "autograd::engine::evaluate_function: "
_PROFILED = ("operator", "kernel")
TABLE_COLUMNS = ["level", "name", "parent", "latency_ms", "calls_per_step", "measured_at_level"]


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


# -- in the training process ---------------------------------------------------------------------


class LeveledProfile:
    """Measures ``steps`` training steps of ``model`` after ``warmup`` steps at one ``level``.

    Use it as a context manager around the training loop and call :meth:`step` at the end of
    every step, from the first: it returns True while steps remain and False once the level's
    record is written (the loop may stop then). ``out`` is the folder the record goes to, shared
    by the runs of all levels; the model and layer levels may leave it out and read
    :attr:`record` instead. Under ``whatif profile`` the environment's ``WHATIF_PROFILE_LEVEL``,
    ``WHATIF_PROFILE_OUT``, ``WHATIF_PROFILE_STEPS``, ``WHATIF_PROFILE_WARMUP`` and
    ``WHATIF_PROFILE_ROUND`` override ``level``, ``out``, ``steps``, ``warmup`` and ``round_index``;
    ``levels`` (or ``WHATIF_PROFILE_LEVELS``) are all the levels profiled, so that an operator
    run knows whether to attribute to layers. A level measured again in a later round
    writes ``LEVEL.ROUND.json``; the view pools the rounds' steps. On a GPU every step ends
    with ``torch.cuda.synchronize()``, at every level, so that a step's time holds its GPU work.
    """

    def __init__(
        self,
        out: Union[str, Path, None] = None,
        *,
        model,
        level: str = "model",
        levels: Optional[Sequence[str]] = None,
        steps: int = 10,
        warmup: int = 3,
        name: Optional[str] = None,
        round_index: int = 0,
    ):
        (self.level,) = parse_levels([os.environ.get(LEVEL_ENV) or level])
        self.levels = parse_levels(os.environ.get(LEVELS_ENV) or levels or [self.level])
        out = os.environ.get(OUT_ENV) or out
        self.out = Path(out) if out is not None else None
        if self.out is None and self.level in _PROFILED:
            raise ProfileError(f"the {self.level} level writes a trace: give LeveledProfile(out=...) or run under `whatif profile`")
        self.steps = count_setting(STEPS_ENV, "steps", steps, minimum=1)
        self.warmup = count_setting(WARMUP_ENV, "warmup", warmup, minimum=1)
        self.round = count_setting(ROUND_ENV, "round", round_index, minimum=0)
        self._stem = self.level if self.round == 0 else f"{self.level}.{self.round}"
        self.model = model
        self.name = name or type(model).__name__
        self.record: Optional[dict] = None  # once the level is measured (or found impossible)
        self._step_ns: list[int] = []  # wall-clock time of each step
        self._step_cpu_ns: list[int] = []  # CPU time of the process in each step
        self._last_ns: Optional[int] = None  # when the step running now began; None outside the `with`
        self._last_cpu_ns = 0
        self._hooks = None
        self._profiler = None
        self._cuda = False

    def __enter__(self) -> "LeveledProfile":
        import torch

        self._torch = torch
        self._cuda = any(p.is_cuda for p in self.model.parameters())
        if self.level == "kernel" and not torch.cuda.is_available():
            self._write(self._header(run=False) | {"reason": "no GPU: torch.cuda.is_available() is False"})
            return self
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        leaves = [(name or type(m).__name__, m) for name, m in self.model.named_modules() if not any(m.children())]
        if self.level == "layer":
            self._hooks = _LayerTimer(leaves, torch)
        elif self.level in _PROFILED and "layer" in self.levels:
            self._hooks = _LayerAnnotator(leaves, torch)
        if self.level in _PROFILED:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.level == "kernel":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                schedule=torch.profiler.schedule(wait=self.warmup - 1, warmup=1, active=self.steps, repeat=1),
            )
            self._profiler.__enter__()
        self._last_ns, self._last_cpu_ns = time.perf_counter_ns(), time.process_time_ns()
        return self

    def step(self) -> bool:
        """End the current training step. True while steps remain; False once the record is
        written (and on every call after that)."""
        if self.record is not None:
            return False
        if self._last_ns is None:
            raise ProfileError("LeveledProfile.step() called outside its `with` block")
        if self._cuda:
            self._torch.cuda.synchronize()
        self._step_ns.append(time.perf_counter_ns() - self._last_ns)
        self._step_cpu_ns.append(time.process_time_ns() - self._last_cpu_ns)
        if self._hooks is not None:
            self._hooks.end_step()
        if self._profiler is not None:
            self._profiler.step()
        if len(self._step_ns) == self.warmup + self.steps:
            self._finish()
            return False
        self._last_ns, self._last_cpu_ns = time.perf_counter_ns(), time.process_time_ns()
        return True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.record is None and self._last_ns is not None:
            self._stop()
            if exc_type is None:
                raise ProfileError(
                    f"the training loop ended after {len(self._step_ns)} steps; the {self.level} level needs "
                    f"{self.warmup} warm-up and {self.steps} measured steps (call profile.step() once per step)"
                )
        return False

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
        if self._hooks is not None:
            self._hooks.detach()

    def _finish(self) -> None:
        self._stop()
        record = self._header(run=True) | {
            "step_ms": [ns / 1e6 for ns in self._step_ns],
            "step_cpu_ms": [ns / 1e6 for ns in self._step_cpu_ns],
        }
        if isinstance(self._hooks, _LayerTimer):
            record["layers"] = [row for row in self._hooks.rows if row[0] >= self.warmup]
        if self._profiler is not None:
            trace = self.out / f"{self._stem}.pt.trace.json.gz"
            self._profiler.export_chrome_trace(str(trace))
            record["trace"] = trace.name
            if self._hooks is not None:
                record["layer_sequence_nr"] = self._hooks.sequence_nr
        self._write(record)

    def _header(self, run: bool) -> dict:
        torch = self._torch
        return {
            "format": RUN_FORMAT,
            "version": VERSION,
            "level": self.level,
            "levels": list(self.levels),
            "model": self.name,
            "round": self.round,
            "run": run,
            "warmup_steps": self.warmup,
            "steps": self.steps,
            "environment": {
                "device": "cuda" if self._cuda else "cpu",
                "device_name": torch.cuda.get_device_name() if self._cuda else cpu_model(),
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "hostname": socket.gethostname(),
            },
        }

    def _write(self, record: dict) -> None:
        self.record = record
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"{self._stem}.json").write_text(json.dumps(record, indent=1) + "\n")


def _created_nodes(outputs: list, inputs: set, claimed: set) -> list:
    """The autograd nodes one forward call created: reachable from its output tensors before a
    node of its inputs, of an earlier call or a gradient accumulation (which the trace cannot
    tie to a layer: it carries no sequence number). ``claimed`` holds the ids of the nodes
    earlier calls of the step created, and this adds the new ones': ids, not the nodes, so that
    the hooks keep no part of the graph, or the tensors it saved, alive past its backward."""
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    nodes, seen = [], set()
    while todo:
        node = todo.pop()
        if node is None or node in inputs or id(node) in claimed or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            continue
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    claimed.update(map(id, nodes))
    return nodes


class _LeafHooks:
    """Forward pre-hooks and hooks on every leaf module; subclasses say what they do."""

    def __init__(self, leaves: list, torch):
        self.leaves = leaves
        self.tensor_type = torch.Tensor
        self.claimed: set = set()
        self.open: dict = {}  # module -> stack of (what the pre-hook started, its inputs' nodes)
        self.handles = []
        for name, module in leaves:
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def end_step(self) -> None:
        """Forget the step's autograd nodes (their ids may be reused by the next step's)."""
        self.claimed.clear()
        self.open.clear()

    def tensors(self, value) -> list:
        """The tensors in a module's arguments or output, however nested in tuples, lists and
        dicts (a loop, not torch's pytree: this runs twice per module call, and the pytree's
        5 us would be most of the hooks' cost)."""
        found, todo = [], [value]
        while todo:
            item = todo.pop()
            if isinstance(item, self.tensor_type):
                found.append(item)
            elif isinstance(item, (tuple, list)):
                todo.extend(item)
            elif isinstance(item, dict):
                todo.extend(item.values())
        return found

    def _pre(self, name: str):
        def pre(module, args) -> None:
            inputs = {t.grad_fn for t in self.tensors(args) if t.grad_fn is not None}
            self.open.setdefault(module, []).append((self.begin(name), inputs))

        return pre

    def _post(self, name: str):
        def post(module, args, output) -> None:
            started, inputs = self.open[module].pop()
            self.end(name, started, _created_nodes(self.tensors(output), inputs, self.claimed))

        return post


class _LayerTimer(_LeafHooks):
    """The layer level: each leaf module's forward and backward time per step. ``rows`` holds
    [step, layer, pass, total_us, calls] for every step."""

    def __init__(self, leaves: list, torch):
        super().__init__(leaves, torch)
        self.rows: list[list] = []
        self.step = 0
        self.totals: dict = defaultdict(lambda: [0, 0])  # (layer, pass) -> [ns, calls] this step

    def begin(self, name: str) -> int:
        return time.perf_counter_ns()

    def end(self, name: str, started: int, nodes: list) -> None:
        total = self.totals[(name, "forward")]
        total[0] += time.perf_counter_ns() - started
        total[1] += 1
        if nodes:
            self.totals[(name, "backward")][1] += 1
            for node in nodes:
                self._time_backward(node, self.totals[(name, "backward")])

    @staticmethod
    def _time_backward(node, total: list) -> None:
        began = [0]

        def pre(grad_outputs) -> None:
            began[0] = time.perf_counter_ns()

        def post(grad_inputs, grad_outputs) -> None:
            total[0] += time.perf_counter_ns() - began[0]

        node.register_prehook(pre)
        node.register_hook(post)

    def end_step(self) -> None:
        self.rows += [[self.step, layer, phase, ns / 1e3, calls] for (layer, phase), (ns, calls) in self.totals.items()]
        self.totals.clear()
        self.step += 1
        super().end_step()


class _LayerAnnotator(_LeafHooks):
    """At the profiler levels: a ``whatif.layer: NAME`` range around each leaf module's forward,
    and the sequence numbers of the autograd nodes it created, which the trace stamps on their
    backward ranges."""

    def __init__(self, leaves: list, torch):
        super().__init__(leaves, torch)
        self.record_function = torch.autograd.profiler.record_function
        self.sequence_nr: dict[str, list[int]] = defaultdict(list)

    def begin(self, name: str):
        scope = self.record_function(LAYER_RANGE + name)
        scope.__enter__()
        return scope

    def end(self, name: str, scope, nodes: list) -> None:
        scope.__exit__(None, None, None)
        self.sequence_nr[name].extend(node._sequence_nr() for node in nodes)


# -- from the runs to one hierarchy ---------------------------------------------------------------


def read_runs(folder: Union[str, Path]) -> dict[str, list[dict]]:
    """The level records in ``folder``: per level, least intrusive first, its rounds in order."""
    folder = Path(folder)
    runs = {}
    for level in LEVELS:
        paths = sorted(folder.glob(f"{level}*.json"), key=lambda p: _round_of(p.name) or 0)
        records = []
        for path in (p for p in paths if _round_of(p.name) is not None):
            try:
                record = json.loads(path.read_text())
            except ValueError:
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


def _round_of(name: str) -> Optional[int]:
    """The round a level's record or trace file holds (``LEVEL.json``: 0, ``LEVEL.R.json``: R),
    or None for a file that is neither."""
    match = _OUR_FILE.match(name)
    return None if match is None else int(match.group(3) or 0)


def build_view(folder: Union[str, Path]) -> dict:
    """The hierarchy model -> layer -> operator -> kernel from the runs in ``folder``, and per
    run its step time, profiler events per step and overhead (:func:`profiler_overhead`).

    A node is ``{"name", "level", "latency_ms", "calls_per_step", "measured_at_level",
    "by_level", "children"}``: ``latency_ms`` comes from the least intrusive run that measured
    the node (``measured_at_level``), ``by_level`` holds what every run that measured it saw, so
    the inflation a deeper level's profiling causes can be read node by node. A node that only
    a deeper level's path names (an operator's layer when no run measured layers) has no latency.

    A level's latencies are means per step over the faster half of its measured steps, those
    of all its rounds pooled (the steps at most their median step time): a busy machine
    preempts a step now and then, and such steps are left out, the same steps for every node
    of the level, so that within a level the children's means add up as their per-step totals
    do. Rounds that alternate the levels (``whatif profile --rounds``) give every level steps
    from the same stretches of a machine's load."""
    folder = Path(folder)
    runs = read_runs(folder)
    measured = {level: _measure(records, folder) for level, records in runs.items() if records[0]["run"]}
    if not measured:
        raise ProfileError(f"{folder}: no level was run ({'; '.join(r[0].get('reason') or '' for r in runs.values())})")
    model = runs[next(iter(runs))][0]["model"]
    root = _node(model, "model")
    for run, m in measured.items():
        _measured_by(root, run, m["step_ms"], 1.0)
    for level in LEVELS[1:]:
        for run, m in measured.items():
            for path, latency_ms, calls in m["rows"].get(level, []):
                _measured_by(_descendant(root, path, level), run, latency_ms, calls)
    result = {
        "format": VIEW_FORMAT,
        "version": VERSION,
        "model": model,
        "environment": runs[next(iter(measured))][0]["environment"],
        "levels": {
            level: {key: m[key] for key in ("step_ms", "step_ms_median", "step_cpu_ms", "rounds", "steps", "steps_kept", "events_per_step")}
            | {"run": True}
            if (m := measured.get(level))
            else {"run": False, "reason": runs[level][0].get("reason")}
            for level in runs
        },
        "sources": {
            level: next(run for run, m in measured.items() if level == "model" or level in m["rows"])
            for level in LEVELS
            if level == "model" or any(level in m["rows"] for m in measured.values())
        },
        "view": root,
    }
    result["overhead"] = profiler_overhead(result)
    return result


def profiler_overhead(result: dict) -> dict[str, dict]:
    """What profiling at each level costs: its step time against the model level's.

    Per level run: ``step_ms``, ``ratio`` (step time over the model level's), ``overhead_ms``
    and ``overhead_pct`` on the wall clock; for the profiler levels also ``events_per_step``
    (the CPU-side events the profiler recorded in a step: operators, annotations, runtime calls)
    and ``overhead_us_per_event``, the step's extra time spread over them. The same on the
    process's CPU time (``cpu_step_ms``, ``cpu_ratio``, ``cpu_overhead_pct``,
    ``cpu_overhead_us_per_event``; medians over all measured steps): for training on the CPU
    these leave out the time other processes take the core away, which on a shared machine
    swamps a few percent of overhead; on a GPU the wall-clock figures are the ones that count.

    A simulator replaying a trace taken at the operator level can subtract the overhead per
    event from each CPU event, or divide its CPU time by the ratio. Levels not run carry their
    reason; without a model level the comparisons are None."""
    levels = result["levels"]
    model = levels.get("model", {})
    overhead = {}
    for level, info in levels.items():
        if not info["run"]:
            overhead[level] = {"run": False, "reason": info.get("reason")}
            continue
        events = info.get("events_per_step")
        entry = {"run": True, "events_per_step": events}
        for prefix, key in (("", "step_ms"), ("cpu_", "step_cpu_ms")):
            step_ms, base = info[key], model.get(key)
            extra_ms = None if base is None else step_ms - base
            entry |= {
                f"{prefix}step_ms": step_ms,
                f"{prefix}model_step_ms": base,
                f"{prefix}ratio": None if base is None else step_ms / base,
                f"{prefix}overhead_ms": extra_ms,
                f"{prefix}overhead_pct": None if base is None else 100 * extra_ms / base,
                f"{prefix}overhead_us_per_event": None if extra_ms is None or not events else extra_ms * 1e3 / events,
            }
        overhead[level] = entry
    return overhead


def flat_table(result: dict) -> pd.DataFrame:
    """The hierarchy as one row per node, depth first: level, name, parent (the path of names
    from the model, joined by " > "), latency_ms, calls_per_step, measured_at_level, and the
    node's latency in each run that measured it (``at_LEVEL_ms``)."""
    rows = []

    def visit(node: dict, parent: str) -> None:
        by_level = [node["by_level"].get(level) for level in LEVELS]
        rows.append([node["level"], node["name"], parent, node["latency_ms"], node["calls_per_step"], node["measured_at_level"], *by_level])
        path = f"{parent} > {node['name']}" if parent else node["name"]
        for child in node["children"]:
            visit(child, path)

    visit(result["view"], "")
    return pd.DataFrame(rows, columns=TABLE_COLUMNS + [f"at_{level}_ms" for level in LEVELS])


def _node(name: str, level: str) -> dict:
    return {
        "name": name,
        "level": level,
        "latency_ms": None,
        "calls_per_step": None,
        "measured_at_level": None,
        "by_level": {},
        "children": [],
    }


def _descendant(root: dict, path: tuple, level: str) -> dict:
    """The node at ``path`` below the root, made (with its missing ancestors) if need be."""
    node, depth = root, LEVELS.index(level)
    for i, name in enumerate(path):
        child = next((c for c in node["children"] if c["name"] == name), None)
        if child is None:
            child = _node(name, LEVELS[depth - (len(path) - 1 - i)])
            node["children"].append(child)
        node = child
    return node


def _measured_by(node: dict, run: str, latency_ms: float, calls: float) -> None:
    """Note what the run at level ``run`` measured for ``node``; the first run to measure it,
    the least intrusive (runs come in LEVELS order), gives its latency."""
    if node["measured_at_level"] is None:
        node["latency_ms"], node["calls_per_step"], node["measured_at_level"] = latency_ms, calls, run
    node["by_level"][run] = latency_ms


def _measure(records: list[dict], folder: Path) -> dict:
    """One level's step time and what it measured, over its rounds: per level, rows (path
    below the model, mean latency in ms per kept step, mean calls per kept step)."""
    steps_ms = {(r, i): ms for r, record in enumerate(records) for i, ms in enumerate(record["step_ms"][record["warmup_steps"]:])}
    cpu_ms = {(r, i): ms for r, record in enumerate(records) for i, ms in enumerate(record["step_cpu_ms"][record["warmup_steps"]:])}
    median_ms = statistics.median(steps_ms.values())
    kept = [key for key, ms in steps_ms.items() if ms <= median_ms]
    out = {
        "step_ms": statistics.fmean(steps_ms[key] for key in kept),
        "step_ms_median": median_ms,
        "step_cpu_ms": statistics.median(cpu_ms.values()),
        "rounds": len(records),
        "steps": len(steps_ms),
        "steps_kept": len(kept),
        "events_per_step": None,
        "rows": {},
    }
    totals: dict[str, dict] = defaultdict(dict)  # level -> path -> [total_us, calls] over the kept steps
    events = 0.0
    for r, record in enumerate(records):
        mine = [i for round_, i in kept if round_ == r]
        if record["level"] == "layer":
            layers = pd.DataFrame(record["layers"], columns=["step", "layer", "pass", "total_us", "calls"])
            layers["step"] -= record["warmup_steps"]
            layers["path"] = [(_layer_label(layer, phase),) for layer, phase in zip(layers["layer"], layers["pass"])]
            _add_step_sums(totals["layer"], layers, mine)
        elif record["level"] in _PROFILED:
            measured = len(record["step_ms"]) - record["warmup_steps"]
            frames, count = _trace_frames(folder / record["trace"], record.get("layer_sequence_nr"), measured)
            for level, frame in frames.items():
                if level != "kernel" or record["level"] == "kernel":
                    _add_step_sums(totals[level], frame, mine)
            events += float(np.isin(count["step"], mine).sum())
    if records[0]["level"] in _PROFILED:
        out["events_per_step"] = events / len(kept)
    out["rows"] = {
        level: [(path, total_us / 1e3 / len(kept), calls / len(kept)) for path, (total_us, calls) in paths.items()]
        for level, paths in totals.items()
    }
    return out


def _layer_label(layer: str, phase: str) -> str:
    return f"{layer} ({phase})"


def _add_step_sums(totals: dict, frame: pd.DataFrame, steps: list[int]) -> None:
    """Add to ``totals`` (path -> [total_us, calls], in order of first appearance) the sums over
    ``steps`` of a frame with columns path, step, total_us, calls."""
    chosen = frame[frame["step"].isin(steps)]
    for path, total_us, calls in chosen.groupby("path", sort=False)[["total_us", "calls"]].sum().itertuples():
        entry = totals.setdefault(path, [0.0, 0.0])
        entry[0] += total_us
        entry[1] += calls


def _trace_frames(path: Path, sequence_nr: Optional[dict], steps: int) -> tuple[dict, pd.DataFrame]:
    """From a profiler run's trace: per level (operators, kernels and, where the run annotated
    layers, layers) a frame of path, step, total_us and calls, one row per event; and the step
    of every CPU-side event the profiler recorded (column ``step``). Steps are the trace's
    ``ProfilerStep#N`` ranges, the run's measured steps in order; an operator belongs to the
    step it starts in, a kernel to the step its launch call does. A layer's forward latency is
    its ``whatif.layer`` range, its backward latency the sum of its nodes' backward ranges."""
    try:
        trace = load_trace(path)
    except TraceError as err:
        raise ProfileError(str(err)) from None
    iterations = find_iterations(trace)
    if len(iterations) != steps:
        raise ProfileError(f"{path}: {len(iterations)} ProfilerStep ranges for {steps} measured steps")
    ev = trace.events
    kind = ev["kind"].to_numpy()
    start = ev["ts_us"].to_numpy()
    end = start + ev["dur_us"].to_numpy()
    thread = ev["thread"].cat.codes.to_numpy()
    names = ev["name"].astype(str).to_numpy()
    step = np.searchsorted(iterations["start_us"].to_numpy(), start, side="right") - 1
    step[(step < 0) | (start >= iterations["end_us"].to_numpy()[np.maximum(step, 0)])] = -1

    cpu = np.isin(kind, [int(EventKind.CPU_OP), int(EventKind.ANNOTATION), int(EventKind.RUNTIME)])
    counted = cpu & (step >= 0) & ~pd.Series(names).str.startswith("ProfilerStep#").to_numpy()

    ops = np.flatnonzero(kind == int(EventKind.CPU_OP))
    ops = ops[_outermost(ops, start, end, thread)]
    annotations = np.flatnonzero((kind == int(EventKind.ANNOTATION)) & pd.Series(names).str.startswith(LAYER_RANGE).to_numpy())
    forward = {op: _layer_label(names[a][len(LAYER_RANGE):], "forward")
               for op, a in zip(ops.tolist(), _enclosing(ops, annotations, start, end, thread).tolist()) if a >= 0}
    backward = {seq: _layer_label(layer, "backward") for layer, seqs in (sequence_nr or {}).items() for seq in seqs}
    sequence = ev["sequence_nr"].to_numpy()
    op_path = {}
    for op in ops.tolist():
        name, layer = names[op], forward.get(op)
        if name.startswith(_EVALUATE):
            name, layer = name[len(_EVALUATE):], backward.get(int(sequence[op]))
        op_path[op] = (layer, name) if layer else (name,)

    gpu = np.flatnonzero(np.isin(kind, [int(EventKind.KERNEL), int(EventKind.MEMCPY), int(EventKind.MEMSET)]))
    runtime = np.flatnonzero(kind == int(EventKind.RUNTIME))
    launch_of = dict(zip(ev["correlation"].to_numpy()[runtime].tolist(), runtime.tolist()))
    launches = np.array([launch_of.get(c, -1) for c in ev["correlation"].to_numpy()[gpu].tolist()], dtype=np.int64)
    gpu, launches = gpu[launches >= 0], launches[launches >= 0]
    launcher = _enclosing(launches, ops, start, end, thread).tolist()
    kernel_paths = [op_path[op] + (names[k],) if op >= 0 else (names[k],) for k, op in zip(gpu.tolist(), launcher)]

    frames = {
        "operator": _frame(list(op_path.values()), step[ops], end[ops] - start[ops]),
        "kernel": _frame(kernel_paths, step[launches], end[gpu] - start[gpu]),
    }
    if sequence_nr is not None:
        in_backward = [op for op, p in op_path.items() if len(p) == 2 and p[0].endswith("(backward)")]
        layer_rows = annotations.tolist() + in_backward
        layer_paths = [(_layer_label(names[a][len(LAYER_RANGE):], "forward"),) for a in annotations.tolist()]
        layer_paths += [op_path[op][:1] for op in in_backward]
        frames["layer"] = _frame(layer_paths, step[layer_rows], end[layer_rows] - start[layer_rows])
    return frames, pd.DataFrame({"step": step[counted]})


def _frame(paths: list, steps: np.ndarray, durations_us: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"path": paths, "step": steps, "total_us": durations_us, "calls": 1})


def _outermost(rows: np.ndarray, start: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """Which of ``rows`` no other of them on the same thread encloses (rows sorted by thread,
    then start, longest first, are nested in an earlier one iff they start before the latest
    end so far)."""
    order = np.lexsort((start[rows] - end[rows], start[rows], thread[rows]))
    keep = np.zeros(len(rows), dtype=bool)
    latest_end, current = -np.inf, None
    for i in order.tolist():
        row = rows[i]
        if thread[row] != current:
            current, latest_end = thread[row], -np.inf
        if start[row] >= latest_end:
            keep[i] = True
        latest_end = max(latest_end, end[row])
    return keep


def _enclosing(inner: np.ndarray, outer: np.ndarray, start: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """For each of ``inner``, the one of ``outer`` (disjoint ranges on each thread) on its thread
    that contains its start, or -1."""
    found = np.full(len(inner), -1, dtype=np.int64)
    for code in np.unique(thread[inner]).tolist():
        mine = np.flatnonzero(thread[inner] == code)
        theirs = outer[thread[outer] == code]
        theirs = theirs[np.argsort(start[theirs], kind="stable")]
        if not len(theirs):
            continue
        at = np.searchsorted(start[theirs], start[inner[mine]], side="right") - 1
        candidate = theirs[np.maximum(at, 0)]
        inside = (at >= 0) & (start[inner[mine]] < end[candidate])
        found[mine[inside]] = candidate[inside]
    return found


# -- whatif profile --------------------------------------------------------------------------------


def profile_command(
    command: Sequence[str],
    levels: Union[str, Sequence[str]] = LEVELS,
    out: Optional[Path] = None,
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    rounds: int = 1,
) -> dict:
    """Run ``command`` (a training script using :class:`LeveledProfile`) once per level, least
    intrusive first, ``rounds`` times over, into the folder ``out`` (default: ``SCRIPT.xsp``),
    then build the view (:func:`build_view`) and write it there as ``view.json`` and
    ``view.csv``. Alternating the levels round by round spreads each level's steps over the
    same stretch of time, so that a machine busy with other work for a while slows every level
    alike rather than one. An earlier leveled profile in ``out`` is replaced; a folder holding
    anything else is refused. Raises :class:`ProfileError` for an unknown level, a missing
    script, a script that fails or writes no record."""
    levels = parse_levels(levels)
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ProfileError("no command to run: whatif profile [--levels LEVELS] -- python SCRIPT.py ARGS...")
    script = script_of(command)
    if script is not None and not Path(script).is_file():
        raise ProfileError(f"{script}: no such script")
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    for what, value in (("--steps", steps), ("--warmup", warmup), ("--rounds", rounds)):
        if value is not None and value < 1:
            raise ProfileError(f"{what} must be at least 1, not {value}")
    out = Path(out) if out is not None else Path(f"{Path(script).stem if script else 'profile'}.xsp")
    _clear(out)
    shown = shlex.join(command)
    counts = {STEPS_ENV: steps, WARMUP_ENV: warmup}
    inherited = {name: value for name, value in os.environ.items() if name not in counts}
    chosen = {name: str(value) for name, value in counts.items() if value is not None}
    for level, round_ in ((level, r) for r in range(rounds) for level in levels):
        if round_ and not read_runs(out)[level][0]["run"]:
            continue  # a level that cannot run here (the kernel level without a GPU) says so once
        env = inherited | chosen | {
            LEVEL_ENV: level, LEVELS_ENV: ",".join(levels), OUT_ENV: str(out.resolve()), ROUND_ENV: str(round_)
        }
        record = out / (f"{level}.json" if round_ == 0 else f"{level}.{round_}.json")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True)
        except FileNotFoundError:
            raise ProfileError(f"{command[0]}: no such command") from None
        except PermissionError:
            raise ProfileError(f"{command[0]}: not executable") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            why = f": {lines[-1].strip()[:300]}" if lines else ""
            status = f"was killed by signal {-done.returncode}" if done.returncode < 0 else f"exited with status {done.returncode}"
            raise ProfileError(f"`{shown}` {status} at the {level} level{why}")
        if not record.is_file():
            raise ProfileError(
                f"`{shown}` wrote no {record.name} to {out}: does it use whatif.collectors.leveled.LeveledProfile "
                "and call profile.step() every step?"
            )
    return _write_view(out)


def run_levels(
    step: Callable[[], object],
    model,
    out: Union[str, Path],
    levels: Union[str, Sequence[str]] = LEVELS,
    rounds: int = 1,
    steps: int = 10,
    warmup: int = 3,
    name: Optional[str] = None,
) -> dict:
    """Every level in this process: call ``step`` (one training step of ``model``) under a
    :class:`LeveledProfile` of each level in turn, least intrusive first, ``rounds`` times over,
    then build the view and write it into ``out`` as :func:`profile_command` does.

    One process saves a Python start and a torch import per run, which lets the levels
    alternate in more, shorter rounds on a busy machine; the model stays warm between runs (the
    hooks and the profiler of one run are gone before the next begins). Under ``whatif
    profile``, which chooses the level of each process, use :class:`LeveledProfile` alone."""
    if os.environ.get(LEVEL_ENV):
        raise ProfileError(f"run_levels chooses each level itself; {LEVEL_ENV} is set (running under `whatif profile`?)")
    levels = parse_levels(levels)
    out = Path(out)
    _clear(out)
    not_run: set = set()
    for level, round_index in ((level, r) for r in range(rounds) for level in levels):
        if level in not_run:
            continue
        with LeveledProfile(out, model=model, level=level, levels=levels, steps=steps, warmup=warmup, name=name, round_index=round_index) as profile:
            step()
            while profile.step():
                step()
        if not profile.record["run"]:
            not_run.add(level)
    return _write_view(out)


def _write_view(out: Path) -> dict:
    result = build_view(out) | {"folder": str(out)}
    (out / VIEW_FILE).write_text(json.dumps(result, indent=1) + "\n")
    flat_table(result).to_csv(out / TABLE_FILE, index=False)
    return result


def _clear(out: Path) -> None:
    """Make ``out`` an empty folder, removing an earlier leveled profile's files, refusing others."""
    if out.exists() and not out.is_dir():
        raise ProfileError(f"{out}: exists and is not a folder")
    if out.is_dir():
        present = list(out.iterdir())
        others = [p.name for p in present if p.name not in (VIEW_FILE, TABLE_FILE) and _round_of(p.name) is None]
        if others:
            raise ProfileError(f"{out}: refusing to write into a folder that holds other files ({others[0]}) than a leveled profile")
        for p in present:
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
