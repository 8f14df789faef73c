"""What the critical paths of a schedule (``sim/critical_path.py``) are made of, task by task."""

from __future__ import annotations

import numpy as np
import pandas as pd

from whatif.sim.critical_path import CriticalPath
from whatif.sim.engine import Schedule


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
