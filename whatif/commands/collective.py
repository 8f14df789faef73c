"""``whatif collective`` (a simulated nccl-tests) and ``whatif calibrate nccl-tests``.

``whatif collective CLUSTER.yaml --op all_reduce --min-bytes 8M --max-bytes 8G`` prints the
table nccl-tests would print for the cluster (``topology.collective_cost`` at every size), with
the algorithm and protocol NCCL would pick. ``whatif calibrate nccl-tests FILE... --cluster
CLUSTER.yaml --out CALIBRATED.yaml`` fits the cluster's NCCL calibration to measured tables
(``topology.calibrate``), prints every row's error after the fit and what looks broken, and
writes the calibrated cluster, which ``whatif collective`` and scenarios read.

``CLUSTER.yaml`` is a scenario's ``cluster:`` block on its own, or a whole scenario (its
``cluster:`` is used; ``links: FILE`` is merged as scenarios merge it, and ``file: FILE``,
another cluster file, read as scenarios read it: ``topology.yamlfile.with_cluster_file``).
Errors are one line that names the file and the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import yaml

from whatif.collectors.diagnostics import report
from whatif.topology import Cluster, TopologyError, collective_cost, parse_size
from whatif.topology.calibrate import EFFICIENCY_RANGE, LATENCY_RANGE, fit_tables
from whatif.topology.nccl.measured import BOUNDS, at_bound
from whatif.topology.nccl.tuning import OPS, parse_choices
from whatif.topology.nccl.versions import LATEST, parse_version, version_text
from whatif.topology.nccl_tests import bus_factor, named_operation, read_table
from whatif.topology.yamlfile import read_yaml, with_cluster_file

from . import refuse_inputs

DTYPES = {"int8": 1, "uint8": 1, "half": 2, "bfloat16": 2, "float": 4, "int32": 4, "double": 8, "int64": 8}
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum", "reduce": "sum"}
ROOTED = ("broadcast", "reduce")


def add_parsers(subparsers) -> None:
    """Register ``collective`` and ``calibrate`` on the ``whatif`` command's subparsers."""
    collective = subparsers.add_parser(
        "collective", help="a simulated nccl-tests: one collective's time at every size on a cluster",
        description="Print the table nccl-tests would print on CLUSTER.yaml. algbw and busbw are in GB/s "
                    "(1e9 bytes/s), as nccl-tests prints them; busbw is nccl-tests' bus bandwidth.")
    collective.add_argument("cluster", type=Path, help="a cluster YAML (a scenario's cluster: block) or a scenario")
    collective.add_argument("--op", default="all_reduce", help=f"one of {', '.join(OPS)}, or as nccl-tests names "
                                                               "it (alltoall, sendrecv_perf; default all_reduce)")
    collective.add_argument("--min-bytes", "-b", default="8M", help="smallest size (default 8M; K, M, G are powers of 2)")
    collective.add_argument("--max-bytes", "-e", default="8G", help="largest size (default 8G)")
    collective.add_argument("--step-factor", "-f", type=float, default=2.0, help="multiply the size by this (default 2)")
    collective.add_argument("--algorithm", help="force like NCCL_ALGO: ring, tree, nvls, nvls_tree, collnet_direct, "
                                                "collnet_chain, pat; a list (ring,tree) or ^nvls excludes")
    collective.add_argument("--protocol", help="force like NCCL_PROTO: ll, ll128, simple (or a list)")
    collective.add_argument("--ranks", help="GPUs of the communicator, e.g. 0-7 or 0,8,16,24 (default: every GPU)")
    collective.add_argument("--dtype", default="float", choices=sorted(DTYPES), help="element type (default float)")
    collective.add_argument("--nccl-version", help="the NCCL release to choose as (e.g. 2.26.2; default: the cluster's "
                                                   "nccl: version, else the newest modelled)")
    collective.add_argument("--json", action="store_true",
                            help="rows of bytes, time_us, algbw_gbps, busbw_gbps (GB/s), algorithm, protocol")
    collective.add_argument("--plot", type=Path, metavar="OUT.png",
                            help="bus bandwidth against size, each size marked by NCCL's choice")
    calibrate = subparsers.add_parser("calibrate", help="fit a cluster to measurements")
    what = calibrate.add_subparsers(dest="calibrate_command", required=True)
    tests = what.add_parser("nccl-tests", help="fit the NCCL model to nccl-tests outputs",
                            description="Fit per link class and algorithm/protocol the bandwidth efficiency and "
                                        "latency factor the specs cannot know, print each row's error after the fit, "
                                        "and write the calibrated cluster YAML.")
    tests.add_argument("files", type=Path, nargs="+", help="nccl-tests outputs, text or JSON (-J), of any op, "
                                                           "size range and scale")
    tests.add_argument("--cluster", type=Path, required=True, help="the cluster they ran on (YAML, or a scenario)")
    tests.add_argument("--out", type=Path, required=True, help="calibrated cluster YAML to write")
    tests.add_argument("--plot", type=Path, metavar="OUT.png",
                       help="each table's measured bus bandwidth against the calibrated prediction")
    tests.add_argument("--op", help="the operation, for files whose header and name do not say")
    tests.add_argument("--algorithm", help="NCCL_ALGO the runs were forced to, if any (default: what each "
                                           "output says, else none)")
    tests.add_argument("--protocol", help="NCCL_PROTO the runs were forced to, if any (default: as --algorithm)")
    tests.add_argument("--nccl-version", help="the NCCL release the runs used (e.g. 2.26.2), if neither the cluster "
                                              "YAML nor the outputs say")


