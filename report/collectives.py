"""Figures of one collective against message size: what ``whatif collective`` predicts and what
``whatif calibrate nccl-tests`` fitted to a user's own tables.

Both draw nccl-tests' bus bandwidth (GB/s, 1e9 bytes/s) against the size on a log2 axis, the
way nccl-tests' users read their tables: a flat line at the top is the fabric's rate, the slope on
the left is latency. The predicted curve marks each size with the algorithm and protocol NCCL
would choose there, so a change of choice shows as a change of marker. A calibration gets one
panel per measured table: the measured rows as points (hollow where the fit left a row out), the
fitted prediction as a line through the same sizes, each panel titled with its median and
largest |error|.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # as report/plots.py's, without its pandas import


def _size_label(size: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size:g}"


def _size_axis(axis, sizes: list) -> None:
    axis.set_xscale("log", base=2)
    lo, hi = int(math.floor(math.log2(min(sizes)))), int(math.ceil(math.log2(max(sizes))))
    step = max(1, (hi - lo) // 8)
    ticks = [2.0 ** k for k in range(lo, hi + 1, step)]
    axis.set_xticks(ticks)
    axis.set_xticklabels([_size_label(t) for t in ticks])
    axis.set_xlabel("message size (bytes)")
    axis.grid(True, which="major", alpha=0.3)


def _save(fig, path: Path) -> None:
    from .timeline import write_atomically

    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=150, bbox_inches="tight")
    write_atomically(Path(path), buffer.getvalue())


def plot_collective(rows: list, path: Path, title: str) -> None:
    """``whatif collective``'s rows (``bytes``, ``busbw_gbps``, ``algorithm``, ``protocol``): the
    predicted bus bandwidth, each size marked by the algorithm/protocol chosen there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.8))
    sizes = [r["bytes"] for r in rows]
    axis.plot(sizes, [r["busbw_gbps"] for r in rows], color="0.6", linewidth=1.2, zorder=1)
    choices = list(dict.fromkeys(f"{r['algorithm']}/{r['protocol']}" for r in rows))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, choice in enumerate(choices):
        picked = [r for r in rows if f"{r['algorithm']}/{r['protocol']}" == choice]
        axis.scatter([r["bytes"] for r in picked], [r["busbw_gbps"] for r in picked], marker=MARKERS[k % len(MARKERS)],
                     color=colours[k % len(colours)], label=choice, zorder=2)
    _size_axis(axis, sizes)
    axis.set_ylabel("bus bandwidth (GB/s)")
    axis.set_ylim(bottom=0)
    axis.set_title(title, fontsize=10)
    axis.legend(title="NCCL's choice", fontsize=8, loc="upper left")
    _save(fig, path)
    plt.close(fig)


def plot_calibration(tables: list, fitted: list, left_out: set, path: Path) -> None:
    """One panel per nccl-tests table (``topology.nccl_tests.Table``): its measured bus bandwidth
    as points (hollow: left out of the fit), the calibrated prediction as a line (``fitted``:
    ``topology.calibrate.FittedRow``s, matched to their table by path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from whatif.topology.nccl_tests import bus_factor

    columns = min(3, len(tables))
    rows_of_panels = math.ceil(len(tables) / columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(5.2 * columns, 3.8 * rows_of_panels), squeeze=False)
    for axis in axes.flat[len(tables):]:
        axis.set_visible(False)
    for axis, table in zip(axes.flat, tables):
        mine = sorted((r for r in fitted if r.table == table.path), key=lambda r: r.size_bytes)
        factor = bus_factor(table.op, table.n_ranks) if table.n_ranks else 1.0
        label = "bus bandwidth (GB/s)" if table.n_ranks or factor == 1.0 else "algorithm bandwidth (GB/s)"
        sizes = [r.size_bytes for r in mine]
        if not mine:
            axis.set_visible(False)
            continue
        busbw = lambda us, size: size / us / 1e3 * factor  # noqa: E731 (GB/s)
        axis.plot(sizes, [busbw(r.predicted_us, r.size_bytes) for r in mine], color="C1", linewidth=1.5,
                  label="calibrated prediction")
        kept = [r for r in mine if (r.table, r.size_bytes) not in left_out]
        out = [r for r in mine if (r.table, r.size_bytes) in left_out]
        axis.scatter([r.size_bytes for r in kept], [busbw(r.measured_us, r.size_bytes) for r in kept], color="C0",
                     s=18, zorder=3, label="measured")
        if out:
            axis.scatter([r.size_bytes for r in out], [busbw(r.measured_us, r.size_bytes) for r in out],
                         facecolors="none", edgecolors="C0", s=30, zorder=3, label="measured, left out of the fit")
        errors = sorted(abs(r.error_pct) for r in kept) or [0.0]
        ranks = f", {table.n_ranks} ranks" if table.n_ranks else ""
        axis.set_title(f"{Path(table.path).name}\n{table.op}{ranks}: median |error| {errors[len(errors) // 2]:.1f} %, "
                       f"max {errors[-1]:.1f} %", fontsize=8)
        _size_axis(axis, sizes)
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
