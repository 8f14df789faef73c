"""How close `whatif collective` comes to public nccl-tests tables: spec-only and held out.

    .venv/bin/python bench/nccl_accuracy.py [FOLDER]        # FOLDER defaults to bench/nccl_tests
    .venv/bin/python bench/nccl_accuracy.py --rows TABLE    # one table row by row
    .venv/bin/python bench/nccl_accuracy.py --json
    .venv/bin/python bench/nccl_accuracy.py --markdown      # the cross-scale table docs/communication.md quotes
    .venv/bin/python bench/nccl_accuracy.py --unprinted-as-newest  # cross-scale as a user without the release
    .venv/bin/python bench/nccl_accuracy.py --write-measured  # refit presets/measured.yaml

FOLDER holds ``data/*.txt`` (nccl-tests outputs) and ``tables.yaml`` (each table's cluster as
its source describes it, its NCCL version, a ``healthy`` flag, a ``series`` for tables of one
cluster at several scales). Every table is predicted from a cluster built from that description
and our presets (``cluster_config``), with the NCCL release it ran (printed, or implied by its
date: ``IMPLIED``), in two columns:

* **spec-only**: NCCL's tuning tables of that release and the vendors' specs, nothing else
  (``measured: spec``): no number of any table is used.
* **held-out**: plus the constants only measurements give (``nccl/measured.py``: kernel start
  by GPU generation, per-hop latency by NIC kind, point-to-point efficiency between nodes,
  nccl-tests' host cost when one thread drives several GPUs), estimated from the healthy tables
  of every *other* source: a source's tables never inform the constants that predict them.

Per table: the median and largest |error| of the out-of-place time over its rows and over its
rows of 64 MiB and more, and what NCCL picks. Unhealthy tables (the source reports a fault),
disturbed ones (``calibrate.disturbed``: a size markedly slower than twice that size in both
its runs, which no collective's own cost does; judged from the table alone, no model) and
undiagnosed ones are listed apart: there the error is the diagnosis. Rows whose out-of-place
and in-place runs differ by more than 1.5x (``calibrate.spikes``) are one run's noise: they
are printed but left out of every figure and fit. The cross-scale check
calibrates (``whatif calibrate nccl-tests``) on one scale of a series, on top of its source's
held-out constants, and predicts the series' other scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from whatif.topology import Cluster, TopologyError, collective_cost  # noqa: E402
from whatif.topology.nccl.tuning import parse_choices  # noqa: E402
from whatif.topology.calibrate import (decompose, diagnose, disturbed, fit_tables, spikes, table_comm,  # noqa: E402
                                       table_time_us)
from whatif.topology.nccl.measured import SPEC, fit  # noqa: E402
from whatif.topology.nccl_tests import Row, Table, read_table  # noqa: E402

GPUS = (("gb300", "gb300"), ("gb200", "gb200"), ("b200", "b200"), ("gh200", "gh200"), ("h200", "h200"),
        ("h100", "h100"), ("a100", "a100"), ("v100", "v100"), ("2080", "rtx2080ti"))
NICS = {"infiniband_ndr": "ib", "infiniband_hdr": "ib", "infiniband_edr": "ib", "roce": "roce", "efa": "efa",
        "gpudirect_tcpx": "socket", "gpudirect_tcpxo": "socket", "slingshot11": "ofi"}
# The NIC kind the measured constants are keyed on (nics.yaml's kind): EFA by generation, as AWS
# names them (p3dn, p4d, p4de: EFA; p5: EFAv2; p5en: EFAv3), Google's two TCP plugins apart.
KINDS = {"infiniband_ndr": "ib", "infiniband_hdr": "ib", "infiniband_edr": "ib", "roce": "roce",
         "gpudirect_tcpx": "tcpx", "gpudirect_tcpxo": "tcpxo", "slingshot11": "slingshot"}
EFA_GENERATION = {"v100": "efa1", "a100": "efa1", "h100": "efa2", "h200": "efa3"}


GIB_SOURCES = ("google-dranet",)  # GCP's A3 Ultra / A4 RoCE runs through Google's gIB NCCL plugin


def nic_kind(entry: dict, gpu: str) -> str:
    kind = str(entry.get("nic_kind") or "")
    if kind == "roce" and (entry.get("source_id") in GIB_SOURCES or "_gcp_" in str(entry["file"])):
        return "gib"
    return EFA_GENERATION.get(gpu, "efa") if kind == "efa" else KINDS.get(kind, NICS.get(kind, "ib"))
# The compute NIC of each GPU generation's reference system (DGX A100: HDR 200G; DGX H100/H200,
# B200, GB200 NVL72: NDR 400G; GB300 NVL72: ConnectX-8 800G), for tables that do not state it.
NIC_GBPS_OF_GPU = {"a100": 200, "v100": 100, "gb300": 800}
# The CPUs of the platforms in the file names (vendor pages): NCCL's tuning depends on the vendor.
CPUS = (("aws_p5en", "intel"), ("aws_p5", "amd"), ("p4d", "intel"), ("oci_bm.gpu4.8", "amd"), ("gb200", "arm"),
        ("gb300", "arm"), ("gh200", "arm"), ("datacrunch", "amd"), ("crusoe", "amd"), ("coreweave_16node", "amd"),
        ("oci_oke_bm.gpu4.8", "amd"))
LARGE_BYTES = 64 * 2**20  # the bandwidth-bound rows, reported apart
# NCCL releases by date (git tags of NVIDIA/nccl) and the release a table's date implies where its
# NCCL version was not printed: the newest release published at least LAG_DAYS before the table
# (containers and cloud images ship a release a few months old), and never older than the first
# release that supports its GPU (Blackwell: 2.25). Where the source names an image or a default
# build whose NCCL is known, that version instead; the reason is kept with each table.
RELEASES = (("2.4.8", "2019-06-25"), ("2.5.6", "2019-11-19"), ("2.6.4", "2020-03-20"), ("2.7.8", "2020-07-27"),
            ("2.8.4", "2021-02-09"), ("2.9.9", "2021-05-12"), ("2.10.3", "2021-07-08"), ("2.11.4", "2021-09-08"),
            ("2.12.10", "2022-03-30"), ("2.12.12", "2022-05-13"), ("2.13.4", "2022-07-11"), ("2.14.3", "2022-08-18"),
            ("2.15.5", "2022-10-25"), ("2.16.5", "2023-02-02"), ("2.17.1", "2023-03-01"), ("2.18.1", "2023-04-18"),
            ("2.18.3", "2023-06-14"), ("2.18.5", "2023-08-23"), ("2.19.3", "2023-09-26"), ("2.20.3", "2024-02-13"),
            ("2.21.5", "2024-04-02"), ("2.22.3", "2024-06-19"), ("2.23.4", "2024-09-16"), ("2.24.3", "2025-01-07"),
            ("2.25.1", "2025-01-27"), ("2.26.2", "2025-03-12"), ("2.26.6", "2025-05-20"), ("2.27.3", "2025-05-29"),
            ("2.27.5", "2025-06-18"), ("2.27.7", "2025-07-24"), ("2.28.3", "2025-09-02"), ("2.28.7", "2025-10-17"),
            ("2.28.9", "2025-11-10"), ("2.29.3", "2026-02-03"), ("2.29.7", "2026-02-27"), ("2.30.7", "2026-06-04"))
LAG_DAYS = 90
FIRST_RELEASE = {"blackwell": "2.25.1"}
# Tables without a printed version: (file name prefix, the table's date, or a version the source names, why).
IMPLIED = (
    ("b200_vultr_", "2026-05-18", None, "report generated 2026-05-18"),
    ("b200_gcp_a4_2node_roce_allreduce", "2025-04-15", None, "dstack's GCP page, April 2025"),
    ("h100_aws_p5_1node_8gpu_allreduce_awsbatch", "2024-10-30", None, "nccl-tests:latest image, October 2024"),
    ("h100_aws_p5_2node_efa_allreduce.txt", None, "2.20.3", "the README's default build at that commit"),
    ("a100_aws_p4de_2node_efa_allreduce", None, "2.20.3", "the README's default build at that commit"),
    ("h100_gcp_a3mega_2node_tcpxo_allreduce", "2025-04-02", None, "commit of 2025-04-02"),
    ("h100_gcp_a3mega_2node_tcpxo_allgather", None, "2.21.5", "image nvcr.io/nvidia/pytorch:24.04 (NCCL 2.21.5)"),
    ("h100_gcp_a3high_2node_tcpx_allgather", "2025-04-15", None, "dstack's GCP page, April 2025"),
    ("h100_nebius_2node_ib_allreduce", "2025-04-15", None, "dstack's Nebius page, 2025"),
    ("h100_2node_1gpu_4nic_roce", "2024-07-12", None, "issue of 2024-07-12"),
    ("h200_datacrunch_2node_allreduce", "2025-04-24", None, "commit of 2025-04-24"),
    ("h200_aws_p5en_16node", "2025-09-26", None, "README commit of 2025-09-26"),
    ("h200_gcp_2node_1gpu_allreduce", None, "2.25.1", "the same source's H200 demo prints 2.25.1"),
    ("a100_oci_bm.gpu4.8_", "2022-01-15", None, "tutorial of about 2022 (CUDA 11.3 era)"),
    ("a100_crusoe_2node_ib_allreduce", "2026-02-01", None, "commit of February 2026"),
    ("a100_coreweave_16node_128gpu_allreduce_2022", "2022-07-05", None, "image coreweave/nccl-tests:2022-07-05"),
    ("rtx2080ti_autodl_", "2025-06-05", None, "post of 2025-06-05"),
    ("h100_ib_", "2025-06-01", None, "issue 309, May-June 2025"),
    ("h100_roce_128node", "2025-09-08", None, "issue 322, 2025"),
    ("h100_1node_8gpu_allreduce_issue290", "2025-03-03", None, "issue 290, March 2025"),
    ("h100_ib_2node_16gpu_allreduce_issue290", "2025-03-03", None, "issue 290, March 2025"),
    ("h100_ib_2node_16gpu_allreduce_ring_issue290", "2025-03-03", None, "issue 290, March 2025"),
    ("gh200_cscs_alps_", "2025-12-17", None, "CSCS docs of 2025-12-17"),
    ("a100_superbench_", "2021-12-30", None, "SuperBench fixture of 2021-12-30"),
    ("v100_aws_p3dn_", "2019-07-23", None, "gist of 2019-07-23"),
    ("gb200_oci_oke_2tray", None, "2.26.6", "the MPIJob image's nccl-2.26.6"),
)


def _date_release(date: str, generation: str) -> str:
    import datetime
    cutoff = (datetime.date.fromisoformat(date) - datetime.timedelta(days=LAG_DAYS)).isoformat()
    found = [v for v, d in RELEASES if d <= cutoff] or [RELEASES[0][0]]
    version = found[-1]
    first = FIRST_RELEASE.get(generation)
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    return max(version, first, key=key) if first else version


def nccl_version(entry: dict) -> tuple:
    """``(version, how)``: the table's printed NCCL version, else the one its date or source implies
    (see IMPLIED), else ``(None, 'unknown')`` (the newest modelled is used)."""
    if entry.get("nccl_version"):
        return str(entry["nccl_version"]), "printed"
    name = str(entry["file"])
    for prefix, date, named, why in IMPLIED:
        if name.startswith(prefix):
            if named:
                return named, f"implied: {why}"
            return _date_release(date, str(entry.get("generation", ""))), f"implied: {why}"
    return None, "unknown: the newest modelled"


LISTED_NICS: dict = {}  # (source, GPU) -> NICs its runs' environments name; filled by load()


def listed_nics(entry: dict) -> int:
    listed = str((entry.get("env") or {}).get("UCX_NET_DEVICES", "")).split(",")
    return len([d for d in listed if d.strip()])


def cluster_config(entry: dict) -> dict:
    """A cluster description from a tables.yaml entry: GPU, NVLink, NICs and NCCL environment."""
    gpu_name = str(entry.get("gpu", "")).lower().replace(" ", "")
    gpu = next(preset for key, preset in GPUS if key in gpu_name)
    per_node, nodes = int(entry.get("gpus_per_node") or 1), int(entry.get("nodes") or 1)
    intra = str(entry.get("intra_node") or "none")
    config = {"gpu": gpu, "machines": nodes, "gpus_per_machine": per_node}
    if intra == "nvl72":
        n = nodes * per_node
        config["nvlink_domain"] = 72 if n % 72 == 0 else (n // 2 if nodes > 18 else n)
    elif intra.startswith("pcie") or intra == "none" or per_node == 1:
        config["nvlink_domain"] = 1 if gpu in ("rtx2080ti",) or intra.startswith("pcie") else per_node
    else:
        config["nvlink_domain"] = per_node
    config["nvswitch"] = "nvswitch" in intra or intra == "nvl72"
    nics = int(entry.get("nics_per_node") or 0)
    kind = str(entry.get("nic_kind") or "")
    gbps = entry.get("nic_gbps")
    if kind and entry.get("nics_per_node") is None:
        # NIC count not stated: the devices the run's environment names, else those the same
        # source's runs on the same GPUs name (CoreWeave's A100 manifests: ibp0..ibp3), else one
        # per GPU (the rail-optimised design of DGX SuperPODs and the clouds' 8-GPU shapes)
        nics = listed_nics(entry) or LISTED_NICS.get((entry.get("source_id"), entry.get("gpu")), 0) or per_node
    if kind and not gbps:
        gbps = NIC_GBPS_OF_GPU.get(gpu, 400)  # rate not stated: the GPU generation's reference NIC
    if nics and gbps:
        transport = NICS.get(kind, "ib")
        config["nics_per_machine"] = nics
        config["nic"] = {"bandwidth": f"{gbps}Gbps", "transport": transport, "kind": nic_kind(entry, gpu)}
    else:
        config["nics_per_machine"] = max(nics, 1)
        config["nic"] = "ib_ndr"
    name = str(entry["file"]).lower()
    config["cpu"] = next((cpu for key, cpu in CPUS if key in name), "intel")
    env = {k: str(v) for k, v in (entry.get("env") or {}).items()}
    if env.get("NCCL_COLLNET_ENABLE") == "1":
        config["network"] = {"sharp": True}
    version, _ = nccl_version(entry)
    nccl = {"version": version} if version else {}
    minimum = env.get("NCCL_MIN_NCHANNELS") or env.get("NCCL_MIN_CTAS")
    if minimum:
        nccl["min_channels"] = int(minimum)
    if nccl:
        config["nccl"] = nccl
    return config


def as_user_would(entry: dict, config: dict) -> dict:
    """``config`` as a user holding only the table would give it: where the table does not print
    its NCCL release, none (so the newest modelled), not the one its date implies."""
    if nccl_version(entry)[1] == "printed":
        return config
    nccl = {k: v for k, v in config.get("nccl", {}).items() if k != "version"}
    return {**{k: v for k, v in config.items() if k != "nccl"}, **({"nccl": nccl} if nccl else {})}


def with_calibration(config: dict, calibration) -> dict:
    """``config`` with ``calibration``'s factors, keeping its own NCCL version."""
    nccl = {k: v for k, v in calibration.as_config().items() if k not in ("version", "min_channels")}
    for key in ("version", "min_channels"):
        if config.get("nccl", {}).get(key):
            nccl[key] = config["nccl"][key]
    return {**config, "nccl": nccl}


