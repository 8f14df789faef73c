"""Coverage of whatif's prediction intervals: against a lab campaign's real runs, and against
iterations held out of real traces.

``whatif predict`` gives every configuration a central value and a 90 % interval
(``report/intervals.py``: from the spread of the trace's own iterations, each simulated in the
scenario). Two checks of that interval:

1. **Real runs** (``--campaign DIR``, repeatable): a lab campaign's output folder, as
   ``bench/validation_grid.py`` writes it (``validation.csv``; the captures and calibrations
   under ``DIR/work``: ``work/captures/MODEL_1x1.bundle``, ``work/links/links_Bmbps.yaml``) or as
   ``bench/parallel_validation.py`` writes it (``parallel_validation.json``, whose points name
   their captures; the calibrations under ``DIR/work/links``). Every measured point is
   predicted again from what the campaign kept, as the campaign predicts it (``lab/validate.py``
   ``validation_scenario``, ``bench/parallel_predictor.py`` ``scenario``), and its interval is
   held against the real run's median (``measured_ms``, the median of the repeated runs: the
   figure the target is about) and against each repeated run's median (``runs_ms``). Each
   point is predicted twice: on its calibration without runs (the interval of the iterations,
   widened to hold each other capture process's prediction where the bundle notes them) and
   with each run of the calibration (``whatif predict`` widens the interval to hold their
   predictions, ``report/intervals.py``; the target is about this one): from the links file's
   ``runs``, or for a
   calibration made before they were written, from the per-run probe records its folder kept
   (``work/links/calibration_B``). Where a campaign kept no calibration (one run without a
   predictor), ``--links DIR`` names a folder of them; none is ever measured from here. Target:
   the 90 % interval covers the real run's median in at least 85 % of points. Its width is
   reported as the mean of ``(high - low) / central``, beside the narrowest width that would
   have covered 85 % of the points had every interval been ``central * exp(+-h)`` with one
   ``h`` for all (what "not wider than it needs to be" is held against).
2. **Held-out iterations** (``--traces DIR``, default ``../shared/traces``, and every capture
   of the campaigns): in every trace of at least six ``ProfilerStep`` iterations (one held out,
   the rest keeps the three steady ones ``report/intervals.py`` needs for an interval), each
   steady iteration (not the first, not the last) in turn is left out, the interval is made from
   the trace without it, exactly as a prediction makes it (the steady iterations of what is left,
   replayed), and held against the left-out iteration's measured time. This needs no lab: the
   real GPU traces check that the interval holds what the next iteration does.

Writes under ``--out`` (default ``bench/out/interval_coverage``) ``points.csv`` (one row per
campaign point), ``held_out.csv`` (one row per left-out iteration) and ``summary.json``; prints
both checks' coverage and width and PASS or FAIL against the target (a check without data says
so and is neither).

    nice -n 19 .venv/bin/python bench/interval_coverage.py --campaign /work/wt/lab-par/bench/out/parallel_validation
    nice -n 19 .venv/bin/python bench/interval_coverage.py --no-campaign    # the held-out check alone
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import yaml

from measured_code import code_version
from whatif.collectors.diagnostics import warn
from whatif.collectors.iterations import find_iterations
from whatif.collectors.load import load_trace
from whatif.collectors.kineto import TraceError
from whatif.report.intervals import LEVEL, MIN_ITERATIONS as INTERVAL_MIN_STEADY, steady_interval
from whatif.report.iterations import steady_median

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"
COVERAGE_TARGET = 0.85
# a trace must keep an interval with one iteration held out: the rest's steady iterations (all but
# its first and last) must number at least the interval's minimum
MIN_ITERATIONS = INTERVAL_MIN_STEADY + 3


def campaign_points(folder: Path) -> list[dict]:
    """Every measured point of a campaign folder, each with how to predict it again: ``kind``
    (``grid`` or ``parallel``), a label, ``measured_ms``, ``runs_ms`` and the arguments of its
    prediction."""
    grid, parallel = folder / "validation.csv", folder / "parallel_validation.json"
    if grid.exists():
        with grid.open() as f:
            rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
        return [_grid_point(folder, r) for r in rows]
    if parallel.exists():
        from whatif.lab.parallel import point_of_record

        points = [point_of_record(r) for r in json.loads(parallel.read_text())["points"]]
        from whatif.lab.parallel import LOOPBACK_MBPS
        from whatif.lab.validate import links_path

        work = (folder / "work").resolve()
        return [{"kind": "parallel", "label": p.setting.label, "measured_ms": p.measured_ms, "runs_ms": list(p.runs_ms),
                 "campaign_predicted_ms": p.predicted_ms, "setting": p.setting,
                 "captures": {k: Path(v) for k, v in p.captures.items()}, "work": work,
                 "links": links_path(p.setting.bandwidth_mbps or LOOPBACK_MBPS, work)}
                for p in points if p.status == "ok"]
    raise SystemExit(f"{folder}: neither validation.csv (bench/validation_grid.py) nor parallel_validation.json "
                     "(bench/parallel_validation.py) is there")


def _grid_point(folder: Path, row: dict) -> dict:
    from whatif.lab.validate import capture_path, links_path

    work = (folder / "work").resolve()
    bandwidth = next(float(v) for v in (row.get("calibrated_at_mbps"), row["bandwidth_mbps"], "400") if v not in (None, ""))
    where = f" @ {float(row['bandwidth_mbps']):g} Mbps" if row["bandwidth_mbps"] else " (one machine)"
    return {"kind": "grid", "label": f"{row['model']} {row['machines']}x{row['gpus_per_machine']}{where} {row['framework']}",
            "measured_ms": float(row["measured_ms"]),
            "runs_ms": [float(v) for v in row.get("runs_ms", "").split(";") if v] or [float(row["measured_ms"])],
            "campaign_predicted_ms": float(row["predicted_ms"]) if row.get("predicted_ms") else None,
            "trace": capture_path(row["model"], work), "links": links_path(bandwidth, work),
            "machines": int(row["machines"]), "gpus": int(row["gpus_per_machine"]), "bandwidth": bandwidth,
            "framework": "horovod" if row["framework"] == "single" else row["framework"]}


def predicted_row(point: dict, links_file: Path) -> dict:
    """The point predicted again on ``links_file``: its results row, with the interval."""
    from whatif.pipeline import predict

    needed = [point["trace"]] if point["kind"] == "grid" else list(point["captures"].values())
    for path in needed:
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} (kept by the campaign) is missing")
    if point["kind"] == "grid":
        from whatif.lab.validate import validation_scenario

        scenario = validation_scenario(point["trace"], links_file, point["machines"], point["gpus"],
                                       point["bandwidth"], point["framework"])
    else:
        sys.path.insert(0, str(REPO / "bench"))
        from parallel_predictor import scenario as parallel_scenario

        scenario = parallel_scenario(point["setting"], point["captures"], point["work"], links_file)
    return predict(scenario.request()).results.iloc[0].to_dict()


def links_variants(links: Path, out: Path) -> dict:
    """The campaign's calibration as two links files written under ``out``: ``iterations``
    without calibration runs (the interval of the iterations alone), ``calibrated`` with them,
    from the file's own ``runs`` or else from the per-run probe records its calibration folder
    kept (``lab/calibrate.py``'s ``calibrations_of_runs``; none where neither exists). The
    campaign's own file is never written: where it is missing, so is the point's prediction (a
    calibration is not run from here)."""
    from whatif.lab.calibrate import calibrations_of_runs

    if not links.exists():
        raise FileNotFoundError(f"{links} (the campaign's calibration) is missing")
    doc = yaml.safe_load(links.read_text())
    bandwidth = float(links.stem.removeprefix("links_").removesuffix("mbps"))
    runs = doc.get("runs") or [{k: v for k, v in run.items() if k != "measured"}
                               for run in calibrations_of_runs(links.parent / f"calibration_{bandwidth:g}", bandwidth)]
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for variant, kept in (("iterations", []), ("calibrated", runs)):
        path = out / f"{links.stem}.{variant}.yaml"
        path.write_text(yaml.safe_dump({**{k: v for k, v in doc.items() if k != "runs"}, "runs": kept}, sort_keys=False))
        written[variant] = path
    written["calibration_runs"] = len(runs)
    return written


def check_campaigns(folders: list[Path], out: Path, links_dir: Optional[Path] = None) -> pd.DataFrame:
    """One row per measured point of the campaigns: measured, and the prediction with its
    interval without the calibration's runs (the iterations', and the capture processes' where
    the bundle notes them) and with them; where a campaign kept
    no calibration for a point, ``links_dir``'s (``links_Bmbps.yaml``), if given."""
    rows = []
    for number, folder in enumerate(folders):
        for point in campaign_points(folder):
            base = {"campaign": str(folder), "point": point["label"], "measured_ms": point["measured_ms"],
                    "runs_ms": ";".join(f"{ms:.2f}" for ms in point["runs_ms"])}
            kept = point["links"]
            if not kept.exists() and links_dir is not None:
                kept = links_dir / kept.name
                base["links"] = str(kept)
            try:
                links = links_variants(kept, out / "links" / str(number))
                plain = predicted_row(point, links["iterations"])
                calibrated = predicted_row(point, links["calibrated"]) if links["calibration_runs"] else plain
            except Exception as err:  # noqa: BLE001 - a point that cannot be predicted is reported, not fatal
                rows.append({**base, "status": f"not predicted: {type(err).__name__}: {err}"})
                print(f"{point['label']}: not predicted ({err})", flush=True)
                continue
            row = {**base, "status": "ok", "predicted_ms": plain["iteration_ms"],
                   "campaign_predicted_ms": point["campaign_predicted_ms"],
                   "error_pct": 100.0 * (plain["iteration_ms"] / point["measured_ms"] - 1),
                   "calibration_runs": links["calibration_runs"]}
            for variant, predicted in (("iterations", plain), ("calibrated", calibrated)):
                low, high = predicted["iteration_ms_low"], predicted["iteration_ms_high"]
                row.update({f"{variant}_low_ms": low, f"{variant}_high_ms": high,
                            f"{variant}_width_pct": 100.0 * (high - low) / predicted["iteration_ms"],
                            f"{variant}_covers": bool(low <= point["measured_ms"] <= high),
                            f"{variant}_runs_covered": sum(low <= ms <= high for ms in point["runs_ms"]),
                            # the interval's width around the median run: the runs' spread alone,
                            # without the model's error
                            f"{variant}_runs_within_width": sum(
                                low / predicted["iteration_ms"] <= ms / point["measured_ms"] <= high / predicted["iteration_ms"]
                                for ms in point["runs_ms"])})
            row["runs"] = len(point["runs_ms"])
            rows.append(row)
            print(f"{point['label']}: measured {point['measured_ms']:.1f} ms (runs {base['runs_ms']}), predicted "
                  f"{row['predicted_ms']:.1f} ({row['error_pct']:+.1f} %); {100 * LEVEL:g} % interval "
                  f"{row['iterations_low_ms']:.1f}-{row['iterations_high_ms']:.1f} without the calibration's runs "
                  f"({'covers' if row['iterations_covers'] else 'misses'}), {row['calibrated_low_ms']:.1f}-"
                  f"{row['calibrated_high_ms']:.1f} with {links['calibration_runs']} calibration runs "
                  f"({'covers' if row['calibrated_covers'] else 'misses'})", flush=True)
    return pd.DataFrame(rows)


