"""Issue 30's speed and size targets, each measured as a user meets it and set against a plain
``json.load(gzip.open(f))`` of the same trace in the same run (the *decode*), so that a busy or
a fast machine moves both sides alike.

Each measurement is a function of :class:`Bench` that returns :class:`Row` s; ``MEASUREMENTS``
lists them, and ``--only REGEX`` picks some by name. A row has the figure measured, its ratio
to the decode where it is a time, and its target, if any: a time's is a ratio to the decode, a
size's an amount. Commands run as the installed ``whatif`` (interpreter start and imports
included), each ``--runs`` times; the median is the figure. Where two commands are compared,
their runs alternate (A B A B ...), so a change of load during the bench falls on both. Python
writes its bytecode cache as it does for a user (``USER_ENV``); the first, untimed run of each
command writes it.

* ``replay``: ``whatif replay`` of the largest shared trace (216k events). Target: <= 0.75x
  the decode of that trace. Measured twice: as the first command on the trace (the graph cache,
  ``whatif/graph_cache.py``, off), and as a later one (the cache on, written by the untimed run).
* ``daydream_grid``: Daydream's grid (``scenarios/bandwidth_10_20_40.yaml``: 1x1 .. 4x2 at 10,
  20 and 40 Gbps, Horovod, FIFO; Zhu et al., USENIX ATC 2020) on the ResNet-50 V100 trace,
  ``whatif predict --json`` as a user runs it (``--jobs`` all cores). Target: <= 2x the decode.
  Measured twice, first and later command, as the replay.

Every other figure is a first command's: the graph cache is off, and the bench's commands keep
their cache in its scratch folder, never the user's.
* ``heterogeneous``: 128 machines x 8 GPUs (1024), DDP, ResNet-50, machine 5 1.3x slower and
  every GPU's GPU tasks slowed by its own ``exp(N(0, 0.05))`` (``gpu_variation``): wall time and
  peak memory of ``whatif predict``. Targets: <= 10 s, <= 2 GB. Then the same at 8x8, as
  predicted (the deciding workers) and with ``replicate: true`` (all 64): the largest relative
  difference of their numbers must be 0.
* ``parameter_server``: 8 x 8 GPUs, parameter server with P3, ResNet-50 at 25 Gbps: the seconds
  of ``simulate_cluster`` in ``predict`` (its graph built and simulated). Target: <= 1 s.
* ``grid_jobs``: Daydream's grid (``scenarios/bandwidth_10_20_40.yaml``: 1x1 .. 4x2 at 10, 20
  and 40 Gbps, Horovod, FIFO; Zhu et al., USENIX ATC 2020) on the ResNet-50 V100 trace,
  ``whatif predict --json`` with ``--jobs 1`` and with ``--jobs`` = this machine's cores; the
  speed-up is the ratio of the medians, reported without a target.
* ``parallelism_grid``: the largest parallelism grid a user of issue 28 would sweep: the bundled
  transformer (``data/transformer_cpu.bundle``) on DGX H100 machines (8 and 64 of them: 64 and
  512 GPUs, NCCL's fabric), tensor 1, 2, 4, 8 x pipeline 1, 2, 4 stages (8 microbatches, 1F1B)
  x ZeRO 0, 1, 3: 72 points, ``whatif predict --json --yes`` as a user runs it (``--jobs`` all
  cores). Its points, wall seconds, seconds per point, ratio to the decode of its trace (the
  bundle's) and peak memory, and the same with ``--jobs 1`` (runs alternating) and the speed-up,
  reported without a target.
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
LARGEST = SHARED / "hta-misc" / "v100_ddp2_compiled_rank1.json.gz"  # 216,092 events
RESNET50 = SHARED / "kineto-resnet50-v100" / "resnet50_bs32_workers0.pt.trace.json.gz"
WHATIF = Path(sys.executable).with_name("whatif")
MB = 1e6

#: Daydream's grid as the shipped scenario asks it (1 to 4 machines x 1 or 2 GPUs x 10, 20 and
#: 40 Gbps: 24 points, the 21 of the paper and 1x2), on the ResNet-50 trace instead of the CNN's
DAYDREAM_SCENARIO = REPO / "scenarios" / "bandwidth_10_20_40.yaml"
GRID_POINTS = 24
REPLAY_TARGET = 0.75  # issue 30: x the decode
GRID_TARGET = 2.0
HETEROGENEOUS_TARGET_S, HETEROGENEOUS_TARGET_MB = 10.0, 2000.0
PS_TARGET_S = 1.0
HETEROGENEOUS = {
    "cluster": {"machines": 128, "gpus_per_machine": 8, "intra_node": "nvlink2", "inter_node": "100gbe"},
    "framework": "ddp",
    "stragglers": [{"machine": 5, "slowdown": 1.3}],
    "gpu_variation": {"sigma": 0.05, "seed": 0},
}
PARAMETER_SERVER = {
    "cluster": {"machines": 8, "gpus_per_machine": 8, "intra_node": "nvlink2", "inter_node": "25gbe"},
    "framework": "ps",
    "policy": "p3",
}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
TIMELINE_TARGET_MB = 2.0  # issue 30: per configuration
TRANSFORMER = REPO / "data" / "transformer_cpu.bundle"
#: issue 28's largest grid: every layout of tensor x pipeline x ZeRO on two DGX H100 clusters
PARALLELISM_GRID = {
    "trace": str(TRANSFORMER),
    "cluster": {"machine": "dgx_h100", "machines": [8, 64]},
    "framework": "ddp",
    "parallelism": {"tensor": [1, 2, 4, 8], "pipeline": {"stages": [1, 2, 4], "microbatches": 8, "schedule": "1f1b"},
                    "zero": [0, 1, 3]},
}
PARALLELISM_POINTS = 2 * 4 * 3 * 3


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

    def time_commands(self, *commands: list, cached: bool = False) -> list[list[float]]:
        """Wall seconds of each command, ``runs`` times, the commands in turn (after one untimed
        run of each, which writes the graph cache where ``cached``); a failing command stops the
        bench with its stderr."""
        for command in commands:
            _run(command, cached)
        samples: list = [[] for _ in commands]
        for _ in range(self.runs):
            for i, command in enumerate(commands):
                t0 = time.perf_counter()
                _run(command, cached)
                samples[i].append(time.perf_counter() - t0)
        return samples

    def scenario(self, name: str, doc: dict) -> Path:
        """``doc`` on the ResNet-50 V100 trace, written into the scratch folder."""
        path = self.scratch / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"trace": str(RESNET50), **doc}))
        return path

    def daydream_grid(self) -> Path:
        """``DAYDREAM_SCENARIO`` on the ResNet-50 V100 trace, written into the scratch folder."""
        path = self.scratch / "daydream_resnet50.yaml"
        doc = yaml.safe_load(DAYDREAM_SCENARIO.read_text())
        path.write_text(yaml.safe_dump({**doc, "trace": str(RESNET50)}))
        return path


#: The commands' environment: this one's, but with Python writing its bytecode cache, as it does
#: for a user (some sandboxes set PYTHONDONTWRITEBYTECODE, which makes every run compile the
#: modules of an editable install again; the untimed first run of each command writes the cache).
#: The graph cache (whatif/graph_cache.py) off: a first command on a trace; ``main`` points
#: WHATIF_CACHE_DIR at the scratch folder.
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"WHATIF_GRAPH_CACHE": "0"}


def _run(command: list, cached: bool = False) -> subprocess.CompletedProcess:
    env = USER_ENV | {"WHATIF_GRAPH_CACHE": "1"} if cached else USER_ENV
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"speed: {' '.join(map(str, command))} failed (status {done.returncode}): "
                         f"{done.stderr.strip()[-2000:]}")
    return done


def _first_and_later(bench: Bench, name: str, command: list, trace: Path, target: float) -> list[Row]:
    """``command`` as the first on its trace and as a later one (its graph cached), each against
    the decode of ``trace`` and ``target``."""
    rows = []
    for cached, when in ((False, "first command on the trace"), (True, "a later command (graph cached)")):
        (samples,) = bench.time_commands(command, cached=cached)
        seconds = statistics.median(samples)
        ratio = seconds / bench.decode_s(trace)
        rows.append(Row(f"{name}, {when}", seconds, "s", ratio, f"<= {target:g}x decode", ratio <= target))
    return rows


def replay(bench: Bench) -> list[Row]:
    return _first_and_later(bench, f"whatif replay {LARGEST.name}", [WHATIF, "replay", LARGEST], LARGEST,
                            REPLAY_TARGET)


def daydream_grid(bench: Bench) -> list[Row]:
    return _first_and_later(bench, f"Daydream grid ({GRID_POINTS} points), whatif predict",
                            [WHATIF, "predict", bench.daydream_grid(), "--json"], RESNET50, GRID_TARGET)


def heterogeneous(bench: Bench) -> list[Row]:
    large = bench.scenario("heterogeneous_1024", HETEROGENEOUS)
    seconds, megabytes = [], []
    for _ in range(bench.runs):
        s, mb, _ = _timed_with_memory([WHATIF, "predict", large, "--json"])
        seconds.append(s)
        megabytes.append(mb)
    wall, peak = statistics.median(seconds), max(megabytes)
    small = {**HETEROGENEOUS, "cluster": {**HETEROGENEOUS["cluster"], "machines": 8}}
    _, _, deciding = _timed_with_memory([WHATIF, "predict", bench.scenario("heterogeneous_64", small), "--json"])
    full_s, full_mb, full = _timed_with_memory(
        [WHATIF, "predict", bench.scenario("heterogeneous_64_replicated", {**small, "replicate": True}), "--json"])
    difference = _largest_difference(deciding, full)
    return [
        Row("1024 GPUs, one slow machine and per-GPU slowdowns: predict", wall, "s", wall / bench.decode_s(RESNET50),
            f"<= {HETEROGENEOUS_TARGET_S:g} s", wall <= HETEROGENEOUS_TARGET_S),
        Row("1024 GPUs, the same: peak memory (largest of the runs)", peak, "MB", None,
            f"<= {HETEROGENEOUS_TARGET_MB:g} MB", peak <= HETEROGENEOUS_TARGET_MB),
        Row("64 GPUs, the same, replicate: true (every worker; one run)", full_s, "s", full_s / bench.decode_s(RESNET50)),
        Row("64 GPUs, replicate: true: peak memory", full_mb, "MB"),
        Row("64 GPUs: predicted vs replicate: true, largest relative difference", difference, "", None, "== 0",
            difference == 0),
    ]


def parameter_server(bench: Bench) -> list[Row]:
    from cluster_speed import timing_simulate_cluster  # in process: the simulation alone is timed
    from whatif.pipeline import predict
    from whatif.scenario import Scenario

    seconds: list = []
    cpu_seconds = []
    request = Scenario.from_file(bench.scenario("ps_p3_64", PARAMETER_SERVER)).request()
    with timing_simulate_cluster(seconds):
        for _ in range(bench.runs):
            cpu = time.process_time()
            predict(request)
            cpu_seconds.append(time.process_time() - cpu)
    median = statistics.median(seconds)
    return [
        Row("8x8 parameter server, P3: simulate_cluster", median, "s", median / bench.decode_s(RESNET50),
            f"<= {PS_TARGET_S:g} s", median <= PS_TARGET_S),
        Row("8x8 parameter server, P3: CPU seconds of the whole predict", statistics.median(cpu_seconds), "s"),
    ]


def _timed_with_memory(command: list) -> tuple[float, float, str]:
    """Wall seconds, peak resident MB (``wait4``'s, of this child alone) and stdout of ``command``."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        process = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=err, env=USER_ENV)
        out = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - t0
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            err.seek(0)
            raise SystemExit(f"speed: {' '.join(map(str, command))} failed (status {process.returncode}): "
                             f"{err.read().decode(errors='replace').strip()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, out.decode()


def _largest_difference(a: str, b: str) -> float:
    """The largest relative difference between the numbers of two outputs of the same shape."""
    x, y = NUMBER.findall(a), NUMBER.findall(b)
    if len(x) != len(y):
        return float("inf")
    return max((abs(float(p) - float(q)) / max(abs(float(q)), 1e-300) for p, q in zip(x, y) if p != q), default=0.0)


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


def parallelism_grid(bench: Bench) -> list[Row]:
    path = bench.scratch / "parallelism_grid.yaml"
    path.write_text(yaml.safe_dump(PARALLELISM_GRID))
    command = [WHATIF, "predict", path, "--json", "--yes"]
    _run(command)  # untimed, as time_commands does
    seconds, megabytes, serial = [], [], []
    for _ in range(bench.runs):  # all cores and one, alternating
        s, mb, out = _timed_with_memory(command)
        seconds.append(s)
        megabytes.append(mb)
        serial.append(_timed_with_memory(command + ["--jobs", "1"])[0])
    points = len(json.loads(out)["results"])
    if points != PARALLELISM_POINTS:
        raise SystemExit(f"speed: {points} points predicted for the parallelism grid's {PARALLELISM_POINTS}")
    wall, one = statistics.median(seconds), statistics.median(serial)
    decode = bench.decode_s(_bundle_trace(TRANSFORMER))
    return [
        Row(f"parallelism grid ({points} points, 64 and 512 GPUs), predict", wall, "s", wall / decode),
        Row("parallelism grid: seconds per point", wall / points, "s", wall / points / decode),
        Row("parallelism grid: peak memory (largest of the runs)", max(megabytes), "MB"),
        Row("parallelism grid, predict --jobs 1", one, "s", one / decode),
        Row(f"speed-up of --jobs {available_cores()} over --jobs 1 (ratio of the medians)", one / wall, "x"),
    ]


def _bundle_trace(bundle: Path) -> Path:
    """The trace file of a capture bundle (its largest ``.json.gz``)."""
    return max(bundle.rglob("*.json.gz"), key=lambda f: f.stat().st_size)


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


MEASUREMENTS: list[Callable[[Bench], list[Row]]] = [
    replay, daydream_grid, heterogeneous, parameter_server, grid_jobs, parallelism_grid, timeline_size]


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
        USER_ENV["WHATIF_CACHE_DIR"] = os.environ["WHATIF_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ["WHATIF_GRAPH_CACHE"] = "0"  # the in-process measurements: first commands too
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
