"""Figures for a design doc: the scaling curve and the per-configuration breakdown.

Where the results are of parallel jobs (``parallelism`` and ``exposed_<dimension>_ms``
columns, ``report/cluster.py``), each parallelism is its own series and the exposed
communication bar is split by dimension: each dimension's exposed time scaled so that the parts
add up to the exposed communication (a dimension's exposed time counts time another one's
overlaps too, so they may add up to more)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd

from .timeline import write_atomically


def _configuration(frame: pd.DataFrame) -> pd.Series:
    return frame["machines"].astype(str) + "x" + frame["gpus_per_machine"].astype(str)


def _series_label(row) -> str:
    parallelism = getattr(row, "parallelism", None)
    return f"{row.inter_node_gbps:g} Gbps, {row.framework}, {row.policy}" + (
        f", {parallelism}" if isinstance(parallelism, str) else "")


def _exposed_by_dimension(frame: pd.DataFrame) -> tuple[dict, dict]:
    """The breakdown's columns and names with the exposed communication split by dimension
    (added to ``frame``), or the plain three where the results have no dimensions."""
    colours = {"compute_ms": "#4c72b0", "exposed_comm_ms": "#dd8452", "idle_ms": "#c7c7c7"}
    names = {"compute_ms": "compute", "exposed_comm_ms": "exposed communication", "idle_ms": "idle"}
    dimensions = [c for c in frame.columns if c.startswith("exposed_") and c.endswith("_ms") and c != "exposed_comm_ms"]
    if not dimensions:
        return colours, names
    parts = frame[dimensions].fillna(0.0)
    total = parts.sum(axis=1).to_numpy()
    scale = np.divide(frame["exposed_comm_ms"].to_numpy(), total, out=np.zeros_like(total), where=total > 0)
    palette = ["#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3"]
    colours, names = {"compute_ms": colours["compute_ms"]}, {"compute_ms": "compute"}
    for column, colour in zip(dimensions, palette):
        frame[f"plot_{column}"] = parts[column].to_numpy() * scale
        colours[f"plot_{column}"] = colour
        names[f"plot_{column}"] = f"exposed {column[len('exposed_'):-len('_ms')]} communication"
    frame["plot_exposed_other"] = np.where(total > 0, 0.0, frame["exposed_comm_ms"].to_numpy())
    colours["plot_exposed_other"], names["plot_exposed_other"] = "#ccb974", "exposed communication (other)"
    colours["idle_ms"], names["idle_ms"] = "#c7c7c7", "idle (and pipeline bubble)"
    return colours, names


def plot_scenario(results: pd.DataFrame, path: Path, title: str = "") -> None:
    """Two panels: throughput speed-up against configuration (1x1 ... 4x2), one line per
    bandwidth (and framework / policy where the grid varies them), with ideal scaling dashed;
    and stacked bars of compute, exposed communication and idle time per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = results.copy()
    frame["configuration"] = _configuration(frame)
    order = frame.sort_values(["workers", "machines"])["configuration"].drop_duplicates().tolist()
    position = {c: i for i, c in enumerate(order)}
    frame["x"] = frame["configuration"].map(position)
    frame["series"] = [_series_label(r) for r in frame.itertuples()]

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, group in frame.groupby("series", sort=False):
        group = group.sort_values("x")
        curve.plot(group["x"], group["speedup"], marker="o", label=label)
    ideal = frame.drop_duplicates("configuration").sort_values("x")
    curve.plot(ideal["x"], ideal["workers"], "k--", linewidth=1, label="ideal (linear)")
    curve.set_xticks(range(len(order)), order)
    curve.set_xlabel("machines x GPUs per machine")
    curve.set_ylabel("throughput speed-up over 1x1")
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)
    curve.set_title("Scaling")

    series = frame["series"].unique().tolist()
    width = 0.8 / max(len(series), 1)
    colours, names = _exposed_by_dimension(frame)
    for k, label in enumerate(series):
        group = frame[frame["series"] == label].sort_values("x")
        x = group["x"] + (k - (len(series) - 1) / 2) * width
        bottom = 0
        for column, colour in colours.items():
            bars.bar(x, group[column], width, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5,
                     label=names[column] if k == 0 else None)
            bottom = bottom + group[column].to_numpy()
    bars.set_xticks(range(len(order)), order)
    bars.set_xlabel("machines x GPUs per machine")
    if len(series) > 1:
        bars.text(0.0, 1.0, "bars, left to right: " + "; ".join(series), transform=bars.transAxes,
                  fontsize=7, va="bottom", ha="left")
    bars.set_ylabel("iteration time, ms")
    bars.legend(fontsize=8)
    bars.set_title("Where the iteration goes", pad=14 if len(series) > 1 else 6)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=130)
    finally:
        plt.close(fig)
    write_atomically(Path(path), image.getvalue())