def forced(entry: dict) -> tuple:
    """``(algorithm, protocol)`` specs from the run's NCCL environment (NCCL_ALGO syntax)."""
    env = {k: str(v) for k, v in (entry.get("env") or {}).items()}
    algorithm = env.get("NCCL_ALGO")
    if env.get("NCCL_TREE_THRESHOLD") == "0":
        algorithm = "ring"
    if env.get("NCCL_NVLS_ENABLE") == "0" and algorithm is None:
        algorithm = "^nvls,nvls_tree"
    return algorithm, env.get("NCCL_PROTO")


def with_measured(cluster: Cluster, measured) -> Cluster:
    """``cluster`` with these measured constants (``measured: spec`` for the spec-only column)."""
    calibration = dataclasses.replace(cluster.fabric.calibration, measured=measured)
    return dataclasses.replace(cluster, fabric=dataclasses.replace(cluster.fabric, calibration=calibration))


def evaluate(entry: dict, table, cluster: Cluster) -> dict:
    """Per-row errors of one table against ``cluster`` (its measured constants included): the GPU
    time of ``collective_cost``, at least nccl-tests' host time for the GPUs a thread drives."""
    algorithm, protocol = forced(entry)
    comm = table_comm(cluster.fabric, table)[1]
    measured = cluster.fabric.calibration.constants
    rows, chosen, noise = [], [], spikes(table)
    for row in table.rows:
        cost = collective_cost(cluster, table.op, row.size_bytes, algorithm=algorithm, protocol=protocol)
        predicted = table_time_us(table, comm, cost, measured)
        error = (predicted - row.time_us) / row.time_us * 100
        rows.append({"bytes": row.size_bytes, "measured_us": row.time_us, "predicted_us": predicted,
                     "error_pct": error, "algorithm": cost.algorithm, "protocol": cost.protocol,
                     "spike": row in noise})
        label = f"{cost.algorithm}/{cost.protocol}"
        if label not in chosen:
            chosen.append(label)
    scored = [r for r in rows if not r["spike"]]
    errors = [abs(r["error_pct"]) for r in scored]
    large = [abs(r["error_pct"]) for r in scored if r["bytes"] >= LARGE_BYTES]
    note = diagnose(table, comm, parse_choices(algorithm, protocol))
    version, how = nccl_version(entry)
    return {"file": entry["file"], "op": table.op, "ranks": cluster.n_gpus, "nodes": cluster.machines,
            "nccl": (version or "newest") + ("" if how == "printed" else "*"), "source": entry.get("source_id"),
            "healthy": healthy(entry), "spikes": len(noise), "rows": rows, "median_pct": statistics.median(errors),
            "max_pct": max(errors), "large_median_pct": statistics.median(large) if large else None,
            "chosen": chosen, "diagnosis": note.split(": ", 1)[1] if note else "",
            "disturbed": entry.get("disturbed", ""), "coarse": entry.get("coarse_rows", 0)}


