"""Specification of `whatif collective` and `whatif calibrate nccl-tests`."""

import json

import pytest
import yaml

from whatif.cli import main
from whatif.topology import Cluster, collective_cost

H100 = "machine: dgx_h100\nmachines: 2\n"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def h100(tmp_path):
    path = tmp_path / "h100.yaml"
    path.write_text(H100)
    return path


def test_collective_prints_the_table_nccl_tests_would_print(capsys, h100):
    code, out, _ = run(capsys, "collective", str(h100), "--op", "all_reduce", "--min-bytes", "8M", "--max-bytes", "64M")
    assert code == 0
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    assert [int(line.split()[0]) for line in lines] == [8 << 20, 16 << 20, 32 << 20, 64 << 20]
    first = lines[0].split()
    cost = collective_cost(Cluster.from_config(yaml.safe_load(H100)), "all_reduce", 8 << 20)
    assert float(first[5]) == pytest.approx(cost.time_us, abs=0.01)
    assert first[-2:] == [cost.algorithm, cost.protocol]
    busbw = float(first[7])
    assert busbw == pytest.approx((8 << 20) / cost.time_us / 1e3 * 2 * 15 / 16, abs=0.01)


@pytest.mark.parametrize("spelled, op", [("alltoall", "all_to_all"), ("sendrecv_perf", "send_recv"),
                                          ("All-Gather", "all_gather")])
def test_collective_takes_the_operation_as_nccl_tests_names_it(capsys, h100, spelled, op):
    """``--op`` as nccl-tests' programs spell it (``alltoall_perf``, ``sendrecv_perf``) prints
    the same table as the operation's own name, as ``calibrate nccl-tests --op`` reads it."""
    argv = ("collective", str(h100), "--min-bytes", "1M", "--max-bytes", "4M", "--json")
    (code, out, _), (code_named, named, _) = run(capsys, *argv, "--op", spelled), run(capsys, *argv, "--op", op)
    assert code == code_named == 0 and out == named and json.loads(out)


def test_collective_chooses_as_the_release_it_is_told(capsys, h100):
    code, out, _ = run(capsys, "collective", str(h100), "-b", "1G", "-e", "1G", "--json", "--nccl-version", "2.17.1")
    assert code == 0 and json.loads(out)["rows"][0]["algorithm"] != "nvls_tree"  # NVLS tree came with 2.18
    code, out, _ = run(capsys, "collective", str(h100), "-b", "1G", "-e", "1G", "--nccl-version", "2.23.4")
    assert code == 0 and "NCCL 2.23.4" in out.splitlines()[0] and "nvls_tree" in out
    code, _, err = run(capsys, "collective", str(h100), "--nccl-version", "two")
    assert code == 2 and "nccl.version" in err and len(err.strip().splitlines()) == 1


def test_collective_json_has_bytes_time_bandwidths_and_the_choice(capsys, h100):
    code, out, _ = run(capsys, "collective", str(h100), "--op", "all_gather", "-b", "1M", "-e", "1G", "-f", "32",
                       "--algorithm", "ring", "--protocol", "simple", "--json")
    rows = json.loads(out)["rows"]
    assert code == 0 and len(rows) == 3
    assert set(rows[0]) >= {"bytes", "time_us", "algbw_gbps", "busbw_gbps", "algorithm", "protocol"}
    assert {(r["algorithm"], r["protocol"]) for r in rows} == {("ring", "simple")}
    assert rows[0]["busbw_gbps"] == pytest.approx(rows[0]["algbw_gbps"] * 15 / 16)


