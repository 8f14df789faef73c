"""Figures for a design doc: the scaling curve and the per-configuration breakdown.

The x axis orders the configurations by machines, then GPUs per machine (1x1, 1x2, 2x1, 2x2,
...); each series (a bandwidth, framework and policy) is drawn as one line per GPUs-per-machine
count, so that every line follows machines and rises as it should instead of rising and falling
between 1x2 and 2x1. Series that predict the same are drawn side by side (each its own marker,
shifted a little along x) and named as the same in the legend, rather than hiding each other.
Both legends sit below their panels, never on the data; the title is the scenario's ``name``
and ``description`` where it has them.

Where the results are of parallel jobs (``parallelism`` and ``exposed_<dimension>_ms``
columns, ``report/cluster.py``), each parallelism is its own series and the exposed
communication bar is split by dimension: each dimension's exposed time scaled so that the parts
add up to the exposed communication (a dimension's exposed time counts time another one's
overlaps too, so they may add up to more)."""

from __future__ import annotations

import io
import re
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from .intervals import LEVEL
from .timeline import write_atomically

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
#: two series whose speed-ups differ by less than this (relative) everywhere are the same line
SAME = 1e-3


def configuration_order(results: pd.DataFrame) -> list[str]:
    """The configurations ``MxG`` of ``results``, by machines, then GPUs per machine."""
    shapes = results[["machines", "gpus_per_machine"]].drop_duplicates().astype(int)
    shapes = shapes.sort_values(["machines", "gpus_per_machine"])
    return [f"{m}x{g}" for m, g in zip(shapes["machines"], shapes["gpus_per_machine"])]


def _layout(parallelism) -> str:
    """A parallelism's label without its data-parallel degree, which follows the cluster's size:
    ``tp8 pp2(1f1b m4) fsdp`` for ``dp32 tp8 pp2(1f1b m4) fsdp``; ``data parallel`` alone."""
    if not isinstance(parallelism, str):
        return ""
    return re.sub(r"^dp\d+\s*", "", parallelism).strip() or "data parallel"


def series_labels(frame: pd.DataFrame) -> tuple[list[str], str]:
    """Each row's series (its bandwidth, framework, policy and parallel layout) named by what
    varies across the results, and what every row shares, for the figure's heading: a grid of
    parallel layouts on one fabric is ``tp8 fsdp``, not ``3200 Gbps, ddp, fifo, dp64 tp8 fsdp``
    sixteen times. A layout's data-parallel degree follows the cluster's size, so one layout on
    8 and 64 machines is one series, one line of the scaling curve."""
    parts = [("{} per machine", [f"{g:g} Gbps" for g in frame["inter_node_gbps"]]),
             ("framework {}", frame["framework"].astype(str).tolist()),
             ("policy {}", frame["policy"].astype(str).tolist())]
    parts += [("{}", frame[c].astype(str).tolist()) for c in frame.attrs.get("described", ()) if c in frame]
    if "parallelism" in frame:
        parts.append(("{}", [_layout(p) for p in frame["parallelism"]]))
    varying = [column for _, column in parts if len(set(column)) > 1]
    shared = ", ".join(form.format(column[0]) for form, column in parts if len(set(column)) == 1 and column[0])
    if not varying:
        return [", ".join(column[0] for _, column in parts if column[0])] * len(frame), ""
    return [", ".join(v for v in values if v) for values in zip(*varying)], shared


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
    other = np.where(total > 0, 0.0, frame["exposed_comm_ms"].fillna(0.0).to_numpy())
    if other.any():  # configurations whose communication has no dimension
        frame["plot_exposed_other"] = other
        colours["plot_exposed_other"], names["plot_exposed_other"] = "#ccb974", "exposed communication (other)"
    if "bubble_ms" in frame and frame["bubble_ms"].fillna(0.0).any():  # the schedule's fill and drain apart
        bubble = np.minimum(frame["bubble_ms"].fillna(0.0).to_numpy(), frame["idle_ms"].to_numpy())
        frame["plot_bubble_ms"], frame["plot_idle_ms"] = bubble, frame["idle_ms"].to_numpy() - bubble
        colours["plot_bubble_ms"], names["plot_bubble_ms"] = "#8c8c8c", "pipeline bubble (fill and drain)"
        colours["plot_idle_ms"], names["plot_idle_ms"] = "#c7c7c7", "idle"
        return colours, names
    colours["idle_ms"], names["idle_ms"] = "#c7c7c7", "idle (and pipeline bubble)"
    return colours, names


def _error_bars(central: pd.Series, low: pd.Series, high: pd.Series) -> np.ndarray:
    """Matplotlib's ``yerr`` for an interval: the distances below and above the central value
    (none, 0, where a configuration has no interval)."""
    below = (central - low).to_numpy(dtype=float)
    above = (high - central).to_numpy(dtype=float)
    return np.nan_to_num(np.vstack([below, above]), nan=0.0)


def same_as(frame: pd.DataFrame, series: list[str]) -> dict:
    """For each series whose speed-ups equal an earlier series' (within :data:`SAME`), that
    earlier series."""
    curves = {label: frame[frame["series"] == label].set_index("configuration")["speedup"] for label in series}
    found = {}
    for i, label in enumerate(series):
        for earlier in series[:i]:
            a, b = curves[label].align(curves[earlier], join="outer")
            if earlier not in found and np.allclose(a, b, rtol=SAME, atol=0.0, equal_nan=False):
                found[label] = earlier
                break
    return found


