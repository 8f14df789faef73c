"""The across-level view of a leveled profile: one hierarchy, and what each level's profiling costs.

XSP (Li et al., "XSP: Across-Stack Profiling and Analysis of Machine Learning Models on GPUs",
IPDPS 2020) takes each level's latencies from the least intrusive run that measures them and
correlates the levels into one across-stack hierarchy. :func:`build_view` reads the runs of a
profile folder (:func:`~whatif.collectors.xsp.levels.read_runs`) into the hierarchy model ->
layer -> operator -> kernel and the overhead of each level, its step time against the model
level's (:func:`profiler_overhead`); :func:`flat_table` flattens it to one row per node.
Operators outside every leaf module (the loss, the optimizer, functional code in a non-leaf
``forward``) hang under the model directly, as do their kernels. A layer's latency and its
operators' come from different runs, so their sum can exceed it where the profiler's
bookkeeping inside the operators outweighs the hooks' own time in the layer run.

The two runs can disagree much more than that on one layer: a step in which the machine took the
core away for a few milliseconds inside that layer (a scheduler's time slice on a shared
machine) adds them to the layer in that run only. Every node therefore also keeps, per run, the
range of its per-step times over the kept steps, and :func:`level_disagreements` lists the layers
whose two runs differ by more than a factor :data:`DISAGREEMENT_FACTOR`: ``noise`` where one
run's range reaches the other's (a preempted step, not a property of the layer: more steps or
rounds on a quieter machine settle it), ``systematic`` where even the ranges stay that far
apart (the profiler's per-operator cost, or a layer whose work really differs between runs).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd

from ..iterations import find_iterations
from ..kineto import EventKind, TraceError
from ..load import load_trace
from .levels import LAYER_RANGE, LEVELS, PROFILER_LEVELS, VERSION, ProfileError, read_runs

VIEW_FORMAT = "whatif-leveled-view"
VIEW_FILE = "view.json"
TABLE_FILE = "view.csv"
TABLE_COLUMNS = ["level", "name", "parent", "latency_ms", "calls_per_step", "measured_at_level"]
_EVALUATE = "autograd::engine::evaluate_function: "
DISAGREEMENT_FACTOR = 2.0


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
            for path, latency_ms, calls, range_ms in m["rows"].get(level, []):
                _measured_by(_descendant(root, path, level), run, latency_ms, calls, range_ms)
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
    result["disagreements"] = level_disagreements(result)
    return result


def level_disagreements(result: dict, factor: float = DISAGREEMENT_FACTOR) -> list[dict]:
    """The layers whose latency in the layer run and in the operator run differ by more than
    ``factor`` either way, largest ratio first: ``{"name", "layer_ms", "operator_ms", "ratio",
    "layer_range_ms", "operator_range_ms", "verdict"}``. ``verdict`` is ``"noise"`` where the
    runs' per-step ranges come within ``factor`` of each other (some step of one run was that slow
    or that fast too), else ``"systematic"``. Views written before the ranges were kept give
    ``"unknown"``."""
    found = []

    def visit(node: dict) -> None:
        by_level = node["by_level"]
        if node["level"] == "layer" and "layer" in by_level and "operator" in by_level:
            layer_ms, operator_ms = by_level["layer"], by_level["operator"]
            low, high = sorted((layer_ms, operator_ms))
            if high > factor * max(low, 1e-6):
                ranges = node.get("range_by_level", {})
                layer_range, operator_range = ranges.get("layer"), ranges.get("operator")
                if layer_range is None or operator_range is None:
                    verdict = "unknown"
                else:
                    (slow_low, _), (_, fast_high) = (
                        (operator_range, layer_range) if operator_ms > layer_ms else (layer_range, operator_range))
                    verdict = "systematic" if slow_low > factor * max(fast_high, 1e-6) else "noise"
                found.append({"name": node["name"], "layer_ms": layer_ms, "operator_ms": operator_ms,
                              "ratio": high / max(low, 1e-6), "layer_range_ms": layer_range,
                              "operator_range_ms": operator_range, "verdict": verdict})
        for child in node["children"]:
            visit(child)

    visit(result["view"])
    return sorted(found, key=lambda d: -d["ratio"])


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
        "range_by_level": {},
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


def _measured_by(node: dict, run: str, latency_ms: float, calls: float, range_ms: Optional[list] = None) -> None:
    """Note what the run at level ``run`` measured for ``node`` (its mean per step and, below the
    model, the range of its per-step times); the first run to measure it, the least intrusive
    (runs come in LEVELS order), gives its latency."""
    if node["measured_at_level"] is None:
        node["latency_ms"], node["calls_per_step"], node["measured_at_level"] = latency_ms, calls, run
    node["by_level"][run] = latency_ms
    if range_ms is not None:
        node["range_by_level"][run] = range_ms


def _measure(records: list[dict], folder: Path) -> dict:
    """One level's step time and what it measured, over its rounds: per level, rows (path
    below the model, mean latency in ms per kept step, mean calls per kept step, [lowest,
    highest] of its per-step latencies in ms over the kept steps, a step without it counting 0)."""
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
    totals: dict[str, dict] = defaultdict(dict)  # level -> path -> [total_us, calls, {step: us}] over the kept steps
    events = 0.0
    for r, record in enumerate(records):
        mine = [i for round_, i in kept if round_ == r]
        if record["level"] == "layer":
            layers = pd.DataFrame(record["layers"], columns=["step", "layer", "pass", "total_us", "calls"])
            layers["step"] -= record["warmup_steps"]
            layers["path"] = [(_layer_label(layer, phase),) for layer, phase in zip(layers["layer"], layers["pass"])]
            _add_step_sums(totals["layer"], layers, mine, r)
        elif record["level"] in PROFILER_LEVELS:
            measured = len(record["step_ms"]) - record["warmup_steps"]
            frames, count = _trace_frames(folder / record["trace"], record.get("layer_sequence_nr"), measured)
            for level, frame in frames.items():
                if level != "kernel" or record["level"] == "kernel":
                    _add_step_sums(totals[level], frame, mine, r)
            events += float(np.isin(count["step"], mine).sum())
    if records[0]["level"] in PROFILER_LEVELS:
        out["events_per_step"] = events / len(kept)
    out["rows"] = {
        level: [(path, total_us / 1e3 / len(kept), calls / len(kept), _range_ms(per_step, len(kept)))
                for path, (total_us, calls, per_step) in paths.items()]
        for level, paths in totals.items()
    }
    return out


def _layer_label(layer: str, phase: str) -> str:
    return f"{layer} ({phase})"


def _range_ms(per_step: dict, kept: int) -> list:
    """[lowest, highest] per-step time in ms over ``kept`` steps, of which ``per_step`` (step ->
    us) holds those the node appeared in."""
    values = list(per_step.values()) + [0.0] * (kept - len(per_step))
    return [min(values) / 1e3, max(values) / 1e3]


def _add_step_sums(totals: dict, frame: pd.DataFrame, steps: list[int], round_: int) -> None:
    """Add to ``totals`` (path -> [total_us, calls, {(round, step): us}], in order of first
    appearance) the sums over ``steps`` of round ``round_``'s frame with columns path, step,
    total_us, calls."""
    chosen = frame[frame["step"].isin(steps)]
    for (path, step), total_us, calls in chosen.groupby(["path", "step"], sort=False)[["total_us", "calls"]].sum().itertuples():
        entry = totals.setdefault(path, [0.0, 0.0, {}])
        entry[0] += total_us
        entry[1] += calls
        entry[2][(round_, step)] = entry[2].get((round_, step), 0.0) + total_us


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