def held_out(trace: Path) -> list[dict]:
    """Each steady iteration of ``trace`` left out in turn, the interval from the rest."""
    from whatif.pipeline import Request, predict

    try:
        iterations = find_iterations(load_trace(trace))
    except TraceError as err:
        warn(str(trace), 1, f"left out of the held-out check ({err})")
        return []
    if len(iterations) < MIN_ITERATIONS:
        return []
    report = predict(Request(trace, remove_profiler_overhead=False)).report  # the replay: every iteration
    times = report["predicted_ms"]
    rows = []
    for k in range(1, len(times) - 1):
        rest = times.drop(index=times.index[k])
        central = steady_median(rest)
        low, high = steady_interval(rest)
        measured = float(report["measured_ms"].iloc[k])
        rows.append({"trace": str(trace), "iteration": report["name"].iloc[k], "measured_ms": measured,
                     "central_ms": central, "low_ms": low, "high_ms": high, "width_pct": 100.0 * (high - low) / central,
                     "covered": bool(low <= measured <= high)})
    return rows


def needed_width_pct(central: np.ndarray, measured: np.ndarray, share: float = COVERAGE_TARGET) -> float:
    """The width (% of the central value) of intervals ``central * exp(+-h)``, one ``h`` for all,
    that would just cover ``share`` of the measured values."""
    h = float(np.quantile(np.abs(np.log(measured / central)), share))
    return 100.0 * (math.exp(h) - math.exp(-h))