def test_collective_takes_a_whole_scenario_and_a_group_of_ranks(capsys, tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("trace: t.json\ncluster:\n  machine: dgx_h100\n  machines: 4\nframework: ddp\n")
    code, out, _ = run(capsys, "collective", str(scenario), "--ranks", "0-7", "-b", "1G", "-e", "1G", "--json")
    assert code == 0 and json.loads(out)["ranks"] == 8 and json.loads(out)["rows"][0]["algorithm"] == "nvls"


@pytest.mark.parametrize(
    "text, argv, where",
    [
        ("machine: dgx_h100\nmachines: [1, 2]\n", [], "machines"),
        ("machine: dgx_h999\nmachines: 2\n", [], "machine"),
        ("machine: dgx_h100\nmachines: 2\n", ["--op", "gather"], "--op"),
        ("machine: dgx_h100\nmachines: 2\n", ["--algorithm", "nvls_tree,foo"], "--algorithm"),
        ("machine: dgx_h100\nmachines: 2\n", ["--ranks", "0-99"], "--ranks"),
        ("machine: [dgx_h100\n", [], "not valid YAML"),
    ],
)
def test_collective_errors_are_one_line_naming_file_and_key_with_exit_2(capsys, tmp_path, text, argv, where):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, out, err = run(capsys, "collective", str(path), *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and where in err
    assert "Traceback" not in err
    if not where.startswith("--"):
        assert str(path) in err


def measured_table(cluster: Cluster, op: str, n: int, bandwidth_factor: float, extra_us: float) -> str:
    """An nccl-tests table as a degraded cluster would print it: our prediction, slowed down."""
    lines = [f"# Collective test starting: {op}_perf"]
    for size in (4**k * 8 for k in range(15)):
        cost = collective_cost(cluster, op, size)
        time = extra_us + cost.time_us / bandwidth_factor
        algbw = size / time / 1e3
        busbw = algbw * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)
        lines.append(f"{size:>12} {size // 4:>12} float sum -1 {time:10.2f} {algbw:7.2f} {busbw:7.2f} 0 "
                     f"{time:10.2f} {algbw:7.2f} {busbw:7.2f} 0")
    return "\n".join(lines) + "\n"


def test_calibrate_fits_measured_tables_writes_a_cluster_and_says_when_the_network_is_slow(capsys, tmp_path, h100):
    cluster = Cluster.from_config(yaml.safe_load(H100))
    slow = tmp_path / "ar.txt"
    slow.write_text(measured_table(cluster, "all_reduce", 16, 0.25, 0.0))
    out_path = tmp_path / "calibrated.yaml"
    code, out, err = run(capsys, "calibrate", "nccl-tests", str(slow), "--cluster", str(h100), "--out", str(out_path))
    assert code == 0, err
    assert "this network delivers 25 % of the" in out and "8 x 400 Gb/s NICs" in out and "check NICs and routing" in out
    errors = sorted(abs(float(line.split()[4].rstrip("%"))) for line in out.splitlines() if line.startswith("ar.txt"))
    # the physical constants first (kernel start, hop latency, NVLink and NIC efficiency), then every
    # (algorithm, protocol) with three or more rows fits both factors on what they leave; one with
    # fewer, the factor of what dominates its rows. A table slowed 4x in latency as well as in
    # bandwidth is not what physical constants describe, so about 1 % is left in the median; and a
    # per-channel ceiling of NCCL's kernels (LL's, here at 128 KiB) is no link's rate, which the
    # NIC's efficiency does not slow, so the worst row, where it binds, keeps about a quarter.
    assert len(errors) == 15 and errors[len(errors) // 2] < 1.5 and errors[-1] < 30.0
    calibrated = yaml.safe_load(out_path.read_text())
    assert calibrated["machine"] == "dgx_h100" and "net" in calibrated["nccl"]
    code, out, _ = run(capsys, "collective", str(out_path), "-b", "1G", "-e", "1G", "--json")
    row = json.loads(out)["rows"][0]
    assert row["time_us"] == pytest.approx(collective_cost(cluster, "all_reduce", 1 << 30).time_us / 0.25, rel=0.01)


def test_calibrate_reads_tables_at_several_scales_and_ops(capsys, tmp_path, h100):
    one = Cluster.from_config({"machine": "dgx_h100", "machines": 1})
    two = Cluster.from_config(yaml.safe_load(H100))
    files = []
    for name, cluster, op, n in (("one_ag.txt", one, "all_gather", 8), ("two_ar.txt", two, "all_reduce", 16)):
        path = tmp_path / name
        path.write_text(measured_table(cluster, op, n, 0.9, 3.0))
        files.append(str(path))
    code, out, _ = run(capsys, "calibrate", "nccl-tests", *files, "--cluster", str(h100), "--out", str(tmp_path / "c.yaml"))
    assert code == 0 and "nvlink" in out and "net" in out and "this network delivers" not in out


def test_calibrate_errors_name_the_file_and_line(capsys, tmp_path, h100):
    bad = tmp_path / "bad.txt"
    bad.write_text("# Collective test starting: all_reduce_perf\n        1024   256  float sum -1  12.x  0.1 0.1 0\n")
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(bad), "--cluster", str(h100), "--out", str(tmp_path / "o.yaml"))
    assert code == 2 and f"{bad}:2" in err and len(err.strip().splitlines()) == 1


def test_calibrate_marks_the_rows_it_leaves_out_and_sums_up_the_others(capsys, tmp_path):
    """Issue 309's 4-node table opens with a row one of its runs contradicts (1 MiB: 317 us out of
    place, 93 us in place): the fit leaves it out, the table of rows marks it, and the summary's
    median and max are those of the rows fitted."""
    from pathlib import Path

    table = Path(__file__).resolve().parents[1] / "bench" / "nccl_tests" / "data" / "h100_ib_4node_32gpu_allreduce_issue309.txt"
    cluster = tmp_path / "h100x4.yaml"
    cluster.write_text("machine: dgx_h100\nmachines: 4\n")
    code, out, _ = run(capsys, "calibrate", "nccl-tests", str(table), "--cluster", str(cluster),
                       "--out", str(tmp_path / "c.yaml"))
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("h100_ib_4node")]
    marked = [line for line in rows if line.endswith("(left out of the fit)")]
    assert [int(line.split()[1]) for line in marked] == [1 << 20]
    errors = sorted(abs(float(line.split()[4].rstrip("%"))) for line in rows if line not in marked)
    summary = next(line for line in out.splitlines() if "median |error|" in line)
    assert summary.startswith(f"{len(rows) - 1} rows fitted:")
    assert summary.endswith(f"max {errors[-1]:.1f} %")
    assert "1 row left out of the fit (1 MiB)" in out


DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "bench" / "nccl_tests" / "data"
XE9680 = DATA / "h100_xe9680_ib_2node_16gpu_allreduce_nccl2.26.2_issue309.txt"  # NCCL 2.26.2
OCI = DATA / "h100_oci_bm.gpu.h100.8_2node_allreduce_nccl2.23.4.txt"  # NCCL 2.23.4


def test_calibrate_takes_the_release_the_tables_ran_and_writes_it(capsys, tmp_path, h100):
    out_path = tmp_path / "c.yaml"
    code, out, err = run(capsys, "calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100), "--out", str(out_path))
    assert code == 0, err
    assert "NCCL 2.26.2, as the tables say they ran it" in out
    assert str(yaml.safe_load(out_path.read_text())["nccl"]["version"]) == "2.26.2"


def test_calibrate_refuses_tables_of_two_releases_unless_told_which_and_warns_of_the_other(capsys, tmp_path, h100):
    out_path = tmp_path / "c.yaml"
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(XE9680), str(OCI), "--cluster", str(h100), "--out", str(out_path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out_path.exists()
    assert "--nccl-version" in err and "2.23.4 in h100_oci" in err and "2.26.2 in h100_xe9680" in err
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100), "--out", str(out_path),
                       "--nccl-version", "2.23.4")
    assert code == 0 and "h100_xe9680_ib_2node_16gpu_allreduce_nccl2.26.2_issue309.txt: ran NCCL 2.26.2, calibrated as NCCL 2.23.4" in err
    code, _, err = run(capsys, "--strict", "calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100),
                       "--out", str(tmp_path / "strict.yaml"), "--nccl-version", "2.23.4")
    assert code == 2 and "--strict" in err


