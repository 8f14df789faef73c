"""XSP's automated pipeline over our model zoo: every model at every level, one table, a few plots.

For each model of ``examples/zoo.py`` (five families, three sizes) one process runs the model
once per level (model, layer, operator; kernel where a GPU is present) and again, the levels
alternating round after round (``examples/zoo.py MODEL --levels ... --rounds R``, which calls
``run_levels``; ``whatif profile`` would start a process per level and round, and the torch
import each costs would double the pipeline's time), and the view it builds is reduced to one
row of ``zoo.csv``:

- the step time at each level and each level's overhead against the model level, with the
  profiler events per step and the overhead per event at the operator level;
- where the time goes at the layer level (leaf modules' forward, their backward, and the rest
  of the step: loss, optimizer, data loading, functional code between modules), each from the
  layer run;
- how much longer the layers take in the operator run than in the layer run (XSP's point: a
  profiler inflates the levels above the one it measures);
- where it goes at the operator level, from the operator run: matrix products and
  convolutions (recurrent and attention kernels included), normalization, embeddings, other
  operators, and the time between operators (Python, the framework's dispatch, the profiler).

The models run with glibc's memory trimming off (``STEADY_ALLOCATOR``), so that no level
owes its speed to the pages an earlier run left mapped. The plots: ``where_time_goes.png`` (both breakdowns, as shares of the step, per model) and
``overhead.png`` (each level's overhead per model, and the operator level's cost per event, on
the process's CPU time, which other processes on a shared machine disturb far less than the
wall clock; the table has both).
Each model's full hierarchy stays in ``OUT/MODEL.xsp/view.csv``. The machine's load is printed
with the figures: the development machine is shared, and a busy core inflates step times.

    .venv/bin/python bench/xsp_zoo.py [--quick] [--steps N] [--warmup N] [--rounds R] [--models A,B] [--out DIR]

By default every level runs four times per model, 5 measured steps a run: 20 steps per level,
of which the faster half count, the levels alternating so that a burst of other work on the
machine slows them alike. ``--quick`` profiles the small size of each family in one round of 5
steps (under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)
from whatif.collectors.host import cpu_model  # noqa: E402
from whatif.collectors.xsp.levels import LEVELS  # noqa: E402
from whatif.collectors.xsp.view import VIEW_FILE, flat_table  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
import torch  # noqa: E402
from zoo import ZOO  # noqa: E402

from whatif.collectors.capture import STEADY_ALLOCATOR  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "out" / "xsp"
LAYER_PARTS = ("layers forward", "layers backward", "outside layers")
OPERATOR_FAMILIES = {  # first match wins, on the lower-cased operator name
    "matmul & conv": re.compile(r"linear|addmm|bmm|matmul|conv|attention|lstm|rnn|(^|::)mm"),
    "normalization": re.compile(r"norm"),
    "embedding": re.compile(r"embedding"),
}
OPERATOR_PARTS = tuple(OPERATOR_FAMILIES) + ("other operators", "between operators")


def summarize(name: str, view: dict) -> dict:
    """One row of the zoo table from a model's view."""
    entry = ZOO[name]
    row = {"model": name, "family": entry.family, "size": entry.size, "batch": entry.batch_size}
    for level, info in view["overhead"].items():
        if info["run"]:
            row[f"{level}_step_ms"] = info["step_ms"]
            row[f"{level}_cpu_step_ms"] = info["cpu_step_ms"]
            if level != "model":
                row[f"{level}_overhead_pct"] = info["overhead_pct"]
                row[f"{level}_cpu_overhead_pct"] = info["cpu_overhead_pct"]
    operator = view["overhead"].get("operator", {})
    row["events_per_step"] = operator.get("events_per_step")
    row["overhead_us_per_event"] = operator.get("overhead_us_per_event")
    row["cpu_overhead_us_per_event"] = operator.get("cpu_overhead_us_per_event")
    table = flat_table(view)
    if "layer" in view["sources"]:
        layers = table[table["level"] == "layer"]
        step_ms = view["view"]["by_level"]["layer"]
        row["layers forward"] = layers.loc[layers["name"].str.endswith("(forward)"), "at_layer_ms"].sum()
        row["layers backward"] = layers.loc[layers["name"].str.endswith("(backward)"), "at_layer_ms"].sum()
        row["outside layers"] = step_ms - row["layers forward"] - row["layers backward"]
        if layers["at_operator_ms"].notna().any():
            row["layers_under_profiler_pct"] = 100 * (layers["at_operator_ms"].sum() / layers["at_layer_ms"].sum() - 1)
    if "operator" in view["sources"]:
        operators = table[(table["level"] == "operator") & table["at_operator_ms"].notna()]
        family = operators["name"].str.lower().map(_family)
        for part in OPERATOR_PARTS[:-1]:
            row[part] = operators.loc[family == part, "at_operator_ms"].sum()
        row["between operators"] = view["view"]["by_level"]["operator"] - operators["at_operator_ms"].sum()
    return row


def _family(name: str) -> str:
    return next((family for family, pattern in OPERATOR_FAMILIES.items() if pattern.search(name)), "other operators")


