"""How close `whatif collective` comes to public nccl-tests tables, from vendor specs alone.

    .venv/bin/python bench/nccl_accuracy.py [FOLDER]        # FOLDER defaults to bench/nccl_tests
    .venv/bin/python bench/nccl_accuracy.py --rows TABLE    # one table row by row
    .venv/bin/python bench/nccl_accuracy.py --json

FOLDER holds ``data/*.txt`` (nccl-tests outputs) and ``tables.yaml`` (each table's cluster as
its source describes it, and a ``healthy`` flag). Every table is predicted from a cluster built
from that description and our presets (``cluster_config``): no number of the table itself is
used, no fitting. Per table: the median and largest |error| of the out-of-place time over its
rows, and the algorithms/protocols we chose. Unhealthy tables (the source reports a fault) and
undiagnosed ones are listed apart: there the error is the diagnosis.

The cross-scale check calibrates on one table of a cluster (``whatif calibrate nccl-tests``'
fit) and predicts another table of the same cluster at another scale; the leave-one-out check
calibrates on all of a cluster's tables but one and predicts that one (``--no-cross-scale``
skips both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from whatif.topology import Cluster, TopologyError, collective_cost  # noqa: E402
from whatif.topology.backends import parse_choices  # noqa: E402
from whatif.topology.calibrate import diagnose, fit_tables, table_comm  # noqa: E402
from whatif.topology.nccl_tests import read_table  # noqa: E402

GPUS = (("gb300", "gb300"), ("gb200", "gb200"), ("b200", "b200"), ("gh200", "gh200"), ("h200", "h200"),
        ("h100", "h100"), ("a100", "a100"), ("v100", "v100"), ("2080", "rtx2080ti"))
NICS = {"infiniband_ndr": "ib", "infiniband_hdr": "ib", "infiniband_edr": "ib", "roce": "roce", "efa": "efa",
        "gpudirect_tcpx": "socket", "gpudirect_tcpxo": "socket"}
NIC_LATENCY_US = {"efa": 20.0, "socket": 20.0}  # as nics.yaml's efa_* and tcp_* presets
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
)
# Cross-scale pairs: (calibrate on, predict) tables of one cluster.
CROSS_SCALE = (
    ("b200_vultr_2node_ib_allreduce.txt", "b200_vultr_1node_8gpu_allreduce.txt"),
    ("gb200_nvl72_2rack_128gpu_allreduce_nccl2.26.2.txt", "gb200_nvl72_20rack_1440gpu_allreduce_nccl2.26.2.txt"),
    ("a100_coreweave_sharp_32gpu_allreduce_nccl2.12_2022.txt", "a100_coreweave_16node_128gpu_allreduce_2022.txt"),
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
        # NIC count not stated: the devices the run's environment names, else one per GPU (the
        # rail-optimised design of DGX SuperPODs and the clouds' 8-GPU shapes)
        listed = str((entry.get("env") or {}).get("UCX_NET_DEVICES", "")).split(",")
        nics = len([d for d in listed if d.strip()]) or per_node
    if kind and not gbps:
        gbps = NIC_GBPS_OF_GPU.get(gpu, 400)  # rate not stated: the GPU generation's reference NIC
    if nics and gbps:
        transport = NICS.get(kind, "ib")
        config["nics_per_machine"] = nics
        config["nic"] = {"bandwidth": f"{gbps}Gbps", "transport": transport,
                         "latency": f"{NIC_LATENCY_US.get(transport, 0.0)}us"}
    else:
        config["nics_per_machine"] = max(nics, 1)
        config["nic"] = "ib_ndr"
    name = str(entry["file"]).lower()
    config["cpu"] = next((cpu for key, cpu in CPUS if key in name), "intel")
    env = {k: str(v) for k, v in (entry.get("env") or {}).items()}
    if env.get("NCCL_COLLNET_ENABLE") == "1":
        config["network"] = {"sharp": True}
    version, _ = nccl_version(entry)
    if version:
        config["nccl"] = {"version": version}
    return config


def with_calibration(config: dict, calibration) -> dict:
    """``config`` with ``calibration``'s factors, keeping its own NCCL version."""
    nccl = {k: v for k, v in calibration.as_config().items() if k != "version"}
    if config.get("nccl", {}).get("version"):
        nccl["version"] = config["nccl"]["version"]
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


