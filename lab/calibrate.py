"""Fitting the lab's network to the topology model: latency and bandwidth efficiency.

A ring all-reduce of ``S`` bytes over ``n`` workers costs ``2(n-1) L + 2(n-1)/n * S / (e B)``
(``topology.collectives``). Timing Gloo's all-reduce at several sizes on the emulated cluster
and fitting a line to time against size gives the latency ``L`` (from the intercept) and the
efficiency ``e`` the shaped link really delivers (from the slope), once across machines (the
NICs) and once inside one machine (loopback between its workers). They are written as a
topology YAML that scenarios can use, so predictions for the lab use the lab's own network.

The probe also times the all-reduces while the worker's core computes, and the compute while
the all-reduces run (``lab/probes/allreduce.py``): on CPU workers the TCP stack and
Gloo's reductions share the core with the training step, so communication that overlaps
backward is slower than on an idle worker, and backward is slower too. Their ratios are the
links' ``cpu_contention`` factors (``topology.Link``). Where Horovod is installed, a Horovod job
also measures the CPU time its background loop takes per cycle on each worker's core
(``lab/probes/horovod_loop.py``): the links' ``horovod_loop``, the slowest worker's.

Every worker of the lab runs on the one box, whatever machine the cluster puts it on, so the
workers also share its memory: a last job streams memory and multiplies matrices on one worker
alone, then on all of them at once (``lab/probes/memory.py``), which gives the topology's
``shared_memory`` (``topology.SharedMemory``, among the whole cluster).

The parallel families call other collectives than the all-reduce, and Gloo runs each its own
way (``topology/collectives.py``): a last pair of jobs times ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single`` and paired sends and receives at several sizes,
across machines and inside one (``lab/probes/collectives.py``), and fits each op's latency and
efficiency (on loopback its bandwidth) through the op's own closed form (:func:`fit_collectives`):
the links' ``collectives`` entries (``topology.Link``), which price those ops and leave the
all-reduce, and every prediction made from it, as they were. Another pair times small all-reduces
(1 kB to 1 MB), each in a burst of 24 as a step issues them (``lab/probes/small_allreduce.py``):
the links' ``floor``, the least time an all-reduce takes however small (:func:`fit_floor`),
which the line through the large sizes misses across machines (2.6 to 3.0 ms against 0.5 to
1.0). ``--floor-into`` measures it into a links file calibrated before it (:func:`add_floor`).

Every probe job runs ``runs`` times (default ``RUNS``) and each of its figures is the median of
the runs, but for the collectives probe's, which are the mean: Gloo's all-gather, all-to-all and
send/recv between two machines run the two directions at once or one after the other, and the
median of three runs priced them at whichever mode two runs fell into (the FSDP steps of
campaigns G and H ran their all-gathers mostly in the slow mode and were predicted 7 to 15 %
short); the mean is the op's expected time, what a step of many of them adds up to. The
links each run alone gives are kept too, under ``runs`` (``calibrations_of_runs``), and
``whatif predict`` predicts with each of them to widen its interval by the calibration's
spread: on the virtual machine this was built on, four calibrations at 400 Mbps taken one
after another fitted the loopback's bandwidth at 1.1 to 2.0 GB/s, its ``comm`` contention at 1.08
to 2.31 and the total memory bandwidth at 52 to 82 GB/s, and the 1x2 predictions made from them
moved by up to 35 points (the wide MLP with Horovod, from -21 % to +14 %). Two calibrations of
three runs each agreed on ``comm`` (1.31 and 1.37, when it was one median over 1 to 32 MB) and
the memory bandwidth (53.8 GB/s).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from whatif.collectors.host import cpu_model
from whatif.topology import Cluster, Link, collective_cost
from whatif.topology.cluster import CALIBRATED_OPS
from whatif.topology.units import TopologyError
from whatif.topology.yamlfile import read_yaml

from .cluster import LabError, LabSpec, check_can_run, progress, run_job

SIZES_BYTES = (64e3, 256e3, 1e6, 4e6, 16e6, 32e6, 64e6)  # up to Horovod's fusion buffer
COLLECTIVE_SIZES_BYTES = (64e3, 256e3, 1e6, 4e6, 16e6)  # an FSDP unit's parameters, a pipeline's activations
RUNS = 3
#: The small all-reduces whose time is the host's alone (``lab/probes/small_allreduce.py``): the
#: floor is the median of their times each in a burst (``fit_floor``)
FLOOR_MAX_BYTES = 16384


def combine_runs(runs: list, combine=np.median) -> dict:
    """One probe's record from several runs of it: every number, and every number of a list,
    the median over the runs (or ``combine``'s figure, e.g. ``np.mean``); anything the runs agree
    on, or that is not a number, as the first run has it."""
    first = runs[0]
    combined = {}
    for key, value in first.items():
        values = [run[key] for run in runs]
        if all(v == value for v in values) or isinstance(value, bool) or not isinstance(value, (int, float, list)):
            combined[key] = value
        elif isinstance(value, list):
            combined[key] = [float(combine(column)) for column in zip(*values)]
        else:
            combined[key] = float(combine(values))
    return combined


#: Runs of the collectives probe across machines whose times for one op and size (from
#: ``SPREAD_FROM_BYTES`` on, where the bytes, not the host, set the time) lie this far apart are
#: named (:func:`runs_apart`): Gloo's two-rank all-to-all and all-gather run the two directions
#: at once or one after the other (16 MB at 200 Mbps: 340 or 590 to 666 ms), and three runs
#: may see one mode only.
SPREAD_RATIO = 1.4
SPREAD_FROM_BYTES = 4e6


def runs_apart(runs: list, from_bytes: float = SPREAD_FROM_BYTES, ratio: float = SPREAD_RATIO) -> list[str]:
    """Each op and size of a probe's ``runs`` (records with ``sizes_bytes`` and a list of
    seconds per op) whose slowest run took ``ratio`` times the fastest or more, from
    ``from_bytes`` on: one phrase each, e.g. ``all_to_all at 16 MB: 69 to 108 ms``."""
    first = runs[0]
    sizes = first.get("sizes_bytes") or []
    out = []
    for key, value in first.items():
        if key == "sizes_bytes" or not isinstance(value, list) or len(value) != len(sizes):
            continue
        for i, size in enumerate(sizes):
            times = [run[key][i] for run in runs]
            if size >= from_bytes and min(times) > 0 and max(times) >= ratio * min(times):
                out.append(f"{key} at {size / 1e6:g} MB: {min(times) * 1e3:.0f} to {max(times) * 1e3:.0f} ms")
    return out


def run_probe(spec: LabSpec, framework: str, argv: list, out_dir: Path, result_file: str, runs: int, what: str,
              timeout_s: int, env: dict = None, name_spread: bool = False, combine=np.median) -> dict:
    """``runs`` jobs of a probe, each in its own folder under ``out_dir``, combined by
    ``combine`` (:func:`combine_runs`). With ``name_spread``, a line names the op and sizes
    whose runs lie far apart (:func:`runs_apart`)."""
    records = []
    for run in range(runs):
        run_dir = out_dir / f"run{run}"
        progress(f"calibration: {what} on {spec.machines}x{spec.gpus_per_machine}, run {run + 1} of {runs}")
        result = run_job(spec, framework, argv, run_dir, timeout_s=timeout_s, env=env)
        if any(result.exit_codes):
            raise LabError(f"{what} failed; see the logs in {run_dir}")
        records.append(json.loads((run_dir / result_file).read_text()))
    apart = runs_apart(records) if name_spread and len(records) > 1 else []
    if apart:
        progress(f"warning: {what} on {spec.machines}x{spec.gpus_per_machine}: runs far apart, "
                 f"{'; '.join(apart)} over {len(records)} runs; the links take each size's "
                 f"{combine.__name__}, so a calibration again may price these ops "
                 f"differently (the runs are in {out_dir})")
    return combine_runs(records, combine)


def fit_ring(sizes_bytes, seconds, workers: int, bandwidth_bytes_per_s: float) -> dict:
    """Latency (us) and efficiency from all-reduce times of a ring of ``workers``."""
    slope, intercept = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(seconds, float), 1)
    steps = 2 * (workers - 1)
    efficiency = (steps / workers) / (bandwidth_bytes_per_s * slope)
    latency_us = max(intercept, 0.0) / steps * 1e6
    return {"latency_us": float(latency_us), "efficiency": float(min(efficiency, 1.0)), "raw_efficiency": float(efficiency)}


def fit_contention(measured: dict, min_bytes: float = 1e6) -> dict:
    """``{comm, compute}`` slowdowns from one probe: ``comm`` by size, the ratio of busy to idle
    all-reduce time at each size of at least ``min_bytes`` (an idle all-reduce smaller than that
    waits on the virtual CPU waking up more than it moves bytes: 256 kB took 3 ms idle and 0.3 ms
    beside a computing thread), and ``compute``, the compute thread's rate alone over its rate
    during the all-reduces. Never below 1: a busy all-reduce that beats its idle twin (1 MB, at
    times) shows the idle one waiting on a waking virtual CPU, not a computing core speeding
    communication up.

    The slowdown grows with the size (``topology.Link``): on loopback 1.17 at 4 MB, 1.64 at 16 MB
    and 2.47 at 64 MB in one probe. One median over 1 to 32 MB, as this fit was before, took
    1.31 to 1.37 for all of them, and predicted the wide MLP's two workers on one machine, whose
    all-reduces Horovod fuses into 64 MB, 18 % short."""
    comm = {
        f"{size / 1e6:g}MB": round(max(busy / idle, 1.0), 4)
        for size, idle, busy in zip(measured["sizes_bytes"], measured["seconds"], measured["seconds_busy"])
        if size >= min_bytes and idle > 0
    }
    compute = measured["compute_rate_alone"] / measured["compute_rate_during_comm"]
    return {"comm": comm or 1.0, "compute": round(max(float(compute), 1.0), 4)}


def measure(spec: LabSpec, out_dir: Path, sizes=SIZES_BYTES, runs: int = RUNS) -> dict:
    argv = [sys.executable, "-m", "whatif.lab.probes.allreduce", *[str(int(s)) for s in sizes]]
    return run_probe(spec, "ddp", argv, out_dir, "allreduce.json", runs, "calibration workers", 600)


def measure_collectives(spec: LabSpec, out_dir: Path, sizes=COLLECTIVE_SIZES_BYTES, runs: int = RUNS) -> dict:
    argv = [sys.executable, "-m", "whatif.lab.probes.collectives", *[str(int(s)) for s in sizes]]
    return run_probe(spec, "ddp", argv, out_dir, "collectives.json", runs, "the collectives probe", 600,
                     name_spread=spec.machines > 1,  # loopback's are noisy at every size: not named
                     combine=np.mean)  # an op's expected time, whichever of Gloo's modes a run fell into


def measure_floor(spec: LabSpec, out_dir: Path, runs: int = RUNS) -> dict:
    argv = [sys.executable, "-m", "whatif.lab.probes.small_allreduce"]
    return run_probe(spec, "ddp", argv, out_dir, "small_allreduce.json", runs, "the small all-reduce probe", 600)


def fit_floor(measured: dict) -> str:
    """The all-reduce's floor on a link (YAML, ``topology.Link.floors_us``): the median of the
    small all-reduces' times (up to :data:`FLOOR_MAX_BYTES`), each timed in a burst as a step
    issues them. One at a time they take either about 0.45 or about 3.9 ms on the lab's box, so
    the burst, the mean of many, is what a step of many pays."""
    burst = [t for size, t in zip(measured["sizes_bytes"], measured["burst"]) if size <= FLOOR_MAX_BYTES]
    if not burst:
        raise LabError(f"the small all-reduce probe timed no size up to {FLOOR_MAX_BYTES} bytes")
    return f"{float(np.median(burst)) * 1e6:.1f}us"


def add_floor(links_yaml: Path, bandwidth_mbit: float, work_dir: Path = None, runs: int = RUNS) -> dict:
    """Measure the all-reduce's floor across two machines and inside one into an existing
    topology YAML (each link's ``floor``, in every run's calibration too), keeping the rest; the
    file is replaced only once the measurement is done."""
    doc = _calibrated(links_yaml)
    specs = _probe_specs(bandwidth_mbit)
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="whatif-calibrate-"))
    for where, spec in specs.items():
        record = measure_floor(spec, work_dir / f"small_allreduce_{where}", runs)
        link, floor = _LINK_OF[where], fit_floor(record)
        for target in [doc] + [run for run in doc.get("runs", []) if isinstance(run, dict) and link in run]:
            target[link]["floor"] = floor
        doc.setdefault("measured", {}).setdefault(where, {})["small_allreduce"] = record
    _replace(links_yaml, doc)
    return doc


_LINK_OF = {"across_machines": "inter_node", "inside_a_machine": "intra_node"}


def _probe_specs(bandwidth_mbit: float) -> dict:
    """The two settings every link probe runs in, by where, each checked to run on this box."""
    specs = {"across_machines": LabSpec(2, 1, bandwidth_mbit), "inside_a_machine": LabSpec(1, 2, bandwidth_mbit)}
    for spec in specs.values():
        check_can_run(spec)
    return specs


def _calibrated(links_yaml: Path) -> dict:
    """A calibrated topology YAML's document (one with both links), or a one-line error."""
    try:
        doc = read_yaml(links_yaml)
    except TopologyError as err:
        raise LabError(f"{links_yaml}: cannot read it as a topology YAML ({err.message})") from None
    if not isinstance(doc, dict) or not {"intra_node", "inter_node"} <= set(doc):
        raise LabError(f"{links_yaml}: has no intra_node and inter_node links; write one with whatif lab calibrate --out")
    return doc