def test_calibrate_reads_nccl_tests_json_and_the_algorithm_its_environment_forced(capsys, tmp_path, h100):
    """A real table as nccl-tests -J writes it (tests/test_nccl_tests_parsing.py's ``_as_json``),
    run with NCCL_ALGO=Ring: every row is fitted as a ring, without --algorithm."""
    from test_nccl_tests_parsing import _as_json

    path = tmp_path / "ring.json"
    path.write_text(_as_json(XE9680.read_text(), env=("NCCL_ALGO=Ring",), version=22602))
    code, out, err = run(capsys, "calibrate", "nccl-tests", str(path), "--cluster", str(h100), "--out", str(tmp_path / "c.yaml"))
    assert code == 0, err
    assert "ring.json: forced to NCCL_ALGO Ring, as its output says" in out
    chosen = [line.split()[5] for line in out.splitlines() if line.startswith("ring.json ")]
    assert len(chosen) > 10 and all(c.startswith("ring/") for c in chosen)
    code, out, _ = run(capsys, "calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100), "--out", str(tmp_path / "d.yaml"))
    assert any(not line.split()[5].startswith("ring/") for line in out.splitlines() if line.startswith("h100_xe9680"))


def test_collective_and_calibrate_draw_their_plots_and_never_write_over_an_input(capsys, tmp_path, h100):
    png = tmp_path / "busbw.png"
    code, out, _ = run(capsys, "collective", str(h100), "-b", "8", "-e", "1G", "--plot", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "busbw" in out
    fit_png = tmp_path / "fit.png"
    code, out, err = run(capsys, "calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100),
                         "--out", str(tmp_path / "c.yaml"), "--plot", str(fit_png))
    assert code == 0, err
    assert fit_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {fit_png}" in out
    before = h100.read_bytes()
    for argv in (("collective", str(h100), "--plot", str(h100)),
                 ("calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100), "--out", str(h100)),
                 ("calibrate", "nccl-tests", str(XE9680), "--cluster", str(h100), "--out", str(tmp_path / "d.yaml"),
                  "--plot", str(XE9680))):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "refusing to overwrite an input file" in err and len(err.strip().splitlines()) == 1
    assert h100.read_bytes() == before and not (tmp_path / "d.yaml").exists()


def test_sizes_that_all_round_to_nothing_are_one_line_not_an_empty_table_or_a_missing_plot(capsys, tmp_path, h100):
    """nccl-tests sizes an all-gather in whole 16-byte shares per rank: on the 16 GPUs of the
    cluster, 8 to 128 bytes are no share at all. The user hears so, and no plot is promised."""
    png = tmp_path / "none.png"
    code, out, err = run(capsys, "collective", str(h100), "--op", "all_gather", "-b", "8", "-e", "128", "--plot", str(png))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert "--max-bytes" in err and "rounds to 0 bytes for all_gather on 16 ranks" in err and "16-byte shares" in err
    assert not png.exists()
    code, out, err = run(capsys, "collective", str(h100), "--op", "all_gather", "-b", "8", "-e", "1K")
    assert code == 0 and "all_gather" in out


ISSUE309 = {nodes: DATA / f"h100_ib_{nodes}node_{8 * nodes}gpu_allreduce_issue309.txt" for nodes in (2, 8)}


def _out_of_place_us(path) -> dict:
    return {int(p[0]): float(p[5]) for p in (line.split() for line in path.read_text().splitlines())
            if p and p[0].isdigit()}


def test_two_nodes_of_an_unstated_release_calibrate_to_rates_that_carry_to_eight(capsys, tmp_path):
    """Issue 309's H100 cluster, two nodes of its eight (the output names no NCCL release, so the
    calibration warns and takes the newest): the NVLS tree's NVSwitch and NIC rates are told
    only as a product by one scale, and the fit keeps the split nearest their priors (it had left
    NVLS at its 1.5 bound and the NICs at 47 %, which made all eight nodes 65 to 86 % slow from
    256 MiB up); a calibrated cluster named by a file, its machines changed, predicts the eight."""
    cluster = tmp_path / "h100x2.yaml"
    cluster.write_text("machine: hgx_h100\nmachines: 2\n")
    calibrated = tmp_path / "calibrated.yaml"
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(ISSUE309[2]), "--cluster", str(cluster), "--out", str(calibrated))
    assert code == 0 and "do not say which NCCL release ran them" in err and "--nccl-version" in err
    assert "the fit left" not in err
    rates = yaml.safe_load(calibrated.read_text())["nccl"]["measured"]
    assert 0.8 < rates["efficiency"]["ib"] <= 1.1 and 0.9 < rates["link_efficiency"]["nvls"] < 1.2
    eight = tmp_path / "eight.yaml"
    eight.write_text(f"cluster: {{file: {calibrated.name}, machines: 8}}\n")
    code, out, _ = run(capsys, "collective", str(eight), "-b", "256M", "-e", "8G", "--json")
    measured = _out_of_place_us(ISSUE309[8])
    errors = [row["time_us"] / measured[row["bytes"]] - 1 for row in json.loads(out)["rows"]]
    assert code == 0 and len(errors) == 6 and max(map(abs, errors)) < 0.12


def test_a_rate_the_fit_leaves_at_a_bound_is_named(capsys, tmp_path, h100):
    """Rows no allowed rate explains (a table 20 times slower than the fabric) leave the NICs'
    rate at its lower bound, and the calibration says so."""
    from whatif.topology.nccl.measured import BOUNDS, Measured

    assert Measured(efficiency=(("ib", BOUNDS["efficiency"][0]),), link_efficiency=(("nvls", 1.2),)).at_bounds() == ["ib at 0.1"]
    slow = tmp_path / "slow.txt"
    slow.write_text(measured_table(Cluster.from_config(yaml.safe_load(H100)), "all_reduce", 16, 0.05, 0.0))
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(slow), "--cluster", str(h100), "--out", str(tmp_path / "c.yaml"))
    assert code == 0 and "the fit left ib at 0.1" in err
    # issue 309's 4-node table after its 2-node one: the trees on 3+ nodes want a rate factor above
    # the 2x allowed, which the factors' lines say
    code, out, _ = run(capsys, "calibrate", "nccl-tests", str(ISSUE309[2]), str(DATA / "h100_ib_4node_32gpu_allreduce_issue309.txt"),
                       "--cluster", str(h100), "--out", str(tmp_path / "c24.yaml"))
    trees = next(line for line in out.splitlines() if "tree/ll128 on 3+ nodes" in line)
    assert code == 0 and "bandwidth x2.000" in trees and trees.endswith("bandwidth at its bound: the rows want more")


def test_a_table_of_several_data_types_is_fitted_with_a_warning(capsys, tmp_path):
    """nccl-tests -d all prints each size once per type; NVLS reduces only some types, so such
    rows may be another algorithm's. Issue 309's two-node table with its rows again as half."""
    lines = ISSUE309[2].read_text().splitlines()
    rows = [line for line in lines if line.split() and line.split()[0].isdigit()]
    both = tmp_path / "all_reduce_two_types.txt"
    both.write_text("\n".join(lines + [row.replace(" float ", " half  ", 1) for row in rows]) + "\n")
    cluster = tmp_path / "h100x2.yaml"
    cluster.write_text("machine: hgx_h100\nmachines: 2\n")
    code, _, err = run(capsys, "calibrate", "nccl-tests", str(both), "--cluster", str(cluster), "--out",
                       str(tmp_path / "calibrated.yaml"), "--nccl-version", "2.25.1")
    assert code == 0
    assert f"{both}: {len(rows)} rows repeat a size (2 data types: float, half," in err
    code, _, err = run(capsys, "--strict", "calibrate", "nccl-tests", str(ISSUE309[2]), "--cluster", str(cluster),
                       "--out", str(tmp_path / "one.yaml"), "--nccl-version", "2.25.1")
    assert code == 0 and "repeat a size" not in err  # one type: nothing to say