def evaluate(entry: dict, table, cluster: Cluster) -> dict:
    """Per-row errors of one table against ``cluster``."""
    algorithm, protocol = forced(entry)
    rows, chosen = [], []
    for row in table.rows:
        cost = collective_cost(cluster, table.op, row.size_bytes, algorithm=algorithm, protocol=protocol)
        error = (cost.time_us - row.time_us) / row.time_us * 100
        rows.append({"bytes": row.size_bytes, "measured_us": row.time_us, "predicted_us": cost.time_us,
                     "error_pct": error, "algorithm": cost.algorithm, "protocol": cost.protocol})
        label = f"{cost.algorithm}/{cost.protocol}"
        if label not in chosen:
            chosen.append(label)
    errors = [abs(r["error_pct"]) for r in rows]
    large = [abs(r["error_pct"]) for r in rows if r["bytes"] >= LARGE_BYTES]
    note = diagnose(table, table_comm(cluster.fabric, table)[1], parse_choices(algorithm, protocol))
    version, how = nccl_version(entry)
    return {"file": entry["file"], "op": table.op, "ranks": cluster.n_gpus, "nodes": cluster.machines,
            "nccl": (version or "newest") + ("" if how == "printed" else "*"),
            "healthy": entry.get("healthy"), "rows": rows, "median_pct": statistics.median(errors),
            "max_pct": max(errors), "large_median_pct": statistics.median(large) if large else None,
            "chosen": chosen, "diagnosis": note.split(": ", 1)[1] if note else ""}


def load(folder: Path) -> list:
    entries = yaml.safe_load((folder / "tables.yaml").read_text())["tables"]
    out = []
    for entry in entries:
        path = folder / "data" / entry["file"]
        if not path.exists():
            continue
        table = read_table(path, entry.get("op"))
        out.append((entry, table, Cluster.from_config(cluster_config(entry), "tables.yaml")))
    return out


def cross_scale(folder: Path, loaded: list) -> list:
    by_file = {entry["file"]: (entry, table, cluster) for entry, table, cluster in loaded}
    results = []
    for source, target in CROSS_SCALE:
        if source not in by_file or target not in by_file:
            continue
        entry, table, cluster = by_file[source]
        calibrated = fit_tables([table], cluster, [parse_choices(*forced(entry))]).cluster
        t_entry, t_table, t_cluster = by_file[target]
        scaled = Cluster.from_config(with_calibration(cluster_config(t_entry), calibrated.fabric.calibration))
        results.append({"calibrated_on": source, **evaluate(t_entry, t_table, scaled)})
    return results


