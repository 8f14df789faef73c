"""Specification of reading nccl-tests output: every real format, and one-line errors."""

import json
from pathlib import Path

import pytest
import yaml

from whatif.topology import TopologyError
from whatif.topology.calibrate import disturbed, spikes
from whatif.topology.nccl_tests import bus_factor, parse_json, parse_text, read_table

REPO = Path(__file__).resolve().parent.parent
COLLECTED = REPO / "bench" / "nccl_tests" / "data"

# nccl-tests 2.13+: header, Rank lines, redop and root columns, #wrong (an H100 node, abridged)
CURRENT = """\
# nccl-tests version 2.13.10 nccl-headers=22105 nccl-library=22105
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41 on node-a device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  42 on node-a device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid  43 on node-b device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid  44 on node-b device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    29.92    0.00    0.00      0    29.42    0.00    0.00      0
     1048576        262144     float     sum      -1    87.08   12.04   18.06      0    77.82   13.47   20.21      0
  8589934592    2147483648     float     sum      -1    34448  249.36  374.04      0    34440  249.42  374.13      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 130.7
"""

# nccl-tests 1.x / NCCL 2.4: no root column, "error" instead of #wrong, no header line (a V100 run)
OLD = """\
 nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
                                                     out-of-place                       in-place
       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2   float     sum    145.4    0.00    0.00  1e-07    143.9    0.00    0.00  1e-07
   1073741824     268435456   float     sum    10711  100.25  187.97  1e-07    10706  100.29  188.05  1e-07
"""

# MPI and srun prefixes, NCCL log lines in between, an all-gather's size-0 row (AWS runs)
PREFIXED = """\
[1,0]<stdout>:# Collective test starting: all_gather_perf
[1,0]<stdout>:#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
node-a:123:456 [0] NCCL INFO Channel 00/32 : 0 1 2 3
[1,0]<stdout>:           0             0     float    none      -1     0.11    0.00    0.00      0     0.11    0.00    0.00      0
[1,0]<stdout>:     1048576         16384     float    none      -1    46.45   22.57   21.16      0    45.90   22.84   21.42      0
0:   1073741824      16777216     float    none      -1    14640   73.34   68.76      0    14630   73.39   68.81      0
"""


def test_a_current_table_gives_its_op_ranks_hosts_gpu_and_out_of_place_times():
    table = parse_text(CURRENT, "h100.txt")
    assert (table.op, table.n_ranks, table.hosts, table.gpu) == ("all_reduce", 4, 2, "NVIDIA H100 80GB HBM3")
    assert [r.time_us for r in table.rows] == [29.92, 87.08, 34448.0]
    assert [r.in_place_us for r in table.rows] == [29.42, 77.82, 34440.0]
    assert table.rows[-1].size_bytes == 8589934592 and table.rows[-1].line == 16


def test_an_old_table_without_root_and_with_error_columns_reads_the_same_way():
    table = parse_text(OLD, "p3dn_allreduce_nccl2.4.8.txt")
    assert table.op == "all_reduce"  # from the file name: old tables have no header line
    assert table.n_ranks == 16        # 2(n-1)/n = 187.97 / 100.25
    assert [r.time_us for r in table.rows] == [145.4, 10711.0]


def test_launcher_prefixes_and_log_lines_are_skipped_and_size_zero_rows_dropped():
    table = parse_text(PREFIXED, "run.log")
    assert table.op == "all_gather" and len(table.rows) == 2 and table.rows[0].size_bytes == 1048576


def test_the_op_comes_from_the_header_then_op_then_the_file_name():
    rows = CURRENT.split("# Collective test starting: all_reduce_perf\n")[1]
    assert parse_text(rows, "x.txt", op="broadcast").op == "broadcast"
    assert parse_text(rows, "b200_reducescatter.txt").op == "reduce_scatter"
    with pytest.raises(TopologyError, match="give --op"):
        parse_text(rows, "x.txt")
    with pytest.raises(TopologyError, match="header says all_reduce, but --op says all_gather"):
        parse_text(CURRENT, "x.txt", op="all_gather")