def _replace(links_yaml: Path, doc: dict) -> None:
    written = links_yaml.with_name(links_yaml.name + ".new")
    written.write_text(yaml.safe_dump(doc, sort_keys=False))
    written.replace(links_yaml)


def op_shape(op: str, machines: int, gpus: int) -> tuple[float, float]:
    """``(steps, per_byte)`` of ``op``'s closed form on ``machines x gpus`` workers over one kind
    of link (``topology.collectives``): its time is ``steps L + per_byte S / (e B)``."""
    if op == "send":  # one way: one step of ``L + S / B``, as a send_recv's exchange is priced
        op = "send_recv"
    unit = Link(bandwidth_bytes_per_us=1.0, latency_us=1.0)
    cluster = Cluster(machines, gpus, unit, unit)
    steps = collective_cost(cluster, op, 0.0).time_us
    return steps, (collective_cost(cluster, op, 1e6).time_us - steps) / 1e6


def fit_collectives(measured: dict, machines: int, gpus: int, bandwidth_bytes_per_s: Optional[float]) -> dict:
    """Each op's ``{latency, efficiency}`` (across machines, ``bandwidth_bytes_per_s`` the NIC's
    rate) or ``{bandwidth, latency}`` (inside one, on loopback: ``None``) from the probe's times,
    fitted like the all-reduce's (:func:`fit_ring`): a line of time against size, read through
    the op's own closed form (:func:`op_shape`), so that the topology's formula for the op gives
    back the times measured."""
    sizes = np.asarray(measured["sizes_bytes"], float)
    out = {}
    for op in CALIBRATED_OPS:
        if op not in measured:  # a probe's record from before the op was timed (``send``)
            continue
        slope, intercept = np.polyfit(sizes, np.asarray(measured[op], float), 1)
        steps, per_byte = op_shape(op, machines, gpus)
        latency = f"{max(intercept, 0.0) / steps * 1e6:.1f}us"
        rate = per_byte / slope  # bytes per second the op achieves (per_byte: us per byte at 1 byte/us)
        if bandwidth_bytes_per_s is None:
            out[op] = {"bandwidth": f"{rate / 1e6:.1f}MB/s", "latency": latency, "efficiency": 1.0}
        else:
            out[op] = {"latency": latency, "efficiency": round(float(min(rate / bandwidth_bytes_per_s, 1.0)), 4)}
    return out


