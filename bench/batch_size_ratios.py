"""Which model ratio moves a traced operator call to another batch size: roofline or full model.

``sim/passes/batch_size.py`` rescales every batch-carrying operator call of a trace by a ratio of its
family's model at the new and the old shapes. The kept records of
``bench/batch_size_validation.py`` hold, per round, a profiled trace of each example model at
B0 / 2, B0 and 2 B0 from one process, so the ratio can be checked call family by call family:
the calls of the B0 trace, each rescaled by its ratio, against the same calls (operator and
rescaled shapes) in the trace at B; calls inside data loading, which the prediction scales
with the batch, are left out. This is the operator models' share of a batch-size
prediction, without the CPU time around the operators or the profiler correction.

For each family and point (model, batch size, round) the script prints the error of the
rescaled total against the traced one, per kind of ratio: the roofline's alone, and the
roofline times the family's learned correction (the full model, as ``perfmodel_accuracy.py``
scores it on held-out shapes). Points whose B trace does not hold the same number of matching
calls are left out and counted.

    .venv/bin/python bench/batch_size_ratios.py --perfmodel MODELS.json RECORD_DIR [RECORD_DIR ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from batch_size_validation import MODELS, batch_sizes, trace_path  # noqa: E402  (bench/ is the script's folder)
from measured_code import code_version  # noqa: E402

RATIOS = {"roofline": False, "roofline x learned": True}


def modelled_calls(graph) -> tuple[pd.DataFrame, np.ndarray]:
    """The outermost modelled operator calls of a trace's ``graph`` outside data loading (which
    the prediction scales with the batch instead) and their inclusive times (us)."""
    from whatif.sim.passes.batch_size import data_loading_tasks
    from whatif.sim.perfmodels.shapes import operator_units

    loading_events = graph.tasks["event"].to_numpy()[data_loading_tasks(graph)]
    units = operator_units(graph.ops)
    units = units[(units["unit"] == units["row"]) & ~units["row"].isin(loading_events)]
    return units, graph.ops["dur_us"].reindex(units["row"]).to_numpy(dtype=float)


def record_errors(record: Path, models) -> tuple[list[dict], int]:
    """Per family, point and kind of ratio, the rescaled B0 calls' total against the B trace's."""
    from whatif.collectors.load import load_trace
    from whatif.sim.passes.batch_size import parameter_shapes, rescale_dims
    from whatif.sim.build import build_graph
    from whatif.sim.perfmodels.families import FAMILY_OF

    kept = json.loads((record / "results.json").read_text())
    rows, unmatched = [], 0
    for model, base in MODELS.items():
        for round_ in range(kept["rounds"]):
            if not trace_path(record, model, base, round_).exists():
                continue
            traced = build_graph(load_trace(trace_path(record, model, base, round_)))
            units, duration = modelled_calls(traced)
            ops, dims = units["op"].tolist(), units["dims"].tolist()
            types, args = units["types"].tolist(), units["args"].tolist()
            family = np.array([FAMILY_OF.get(op) for op in ops])
            parameters = parameter_shapes(traced)
            at_base = {kind: models.predict_us(ops, dims, types, args, learned=learned) for kind, learned in RATIOS.items()}
            for batch in batch_sizes(model):
                if batch == base:
                    continue
                new_dims = [rescale_dims(op, d, base, batch, parameters) if d else d for op, d in zip(ops, dims)]
                carries = np.array([n != d for n, d in zip(new_dims, dims)])
                there, there_duration = modelled_calls(build_graph(load_trace(trace_path(record, model, batch, round_))))
                there_keys = np.array([json.dumps([op, d]) for op, d in zip(there["op"], there["dims"])])
                keys = np.array([json.dumps([op, d]) for op, d in zip(ops, new_dims)])
                for kind, learned in RATIOS.items():
                    ratio = models.predict_us(ops, new_dims, types, args, learned=learned) / at_base[kind]
                    rescaled = carries & np.isfinite(ratio)
                    for name in sorted(set(family[rescaled])):
                        mine = rescaled & (family == name)
                        wanted = collections.Counter(keys[mine].tolist())
                        matching = np.isin(there_keys, list(wanted))
                        if collections.Counter(there_keys[matching].tolist()) != wanted:
                            unmatched += 1
                            continue
                        predicted = float((duration[mine] * ratio[mine]).sum())
                        measured = float(there_duration[matching].sum())
                        rows.append({"record": record.name, "model": model, "batch": batch, "round": round_,
                                     "family": name, "ratio": kind, "error_pct": 100 * (predicted / measured - 1)})
    return rows, unmatched


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+", help="kept output folders of batch_size_validation.py")
    parser.add_argument("--perfmodel", type=Path, required=True, help="operator models (JSON)")
    parser.add_argument("--out", type=Path, help="write every point's errors here (CSV)")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.records if not (r / "results.json").exists()]
    if missing:
        parser.error(f"not a kept batch-size record (no results.json): {', '.join(missing)}")

    from whatif.sim.perfmodels.models import load_models

    models = load_models(args.perfmodel, check_device=False)
    print(f"code:   {code_version()}\nmodels: {args.perfmodel}")
    rows, unmatched = [], 0
    for record in args.records:
        found, left_out = record_errors(record, models)
        rows += found
        unmatched += left_out
    errors = pd.DataFrame(rows).assign(abs_pct=lambda d: d["error_pct"].abs())
    if args.out:
        errors.to_csv(args.out, index=False)
    print(f"\n{errors.groupby(['record', 'ratio']).ngroups // len(RATIOS)} records; {len(errors) // len(RATIOS)} "
          f"family points (model, batch size, round); {unmatched // len(RATIOS)} left out, their calls not matched")
    print("\nmean |error| of the rescaled calls against the trace at the new batch size, %:\n")
    by_family = errors.pivot_table(index="family", columns="ratio", values="abs_pct", aggfunc="mean")
    by_record = errors.pivot_table(index="record", columns="ratio", values="abs_pct", aggfunc="mean")
    table = pd.concat([by_family, by_record.rename(index=lambda r: f"record {r}")])
    print("| | " + " | ".join(RATIOS) + " |\n|---|" + "--:|" * len(RATIOS))
    for name, row in table.iterrows():
        print(f"| {name} | " + " | ".join(f"{row[kind]:.1f}" for kind in RATIOS) + " |")
    overall = errors.groupby("ratio")["abs_pct"].mean()
    print("\nall points: " + ", ".join(f"{kind} {overall[kind]:.1f} %" for kind in RATIOS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