def load_cluster_config(path: Path) -> dict:
    """The cluster mapping in ``path``: a cluster YAML or a scenario's ``cluster:`` block."""
    try:
        data = read_yaml(path)
    except TopologyError as err:
        raise TopologyError(str(path), err.message) from None
    if not isinstance(data, Mapping):
        raise TopologyError(str(path), "expected a mapping with machines, gpus_per_machine, ... or a cluster: block")
    key = "cluster" if "cluster" in data else ""
    try:  # a cluster that names a cluster file (file: FILE), or a scenario's cluster: FILE
        config = with_cluster_file(data[key] if key else data, path.parent)
    except TopologyError as err:
        raise TopologyError(f"{path}: {key + '.' if key else ''}{err.key}", err.message) from None
    if not isinstance(config, Mapping):
        raise TopologyError(f"{path}: {key}", "expected a mapping with machines, gpus_per_machine, ... or a file: name")
    config = dict(config)
    if "links" in config:
        links_path = Path(str(config.pop("links")))
        links_path = links_path if links_path.is_absolute() else path.parent / links_path
        try:
            links = read_yaml(links_path) or {}
        except TopologyError as err:
            raise TopologyError(f"{path}: {key + '.' if key else ''}links", f"{links_path}: {err.message}") from None
        for name in ("intra_node", "inter_node", "shared_memory"):
            if name in links and not isinstance(config.get(name), str):
                config[name] = {**links[name], **config[name]} if isinstance(config.get(name), Mapping) else links[name]
    for name, value in config.items():
        if isinstance(value, list):
            raise TopologyError(f"{path}: {key + '.' if key else ''}{name}",
                                "a list makes a grid in a scenario; give one value here")
    return config


def _with_version(config: Mapping, version) -> dict:
    """``config`` with ``nccl: {version: ...}`` set from the command line, if given."""
    if not version:
        return dict(config)
    nccl = config.get("nccl")
    if nccl is not None and not isinstance(nccl, Mapping):
        return dict(config)  # Cluster.from_config says what is wrong with it
    return {**config, "nccl": {**(nccl or {}), "version": str(version)}}


def _cluster(path: Path, config: Mapping) -> Cluster:
    try:
        return Cluster.from_config(config)
    except TopologyError as err:
        raise TopologyError(f"{path}: {err.key}", err.message) from None


def _ranks(text: str) -> list:
    ranks = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            ranks.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise TopologyError("--ranks", f"expected GPU ids like 0-7 or 0,8,16, got {text!r}") from None
    return ranks


