"""Issue 30's speed and size targets, each measured as a user meets it and set against a plain
``json.load(gzip.open(f))`` of the same trace in the same run (the *decode*), so that a busy or
a fast machine moves both sides alike.

Each measurement is a function of :class:`Bench` that returns :class:`Row` s; ``MEASUREMENTS``
lists them, and ``--only REGEX`` picks some by name. A row has the figure measured, its ratio
to the decode where it is a time, and its target, if any: a time's is a ratio to the decode, a
size's an amount. Commands run as the installed ``whatif`` (interpreter start and imports
included), each ``--runs`` times; the median is the figure. Where two commands are compared,
their runs alternate (A B A B ...), so a change of load during the bench falls on both.

* ``grid_jobs``: Daydream's grid (``scenarios/bandwidth_10_20_40.yaml``: 1x1 .. 4x2 at 10, 20
  and 40 Gbps, Horovod, FIFO; Zhu et al., USENIX ATC 2020) on the ResNet-50 V100 trace,
  ``whatif predict --json`` with ``--jobs 1`` and with ``--jobs`` = this machine's cores; the
  speed-up is the ratio of the medians, reported without a target.
* ``timeline_size``: the same grid with ``--timeline``: each configuration's file, compressed
  (what is written) and decompressed (the Chrome JSON, what was written before). Target: every
  configuration <= 2 MB.

Prints a table and PASS, or FAIL with the rows that missed (exit 1; 2 when the trace is
missing). A benchmark to rerun, not a test:

    .venv/bin/python bench/speed.py [--runs N] [--only REGEX]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from measured_code import REPO, code_version  # bench/ is the script's folder
from whatif.collectors.host import cpu_model
from whatif.sweep import available_cores

SHARED = REPO.parent / "shared" / "traces"
RESNET50 = SHARED / "kineto-resnet50-v100" / "resnet50_bs32_workers0.pt.trace.json.gz"
WHATIF = Path(sys.executable).with_name("whatif")
MB = 1e6

#: Daydream's grid as the shipped scenario asks it (1 to 4 machines x 1 or 2 GPUs x 10, 20 and
#: 40 Gbps: 24 points, the 21 of the paper and 1x2), on the ResNet-50 trace instead of the CNN's
DAYDREAM_SCENARIO = REPO / "scenarios" / "bandwidth_10_20_40.yaml"
GRID_POINTS = 24
TIMELINE_TARGET_MB = 2.0  # issue 30: per configuration


@dataclass
class Row:
    """One figure: ``value`` in ``unit``; for a time, its ``ratio`` to the decode of the trace
    it ran on; its ``target``, and whether it ``passed`` (None: reported, with no target)."""

    name: str
    value: float
    unit: str
    ratio: Optional[float] = None
    target: str = ""
    passed: Optional[bool] = None


class Bench:
    """What the measurements share: the runs asked for, a scratch folder, the decode of each
    trace (timed once per run of the bench), and the ``whatif`` command."""

    def __init__(self, runs: int, scratch: Path):
        self.runs, self.scratch = runs, scratch
        self._decode: dict = {}

    def decode_s(self, trace: Path) -> float:
        """The median seconds of ``json.load(gzip.open(trace))`` (after one untimed run, so the
        file is in the page cache, as it is for the commands)."""
        if trace not in self._decode:
            samples = []
            for _ in range(self.runs + 1):
                t0 = time.perf_counter()
                with gzip.open(trace) as f:
                    json.load(f)
                samples.append(time.perf_counter() - t0)
            self._decode[trace] = statistics.median(samples[1:])
        return self._decode[trace]

    def decodes(self) -> dict:
        """Every trace decoded so far, with its median seconds."""
        return dict(self._decode)

    def time_commands(self, *commands: list) -> list[list[float]]:
        """Wall seconds of each command, ``runs`` times, the commands in turn (after one untimed
        run of each); a failing command stops the bench with its stderr."""
        for command in commands:
            _run(command)
        samples: list = [[] for _ in commands]
        for _ in range(self.runs):
            for i, command in enumerate(commands):
                t0 = time.perf_counter()
                _run(command)
                samples[i].append(time.perf_counter() - t0)
        return samples

    def daydream_grid(self) -> Path:
        """``DAYDREAM_SCENARIO`` on the ResNet-50 V100 trace, written into the scratch folder."""
        path = self.scratch / "daydream_resnet50.yaml"
        doc = yaml.safe_load(DAYDREAM_SCENARIO.read_text())
        path.write_text(yaml.safe_dump({**doc, "trace": str(RESNET50)}))
        return path


def _run(command: list) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"speed: {' '.join(map(str, command))} failed (status {done.returncode}): "
                         f"{done.stderr.strip()[-2000:]}")
    return done


def grid_jobs(bench: Bench) -> list[Row]:
    grid = bench.daydream_grid()
    cores = available_cores()
    command = [WHATIF, "predict", grid, "--json"]
    one, many = bench.time_commands(command + ["--jobs", "1"], command + ["--jobs", str(cores)])
    decode = bench.decode_s(RESNET50)
    serial, parallel = statistics.median(one), statistics.median(many)
    return [
        Row(f"Daydream grid ({GRID_POINTS} points), predict --jobs 1", serial, "s", serial / decode),
        Row(f"Daydream grid, predict --jobs {cores} (this machine's cores)", parallel, "s", parallel / decode),
        Row(f"speed-up of --jobs {cores} over --jobs 1 (ratio of the medians)", serial / parallel, "x"),
    ]


def timeline_size(bench: Bench) -> list[Row]:
    grid = bench.daydream_grid()
    folder = bench.scratch / "timelines"
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    t0 = time.perf_counter()
    _run([WHATIF, "predict", grid, "--json", "--timeline", folder / "grid.json.gz"])
    seconds = time.perf_counter() - t0
    files = sorted(folder.glob("grid.*.json.gz"))
    if len(files) != GRID_POINTS:
        raise SystemExit(f"speed: {len(files)} timelines written for {GRID_POINTS} configurations")
    written = [f.stat().st_size / MB for f in files]
    plain = [len(gzip.decompress(f.read_bytes())) / MB for f in files]
    largest = max(written)
    return [
        Row("timeline per configuration, before: Chrome JSON (median)", statistics.median(plain), "MB"),
        Row("timeline per configuration, written: gzip-compressed (median)", statistics.median(written), "MB"),
        Row(f"timeline per configuration, written: the largest of {len(files)}", largest, "MB", None,
            f"<= {TIMELINE_TARGET_MB:g} MB", largest <= TIMELINE_TARGET_MB),
        Row(f"Daydream grid with --timeline (one run, {len(files)} files, {sum(written):.1f} MB)", seconds, "s",
            seconds / bench.decode_s(RESNET50)),
    ]


MEASUREMENTS: list[Callable[[Bench], list[Row]]] = [grid_jobs, timeline_size]


def table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'measurement':<{width}}  {'figure':>12}  {'x decode':>8}  {'target':<18} verdict"]
    for r in rows:
        verdict = {True: "pass", False: "FAIL", None: ""}[r.passed]
        ratio = f"{r.ratio:8.2f}" if r.ratio is not None else " " * 8
        lines.append(f"{r.name:<{width}}  {r.value:9.3f} {r.unit:<2}  {ratio}  {r.target:<18} {verdict}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="timed runs of each command (default: 3)")
    parser.add_argument("--only", metavar="REGEX", help="the measurements whose name it matches "
                        f"({', '.join(m.__name__ for m in MEASUREMENTS)})")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not RESNET50.is_file():
        print(f"speed: error: trace {RESNET50}: no such file", file=sys.stderr)
        return 2
    chosen = [m for m in MEASUREMENTS if args.only is None or re.search(args.only, m.__name__)]
    print(f"code:    {code_version()}")
    print(f"machine: {available_cores()} cores ({cpu_model()}), Python {platform.python_version()}, "
          f"{platform.system()} {platform.release()}")
    print(f"load:    {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min averages at the start)")
    print(f"runs:    {args.runs} of each command, medians")
    rows = []
    with tempfile.TemporaryDirectory(prefix="speed.") as tmp:
        bench = Bench(args.runs, Path(tmp))
        for measure in chosen:
            rows += measure(bench)
        decodes = ", ".join(f"{t.name} {s:.3f} s" for t, s in bench.decodes().items())
    print(f"decode:  json.load(gzip.open(f)), median: {decodes}")
    print()
    print(table(rows))
    missed = [r for r in rows if r.passed is False]
    print()
    print("PASS" if not missed else "FAIL: " + "; ".join(f"{r.name} {r.value:.3f} {r.unit} (target {r.target})" for r in missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