def plot_scenario(results: pd.DataFrame, path: Path, title: str = "", subtitle: str = "") -> None:
    """Two panels: throughput speed-up against configuration (1x1, 1x2, 2x1 ... by machines),
    one line per series and GPUs-per-machine count, with ideal scaling in thin black; and
    stacked bars of compute, exposed communication and idle time per configuration, one bar per
    series. Both show each configuration's prediction interval as error bars. ``title`` (bold) and ``subtitle`` (wrapped) head the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    frame = results.copy()
    frame["configuration"] = [f"{int(m)}x{int(g)}" for m, g in zip(frame["machines"], frame["gpus_per_machine"])]
    order = configuration_order(frame)
    position = {c: i for i, c in enumerate(order)}
    frame["x"] = frame["configuration"].map(position)
    frame["series"], shared = series_labels(frame)
    if shared:
        subtitle = f"{subtitle} Every configuration: {shared}." if subtitle else f"Every configuration: {shared}."
    series = frame["series"].unique().tolist()
    duplicates = same_as(frame, series)
    per_machine = sorted(frame["gpus_per_machine"].astype(int).unique())
    style = {g: LINESTYLES[i % len(LINESTYLES)] for i, g in enumerate(per_machine)}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shift = 0.08 if len(series) > 1 else 0.0

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(13, 5.2))
    handles = []
    for k, label in enumerate(series):
        colour, marker = colours[k % len(colours)], MARKERS[k % len(MARKERS)]
        offset = (k - (len(series) - 1) / 2) * shift
        group = frame[frame["series"] == label]
        for g in per_machine:
            line = group[group["gpus_per_machine"].astype(int) == g].sort_values("machines")
            curve.plot(line["x"] + offset, line["speedup"], color=colour, marker=marker, linestyle=style[g],
                       markersize=6, linewidth=1.5, markerfacecolor="white" if k in (1, 3, 5) else colour)
            if "iteration_ms_low" in line:  # the interval's iterations as speed-ups: a slower one, a lower one
                line = line[line["iteration_ms_low"].notna()]  # no bar where a configuration has no interval
                low = line["speedup"] * line["iteration_ms"] / line["iteration_ms_high"]
                high = line["speedup"] * line["iteration_ms"] / line["iteration_ms_low"]
                curve.errorbar(line["x"] + offset, line["speedup"], yerr=_error_bars(line["speedup"], low, high),
                               fmt="none", ecolor=colour, elinewidth=1, capsize=3, alpha=0.7)
        shown = label + (f" (same as {duplicates[label]})" if label in duplicates else "")
        handles.append(Line2D([], [], color=colour, marker=marker, linestyle="-", label=shown,
                              markerfacecolor="white" if k in (1, 3, 5) else colour))
    ideal = frame.drop_duplicates("configuration")
    for g in per_machine:
        line = ideal[ideal["gpus_per_machine"].astype(int) == g].sort_values("machines")
        if len(line) == 1:  # one configuration: a line through one point would not show; a dash across it does
            x = float(line["x"].iat[0])
            curve.hlines(float(line["machines"].iat[0] * line["gpus_per_machine"].iat[0]), x - 0.4, x + 0.4,
                         color="black", linewidth=0.8, linestyles=style[g], alpha=0.6)
            continue
        curve.plot(line["x"], line["machines"] * line["gpus_per_machine"], color="black", linewidth=0.8,
                   linestyle=style[g], alpha=0.6)
    handles.append(Line2D([], [], color="black", linewidth=0.8, alpha=0.6, label="ideal (linear)"))
    if len(per_machine) > 1:
        handles += [Line2D([], [], color="grey", linestyle=style[g], label=f"{g} GPU{'s' if g > 1 else ''} per machine")
                    for g in per_machine]
    curve.set_xticks(range(len(order)), order)
    curve.set_xlim(-0.5, len(order) - 0.5)
    curve.set_xlabel("machines x GPUs per machine")
    curve.set_ylabel("throughput speed-up over 1x1")
    curve.grid(alpha=0.3)
    curve.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    curve.set_title("Scaling")

    width = 0.8 / max(len(series), 1)
    intervals_named = False
    colours, names = _exposed_by_dimension(frame)
    for k, label in enumerate(series):
        group = frame[frame["series"] == label].sort_values("x")
        x = group["x"] + (k - (len(series) - 1) / 2) * width
        bottom = 0
        for column, colour in colours.items():
            bars.bar(x, group[column], width, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5,
                     label=names[column] if k == 0 else None)
            bottom = bottom + group[column].to_numpy()
        if "iteration_ms_low" in group and group["iteration_ms_low"].notna().any():
            known = group["iteration_ms_low"].notna().to_numpy()
            shown = group[known]
            bars.errorbar(x[known], shown["iteration_ms"], fmt="none", ecolor="black", elinewidth=1, capsize=3,
                          yerr=_error_bars(shown["iteration_ms"], shown["iteration_ms_low"], shown["iteration_ms_high"]),
                          label=f"{100 * LEVEL:g} % interval" if not intervals_named else None)
            intervals_named = True
    bars.set_xticks(range(len(order)), order)
    bars.set_xlabel("machines x GPUs per machine")
    bars.set_ylabel("iteration time, ms")
    note = "bars of a configuration, left to right: the series in the order of the left legend" if len(series) > 1 else None
    legend = bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False,
                         title=note, title_fontsize=7)
    legend._legend_box.align = "left"
    bars.set_title("Where the iteration goes")
    if title:
        fig.suptitle(title, fontweight="bold", y=0.995)
    if subtitle:
        fig.text(0.5, 0.935 if title else 0.97, "\n".join(textwrap.wrap(subtitle, 150)), ha="center", va="top",
                 fontsize=8.5)
    with warnings.catch_warnings():  # long legends leave tight_layout no room; savefig's tight box fits them
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout(rect=(0, 0, 1, 0.9 if subtitle else 0.95))
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=130, bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomically(Path(path), image.getvalue())
