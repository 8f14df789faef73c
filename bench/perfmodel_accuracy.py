"""Operator performance models: per-family error on held-out shapes, and what the sweep costs.

Runs the microbenchmark sweep on this machine (``sim/perfmodels/sweep.py``; ``--quick`` for the
short one), adds the operator calls of the bundled CPU traces (``--no-traces`` leaves them out),
fits the models (``sim/perfmodels/fit.py``) five times, each time holding out another fifth of every
family's shapes (a cross-validation: every shape is predicted once by a model that did not see
it), and prints per family the geometric-mean absolute error (GMAE) on the held-out shapes, with
the roofline alone and with the family's full model. ``--out`` keeps the first fold's models.
Target: under 10 % in every family (the seed paper's figure); the script exits 1 naming the
families that miss it.

No model can be closer to a measurement than the measurement is to itself, so ``--repeat`` runs
the sweep a second time on the same shapes and prints, per family, the GMAE between the two
sweeps' timings of the shapes: the noise floor the models' errors should be read
against. ``--samples FILE`` keeps the sweep (JSON): a later run with the same file refits from
it without sweeping again. The samples keep every pass's timing of a shape, so ``--first-passes K``
refits a kept sweep as if it had timed only K passes: how much the extra passes bought.

    .venv/bin/python bench/perfmodel_accuracy.py [--quick] [--no-traces] [--repeat] [--samples SWEEP.json]
        [--passes N] [--first-passes K] [--out MODELS.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

from measured_code import REPO, code_version  # noqa: E402  (bench/ is the script's folder)
from whatif.sim.perfmodels.families import FAMILY_OF
from whatif.sim.perfmodels.fit import (
    FOLDS,
    fit_models,
    geomean_abs_error,
    held_out_report,
    shape_keys,
    trace_samples,
)
from whatif.sim.perfmodels.sweep import run_sweep

TRACES = (REPO / "data" / "convnet_cpu.bundle", REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz")
TARGET_PCT = 10.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-traces", action="store_true", help="fit from the sweep alone")
    parser.add_argument("--out", type=Path, help="also write the fitted models here")
    parser.add_argument("--repeat", action="store_true", help="sweep the same shapes again: the timings' own noise")
    parser.add_argument("--samples", type=Path, help="the sweep's samples: read when the file exists, else written")
    parser.add_argument("--passes", type=int, help="a new sweep times every shape in this many passes (default: the sweep's own)")
    parser.add_argument("--first-passes", type=int, metavar="K",
                        help="time each shape by its fastest of the first K passes only: what fewer passes would have given")
    args = parser.parse_args(argv)
    print(f"code:    {code_version()}")
    print(f"load:    {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min averages at the start)")
    started = time.perf_counter()
    if args.samples and args.samples.exists():
        samples, device, again = read_sweep(args.samples)
        print(f"sweep:   read from {args.samples}")
    else:
        samples, device = run_sweep(quick=args.quick, progress=lambda line: print(f"  {line}"), passes=args.passes)
        again = run_sweep(quick=args.quick, passes=args.passes)[0] if args.repeat else None
        if args.samples:
            write_sweep(args.samples, samples, device, again)
    swept_s = time.perf_counter() - started
    if args.first_passes:
        samples = fastest_of_first_passes(samples, args.first_passes)
    parts, sources = [samples], ["sweep quick" if args.quick else "sweep"]
    if not args.no_traces:
        for trace in TRACES:
            parts.append(trace_samples(trace))
            sources.append(f"trace {trace.relative_to(REPO)}")
    started = time.perf_counter()
    every_sample = pd.concat(parts, ignore_index=True)
    folds = [fit_models(every_sample, device, sources, fold=k) for k in range(FOLDS)]
    fit_s = time.perf_counter() - started
    if args.out:
        folds[0].save(args.out)
    print(f"device:  {device['name']}, {device['threads']} torch thread(s); peak {device['peak_gflops']:g} GFLOP/s, "
          f"memory {device['bandwidth_gbps']:g} GB/s")
    print(f"sweep:   {len(samples)} shapes in {swept_s:.0f} s; {FOLDS} fits, each holding out a fifth of the shapes, "
          f"{fit_s:.1f} s; samples from {', '.join(sources)}\n")
    table = held_out_report(*folds)
    print("| family | model | held-out samples | of them from traces | roofline GMAE % | model GMAE % | "
          "on swept samples % | on traced samples % | median abs error % |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in table.itertuples():
        traced = "" if r.from_traces == 0 else f"{r.traced_gmae_pct:.1f}"
        print(f"| {r.family} | {r.kind} | {r.held_out} | {r.from_traces} | {r.roofline_gmae_pct:.1f} | "
              f"{r.gmae_pct:.1f} | {r.swept_gmae_pct:.1f} | {traced} | {r.median_abs_error_pct:.1f} |")
    if again is not None:
        print_noise_floor(pd.concat([models.held_out for models in folds], ignore_index=True), samples, again)
    missed = table[table["gmae_pct"] >= TARGET_PCT]
    if len(missed):
        print(f"\nMISS: {', '.join(f'{r.family} {r.gmae_pct:.1f} %' for r in missed.itertuples())} "
              f"(target: GMAE under {TARGET_PCT:g} % in every family)")
        return 1
    print(f"\nPASS: every family's held-out GMAE under {TARGET_PCT:g} %")
    return 0


def fastest_of_first_passes(samples: pd.DataFrame, passes: int) -> pd.DataFrame:
    """The sweep as if it had timed ``passes`` passes: each shape at its fastest of the first ones."""
    if "pass_us" not in samples:
        raise SystemExit("--first-passes: this sweep's samples do not keep their passes' timings")
    taken = [times[:passes] for times in samples["pass_us"]]
    if min(map(len, taken)) < passes:
        raise SystemExit(f"--first-passes {passes}: the sweep timed only {min(map(len, taken))} passes")
    print(f"passes:  each shape's fastest of its first {passes} passes")
    return samples.assign(duration_us=[min(times) for times in taken])


def timings_by_shape(sweep: pd.DataFrame) -> pd.Series:
    """A sweep's durations indexed by :func:`shape_keys`, the first timing of a shape drawn twice."""
    timings = pd.Series(sweep["duration_us"].to_numpy(), index=shape_keys(sweep))
    return timings[~timings.index.duplicated()]


def print_noise_floor(held_out: pd.DataFrame, first: pd.DataFrame, second: pd.DataFrame) -> None:
    """Per family, the GMAE between two sweeps' timings of the held-out sweep shapes."""
    first_time, timed_again = timings_by_shape(first), timings_by_shape(second)
    held = shape_keys(held_out)
    held = held[held.isin(timed_again.index) & held.isin(first_time.index)]
    print("\n| family | held-out shapes timed twice | GMAE between the two sweeps % (noise floor) |")
    print("|---|--:|--:|")
    families = held_out.loc[held.index, "op"].map(FAMILY_OF)
    for family in sorted(set(families)):
        keys = held[families == family]
        floor = geomean_abs_error(timed_again[keys].to_numpy(), first_time[keys].to_numpy())
        print(f"| {family} | {len(keys)} | {100 * floor:.1f} |")


def write_sweep(path: Path, samples: pd.DataFrame, device: dict, again) -> None:
    doc = {"device": device, "samples": samples.to_dict("list"),
           "again": None if again is None else again.to_dict("list")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def read_sweep(path: Path):
    doc = json.loads(path.read_text())
    again = doc.get("again")
    return pd.DataFrame(doc["samples"]), doc["device"], None if again is None else pd.DataFrame(again)


if __name__ == "__main__":
    sys.exit(main())