def plot_breakdown(table: pd.DataFrame, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.38 * len(table) + 2.4), sharey=True)
    for ax, parts, step, title in (
        (axes[0], LAYER_PARTS, "layer_step_ms", "layer level: leaf modules"),
        (axes[1], OPERATOR_PARTS, "operator_step_ms", "operator level: operators"),
    ):
        shares = table[list(parts)].div(table[step], axis=0).clip(lower=0) * 100
        left = pd.Series(0.0, index=table.index)
        for part in parts:
            ax.barh(table["model"], shares[part], left=left, label=part)
            left += shares[part]
        ax.set_xlabel("% of the step")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    axes[0].invert_yaxis()
    fig.suptitle("Where the time goes, by level and model (each from its own level's run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overhead(table: pd.DataFrame, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.38 * len(table) + 2.4), sharey=True)
    y = range(len(table))
    for offset, level in ((-0.2, "layer"), (0.2, "operator")):
        column = f"{level}_cpu_overhead_pct"
        if column in table:
            axes[0].barh([i + offset for i in y], table[column], height=0.4, label=level)
    axes[0].axvline(0, color="black", linewidth=0.8)
    axes[0].set_xlabel("CPU time per step over the model level's, %")
    axes[0].set_title("profiling overhead per level")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    axes[1].barh(list(y), table["cpu_overhead_us_per_event"])
    axes[1].set_xlabel("CPU us per profiler event")
    axes[1].set_title("operator level: overhead per recorded event")
    axes[0].set_yticks(list(y), table["model"])
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(table: pd.DataFrame) -> str:
    """The headline columns as a Markdown table, for docs/validation/xsp.md."""
    columns = {
        "model": "model",
        "model_step_ms": "model ms",
        "layer_cpu_overhead_pct": "layer CPU +%",
        "operator_overhead_pct": "operator wall +%",
        "operator_cpu_overhead_pct": "operator CPU +%",
        "events_per_step": "events/step",
        "cpu_overhead_us_per_event": "CPU us/event",
        "layers_under_profiler_pct": "layers under profiler +%",
        "layers backward": "bwd in layers %",
        "outside layers": "outside layers %",
        "matmul & conv": "matmul+conv %",
        "between operators": "between ops %",
    }
    shown = table.copy()
    for part in ("layers backward", "outside layers"):
        shown[part] = 100 * shown[part] / shown["layer_step_ms"]
    for part in ("matmul & conv", "between operators"):
        shown[part] = 100 * shown[part] / shown["operator_step_ms"]
    shown = shown[[c for c in columns if c in shown]].rename(columns=columns)
    lines = ["| " + " | ".join(shown.columns) + " |", "|---" + "|--:" * (len(shown.columns) - 1) + "|"]
    for row in shown.itertuples(index=False):
        cells = [row[0]] + [f"{v:+.0f}" if "+%" in c else f"{v:.1f}" if isinstance(v, float) else str(v)
                            for c, v in zip(shown.columns[1:], row[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small size of each family, fewer steps")
    parser.add_argument("--steps", type=int, help="measured steps per run (default: 5)")
    parser.add_argument("--warmup", type=int, help="steps before them (default: 2)")
    parser.add_argument("--rounds", type=int, help="rounds of all levels, alternating (default: 4, quick: 1)")
    parser.add_argument("--models", help="comma-separated zoo models (default: all, quick: the small ones)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO)})")
    args = parser.parse_args(argv)
    steps = args.steps or 5
    warmup = args.warmup or 2
    rounds = args.rounds or (1 if args.quick else 4)
    if args.models:
        names = args.models.split(",")
        unknown = [n for n in names if n not in ZOO]
        if unknown:
            parser.error(f"unknown zoo model {unknown[0]!r}; the zoo: {', '.join(ZOO)}")
    else:
        names = [n for n, e in ZOO.items() if e.size == "small" or not args.quick]
    args.out.mkdir(parents=True, exist_ok=True)
    levels = LEVELS if torch.cuda.is_available() else LEVELS[:-1]

    print(f"code:    {code_version()}")
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}, {platform.platform()}")
    print(f"load:    {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min averages at the start)")
    print(f"runs:    {len(names)} models x levels {', '.join(levels)} x {rounds} rounds; {warmup} warm-up and {steps} measured steps each, one thread"
          + ("" if levels == LEVELS else "; no GPU, so no kernel level"))
    started = time.perf_counter()
    rows = []
    for name in names:
        began = time.perf_counter()
        folder = args.out / f"{name}.xsp"
        command = [sys.executable, str(REPO / "examples" / "zoo.py"), name, "--levels", ",".join(levels),
                   "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup), "--out", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ | STEADY_ALLOCATOR)
        if done.returncode != 0:
            print(f"{name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        view = json.loads((folder / VIEW_FILE).read_text())
        rows.append(summarize(name, view))
        print(f"  {name:20s} model {rows[-1]['model_step_ms']:8.2f} ms   operator {rows[-1]['operator_step_ms']:8.2f} ms   "
              f"({time.perf_counter() - began:.0f} s)", flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "zoo.csv", index=False, float_format="%.4f")
    plot_breakdown(table, args.out / "where_time_goes.png")
    plot_overhead(table, args.out / "overhead.png")
    print(f"load:    {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end; {time.perf_counter() - started:.0f} s in all")
    print(f"written: {args.out / 'zoo.csv'}, where_time_goes.png, overhead.png, and MODEL.xsp/ per model\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