def _nccl_size(text: str, key: str) -> float:
    """A size as nccl-tests reads it: K, M, G, T are powers of 1024 (8M = 8388608); units like
    8MB or 1GiB as ``parse_size`` reads them."""
    value = str(text).strip()
    if value[-1:].upper() in "KMGT" and value[:-1].replace(".", "", 1).isdigit():
        return float(value[:-1]) * 1024 ** ("KMGT".index(value[-1].upper()) + 1)
    return parse_size(value, key)


#: The most message sizes one table may have (nccl-tests' default sweep has 30 or so)
MAX_SIZES = 10_000


def _sizes(args, op: str, n_ranks: int) -> list:
    lo, hi = _nccl_size(args.min_bytes, "--min-bytes"), _nccl_size(args.max_bytes, "--max-bytes")
    if hi < lo:
        raise TopologyError("--max-bytes", f"{args.max_bytes} is below --min-bytes {args.min_bytes}")
    if not args.step_factor > 1:
        raise TopologyError("--step-factor", f"must be above 1, got {args.step_factor}")
    if lo <= 0:
        raise TopologyError("--min-bytes", f"must be positive, got {args.min_bytes}")
    rows = math.floor(math.log(hi / lo) / math.log(args.step_factor)) + 1 if math.isfinite(args.step_factor) else 1
    if rows > MAX_SIZES:
        raise TopologyError("--step-factor", f"{args.step_factor:g} from {args.min_bytes} to {args.max_bytes} makes "
                                             f"{rows} sizes (more than {MAX_SIZES}); take a larger step")
    elem = DTYPES[args.dtype]
    sizes, size = [], lo
    while size <= hi * (1 + 1e-12):
        count = int(size) // elem
        if op in ("all_gather", "reduce_scatter", "all_to_all"):  # nccl-tests rounds to whole 16-byte shares
            count = (count // n_ranks) // max(1, 16 // elem) * max(1, 16 // elem) * n_ranks
        sizes.append(count * elem)
        size *= args.step_factor
    return sizes


def run_collective(args) -> int:
    op = named_operation(args.op)
    cluster = _cluster(args.cluster, _with_version(load_cluster_config(args.cluster), args.nccl_version))
    ranks = _ranks(args.ranks) if args.ranks else None
    n = len(ranks) if ranks else cluster.n_gpus
    rows = []
    for size in _sizes(args, op, n):
        if size == 0:
            continue
        cost = collective_cost(cluster, op, size, ranks=ranks, algorithm=args.algorithm, protocol=args.protocol)
        algbw = size / cost.time_us / 1e3 if cost.time_us > 0 else math.inf
        rows.append({"bytes": int(size), "count": int(size) // DTYPES[args.dtype], "time_us": cost.time_us,
                     "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n),
                     "algorithm": cost.algorithm, "protocol": cost.protocol, "channels": cost.channels})
    if not rows:  # every size rounded down to nothing: nccl-tests would print no row either
        shares = ", in whole 16-byte shares per rank" if op in ("all_gather", "reduce_scatter", "all_to_all") else ""
        raise TopologyError("--max-bytes", f"every size up to {args.max_bytes} rounds to 0 bytes for {op} on {n} ranks "
                                           f"(whole {DTYPES[args.dtype]}-byte elements{shares}): nothing to print or "
                                           f"plot; take larger sizes")
    fabric = cluster.fabric.describe() if cluster.fabric is not None else cluster.describe()
    release = ""
    if cluster.fabric is not None and cluster.backend == "nccl":
        release = f", NCCL {version_text(cluster.fabric.calibration.version or LATEST)}"
    if args.plot is not None:
        refuse_inputs(args.plot, (args.cluster,))
        from whatif.report.collectives import plot_collective

        plot_collective(rows, args.plot, f"{op} on {n} ranks of {fabric}\n({cluster.backend} backend{release})")
    if args.json:
        print(json.dumps({"cluster": str(args.cluster), "op": op, "ranks": n, "backend": cluster.backend, "rows": rows}))
        return 0
    print(f"# whatif collective: {op} on {n} ranks of {fabric} ({cluster.backend} backend{release})")
    print(f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>8}  {'algbw':>7}  {'busbw':>7}  "
          f"{'algorithm':>10}  {'protocol':>8}")
    print(f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}")
    for row in rows:
        root = "0" if op in ROOTED else "-1"
        print(f"  {row['bytes']:>10}  {row['count']:>12}  {args.dtype:>8}  {REDOP.get(op, 'none'):>6}  {root:>6}  "
              f"{row['time_us']:>8.2f}  {row['algbw_gbps']:>7.2f}  {row['busbw_gbps']:>7.2f}  "
              f"{row['algorithm']:>10}  {row['protocol']:>8}")
    if rows:
        print(f"# Avg bus bandwidth    : {sum(r['busbw_gbps'] for r in rows) / len(rows):.3f}")
    return 0