def summarise(name: str, covered: pd.Series, width_pct: pd.Series, central, measured) -> dict:
    if not len(covered):
        print(f"{name}: no data")
        return {"points": 0}
    out = {"points": int(len(covered)), "coverage": float(covered.mean()), "mean_width_pct": float(width_pct.mean()),
           "median_width_pct": float(width_pct.median()),
           "needed_width_pct": needed_width_pct(np.asarray(central, float), np.asarray(measured, float))}
    verdict = "PASS" if out["coverage"] >= COVERAGE_TARGET else "FAIL"
    print(f"{name}: the {100 * LEVEL:g} % interval covers {int(covered.sum())} of {len(covered)} "
          f"({100 * out['coverage']:.0f} %, target >= {100 * COVERAGE_TARGET:.0f} %): {verdict}; mean width "
          f"{out['mean_width_pct']:.1f} % of the central value (median {out['median_width_pct']:.1f} %), against "
          f"{out['needed_width_pct']:.1f} % that one width for all would need to cover {100 * COVERAGE_TARGET:.0f} %")
    out["verdict"] = verdict
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", type=Path, action="append", default=[],
                        help="a lab campaign's output folder (bench/validation_grid.py's or bench/parallel_validation.py's)")
    parser.add_argument("--no-campaign", action="store_true", help="the held-out check alone")
    parser.add_argument("--links", type=Path, metavar="DIR",
                        help="calibrations (links_Bmbps.yaml, calibration_B/) for points whose campaign kept none")
    parser.add_argument("--traces", type=Path, default=SHARED, help="real traces for the held-out check")
    parser.add_argument("--out", type=Path, default=Path("bench/out/interval_coverage"))
    args = parser.parse_args(argv)
    if not args.campaign and not args.no_campaign:
        parser.error("give --campaign DIR (a lab campaign's output), or --no-campaign for the held-out check alone")
    print(f"measuring the code of {code_version()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"code": code_version(), "level": LEVEL}

    points = check_campaigns(args.campaign, args.out.resolve(), args.links)
    points.to_csv(args.out / "points.csv", index=False)
    ok = points[points["status"] == "ok"] if len(points) else points
    for variant, what in (("iterations", "without the calibration's runs"), ("calibrated", "with the calibration's runs")):
        if not len(ok):
            break
        name = f"campaign, {what}: the real run's median"
        summary[f"campaign_{variant}"] = summarise(name, ok[f"{variant}_covers"], ok[f"{variant}_width_pct"],
                                                   ok["predicted_ms"], ok["measured_ms"])
        covered, runs = int(ok[f"{variant}_runs_covered"].sum()), int(ok["runs"].sum())
        within = int(ok[f"{variant}_runs_within_width"].sum())
        summary[f"campaign_{variant}"].update(runs_covered=f"{covered} of {runs}", runs_within_width=f"{within} of {runs}")
        print(f"campaign, {what}: every repeated run's median: {covered} of {runs} inside; {within} of {runs} within "
              "the interval's width around the median run (the runs' spread against the width, the model's error aside)")
    if len(ok):
        with_runs = int((ok["calibration_runs"] > 0).sum())
        print(f"campaign: {with_runs} of {len(ok)} points had a calibration with its runs kept")
    elif args.campaign:
        print("campaign: no measured point could be predicted")

    traces = sorted(args.traces.rglob("*.json.gz")) if args.traces.is_dir() else []
    captures = sorted({Path(c) for folder in args.campaign for c in _captures(folder)})
    rows = [row for trace in traces + captures for row in held_out(trace)]
    left_out = pd.DataFrame(rows)
    left_out.to_csv(args.out / "held_out.csv", index=False)
    if len(left_out):
        for source, group in left_out.groupby(left_out["trace"].map(lambda t: Path(t).name), sort=False):
            print(f"  {source}: {int(group['covered'].sum())} of {len(group)} covered, "
                  f"mean width {group['width_pct'].mean():.1f} %")
        summary["held_out"] = summarise("held-out iterations", left_out["covered"], left_out["width_pct"],
                                        left_out["central_ms"], left_out["measured_ms"])
    else:
        print(f"held-out iterations: no trace of at least {MIN_ITERATIONS} iterations")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    # the target is the interval a prediction gives (with the calibration's runs); the variant
    # without them says what those runs add, and passes or fails nothing
    failed = any(part.get("verdict") == "FAIL" for key, part in summary.items()
                 if isinstance(part, dict) and key != "campaign_iterations")
    return 1 if failed else 0


def _captures(folder: Path) -> list:
    """The captures a campaign kept (their bundles)."""
    return sorted((folder / "work" / "captures").glob("*.bundle"))


if __name__ == "__main__":
    sys.exit(main())
