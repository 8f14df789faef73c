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

GPUS = (("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
        ("v100", "v100"), ("2080", "rtx2080ti"))
NICS = {"infiniband_ndr": "ib", "infiniband_hdr": "ib", "infiniband_edr": "ib", "roce": "roce", "efa": "efa",
        "gpudirect_tcpx": "socket", "gpudirect_tcpxo": "socket"}
NIC_LATENCY_US = {"efa": 20.0, "socket": 20.0}  # as nics.yaml's efa_* and tcp_* presets
# The CPUs of the platforms in the file names (vendor pages): NCCL's tuning depends on the vendor.
CPUS = (("aws_p5en", "intel"), ("aws_p5", "amd"), ("p4d", "intel"), ("oci_bm.gpu4.8", "amd"), ("gb200", "arm"),
        ("datacrunch", "amd"), ("crusoe", "amd"), ("coreweave_16node", "amd"))
LARGE_BYTES = 64 * 2**20  # the bandwidth-bound rows, reported apart
# Cross-scale pairs: (calibrate on, predict) tables of one cluster.
CROSS_SCALE = (
    ("b200_vultr_2node_ib_allreduce.txt", "b200_vultr_1node_8gpu_allreduce.txt"),
    ("gb200_nvl72_2rack_128gpu_allreduce_nccl2.26.2.txt", "gb200_nvl72_20rack_1440gpu_allreduce_nccl2.26.2.txt"),
    ("a100_coreweave_sharp_32gpu_allreduce_nccl2.12_2022.txt", "a100_coreweave_16node_128gpu_allreduce_2022.txt"),
)


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
    if nics and entry.get("nic_gbps"):
        transport = NICS.get(kind, "ib")
        config["nics_per_machine"] = nics
        config["nic"] = {"bandwidth": f"{entry['nic_gbps']}Gbps", "transport": transport,
                         "latency": f"{NIC_LATENCY_US.get(transport, 0.0)}us"}
    else:
        config["nics_per_machine"] = max(nics, 1)
        config["nic"] = "ib_ndr"
    name = str(entry["file"]).lower()
    config["cpu"] = next((cpu for key, cpu in CPUS if key in name), "intel")
    env = {k: str(v) for k, v in (entry.get("env") or {}).items()}
    if env.get("NCCL_COLLNET_ENABLE") == "1":
        config["network"] = {"sharp": True}
    return config


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
    return {"file": entry["file"], "op": table.op, "ranks": cluster.n_gpus, "nodes": cluster.machines,
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
        scaled = Cluster.from_config({**cluster_config(t_entry), "nccl": calibrated.fabric.calibration.as_config()})
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
            scaled = Cluster.from_config({**cluster_config(entry), "nccl": fit.cluster.fabric.calibration.as_config()})
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
        print(f"{'table':<62} {'op':<15} {'ranks':>5} {'rows':>4} {'median%':>8} {'max%':>7} {'>=64MiB%':>9}  chosen")
        for r in chosen:
            large = "-" if r["large_median_pct"] is None else f"{r['large_median_pct']:.1f}"
            print(f"{r['file'][:62]:<62} {r['op']:<15} {r['ranks']:>5} {len(r['rows']):>4} {r['median_pct']:>8.1f} "
                  f"{r['max_pct']:>7.1f} {large:>9}  {', '.join(r['chosen'])}")
        if chosen:
            meds = [r["median_pct"] for r in chosen]
            print(f"{'all':<62} {'':<15} {'':>5} {sum(len(r['rows']) for r in chosen):>4} {statistics.median(meds):>8.1f} "
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