@pytest.mark.parametrize(
    "text, line, message",
    [
        (CURRENT.replace("    87.08   12.04", "    8x.08   12.04"), 15, "time '8x.08' is not a number"),
        (CURRENT.replace("   87.08   12.04   18.06      0    77.82   13.47   20.21      0", "   87.08"), 15,
         "a row needs time, algbw, busbw"),
        (CURRENT.replace("     1048576        262144     float     sum      -1    87.08   12.04   18.06      0    77.82"
                         "   13.47   20.21      0", "     1048576        262144"), 15, "a truncated row"),
        (CURRENT.replace("29.92", "0.00"), 14, "must be positive"),
    ],
)
def test_a_malformed_row_is_a_one_line_error_naming_file_and_line(text, line, message):
    with pytest.raises(TopologyError) as err:
        parse_text(text, "bad.txt")
    assert err.value.key == f"bad.txt:{line}" and message in err.value.message and "\n" not in str(err.value)


def test_a_file_without_rows_or_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(TopologyError, match="no nccl-tests rows"):
        parse_text("# Collective test starting: all_reduce_perf\n# Out of bounds values : 0 OK\n", "empty.txt")
    with pytest.raises(TopologyError) as err:
        read_table(tmp_path / "missing.txt")
    assert "missing.txt" in str(err.value)


@pytest.mark.skipif(not COLLECTED.is_dir(), reason="bench/nccl_tests/data is not in this checkout")
@pytest.mark.parametrize("path", sorted(COLLECTED.glob("*.txt")) if COLLECTED.is_dir() else [], ids=lambda p: p.name)
def test_every_collected_public_output_parses(path):
    table = read_table(path)
    assert table.rows and all(r.time_us > 0 for r in table.rows)
    listed = {e["file"]: e for e in yaml.safe_load((COLLECTED.parent / "tables.yaml").read_text())["tables"]}[path.name]
    # ranks from the numbers where they tell (not for factor 1, nor for latency rows of 0.00 GB/s)
    latency_only = max(r.busbw_gbps for r in table.rows) < 1
    assert table.n_ranks == listed["ranks"] or (not table.n_ranks and (table.op in ("send_recv", "broadcast", "reduce")
                                                                       or latency_only))


def _rows(n: int, op: str = "all_reduce") -> str:
    """Rows whose printed busbw / algbw (2 decimals) say ``n`` ranks."""
    out = []
    for size, algbw in ((2**30, 55.48), (2**32, 169.24), (2**34, 183.83)):
        busbw = algbw * bus_factor(op, n)
        out.append(f"{size:>12} {size // 4:>12}     float     sum      -1  {size / algbw / 1e3:>9.0f}  {algbw:6.2f}  "
                   f"{busbw:6.2f}      0")
    return "\n".join(out) + "\n"


def test_a_large_communicators_rank_count_is_the_one_its_rounded_bandwidths_and_rank_lines_allow():
    # 2 decimals of busbw / algbw cannot tell 1020 ranks from 1024: the Rank lines can, and
    # without a complete listing the count with the most factors of two (nodes of 8 GPUs)
    assert parse_text(_rows(1024), "t_allreduce.txt").n_ranks == 1024
    listed = "#  Rank 1019 Group  0 Pid 1 on h device  3 [0000:2c:00] NVIDIA H100\n"
    assert parse_text(listed + _rows(1024), "t_allreduce.txt").n_ranks == 1020
    pasted = "#  Rank  143 Group  0 Pid 1 on h device  3 [0000:2c:00] NVIDIA GB200\n"  # from another run
    assert parse_text(pasted + _rows(128), "t_allreduce.txt").n_ranks == 128


def test_the_header_says_how_many_gpus_one_thread_drives():
    assert parse_text("# nThread 1 nGpus 8 minBytes 8 maxBytes 8\n" + _rows(8), "t_allreduce.txt").gpus_per_thread == 8
    assert parse_text("nThread 1 nGpus 1 minBytes 8 maxBytes 8\n" + _rows(8), "t_allreduce.txt").gpus_per_thread == 1
    assert parse_text(_rows(8), "t_allreduce.txt").gpus_per_thread == 1


def _table(rows: list) -> str:
    """An all-reduce table of (size, out-of-place us, in-place us or None) rows."""
    lines = ["# Collective test starting: all_reduce_perf"]
    for size, out, inplace in rows:
        tail = f"{inplace}    1.00    1.00      0" if inplace else "N/A     N/A     N/A    N/A"
        lines.append(f"{size} {size // 4} float sum -1 {out} 1.00 1.00 0 {tail}")
    return "\n".join(lines) + "\n"