def _release(args, config: Mapping, tables: list) -> tuple:
    """The NCCL release to calibrate as: ``--nccl-version``, else the cluster file's, else the one
    the tables say they ran (NCCL's ``NCCL version`` log line, nccl-tests' ``nccl-library=`` or
    its JSON's ``nccl_version``); and the warnings of tables that say another. Tables of two
    releases with nothing to choose between them are an error: the chooser differs by release."""
    said = {}
    for table in tables:
        if table.nccl_version:
            said.setdefault(version_text(parse_version(table.nccl_version, table.path)), []).append(table.path)
    nccl = config.get("nccl")
    given = args.nccl_version or (nccl.get("version") if isinstance(nccl, Mapping) else None)
    if given is None:
        if len(said) > 1:
            runs = "; ".join(f"{v} in {', '.join(Path(p).name for p in paths)}" for v, paths in sorted(said.items()))
            raise TopologyError("--nccl-version", f"the tables ran different NCCL releases ({runs}): calibrate each "
                                                  "release on its own, or name the one to calibrate as")
        return (next(iter(said)) if said else None), []
    wanted = version_text(parse_version(given, "--nccl-version" if args.nccl_version else f"{args.cluster}: nccl.version"))
    return None, [f"{', '.join(Path(p).name for p in paths)}: ran NCCL {v}, calibrated as NCCL {wanted}"
                  for v, paths in sorted(said.items()) if v != wanted]


def _choices(args, tables: list) -> list:
    """Each table's forced algorithm and protocol: ``--algorithm``/``--protocol`` for every table
    where given, else what the table's own output says it was forced to (JSON's ``env``, or
    NCCL's ``NCCL_ALGO set by environment`` log line)."""
    return [parse_choices(args.algorithm or table.algorithm, args.protocol or table.protocol) for table in tables]


