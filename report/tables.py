"""The tables the commands print, and their rows as JSON records.

Each table is a pandas frame rendered as text: numbers to two decimals (one for the operator
models' errors), missing values as ``-``, long names cut to :data:`SHOWN_NAME_CHARS`. The frames
themselves come from the rest of ``report/``; the commands choose what to print.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .intervals import LEVEL

#: How many operator types and path tasks the tables show (JSON and CSV have them all).
SHOWN_ROWS = 15
#: Kernel names run to hundreds of characters of template arguments; tables cut them here.
SHOWN_NAME_CHARS = 72

_ITERATION_COLUMNS = {
    "name": "iteration",
    "measured_ms": "measured ms",
    "replay_ms": "replay ms",
    "predicted_ms": "predicted ms",
    "error_pct": "error %",
    "speedup": "speed-up",
    "gpu_busy_ms": "GPU busy ms",
    "gpu_idle_ms": "GPU idle ms",
    "sync_wait_ms": "sync wait ms",
    "collective_wait_ms": "collective wait ms",
    "transfer_ms": "transfer ms",
}
_RESULT_COLUMNS = {
    "machines": "machines",
    "gpus_per_machine": "GPUs/machine",
    "inter_node_gbps": "Gbps",
    "framework": "framework",
    "policy": "policy",
    "parallelism": "parallelism",
    "iteration_ms": "iteration ms",
    "speedup": "speed-up",
    "scaling_efficiency": "efficiency",
    "exposed_comm_ms": "exposed comm ms",
    "comm_ms": "comm ms",
    "bubble_ms": "bubble ms",
    "memory_gb": "GB/GPU",
    "fits": "fits",
    "collectives": "collectives",
}
_HELD_OUT_COLUMNS = {
    "held_out": "held-out shapes", "from_traces": "from traces", "roofline_gmae_pct": "roofline GMAE %",
    "gmae_pct": "GMAE %", "swept_gmae_pct": "on swept %", "traced_gmae_pct": "on traced %",
    "median_abs_error_pct": "median |error| %",
}


def json_records(frame: pd.DataFrame) -> list[dict]:
    """The rows as dicts, a missing or infinite number as None (JSON has neither)."""
    return [{k: json_number(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def json_number(value):
    """``value``, or None where it is a missing or infinite number."""
    return None if isinstance(value, float) and not np.isfinite(value) else value


def iteration_table(report: pd.DataFrame) -> str:
    """A per-iteration report (``report.iterations``) as ``whatif replay`` and ``simulate`` show it."""
    shown = report[[c for c in report.columns if c in _ITERATION_COLUMNS]].rename(columns=_ITERATION_COLUMNS)
    return shown.to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-")


def results_table(results: pd.DataFrame) -> str:
    """A cluster prediction's results, one row per configuration, as ``whatif predict`` shows them:
    the iteration's prediction interval (``iteration_ms_low`` to ``iteration_ms_high``) as one
    column ``90 % interval`` beside it, ``-`` where there is none."""
    names = dict(_RESULT_COLUMNS)
    if "iteration_ms_low" in results.columns:
        results = results.copy()
        results["interval"] = [f"{low:.2f}-{high:.2f}" if np.isfinite(low) and np.isfinite(high) else "-"
                               for low, high in zip(results["iteration_ms_low"], results["iteration_ms_high"])]
        at = list(names).index("iteration_ms") + 1
        names = dict([*list(names.items())[:at], ("interval", f"{100 * LEVEL:g} % interval"), *list(names.items())[at:]])
    described = [c for c in results.attrs.get("described", ()) if c in results.columns]
    if described:  # what tells rows of one cluster size apart (hardware, nccl, intra_node ...), after the policy
        at = list(names).index("policy") + 1
        names = dict([*list(names.items())[:at], *((c, c.replace("_", " ")) for c in described), *list(names.items())[at:]])
    for column in results.columns:  # a parallel job's exposed communication by dimension
        if column.startswith("exposed_") and column.endswith("_ms") and column not in names:
            names[column] = column.replace("_", " ")
    shown = results.rename(columns=names)[[v for k, v in names.items() if k in results.columns]]
    return shown.to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-")


def named_table(frame: pd.DataFrame, text_columns: tuple) -> str:
    """``frame`` as text, the ``text_columns`` left-aligned and cut to :data:`SHOWN_NAME_CHARS`."""
    frame = frame.copy()
    formatters = {}
    for column in text_columns:
        cut = frame[column].astype(str).map(lambda s: s if len(s) <= SHOWN_NAME_CHARS else s[: SHOWN_NAME_CHARS - 3] + "...")
        width = max([len(column), *cut.str.len()])
        frame[column] = cut
        formatters[column] = lambda s, width=width: f"{s:<{width}}"
    return frame.to_string(index=False, float_format=_number, na_rep="-", formatters=formatters)


def _number(value: float) -> str:
    return "-" if not np.isfinite(value) else f"{value:.2f}"


def held_out_table(table: pd.DataFrame) -> str:
    """The operator models' errors on held-out shapes (``perfmodels.fit.held_out_report``)."""
    return table.rename(columns=_HELD_OUT_COLUMNS).to_string(index=False, float_format=lambda v: f"{v:.1f}")


def levels_table(result: dict) -> str:
    """What each XSP profiling level cost per step (``collectors/xsp``), and the levels not run."""
    rows, not_run = [], []
    for level, info in result["overhead"].items():
        if not info["run"]:
            not_run.append(f"{level}: not run, {info['reason']}")
            continue
        rows.append({
            "level": level,
            "step ms": info["step_ms"],
            "overhead %": info["overhead_pct"],
            "CPU ms": info["cpu_step_ms"],
            "CPU overhead %": info["cpu_overhead_pct"],
            "events/step": info["events_per_step"],
            "CPU us/event": info["cpu_overhead_us_per_event"],
        })
    table = pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-")
    return "\n".join([table] + not_run)


def profile_table(frame: pd.DataFrame) -> str:
    """Rows of an XSP view (``collectors.xsp.view.flat_table``), to three decimals."""
    return frame.to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="-")