def test_a_row_its_twin_run_contradicts_is_a_spike_and_a_steady_table_has_none():
    steady = parse_text(_table([(8, 30.0, 29.0), (1024, 31.0, 33.0), (1048576, 80.0, 79.0)]), "steady.txt")
    assert spikes(steady) == () and disturbed(steady) == ""
    spiky = parse_text(_table([(8, 83.4, 34.7), (1024, 36.0, 35.0), (1048576, 80.0, None)]), "spiky.txt")
    assert [r.size_bytes for r in spikes(spiky)] == [8]  # 83.4 against 34.7 in place: one run's noise
    assert disturbed(spiky) == ""                         # ... and no reason to doubt the table
    assert spiky.rows[-1].in_place_us is None             # N/A in place: nothing to compare


def test_a_size_slower_than_twice_that_size_in_both_runs_marks_the_run_disturbed():
    # the shape of the GKE A4 all-gather: 2 MiB 1754 / 1558 us, 4 MiB 934 / 959 us
    table = parse_text(_table([(1048576, 998.2, 972.4), (2097152, 1753.7, 1557.5), (4194304, 933.6, 958.6)]),
                       "a4.txt")
    note = disturbed(table)
    assert note.startswith("a4.txt: this run looks disturbed: 2 MiB took 1.9x and 1.6x")
    assert "as long as 4 MiB" in note
    # slower than the next size only (2x more bytes, 1.4x the time) or within 1.5x: not disturbed
    mild = parse_text(_table([(1048576, 140.0, 139.0), (2097152, 100.0, 101.0)]), "mild.txt")
    assert disturbed(mild) == ""


def _as_json(text: str, program: str = "./build/all_reduce_perf", env=(), version: int = 22105, **config) -> str:
    """``text``'s table as nccl-tests 2.19 writes it with ``-J`` (``src/util.cu``, its version 3
    layout): args, env, nccl_version, config, one device per process, and results whose halves
    hold time, alg_bw, bus_bw and nwrong."""
    import re

    devices = [{"rank": int(m.group(1)), "group": 0, "pid": 40 + int(m.group(1)), "hostname": m.group(2),
                "device": 0, "device_hex": "0000:18:00", "device_info": m.group(3)}
               for m in re.finditer(r"#\s*Rank\s+(\d+) Group\s+\d+ Pid\s+\d+ on\s+(\S+) device\s+\d+ \[[^\]]*\] (.*)", text)]
    results = []
    for row in parse_text(text, "t_allreduce.txt").rows:
        results.append({"size": int(row.size_bytes), "count": row.count, "type": row.dtype, "redop": "sum",
                        "root": "    -1",
                        "out_of_place": {"time": row.time_us, "alg_bw": row.algbw_gbps, "bus_bw": row.busbw_gbps,
                                         "nwrong": 0.0},
                        "in_place": None if row.in_place_us is None else
                        {"time": row.in_place_us, "alg_bw": 0.0, "bus_bw": 0.0, "nwrong": 0.0},
                        "actual_iterations": 20, "experiment_name": ""})
    doc = {"version": 3, "start_time": "2026-11-28 08:00:00", "args": [program, "-b", "8", "-e", "8G", "-J", "r.json"],
           "env": ["PATH=/usr/bin", *env], "nccl_version": version,
           "config": {"nthreads": 1, "ngpus": 1, "minimum_bytes": 8, "maximum_bytes": 8 << 30, "step_factor": 2,
                      "warmup_iters": 5, "iterations": 20, **config},
           "devices": devices, "results": results, "out_of_bounds": {"count": 0, "okay": "true"},
           "average_bus_bandwidth": {"bandwidth": 130.7, "okay": "unchecked"}, "end_time": "2026-11-28 08:01:00"}
    return json.dumps(doc)


