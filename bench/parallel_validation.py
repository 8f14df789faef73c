"""Parallel validation: real FSDP2, TP, PP, EP and FSDP+TP runs on the emulated cluster.

For every variant (``lab/parallel.py``'s ``VARIANTS``: fsdp, tp, tp+sp, pp-gpipe, pp-1f1b, ep,
fsdp+tp) on 2 machines x 1 worker at every bandwidth and on 1 machine x 2 workers (loopback),
and FSDP+TP on 2 machines x 2 workers at every bandwidth: capture the single-worker traces the
predictions start from (once per model and batch), run the setting for real ``--repeats`` times
and keep the median run, and, with ``--predictor MODULE:FUNCTION``, predict it
(``lab.parallel.Predictor``: ``f(setting, captures, work) -> ms``); without one ``predicted_ms``
stays empty, for a predictor to fill later from the kept captures (``--repredict``, which runs
the lab only to measure a tensor-parallel point's library cost where its record lacks it:
``lab.parallel.measure_tensor_dispatch``, once per model, batch and sequence parallelism, and an
FSDP point's: ``measure_fsdp_dispatch``, once per model and batch).

Writes ``parallel_validation.csv`` and ``parallel_validation.json`` under ``--out`` (default
``bench/out/parallel_validation``), rewritten as each setting finishes (``--resume`` goes on from
there), and prints each setting's median run with the spread of the runs.

Needs root and network namespaces. Run it alone: it measures CPU time, and anything else on the
machine's cores shows up in the runs. ``--smoke`` is a quick look (3 timed steps after 2 of
warm-up, 2 runs, 200 Mbps only), not a measurement.

    sudo .venv/bin/python bench/parallel_validation.py [--variants fsdp,tp,...] [--bandwidths 200,1000]
        [--no-loopback] [--repeats 3] [--steps 20] [--warmup 5] [--predictor MODULE:FUNCTION]
        [--resume | --repredict] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

from measured_code import code_version
from whatif.lab.parallel import (
    FSDP_FAMILIES, TENSOR_FAMILIES, VARIANTS, as_record, default_settings, measure_fsdp_dispatch,
    measure_tensor_dispatch, point_of_record, predict_point, run_campaign, write_campaign,
)


def load_predictor(spec: str):
    """``MODULE:FUNCTION`` imported."""
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--predictor {spec!r}: give MODULE:FUNCTION")
    return getattr(importlib.import_module(module), name)


def repredict(out: Path, predictor) -> list:
    """The measured points of ``out`` predicted again from their kept captures."""
    path = out / "parallel_validation.json"
    if not path.exists():
        raise SystemExit(f"--repredict: no measurements in {path}")
    points = [point_of_record(r) for r in json.loads(path.read_text())["points"]]
    work = (out / "work").resolve()
    for point in points:
        s = point.setting
        if point.status == "ok" and s.family in TENSOR_FAMILIES and "tensor_dispatch" not in point.captures:
            point.captures["tensor_dispatch"] = str(measure_tensor_dispatch(s.model, s.batch_size, s.sequence_parallel, work))
        if point.status == "ok" and s.family in FSDP_FAMILIES and "fsdp_dispatch" not in point.captures:
            point.captures["fsdp_dispatch"] = str(measure_fsdp_dispatch(s.model, s.batch_size, work))
        if point.status == "ok":
            predict_point(point, predictor, work)
    write_campaign(out, [as_record(p) for p in points])
    return points


def family_table(points: list) -> list[str]:
    """Per family (``setting.family``: tp with and without sequence parallelism, pp under both
    schedules) and per NIC rate (loopback for one machine): the number of predicted points, the
    mean and the worst absolute error, as ``docs/validation/parallel.md`` tabulates them, and
    where every point has its anchor runs the same with the box's speed at the runs."""
    groups: dict = {}
    for p in points:
        if p.status == "ok" and p.error_pct is not None:
            where = "loopback" if p.setting.bandwidth_mbps is None else f"{p.setting.bandwidth_mbps:g} Mbps"
            groups.setdefault((p.setting.family, where), []).append((abs(p.error_pct), p.anchored_error_pct))
    lines = [f"{'family':8} {'network':10} {'points':>6} {'mean |error| %':>15} {'worst |error| %':>16}"
             f" {'anchored: mean':>15} {'worst':>6}"]
    for (family, where), rows in sorted(groups.items()):
        errors = [e for e, _ in rows]
        anchored = [abs(a) for _, a in rows if a is not None]
        shown = f" {sum(anchored) / len(anchored):15.1f} {max(anchored):6.1f}" if len(anchored) == len(rows) else ""
        lines.append(f"{family:8} {where:10} {len(rows):6d} {sum(errors) / len(errors):15.1f} {max(errors):16.1f}{shown}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--bandwidths", default="200,1000", help="Mbps")
    parser.add_argument("--no-loopback", action="store_true", help="leave out the 1 machine x 2 workers settings")
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank; a pipeline's whole batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steady-allocator", action="store_true")
    parser.add_argument("--predictor", metavar="MODULE:FUNCTION")
    parser.add_argument("--out", type=Path, default=Path("bench/out/parallel_validation"))
    parser.add_argument("--resume", action="store_true", help="keep the settings already measured")
    parser.add_argument("--repredict", action="store_true", help="run nothing: predict the measured settings again")
    parser.add_argument("--smoke", action="store_true", help="3 steps after 2, 2 runs, 200 Mbps: a quick look")
    args = parser.parse_args(argv)
    predictor = load_predictor(args.predictor) if args.predictor else None
    print(f"{'predicting with' if args.repredict else 'measuring'} the code of {code_version()}", flush=True)
    if args.repredict:
        if predictor is None:
            raise SystemExit("--repredict needs --predictor")
        points = repredict(args.out, predictor)
    else:
        if args.smoke:
            args.steps, args.warmup, args.repeats, args.bandwidths = 3, 2, 2, "200"
        settings = default_settings(args.variants.split(","), [float(b) for b in args.bandwidths.split(",")],
                                    not args.no_loopback, args.batch_size, args.microbatches)
        points = run_campaign(settings, args.out, args.repeats, args.steps, args.warmup, predictor,
                              args.steady_allocator, args.resume, progress=lambda line: print(line, flush=True))
    measured = [p for p in points if p.status == "ok"]
    predicted = [p for p in measured if p.error_pct is not None]
    print(f"{len(measured)} of {len(points)} settings measured; largest spread of runs "
          f"{max((p.spread_pct for p in measured), default=math.nan):.1f} %")
    if predicted:
        mae = sum(abs(p.error_pct) for p in predicted) / len(predicted)
        print(f"{len(predicted)} predicted: mean absolute error {mae:.1f} %")
        anchored = [abs(p.anchored_error_pct) for p in predicted if p.anchored_error_pct is not None]
        if anchored:
            print(f"{len(anchored)} with the box's speed at the runs (anchor runs, faster-cpu): mean absolute "
                  f"error {sum(anchored) / len(anchored):.1f} %")
        print("\n".join(family_table(predicted)))
    print(f"written to {args.out / 'parallel_validation.csv'}")
    return 0 if len(measured) == len(points) else 1


if __name__ == "__main__":
    sys.exit(main())