def measure_horovod_loop(spec: LabSpec, out_dir: Path, cycle_ms: float, runs: int = RUNS) -> dict:
    argv = [sys.executable, "-m", "whatif.lab.probes.horovod_loop"]
    return run_probe(spec, "horovod", argv, out_dir, "horovod_loop.json", runs, "the Horovod loop probe", 300,
                     env={"HOROVOD_CYCLE_TIME": f"{cycle_ms:g}"})


def measure_shared_memory(spec: LabSpec, out_dir: Path, runs: int = RUNS) -> dict:
    argv = [sys.executable, "-m", "whatif.lab.probes.memory"]
    return run_probe(spec, "ddp", argv, out_dir, "shared_memory.json", runs, "the shared-memory probe", 300)


def fit_shared_memory(measured: dict) -> dict:
    """The lab's ``shared_memory``: one worker's streaming rate alone, all workers' rates
    together while they all stream, and the slowest worker's matrix products beside the others
    against alone (never below 1: a ratio under 1 is noise)."""
    total = sum(measured["stream_bytes_per_s_shared"])
    compute = measured["gemm_flops_per_s_alone"] / min(measured["gemm_flops_per_s_shared"])
    return {
        "among": "cluster",
        "core_bandwidth": f"{measured['stream_bytes_per_s_alone'] / 1e9:.2f}GB/s",
        "total_bandwidth": f"{total / 1e9:.2f}GB/s",
        "compute": round(max(compute, 1.0), 4),
    }