def run_calibrate(args) -> int:
    for path in (args.out, args.plot):
        if path is not None:
            refuse_inputs(path, (args.cluster, *args.files))
    config = load_cluster_config(args.cluster)
    tables = [read_table(path, args.op) for path in args.files]
    from_tables, mismatches = _release(args, config, tables)
    config = _with_version(config, args.nccl_version or from_tables)
    cluster = _cluster(args.cluster, config)
    for text in mismatches:
        report(text)
    if from_tables:
        print(f"NCCL {from_tables}, as the tables say they ran it")
    nccl = config.get("nccl")  # with --nccl-version or the tables' release in it, where either says one
    unstated = not (isinstance(nccl, Mapping) and nccl.get("version"))
    release = version_text(cluster.fabric.calibration.version or LATEST) if cluster.fabric is not None else None
    if unstated and release:
        report(f"{', '.join(Path(t.path).name for t in tables)}: the outputs do not say which NCCL release ran them "
               f"(NCCL_DEBUG=VERSION prints it); calibrated as NCCL {release}, whose choices and constants may not be "
               "those of the release you ran: pass --nccl-version")
    for table in tables:
        repeated = table.repeated_sizes()
        if repeated:
            types = sorted({r.dtype for r in table.rows})
            report(f"{table.path}: {repeated} rows repeat a size ({len(types)} data types: {', '.join(types)}, or several "
                   "reduction ops: nccl-tests -d all / -o all); each is fitted as the same collective, though NCCL "
                   "may run some types on another algorithm (NVLS reduces only some): calibrate one type at a time")
        if (table.algorithm and not args.algorithm) or (table.protocol and not args.protocol):
            forced = ", ".join(f"{k} {v}" for k, v in (("NCCL_ALGO", table.algorithm), ("NCCL_PROTO", table.protocol)) if v)
            print(f"{Path(table.path).name}: forced to {forced}, as its output says")
    sources = ", ".join(str(p) for p in args.files)
    fit = fit_tables(tables, cluster, _choices(args, tables), source=f"whatif calibrate nccl-tests {sources}")
    left_out = set(fit.left_out)  # named below, with the reason
    print(f"{'file':<40} {'size':>12} {'measured us':>12} {'fitted us':>10} {'error':>8}  chosen")
    for row in fit.rows:
        mark = "  (left out of the fit)" if (row.table, row.size_bytes) in left_out else ""
        print(f"{Path(row.table).name[:40]:<40} {row.size_bytes:>12.0f} {row.measured_us:>12.2f} {row.predicted_us:>10.2f} "
              f"{row.error_pct:>+7.1f}%  {row.algorithm}/{row.protocol}{mark}")
    errors = sorted(abs(r.error_pct) for r in fit.rows if (r.table, r.size_bytes) not in left_out)
    if errors:
        fitted = " fitted" if left_out else ""
        print(f"\n{len(errors)} rows{fitted}: median |error| {errors[len(errors) // 2]:.1f} %, max {errors[-1]:.1f} %")
    print("fitted (link, algorithm/protocol: bandwidth factor, latency factor, rows):")
    names = [("any other" if algorithm == "*" else f"{algorithm}/{protocol}") + (f" on {nodes} nodes" if nodes else "")
             for _, algorithm, protocol, *_rest, nodes in fit.groups]
    width = max([20, *map(len, names)])
    for name, (link, _, _, bandwidth, latency, count, _) in zip(names, fit.groups):
        bounded = [what for what, value, bounds in (("bandwidth", bandwidth, EFFICIENCY_RANGE),
                                                     ("latency", latency, LATENCY_RANGE)) if at_bound(value, bounds)]
        mark = f"  {' and '.join(bounded)} at its bound: the rows want more" if bounded else ""
        print(f"  {link:<6} {name:<{width}} bandwidth x{bandwidth:.3f}  latency x{latency:.3f}  ({count} rows){mark}")
    for note in fit.diagnoses:
        print(note)
    measured = fit.cluster.fabric.calibration.measured if fit.cluster.fabric is not None else None
    bounded = measured.at_bounds() if measured is not None else []
    if bounded:
        lo, hi = BOUNDS["efficiency"]
        why = "a release other than the one calibrated as? pass --nccl-version" if unstated else \
            "check the cluster file's machine, NICs and nvlink_domain against the machines that ran them"
        report(f"{', '.join(Path(t.path).name for t in tables)}: the fit left {', '.join(bounded)} (rates of "
               f"{lo:g} to {hi:g} of NCCL's figures are allowed): no rate explains these rows under NCCL "
               f"{release}'s model of this cluster ({why}), so predictions at another scale may be far off")
    out = {**{k: v for k, v in config.items() if k != "nccl"}, "nccl": fit.cluster.fabric.calibration.as_config()}
    from whatif.report.timeline import write_atomically

    write_atomically(args.out, yaml.safe_dump(out, sort_keys=False).encode("utf-8"))
    print(f"written to {args.out}")
    if args.plot is not None:
        from whatif.report.collectives import plot_calibration

        plot_calibration(tables, fit.rows, left_out, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def run(args) -> int:
    """Run ``collective`` or ``calibrate``; errors are TopologyErrors (one line)."""
    try:
        return run_collective(args) if args.command == "collective" else run_calibrate(args)
    except TopologyError as err:
        if err.key in ("algorithm", "protocol", "ranks", "op"):  # an option's value: name the option
            raise TopologyError(f"--{err.key}", err.message) from None
        raise