def test_nccl_tests_json_output_reads_as_the_same_table_as_its_text():
    text, as_json = parse_text(CURRENT, "h100.txt"), parse_json(_as_json(CURRENT), "h100.json")
    assert (as_json.op, as_json.n_ranks, as_json.hosts, as_json.gpu) == (text.op, text.n_ranks, text.hosts, text.gpu)
    assert [(r.size_bytes, r.time_us, r.in_place_us, r.busbw_gbps) for r in as_json.rows] == \
           [(r.size_bytes, r.time_us, r.in_place_us, r.busbw_gbps) for r in text.rows]
    assert (as_json.nccl_version, text.nccl_version) == ("2.21.5", "2.21.5")  # 22105, in both
    assert as_json.algorithm is None and as_json.protocol is None


def test_a_json_output_says_its_program_release_and_forced_algorithm(tmp_path):
    rows = CURRENT.split("# Collective test starting: all_reduce_perf\n")[1]
    table = parse_json(_as_json(rows, "/opt/nccl-tests/build/all_gather_perf_mpi", ("NCCL_ALGO=Ring", "NCCL_PROTO=Simple"),
                                22807), "x.json")
    assert (table.op, table.nccl_version, table.algorithm, table.protocol) == ("all_gather", "2.28.7", "Ring", "Simple")
    path = tmp_path / "run.json"
    path.write_text("\n  " + _as_json(CURRENT))
    assert read_table(path).op == "all_reduce"  # read_table tells JSON from text by its first character


@pytest.mark.parametrize(
    "edit, key, message",
    [
        (lambda d: d["results"][1]["out_of_place"].update(time="nan"), "results[1].out_of_place.time", "finite number"),
        (lambda d: d["results"][2]["out_of_place"].pop("bus_bw"), "results[2].out_of_place.bus_bw", "not a number"),
        (lambda d: d["results"][0].update(out_of_place=None, in_place=None), "results[0].out_of_place", "missing"),
        (lambda d: d["results"][0]["out_of_place"].update(time=0.0), "results[0].out_of_place.time", "positive"),
        (lambda d: d.pop("results"), "results", "not nccl-tests' JSON output"),
    ],
)
def test_a_malformed_json_output_is_a_one_line_error_naming_the_field(edit, key, message):
    doc = json.loads(_as_json(CURRENT))
    edit(doc)
    with pytest.raises(TopologyError) as err:
        parse_json(json.dumps(doc), "bad.json")
    assert err.value.key == f"bad.json: {key}" and message in err.value.message and "\n" not in str(err.value)
    with pytest.raises(TopologyError, match="not valid JSON"):
        parse_json(_as_json(CURRENT)[:-40], "cut.json")  # a run killed before it closed the file


def test_per_iteration_columns_and_row_timestamps_of_newer_nccl_tests_are_read_past():
    # -I 1 (2.19): four per-iteration columns after each half; -T 1 (2.17): the row's date and time
    per_iter = ("     1048576        262144     float     sum      -1    87.08   12.04   18.06      0    85.10    99.20"
                "   101.01     2.10    77.82   13.47   20.21      0    76.90    80.11    84.00     1.50\n")
    stamped = ("     1048576        262144     float     sum      -1    87.08   12.04   18.06      0    77.82   13.47"
               "   20.21      0  2026-11-28 08:00:01\n")
    for line in (per_iter, stamped):
        (row,) = parse_text("# Collective test starting: all_reduce_perf\n" + line, "t.txt").rows
        assert (row.time_us, row.busbw_gbps, row.in_place_us) == (87.08, 18.06, 77.82)


def test_the_nccl_release_comes_from_nccls_log_line_or_the_header_code():
    rows = _rows(8)
    assert parse_text("host:1:1 [0] NCCL INFO NCCL version 2.26.6+cuda12.8\n" + rows, "t_allreduce.txt").nccl_version == "2.26.6"
    assert parse_text("# nccl-tests version 2.17.6 nccl-headers=22602 nccl-library=22602\n" + rows,
                      "t_allreduce.txt").nccl_version == "2.26.2"
    assert parse_text("NCCL version 2.7.8+cuda11.0\n" + rows, "t_allreduce.txt").nccl_version == "2.7.8"
    assert parse_text(rows, "t_allreduce.txt").nccl_version is None
    forced = "host:1:1 [0] NCCL INFO NCCL_ALGO set by environment to Tree\n"
    assert parse_text(forced + rows, "t_allreduce.txt").algorithm == "Tree"