def add_shared_memory(links_yaml: Path, bandwidth_mbit: float, work_dir: Path = None, runs: int = RUNS) -> dict:
    """Measure the lab's shared memory into an existing topology YAML, keeping the rest of it;
    the file is replaced only once the measurement is done."""
    doc = _calibrated(links_yaml)
    check_can_run(LabSpec(1, 2, bandwidth_mbit))
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="whatif-calibrate-"))
    measured = measure_shared_memory(LabSpec(1, 2, bandwidth_mbit), work_dir / "shared_memory", runs)
    doc["shared_memory"] = fit_shared_memory(measured)
    doc.setdefault("measured", {})["shared_memory"] = measured
    _replace(links_yaml, doc)
    return doc


def calibrate(bandwidth_mbit: float, out_yaml: Path, work_dir: Path = None, horovod_cycle_ms: float = 5.0,
              runs: int = RUNS) -> dict:
    """Measure across two machines and inside one; write the fitted topology to ``out_yaml``.
    Horovod's loop is measured at ``horovod_cycle_ms``, the cycle time of the jobs to predict."""
    specs = _probe_specs(bandwidth_mbit)
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="whatif-calibrate-"))
    measured = {where: measure(spec, work_dir / where.split("_")[0], runs=runs) for where, spec in specs.items()}
    if importlib.util.find_spec("horovod") is not None:
        for where, spec in specs.items():
            measured[where]["horovod_loop"] = measure_horovod_loop(spec, work_dir / f"horovod_loop_{where}",
                                                                   horovod_cycle_ms, runs)
    shared = measure_shared_memory(specs["inside_a_machine"], work_dir / "shared_memory", runs)
    ops = {where: measure_collectives(spec, work_dir / f"collectives_{where}", runs=runs) for where, spec in specs.items()}
    for where, spec in specs.items():
        measured[where]["small_allreduce"] = measure_floor(spec, work_dir / f"small_allreduce_{where}", runs)
    doc = fit_links(bandwidth_mbit, measured, shared, ops)
    doc = {"name": doc.pop("name"), "calibrated": calibrated_on(), **doc}
    floors = {where: probe["small_allreduce"] for where, probe in measured.items()}
    doc["runs"] = [{k: v for k, v in run.items() if k != "measured"}
                   for run in calibrations_of_runs(work_dir, bandwidth_mbit, ops, floors)]
    out_yaml.write_text(yaml.safe_dump(doc, sort_keys=False))
    progress(f"calibration at {bandwidth_mbit:g} Mbps done: {out_yaml}")
    return doc


