"""``whatif perfmodel fit|report``: the command-line side of the operator performance models
(``sim/perfmodels/``), and how every command loads a models file (``whatif simulate
--batch-size``'s too)."""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import msgspec
import pandas as pd

from whatif.collectors.diagnostics import report
from whatif.report.tables import held_out_table
from whatif.sim.perfmodels.cache import cache_models, default_models
from whatif.sim.perfmodels.device import current_device
from whatif.sim.perfmodels.fit import fit_models, held_out_report, trace_samples
from whatif.sim.perfmodels.models import DeviceMismatchWarning, PerfModelError, PerfModels, load_models
from whatif.sim.perfmodels.sweep import run_sweep


def add_parsers(sub) -> None:
    """The ``perfmodel`` command and its ``fit`` and ``report`` subcommands."""
    perfmodel = sub.add_parser("perfmodel", help="operator performance models: fit them on this device, report their accuracy")
    commands = perfmodel.add_subparsers(dest="perfmodel_command", required=True)
    fit = commands.add_parser("fit", help="run the microbenchmark sweep (and read traces) and fit the models")
    fit.add_argument("--out", type=Path, metavar="MODELS.json", help="the models file to write")
    fit.add_argument("--cache", action="store_true",
                     help="make the models this machine's default, for --batch-size without --perfmodel")
    fit.add_argument("--quick", action="store_true", help="a sweep of seconds instead of minutes (coarser models)")
    fit.add_argument("--from-trace", action="append", default=[], type=Path, metavar="TRACE",
                     help="also fit from the operator times of this CPU trace or bundle (repeatable)")
    fit.add_argument("--no-sweep", action="store_true", help="fit from the traces alone (no microbenchmarks, no torch)")
    fit.add_argument("--peak-gflops", type=float, help="with --no-sweep: the device's peak GFLOP/s (default: a 1-thread sweep's)")
    fit.add_argument("--bandwidth-gbps", type=float, help="with --no-sweep: the device's memory bandwidth in GB/s")
    fit.add_argument("--threads", type=int, default=1, help="torch intra-op threads, as the traces ran (default: 1)")
    report = commands.add_parser("report", help="per-family geometric-mean error on the held-out shapes")
    report.add_argument("models", type=Path, metavar="MODELS.json")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def load_for_cli(path: Path) -> PerfModels:
    """Load a models file, telling the user on stderr when it was measured on another device."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeviceMismatchWarning)
        models = load_models(path) if path is not None else default_models()
    for warning in caught:
        if issubclass(warning.category, DeviceMismatchWarning):
            report(str(warning.message))  # a warning of the run: --strict makes it an error
    return models


def run(args: argparse.Namespace) -> int:
    if args.perfmodel_command == "fit":
        return _fit(args)
    models = load_for_cli(args.models)
    table = held_out_report(models)
    if args.json:
        out = {"models": str(args.models), "device": models.device, "sources": models.sources,
               "families": table.to_dict(orient="records")}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    device = models.device
    print(f"{args.models}: {device['type']} {device['name']!r}, peak {device['peak_gflops']:g} GFLOP/s, "
          f"memory {device['bandwidth_gbps']:g} GB/s; fitted from {', '.join(models.sources) or 'unknown'}")
    print(held_out_table(table))
    return 0


def _check_fit_arguments(args: argparse.Namespace) -> None:
    """What the sweep's minutes would otherwise end on, checked before it starts."""
    if args.threads < 1:
        raise PerfModelError(f"perfmodel fit --threads {args.threads}: expected a positive whole number")
    for option, value in (("--peak-gflops", args.peak_gflops), ("--bandwidth-gbps", args.bandwidth_gbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PerfModelError(f"perfmodel fit {option} {value}: expected a positive number")
    for trace in args.from_trace:
        if not trace.exists():
            raise PerfModelError(f"perfmodel fit --from-trace {trace}: no such file or bundle")
    if args.out is not None and not args.out.resolve().parent.is_dir():
        raise PerfModelError(f"perfmodel fit --out {args.out}: no such folder {args.out.parent}")


def _fit(args: argparse.Namespace) -> int:
    if args.out is None and not args.cache:
        raise PerfModelError("perfmodel fit: give --out MODELS.json, --cache (this machine's default models), or both")
    if args.no_sweep and not args.from_trace:
        raise PerfModelError("perfmodel fit --no-sweep: give at least one --from-trace TRACE")
    _check_fit_arguments(args)
    started = time.perf_counter()
    parts, sources = [], []
    if args.no_sweep:
        if args.peak_gflops is None or args.bandwidth_gbps is None:
            raise PerfModelError("perfmodel fit --no-sweep: give the device's --peak-gflops and --bandwidth-gbps")
        device = {**current_device(), "threads": args.threads,
                  "peak_gflops": args.peak_gflops, "bandwidth_gbps": args.bandwidth_gbps}
    else:
        try:
            samples, device = run_sweep(quick=args.quick, threads=args.threads,
                                        progress=lambda line: print(f"  {line}", file=sys.stderr))
        except ImportError as err:
            raise PerfModelError(f"perfmodel fit: the microbenchmark sweep needs torch ({err}); or use --no-sweep") from None
        parts.append(samples)
        sources.append("sweep quick" if args.quick else "sweep")
    for trace in args.from_trace:
        samples = trace_samples(trace)
        parts.append(samples)
        sources.append(f"trace {trace} ({len(samples)} operator calls)")
    models = fit_models(pd.concat(parts, ignore_index=True), device, sources)
    written = []
    if args.out is not None:
        models.save(args.out)
        written.append(str(args.out))
    if args.cache:
        written.append(f"{cache_models(models)} (this machine's default models)")
    print(f"wrote {' and '.join(written)}: {len(models.families)} families from {sum(len(p) for p in parts)} samples "
          f"({', '.join(sources)}) in {time.perf_counter() - started:.0f} s; peak {device['peak_gflops']:g} GFLOP/s, "
          f"memory {device['bandwidth_gbps']:g} GB/s")
    print(held_out_report(models)[["family", "kind", "held_out", "gmae_pct"]].to_string(
        index=False, float_format=lambda v: f"{v:.1f}"))
    return 0