def leave_one_out(loaded: list) -> list:
    """For every cluster with three or more healthy tables (same source, GPU and NICs): calibrate
    on all of them but one, predict the one left out (another op, or another scale)."""
    groups: dict = {}
    for entry, table, cluster in loaded:
        if entry.get("healthy"):
            key = tuple(entry.get(k) for k in ("source_id", "gpu", "nic_kind", "nics_per_node", "nic_gbps"))
            groups.setdefault(key, []).append((entry, table, cluster))
    results = []
    for members in groups.values():
        if len(members) < 3:
            continue
        for i, (entry, table, _) in enumerate(members):
            rest = [m for j, m in enumerate(members) if j != i]
            base = max(rest, key=lambda m: m[2].n_gpus)[2]
            fit = fit_tables([m[1] for m in rest], base, [parse_choices(*forced(m[0])) for m in rest])
            scaled = Cluster.from_config(with_calibration(cluster_config(entry), fit.cluster.fabric.calibration))
            results.append({"calibrated_on": f"{len(rest)} other tables", **evaluate(entry, table, scaled)})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=REPO / "bench" / "nccl_tests")
    parser.add_argument("--rows", metavar="TABLE", help="print one table's rows")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-cross-scale", action="store_true")
    args = parser.parse_args(argv)
    try:
        loaded = load(args.folder)
    except (TopologyError, OSError) as err:
        print(f"nccl_accuracy: {err}", file=sys.stderr)
        return 2
    results = [evaluate(entry, table, cluster) for entry, table, cluster in loaded]
    crossed = [] if args.no_cross_scale else cross_scale(args.folder, loaded)
    left_out = [] if args.no_cross_scale else leave_one_out(loaded)
    if args.json:
        print(json.dumps({"tables": results, "cross_scale": crossed, "leave_one_out": left_out}))
        return 0
    if args.rows:
        for result in results + crossed:
            if args.rows in result["file"]:
                print(result["file"], result.get("calibrated_on", ""))
                for r in result["rows"]:
                    print(f"{r['bytes']:>14.0f} {r['measured_us']:>11.2f} {r['predicted_us']:>11.2f} {r['error_pct']:>+8.1f} %"
                          f"  {r['algorithm']}/{r['protocol']}")
        return 0
    for title, wanted in (("healthy", (True,)), ("unhealthy or undiagnosed", (False, None))):
        chosen = [r for r in results if r["healthy"] in wanted]
        print(f"\n{title} tables: {len(chosen)}")
        print(f"{'table':<62} {'op':<15} {'ranks':>5} {'NCCL':>8} {'rows':>4} {'median%':>8} {'max%':>7} {'>=64MiB%':>9}"
              f"  chosen")
        for r in chosen:
            large = "-" if r["large_median_pct"] is None else f"{r['large_median_pct']:.1f}"
            print(f"{r['file'][:62]:<62} {r['op']:<15} {r['ranks']:>5} {r['nccl']:>8} {len(r['rows']):>4} "
                  f"{r['median_pct']:>8.1f} {r['max_pct']:>7.1f} {large:>9}  {', '.join(r['chosen'])}")
        if chosen:
            meds = [r["median_pct"] for r in chosen]
            print(f"{'all':<62} {'':<15} {'':>5} {'':>8} {sum(len(r['rows']) for r in chosen):>4} {statistics.median(meds):>8.1f} "
                  f"{max(r['max_pct'] for r in chosen):>7.1f}  (median of medians, worst row)")
            large = [r["large_median_pct"] for r in chosen if r["large_median_pct"] is not None]
            print(f"within targets (median <= 5 %, max <= 10 %): "
                  f"{sum(r['median_pct'] <= 5 and r['max_pct'] <= 10 for r in chosen)} of {len(chosen)}; "
                  f"rows of 64 MiB and more: median of medians {statistics.median(large):.1f} %, "
                  f"{sum(x <= 5 for x in large)} of {len(large)} tables within 5 %")
            for r in chosen:
                if r["diagnosis"]:
                    print(f"  diagnosis, {r['file']}: {r['diagnosis']}")
    if crossed:
        print("\ncross-scale: calibrate on one table, predict another of the same cluster")
        for r in crossed:
            print(f"  {r['calibrated_on']} -> {r['file']}: median {r['median_pct']:.1f} %, max {r['max_pct']:.1f} % "
                  f"({len(r['rows'])} rows; {', '.join(r['chosen'])})")
    if left_out:
        print("\nleave one out: calibrate on a cluster's other tables, predict this one")
        for r in left_out:
            print(f"  {r['file']:<62} median {r['median_pct']:5.1f} %, max {r['max_pct']:5.1f} % (spec-only: "
                  f"{next(t['median_pct'] for t in results if t['file'] == r['file']):.1f} %)")
        meds = [r["median_pct"] for r in left_out]
        print(f"  median of medians {statistics.median(meds):.1f} % over {len(meds)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
