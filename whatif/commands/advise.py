"""``whatif advise TRACE [SCENARIO]`` (or ``whatif advise SCENARIO``, on its own trace): what the user could do, ranked by predicted gain, each
with the critical path's reason (``whatif/advice.py``); a table, or ``--json``."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path

import msgspec

from whatif.advice import Advice, Option, advise, memory_note
from whatif.report.intervals import LEVEL, describe
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.parallel.units import UnitsError

from . import MAX_GRID_WORKERS, UsageError, check_grid_size

ERRORS = (ScenarioError,)


def add_parsers(sub) -> None:
    parser = sub.add_parser("advise", help="rank the optimizations and the scenario's alternatives by predicted gain")
    parser.add_argument("trace", type=Path, help="PyTorch profiler (Kineto) trace (.json or .json.gz), or a bundle folder; "
                        "or a scenario alone (.yaml), advised on its own trace")
    parser.add_argument("scenario", type=Path, nargs="?",
                        help="a scenario (see scenarios/): its first configuration is the job as it runs, the rest of "
                             "its grid, and every framework and policy on that cluster, are the alternatives "
                             "(its own trace is replaced by TRACE)")
    parser.add_argument("--iteration", metavar="NAME", help="annotation that marks an iteration (default: ProfilerStep#N)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--yes", action="store_true",
                        help=f"run a scenario's grid that simulates more than {MAX_GRID_WORKERS} workers' graphs in all (refused without it)")


#: A lone argument with one of these suffixes is a scenario, advised on its own trace.
SCENARIO_SUFFIXES = (".yaml", ".yml")


def run(args: argparse.Namespace) -> int:
    if args.scenario is None and args.trace.suffix.lower() in SCENARIO_SUFFIXES:
        args.scenario = args.trace  # whatif advise SCENARIO.yaml: the scenario on its own trace
        args.trace = Scenario.from_file(args.scenario).trace
    scenario = Scenario.from_file(args.scenario) if args.scenario is not None else None
    if scenario is not None:
        check_grid_size(args.scenario, scenario, args.yes)
    progress = (lambda text: None) if args.json else (lambda text: print(f"whatif: {text}", file=sys.stderr))
    try:
        advice = advise(args.trace, scenario, args.iteration, progress)
    except UnitsError as err:  # the scenario's parallelism.units, or the trace's lack of blocks
        raise UsageError(f"{args.scenario or args.trace}: {err}") from None
    if args.json:
        sys.stdout.write(msgspec.json.encode(_as_json(advice)).decode() + "\n")
        return 0
    print(advice_table(advice))
    return 0


def advice_table(advice: Advice) -> str:
    """The ranked options, then those not applicable, as text."""
    base = advice.baseline
    interval = f"{100 * LEVEL:g} % interval"
    width = max([34] + [len(o.name) for o in advice.options])  # the option column fits the longest name
    lines = [f"{advice.trace}: baseline {base.name}, {describe(base.predicted_ms, base.low_ms, base.high_ms)} per "
             f"iteration{memory_note(base, base)}",
             f"{'rank':>4}  {'option':<{width}} {'ms':>9} {interval:>15} {'gain %':>7}  reason"]
    for rank, option in enumerate(advice.ranked, 1):
        saved = f"; frees {option.memory_saved_mb:.0f} MB a step" if math.isfinite(option.memory_saved_mb) else ""
        within = (f"{option.low_ms:.2f}-{option.high_ms:.2f}" if math.isfinite(option.low_ms) and
                  math.isfinite(option.high_ms) else "-")
        lines.append(f"{rank:>4}  {option.name:<{width}} {option.predicted_ms:>9.2f} {within:>15} {option.gain_pct:>+7.1f}  "
                     f"{option.reason}{saved}")
    for option in advice.not_applicable:
        lines.append(f"{'-':>4}  {option.name:<{width}} {'':>9} {'':>15} {'':>7}  not applicable: {option.reason}")
    return "\n".join(lines)


def _as_json(advice: Advice) -> dict:
    def plain(option: Option) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(option).items()}

    return {"trace": advice.trace, "scenario": advice.scenario, "baseline": plain(advice.baseline),
            "ranked": [dict(plain(o), rank=i) for i, o in enumerate(advice.ranked, 1)],
            "not_applicable": [plain(o) for o in advice.not_applicable]}
