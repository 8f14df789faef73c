"""What the critical paths of a schedule (``sim/critical_path.py``) are made of, task by task, and
the one-line verdict on what bounds a step (:func:`bound_verdict`), which ``whatif simulate``
prints when a what-if gains next to nothing."""

from __future__ import annotations

import numpy as np
import pandas as pd

from whatif.sim.critical_path import CriticalPath, iteration_critical_paths
from whatif.sim.engine import Schedule
from whatif.sim.graph import GPU_TASK_KINDS

#: what each built-in optimization changes, to say why it gained nothing
CHANGES = {
    "amp": "amp speeds GPU kernels only",
    "faster-gpu": "faster-gpu speeds GPU kernels only",
    "fused-optimizer": "fused-optimizer removes only the optimizer step's launches and CPU work",
    "no-dataloader": "no-dataloader removes only data loading",
    "restructure-bn": "restructure-bn changes only batch normalization and ReLU kernels",
    "metaflow-fusion": "metaflow-fusion removes only element-wise kernels after convolutions and GEMMs",
    "gist": "gist adds encode and decode kernels only",
    "vdnn": "vdnn adds copies over PCIe only",
    "gradient-compression": "gradient-compression changes only communication",
    "blueconnect": "blueconnect changes only the all-reduce's algorithm",
}
#: the critical path's kinds (``sim.critical_path.PATH_KINDS``) gathered into what bounds a step
BOUNDS = {
    "CPU-bound": ("cpu", "cpu overhead"),
    "GPU-bound": ("gpu",),
    "communication-bound": ("communication",),
    "bound by waiting": ("synchronisation", "idle"),
}


def path_tasks(schedule: Schedule, paths: list[CriticalPath]) -> pd.DataFrame:
    """The tasks on the paths grouped by name and kind of time, most time first: name, kind, ms,
    share_pct (of all the paths' time), count (how many times a task of that name is on them)."""
    steps = pd.concat([path.steps for path in paths], ignore_index=True)
    steps = steps[steps["task"] >= 0]
    names = schedule.graph.tasks["name"].astype(str).to_numpy()
    total_us = sum(path.end_us - path.start_us for path in paths)
    grouped = (
        steps.assign(name=names[steps["task"].to_numpy()])
        .groupby(["name", "kind"], sort=False)["duration_us"]
        .agg(["sum", "count"])
        .sort_values("sum", ascending=False)
        .reset_index()
    )
    return pd.DataFrame(
        {
            "name": grouped["name"],
            "kind": grouped["kind"],
            "ms": grouped["sum"] / 1e3,
            "share_pct": 100.0 * grouped["sum"] / total_us if total_us > 0 else np.nan,
            "count": grouped["count"],
        }
    )


def gpu_idle_fraction(schedule: Schedule, start_us: float, end_us: float) -> float:
    """The share of ``[start_us, end_us]`` when no GPU task (kernel, copy, memset, collective)
    runs on any stream: 1 for a trace without a GPU."""
    tasks = schedule.graph.tasks
    on_gpu = np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    start = np.clip(schedule.start_us[on_gpu], start_us, end_us)
    end = np.clip(schedule.end_us[on_gpu], start_us, end_us)
    order = np.argsort(start, kind="stable")
    busy, reach = 0.0, start_us
    for s, e in zip(start[order], end[order]):
        if e > reach:
            busy += e - max(s, reach)
            reach = e
    span = end_us - start_us
    return 1.0 - busy / span if span > 0 else float("nan")


def bound_verdict(schedule: Schedule, spans: pd.DataFrame, changes: list[str]) -> str:
    """One line on what bounds the steps of ``schedule`` (the job the what-if changed), from its
    iterations' critical paths (``spans``: as :func:`iteration_critical_paths` takes them), and
    what the what-ifs ``changes`` touch (an optimization's name, said as :data:`CHANGES` says
    it, or a phrase of its own): e.g. "the step is CPU-bound: 82 % of its
    critical path is CPU work, and the GPU is idle 71 % of it; amp speeds GPU kernels only"."""
    paths = iteration_critical_paths(schedule, spans)
    kinds = sum(path.by_kind() for path in paths)
    total = float(kinds.sum())
    if total <= 0:
        return "the steps take no time on their critical path"
    shares = {bound: float(kinds[list(members)].sum()) / total for bound, members in BOUNDS.items()}
    bound = max(shares, key=shares.get)
    idle = np.nanmean([gpu_idle_fraction(schedule, p.start_us, p.end_us) for p in paths])
    parts = {"CPU-bound": "CPU work", "GPU-bound": "GPU kernels", "communication-bound": "communication",
             "bound by waiting": "waiting (synchronisation and idle time)"}
    line = f"the step is {bound}: {100 * shares[bound]:.0f} % of its critical path is {parts[bound]}"
    on_gpu = np.isin(schedule.graph.tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS]).any()
    line += f", and the GPU is idle {100 * idle:.0f} % of it" if on_gpu else " (the trace has no GPU)"
    said = [CHANGES.get(name, name) for name in changes]
    return line + ("; " + "; ".join(said) if said else "")