def calibration_day() -> str:
    """Today as a calibration is dated (UTC, ISO): what ``calibrated.date`` holds and what
    ``lab.validate.stale_links`` compares it with."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def calibrated_on() -> dict:
    """When and on what the calibration ran (the links file's ``calibrated``): the UTC date and
    the CPU's model, which ``lab.validate.links`` holds against the day it is used on."""
    return {"date": calibration_day(), "cpu": cpu_model(), "cores": os.cpu_count() or 1}


def fit_links(bandwidth_mbit: float, measured: dict, shared: dict, ops: Optional[dict] = None) -> dict:
    """The topology YAML's document from the probes' figures: ``measured`` by where
    (``across_machines``, ``inside_a_machine``: the all-reduce probe's record, with its Horovod
    loop's under ``horovod_loop`` where it was measured, and the small all-reduce probe's under
    ``small_allreduce``: the link's ``floor``), the shared-memory probe's, and where given the
    collectives probe's by where (``ops``: each link's ``collectives``)."""
    contention = {where: fit_contention(probe) for where, probe in measured.items()}
    for where, probe in measured.items():
        if "horovod_loop" in probe:
            contention[where]["horovod_loop"] = f"{max(probe['horovod_loop']['cpu_us_per_cycle']):.1f}us"
    across, inside = measured["across_machines"], measured["inside_a_machine"]
    nic = fit_ring(across["sizes_bytes"], across["seconds"], 2, bandwidth_mbit * 1e6 / 8)
    # inside a machine the "link" is loopback, unshaped: fit its bandwidth with efficiency 1
    slope, intercept = np.polyfit(inside["sizes_bytes"], inside["seconds"], 1)
    loopback_bytes_per_s = 1.0 / slope  # 2(n-1)/n = 1 for two workers
    doc = {
        "name": f"whatif lab at {bandwidth_mbit:g} Mbps (calibrated)",
        "intra_node": {
            "bandwidth": f"{loopback_bytes_per_s / 1e6:.1f}MB/s",
            "latency": f"{max(intercept, 0) / 2 * 1e6:.1f}us",
            "efficiency": 1.0,
            "cpu_contention": contention["inside_a_machine"],
            **({"floor": fit_floor(inside["small_allreduce"])} if "small_allreduce" in inside else {}),
            **({"collectives": fit_collectives(ops["inside_a_machine"], 1, 2, None)} if ops else {}),
        },
        "inter_node": {
            "bandwidth": f"{bandwidth_mbit:g}Mbps",
            "latency": f"{nic['latency_us']:.1f}us",
            "efficiency": round(nic["efficiency"], 4),
            "cpu_contention": contention["across_machines"],
            **({"floor": fit_floor(across["small_allreduce"])} if "small_allreduce" in across else {}),
            **({"collectives": fit_collectives(ops["across_machines"], 2, 1, bandwidth_mbit * 1e6 / 8)} if ops else {}),
        },
        "shared_memory": fit_shared_memory(shared),
        "measured": {**measured, "shared_memory": shared, **({"collectives": ops} if ops else {})},
    }
    return doc


def calibrations_of_runs(work_dir: Path, bandwidth_mbit: float, ops: Optional[dict] = None,
                         floors: Optional[dict] = None) -> list[dict]:
    """One topology document per run of the probes kept in ``work_dir`` (``calibrate``'s
    folder: ``across``, ``inside``, ``horovod_loop_WHERE`` and ``shared_memory``, each with its
    ``runN`` folders): the calibration each run alone gives, whose spread is the calibration's
    (``whatif predict`` widens its interval by it, ``report/intervals.py``). Empty where the
    folder does not hold every probe's runs. The collectives probe's figures (``ops``, their
    medians over the runs) and the small all-reduce probe's (``floors``, by where) are the same
    in every run's document."""
    work_dir = Path(work_dir)
    probes = {"across_machines": ("across", "allreduce.json"), "inside_a_machine": ("inside", "allreduce.json")}
    runs = sorted(p.name for p in (work_dir / "across").glob("run*") if (p / "allreduce.json").exists())
    docs = []
    for run in runs:
        try:
            measured = {where: json.loads((work_dir / folder / run / name).read_text())
                        for where, (folder, name) in probes.items()}
            for where in probes:
                loop = work_dir / f"horovod_loop_{where}" / run / "horovod_loop.json"
                if loop.exists():
                    measured[where]["horovod_loop"] = json.loads(loop.read_text())
                if floors and where in floors:
                    measured[where]["small_allreduce"] = floors[where]
            shared = json.loads((work_dir / "shared_memory" / run / "shared_memory.json").read_text())
        except (OSError, json.JSONDecodeError):
            return []
        docs.append(fit_links(bandwidth_mbit, measured, shared, ops))
    return docs
