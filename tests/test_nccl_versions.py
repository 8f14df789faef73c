"""NCCL releases: which algorithms exist, how each release's tuner prices them, and what it picks."""

import pytest

from whatif.topology import Cluster, TopologyError, collective_cost
from whatif.topology.nccl.graphs import Comm, ring_graph
from whatif.topology.nccl.model import options
from whatif.topology.nccl.versions import LATEST, parse_version, tuner


def cluster(machine="dgx_h100", machines=1, version=None, **overrides) -> Cluster:
    config = {"machine": machine, "machines": machines, **overrides}
    if version:
        config["nccl"] = {"version": version}
    return Cluster.from_config(config)


def option(c, op, algorithm, protocol):
    return next(o for o in options(Comm.of(c.fabric), op) if (o.algorithm, o.protocol) == (algorithm, protocol))


def test_versions_parse_as_nccl_prints_them():
    assert parse_version("2.26.2") == (2, 26, 2)
    assert parse_version("2.18.5-1") == (2, 18, 5)
    assert parse_version("2.7.8+cuda11.0") == (2, 7, 8)
    assert parse_version(22602) == (2, 26, 2)  # NCCL_VERSION_CODE
    assert parse_version("2.99.1") == LATEST  # newer than modelled: the newest tables
    for bad in ("two", "1.9", True):
        with pytest.raises(TopologyError):
            parse_version(bad)


def test_a_clusters_nccl_block_names_its_release_and_round_trips():
    c = cluster(version="2.23.4")
    assert Comm.of(c.fabric).tuner.version == (2, 23, 4)
    assert c.fabric.calibration.as_config()["version"] == "2.23.4"
    assert Comm.of(cluster().fabric).tuner.version == LATEST
    with pytest.raises(TopologyError, match="nccl.version"):
        cluster(version="banana")


def test_algorithms_appear_in_the_release_that_brought_them():
    assert "nvls" not in tuner((2, 16, 5)).algorithms and "nvls" in tuner((2, 17, 1)).algorithms
    assert "nvls_tree" not in tuner((2, 17, 1)).algorithms and "nvls_tree" in tuner((2, 18, 1)).algorithms
    assert "collnet_chain" not in tuner((2, 12, 12)).algorithms and "collnet_chain" in tuner((2, 14, 3)).algorithms
    assert "pat" not in tuner((2, 22, 3)).algorithms and "pat" in tuner((2, 23, 4)).algorithms
    assert tuner((2, 4, 8)).ll128_archs == ()  # LL128 came with 2.5
    assert "blackwell" not in tuner((2, 24, 3)).ll128_archs and "blackwell" in tuner((2, 25, 1)).ll128_archs


def test_h100_gets_nvlink_sharp_only_from_2_17():
    assert collective_cost(cluster(version="2.16.5"), "all_reduce", 1 << 30).algorithm == "ring"
    assert collective_cost(cluster(version="2.17.1"), "all_reduce", 1 << 30).algorithm == "nvls"
    two = cluster(machines=2, version="2.17.1")  # NVLS tree came a release later
    assert collective_cost(two, "all_reduce", 1 << 30).algorithm != "nvls_tree"
    assert collective_cost(cluster(machines=2, version="2.18.5"), "all_reduce", 1 << 30).algorithm == "nvls_tree"


def test_no_ll128_where_the_release_does_not_enable_it():
    with pytest.raises(TopologyError, match="no protocol ll128"):
        collective_cost(cluster("dgx_v100", version="2.4.8"), "all_reduce", 1 << 20, protocol="ll128")
    with pytest.raises(TopologyError, match="no protocol ll128"):
        collective_cost(cluster("dgx_b200", version="2.24.3"), "all_reduce", 1 << 20, protocol="ll128")
    assert collective_cost(cluster("dgx_b200", version="2.25.1"), "all_reduce", 1 << 20, protocol="ll128").protocol == "ll128"


def test_ring_ll_moved_a_quarter_of_the_bus_bandwidth_before_2_21_and_half_since():
    for version, share in (("2.20.3", 0.25), ("2.21.5", 0.5)):
        c = cluster("dgx_a100", version=version)  # A100 node: 12 channels x 20 GB/s = 240 bus; LL cap 87.7
        ring = ring_graph(Comm.of(c.fabric))
        bus = min(87.7, ring.channels * ring.bw_intra * share)
        assert option(c, "all_reduce", "ring", "ll").bandwidth_gbs == pytest.approx(bus * 8 / 14)


def test_tree_simple_hops_cost_28_us_until_2_23_and_4_after():
    for version, hop, base in (("2.22.3", 28.0, 0.0), ("2.23.4", 4.0, 8.4)):
        c = cluster("dgx_a100", 2, version=version)
        # 2 (ppn-1) NVLink hops and 2 log2(2) network hops (14 us from 2.23, 28 before)
        net = 28.0 if version == "2.22.3" else 14.0
        expected = base + 2 * (7 * hop + 1 * net)
        assert option(c, "all_reduce", "tree", "simple").latency_us == pytest.approx(expected)


def test_nvls_tree_is_priced_by_min_speed_and_five_sixths_before_2_28_and_by_efficiency_after():
    old, new = cluster(machines=2, version="2.23.4"), cluster(machines=2, version="2.28.3")
    # 8 heads: NVLink 40 GB/s each, NICs 48 GB/s (search.cc speeds for 400G): min 40 x 8 x 5/6
    assert option(old, "all_reduce", "nvls_tree", "simple").bandwidth_gbs == pytest.approx(8 * 40 * 5 / 6)
    # 2.28: 40 x 0.85 x 7/8 x 2 = 59.5 per head, capped at 57.7 (two nodes), algorithm bw n/2(n-1)
    assert option(new, "all_reduce", "nvls_tree", "simple").bandwidth_gbs == pytest.approx(8 * 57.7 * 16 / 30)


def test_the_chooser_follows_each_releases_tables():
    # One A100 node, 1.5 MiB: until 2.20 LL was priced at a quarter of the bus bandwidth, so LL128
    # (40.6 us + S at 126 GB/s) beats LL (15 us + S at 34 GB/s) from 1.2 MB; from 2.21 at half
    # (50 GB/s), LL keeps sizes up to 2.1 MB. PAT serves one GPU per node from 2.23.
    size = 3 << 19
    early = collective_cost(cluster("dgx_a100", version="2.20.3"), "all_reduce", size)
    late = collective_cost(cluster("dgx_a100", version="2.21.5"), "all_reduce", size)
    assert (early.protocol, late.protocol) == ("ll128", "ll")
    assert collective_cost(cluster(machines=4, version="2.22.3"), "all_gather", 1 << 20,
                           ranks=range(0, 32, 8)).algorithm == "ring"
    assert collective_cost(cluster(machines=4, version="2.23.4"), "all_gather", 1 << 20,
                           ranks=range(0, 32, 8)).algorithm == "pat"