#: busbw printed to 0.01 GB/s tells a row's time within 1 % from this busbw on
COARSE_BUSBW = 0.5


def busbw_table(path: Path, entry: dict) -> tuple:
    """``(table, left_out)`` for a table published as bus bandwidth only (``data/*.csv``:
    ``size_bytes,busbw_gbps`` after ``#`` comment lines): each row's time is its size over its
    algorithm bandwidth (busbw over the op's factor: 1 for send/recv); rows whose busbw is below
    :data:`COARSE_BUSBW` are printed too coarsely to give a time within 1 %, and are counted
    in ``left_out``, not scored."""
    factor = {"sendrecv": 1.0, "send_recv": 1.0}.get(entry["op"])
    if factor is None:
        raise SystemExit(f"{path}: busbw-only tables are read for send/recv only, not {entry['op']}")
    rows, left_out = [], 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if lines[0] != "size_bytes,busbw_gbps":
        raise SystemExit(f"{path}: expected the header size_bytes,busbw_gbps, got {lines[0]!r}")
    for number, line in enumerate(lines[1:], start=2):
        size, busbw = (float(x) for x in line.split(","))
        if busbw < COARSE_BUSBW:
            left_out += 1
            continue
        algbw = busbw / factor
        rows.append(Row(size, int(size // 4), "float", size / (algbw * 1e3), algbw, busbw, number))
    return Table(str(path), "send_recv", tuple(rows), entry["ranks"], entry["nodes"], entry.get("gpu", ""), 1,
                 entry.get("nccl_version")), left_out


def load(folder: Path) -> list:
    """``(entry, table, cluster)`` for every table of ``folder``; the clusters are spec-only."""
    entries = yaml.safe_load((folder / "tables.yaml").read_text())["tables"]
    for entry in entries:
        if listed_nics(entry) and entry.get("nics_per_node") is None:
            LISTED_NICS[(entry.get("source_id"), entry.get("gpu"))] = listed_nics(entry)
    out = []
    for entry in entries:
        path = folder / "data" / entry["file"]
        if not path.exists():
            continue
        if path.suffix == ".csv":
            table, entry["coarse_rows"] = busbw_table(path, entry)
        else:
            table = read_table(path, entry.get("op"))
        note = disturbed(table)
        entry["disturbed"] = note.split(": ", 1)[1] if note else ""
        cluster = Cluster.from_config(cluster_config(entry), "tables.yaml")
        out.append((entry, table, with_measured(cluster, SPEC)))
    return out


def decomposed(loaded: list) -> dict:
    """Every table's rows as the measured constants see them (``calibrate.decompose``)."""
    out = {}
    for entry, table, cluster in loaded:
        comm = table_comm(cluster.fabric, table)[1]
        noise = spikes(table)
        found = decompose(table, comm, parse_choices(*forced(entry)))
        out[entry["file"]] = [r for row, r in zip(table.rows, found) if row not in noise]
    return out


def healthy(entry: dict) -> bool:
    """Whether a table tests the model: its source reports no fault (``healthy`` in tables.yaml)
    and the table itself shows no disturbed run (``calibrate.disturbed``, model-free)."""
    return bool(entry.get("healthy")) and not entry.get("disturbed")


def spans_nvlink_domains(cluster: Cluster) -> bool:
    """Whether a table crosses between multi-node NVLink domains (GB200/GB300 racks): there the
    small-message time is set by NCCL's MNNVL trees and NVLS across 64-GPU cliques (180 to 490 us
    at 8 B to 8 MiB), which the model does not reproduce, not by the NICs' hops."""
    fabric = cluster.fabric
    return fabric.nvlink_domain > fabric.gpus_per_machine and fabric.n_gpus > fabric.nvlink_domain


def training_rows(loaded: list, rows: dict, leave_out: str = "") -> list:
    """The rows the measured constants are estimated from: every healthy table's but those of the
    source ``leave_out`` and those that cross NVLink domains (``spans_nvlink_domains``)."""
    return [r for entry, _, cluster in loaded if healthy(entry) and entry.get("source_id") != leave_out
            and not spans_nvlink_domains(cluster) for r in rows[entry["file"]]]


def held_out(loaded: list, rows: dict) -> dict:
    """Per source, the measured constants estimated from every other source's healthy tables."""
    return {source: fit(training_rows(loaded, rows, source), f"public tables but {source}")
            for source in sorted({entry.get("source_id") for entry, _, _ in loaded})}


def series_of(loaded: list) -> dict:
    """Healthy tables measured at several scales of one cluster by one source: the folder's
    ``series``."""
    groups: dict = {}
    for entry, table, cluster in loaded:
        if entry.get("series") and healthy(entry):
            groups.setdefault(entry["series"], []).append((entry, table, cluster))
    return groups


def cross_scale(loaded: list, constants: dict, unprinted_as_newest: bool = False) -> list:
    """For every series: calibrate (``whatif calibrate nccl-tests``) on one scale's tables, on top
    of the source's held-out measured constants, and predict every other scale's.
    ``unprinted_as_newest``: a table that does not print its NCCL release is calibrated and
    predicted as the newest modelled, as ``whatif calibrate nccl-tests`` does without
    ``--nccl-version``, instead of the release its date implies."""
    results = []
    configured = (lambda entry: as_user_would(entry, cluster_config(entry))) if unprinted_as_newest else cluster_config
    for name, members in series_of(loaded).items():
        scales = sorted({m[2].n_gpus for m in members})
        if len(scales) < 2:
            continue
        for scale in scales:
            on = [m for m in members if m[2].n_gpus == scale]
            base = with_measured(Cluster.from_config(configured(on[0][0]), "tables.yaml"),
                                 constants[on[0][0].get("source_id")])
            calibrated = fit_tables([m[1] for m in on], base, [parse_choices(*forced(m[0])) for m in on]).cluster
            for entry, table, cluster in members:
                if cluster.n_gpus == scale:
                    continue
                config = with_calibration(configured(entry), calibrated.fabric.calibration)
                result = evaluate(entry, table, Cluster.from_config(config))
                results.append({"series": name, "calibrated_on": f"{scale} GPUs", **result})
    return results


def summary(results: list, key: str = "median_pct") -> str:
    meds = [r[key] for r in results]
    large = [r["large_median_pct"] for r in results if r["large_median_pct"] is not None]
    return (f"median of table medians {statistics.median(meds):.1f} %; "
            f"{sum(r['median_pct'] <= 5 and r['max_pct'] <= 10 for r in results)} of {len(results)} within both "
            f"targets (median <= 5 %, max <= 10 %); rows of 64 MiB and more: median of medians "
            f"{statistics.median(large):.1f} %, {sum(x <= 5 for x in large)} of {len(large)} tables within 5 %")


def markdown(spec: list, held: list, crossed: list) -> str:
    """The cross-scale table of docs/communication.md (one line a series: every pair's median and
    max |error|) and the three figures it quotes, from this code's results."""
    lines = ["| series | calibrated on -> predicted: median % (max %) |", "|---|---|"]
    series: dict = {}
    for r in crossed:
        on = r["calibrated_on"].split()[0]
        series.setdefault(r["series"], []).append(f"{on} -> {r['ranks']}: {r['median_pct']:.1f} ({r['max_pct']:.0f})")
    lines += [f"| {name} | {'; '.join(pairs)} |" for name, pairs in series.items()]
    healthy_spec = [s for s in spec if s["healthy"]]
    healthy_held = [h for s, h in zip(spec, held) if s["healthy"]]
    meds = [r["median_pct"] for r in crossed]
    lines += ["", f"cross-scale: median of medians {statistics.median(meds):.1f} % over {len(meds)} predictions, "
              f"{sum(x <= 5 for x in meds)} within 5 %; {len(healthy_spec)} healthy tables: spec-only "
              f"{statistics.median(r['median_pct'] for r in healthy_spec):.1f} %, held-out "
              f"{statistics.median(r['median_pct'] for r in healthy_held):.1f} %"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=REPO / "bench" / "nccl_tests")
    parser.add_argument("--rows", metavar="TABLE", help="print one table's rows")
    parser.add_argument("--env", metavar="KEY=VALUE", action="append", default=[],
                        help="with --rows: predict that table as if its run's NCCL environment also set KEY=VALUE "
                             "(NCCL_ALGO, NCCL_PROTO, NCCL_NVLS_ENABLE=0, NCCL_TREE_THRESHOLD=0); repeatable")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-cross-scale", action="store_true")
    parser.add_argument("--unprinted-as-newest", action="store_true",
                        help="cross-scale only: a table that does not print its NCCL release calibrated and predicted "
                             "as the newest modelled (what calibrate nccl-tests does without --nccl-version)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the cross-scale table and figures as docs/communication.md quotes them")
    parser.add_argument("--write-measured", action="store_true",
                        help="fit the measured constants to every healthy table and write presets/measured.yaml")
    args = parser.parse_args(argv)
    try:
        loaded = load(args.folder)
    except (TopologyError, OSError) as err:
        print(f"nccl_accuracy: {err}", file=sys.stderr)
        return 2
    rows = decomposed(loaded)
    if args.write_measured:
        found = fit(training_rows(loaded, rows), "bench/nccl_accuracy.py --write-measured: every healthy table")
        text = yaml.safe_dump(found.as_config(), sort_keys=False, width=110)
        (REPO / "topology" / "presets" / "measured.yaml").write_text(MEASURED_HEADER + text)
        print(f"written to topology/presets/measured.yaml ({len(found.fitted_on)} tables)")
        return 0
    constants = held_out(loaded, rows)
    if args.env:
        if not args.rows or any("=" not in pair for pair in args.env):
            print("nccl_accuracy: --env KEY=VALUE goes with --rows TABLE", file=sys.stderr)
            return 2
        for entry, _, _ in loaded:
            if args.rows in entry["file"]:
                entry["env"] = {**(entry.get("env") or {}), **dict(pair.split("=", 1) for pair in args.env)}
    spec = [evaluate(entry, table, cluster) for entry, table, cluster in loaded]
    held = [evaluate(entry, table, with_measured(cluster, constants[entry.get("source_id")]))
            for entry, table, cluster in loaded]
    crossed = [] if args.no_cross_scale else cross_scale(loaded, constants, args.unprinted_as_newest)
    if args.json:
        print(json.dumps({"spec_only": spec, "held_out": held, "cross_scale": crossed,
                          "constants": {k: v.as_config() for k, v in constants.items()}}))
        return 0
    if args.markdown:
        print(markdown(spec, held, crossed))
        return 0
    if args.rows:
        for title, results in (("spec-only", spec), ("held-out", held), ("cross-scale", crossed)):
            for result in results:
                if args.rows in result["file"]:
                    print(title, result["file"], result.get("calibrated_on", ""))
                    for r in result["rows"]:
                        print(f"{r['bytes']:>14.0f} {r['measured_us']:>11.2f} {r['predicted_us']:>11.2f} "
                              f"{r['error_pct']:>+8.1f} %  {r['algorithm']}/{r['protocol']}"
                              f"{'  (spike, not scored)' if r['spike'] else ''}")
        return 0
    for title, wanted in (("healthy", (True,)), ("unhealthy, disturbed or undiagnosed", (False,))):
        pairs = [(s, h) for s, h in zip(spec, held) if s["healthy"] in wanted]
        print(f"\n{title} tables: {len(pairs)}   (spec-only: NCCL's constants and vendor specs; held-out: "
              f"measured constants estimated from the other sources' tables)")
        print(f"{'table':<58} {'op':<14} {'ranks':>5} {'NCCL':>8} {'rows':>4} | {'spec med%':>9} {'max%':>6} "
              f"{'>=64M%':>6} | {'held med%':>9} {'max%':>6} {'>=64M%':>6} | chosen")
        for s, h in pairs:
            cells = []
            for r in (s, h):
                large = "-" if r["large_median_pct"] is None else f"{r['large_median_pct']:.1f}"
                cells.append(f"{r['median_pct']:>9.1f} {r['max_pct']:>6.1f} {large:>6}")
            print(f"{s['file'][:58]:<58} {s['op'][:14]:<14} {s['ranks']:>5} {s['nccl']:>8} {len(s['rows']):>4} | "
                  f"{cells[0]} | {cells[1]} | {', '.join(h['chosen'])}")
        if pairs:
            print(f"spec-only: {summary([s for s, _ in pairs])}")
            print(f"held-out:  {summary([h for _, h in pairs])}")
            for s, _ in pairs:
                if s["diagnosis"]:
                    print(f"  diagnosis, {s['file']}: {s['diagnosis']}")
                if s["disturbed"]:
                    print(f"  disturbed, {s['file']}: {s['disturbed']}")
            print(f"  spike rows (out-of-place and in-place runs differ by more than 1.5x), left out of the figures: "
                  f"{sum(s['spikes'] for s, _ in pairs)}")
            coarse = sum(s["coarse"] for s, _ in pairs)
            if coarse:
                print(f"  rows of busbw-only tables below {COARSE_BUSBW} GB/s (printed to 0.01 GB/s: a time known to "
                      f"worse than 1 %), left out of the figures: {coarse}")
    print("\nmeasured constants, held out per source (estimated from every other source's healthy tables):")
    for source, m in constants.items():
        hops = ", ".join(f"{k} {v:.1f}" for k, v in m.hop_us)
        effs = ", ".join(f"{k} {v:.2f}" for k, v in m.efficiency)
        kernels = ", ".join(f"{k} {v:.1f}" for k, v in m.kernel_us)
        print(f"  {source:<40} kernel us: {kernels}; hop us: {hops}; efficiency: {effs}; p2p "
              f"{m.p2p_efficiency:.2f}; host {m.host_launch_us:.1f} + {m.host_call_us:.2f}/call us")
    if crossed:
        print("\ncross-scale: calibrate on one scale of a series (on its source's held-out constants), "
              "predict the others")
        for r in crossed:
            print(f"  {r['series'][:60]:<60} {r['calibrated_on']:>10} -> {r['ranks']:>4} GPUs {r['file'][:50]:<50} "
                  f"median {r['median_pct']:5.1f} %, max {r['max_pct']:5.1f} %")
        meds = [r["median_pct"] for r in crossed]
        print(f"  median of medians {statistics.median(meds):.1f} % over {len(meds)} predictions; "
              f"{sum(x <= 5 for x in meds)} within 5 %")
    return 0


MEASURED_HEADER = """# Measured constants (topology/nccl/measured.py): what only measurements can say, estimated
# from every healthy public nccl-tests table of bench/nccl_tests by
#   .venv/bin/python bench/nccl_accuracy.py --write-measured
# (least squares on log time, each table weighted equally). Per-source held-out estimates, and
# how well each predicts the tables it never saw, are printed by bench/nccl_accuracy.py.
#
#   kernel_us       a collective's GPU start beyond NCCL's latencies, by GPU generation
#   hop_us          extra latency of one network hop, by NIC kind (nics.yaml's kind)
#   efficiency      fraction of NCCL's network-bound bandwidth a NIC kind delivers
#   p2p_efficiency  the same for point-to-point traffic between nodes (all-to-all)
#   host_*          nccl-tests' host thread per GPU it drives (launch) and per NCCL call
"""


if __name__ == "__main__":
    sys.exit(main())
