"""Send/recv and all-to-all as NCCL schedules them (``nccl/p2p.py``): the schedule's facts on toy
topologies, each time against its closed form, and real tables within what the docs claim."""

import statistics
import sys
from pathlib import Path

import pytest

from whatif.topology import Cluster, collective_cost
from whatif.topology.nccl import p2p, tuning
from whatif.topology.nccl.graphs import Comm

REPO = Path(__file__).resolve().parent.parent
KIB, MIB, GIB = 1024, 2**20, 2**30


def cluster(machine, machines=1, **overrides) -> Cluster:
    return Cluster.from_config({"machine": machine, "machines": machines, **overrides, "nccl": {"measured": "spec"}})


def simple_latency(link: str, steps: int) -> float:
    return tuning.BASE_LATENCY_US["ring"][2] + steps * tuning.HOP_LATENCY_US[link]["ring"][2]


def test_one_a100_node_gets_nccls_p2p_channels_and_nvlink_steps():
    comm = Comm.of(cluster("dgx_a100").fabric)
    s = p2p.schedule(comm)
    # 24 collective channels -> 32 p2p channels; a peer through NVSwitch: 2 x 12 NVLinks -> 32;
    # 8 ranks x 4 channels fill the 32; NVLink steps of 512 KiB in one node
    assert (s.channels, s.per_peer, s.min_per_peer, s.step) == (32, 32, 4, 512 * KIB)
    # a send starts on 4 channels of at least 64 KiB and doubles while a part exceeds 16 MiB
    assert [p2p.peer_channels(s, b) for b in (64 * KIB, 256 * KIB, 64 * MIB, 128 * MIB, GIB)] == [1, 4, 4, 8, 32]


def test_all_to_all_in_one_node_is_rounds_on_channels_at_half_a_ring_channel():
    c = cluster("dgx_a100")
    n, size = 8, 8 * GIB
    b = size / n  # 1 GiB to each peer, on 32 channels of 32 MiB parts
    demand, channels = 7 * 32, 32  # 7 peers x 32 channels on 32: 7 batches a channel
    rate = min(240.0, channels * 20.0 / 2)  # NVLink 240 GB/s; a channel moves half its ring speed of 20
    fill = 512 * KIB * 7 * 32  # each part's last step copied out of the receiver's buffer
    expected = simple_latency("nvlink", demand // channels) + (7 * b + fill) / (rate * 1e3)
    cost = collective_cost(c, "all_to_all", size)
    assert (cost.algorithm, cost.protocol) == ("p2p", "simple")
    assert cost.time_us == pytest.approx(expected)


def test_a_mid_size_all_to_all_is_bound_by_its_channels_not_the_nvlink():
    c = cluster("dgx_b200")
    size = 64 * MIB  # 8 MiB a peer on 4 channels of 2 MiB (4 steps of 512 KiB)
    rate = 7 * 4 * 45.0 / 2  # 28 channels at 22.5 GB/s = 630 < the 720 GB/s of B200's NVLink
    expected = simple_latency("nvlink", 1) + (7 * size / 8 + 512 * KIB * 28) / (rate * 1e3)
    assert collective_cost(c, "all_to_all", size).time_us == pytest.approx(expected)
    # ... so the bus bandwidth ramps up with the size as NCCL's does (B200: 135 us at 64 MiB)
    big = collective_cost(c, "all_to_all", 16 * GIB)
    assert size / collective_cost(c, "all_to_all", size).time_us < 0.9 * (16 * GIB) / big.time_us


def test_send_recv_between_two_nvlink_gpus_and_its_ll_threshold():
    c = cluster("dgx_a100", gpus_per_machine=2, nics_per_machine=2)
    s = p2p.schedule(Comm.of(c.fabric))
    assert s.min_per_peer == 16  # 2 ranks x 16 channels fill 32
    # 128 KiB on 2 channels of 64 KiB: 64 KiB a channel is above LL's 16 KiB, so Simple
    small = collective_cost(c, "send_recv", 128 * KIB)
    assert small.protocol == "simple" and small.channels == 2
    tiny = collective_cost(c, "send_recv", 16 * KIB)  # one channel of 16 KiB: LL at half the rate
    rate = 20.0 / 2 * tuning.RING_LL_FACTOR
    expected = (tuning.BASE_LATENCY_US["ring"][0] + tuning.HOP_LATENCY_US["nvlink"]["ring"][0]
                + 2 * 16 * KIB / (rate * 1e3))
    assert tiny.protocol == "ll" and tiny.time_us == pytest.approx(expected)


def test_all_to_all_across_two_rail_optimised_nodes_is_bound_by_the_nics():
    c = cluster("dgx_h100", 2)
    comm = Comm.of(c.fabric)
    s = p2p.schedule(comm)
    # 2.29+: a network peer gets ceil(48 GB/s / 14) = 4 channels; 4 x ceil(16 / 8) fits 16 channels;
    # across nodes the steps are 128 KiB
    assert (s.channels, s.per_peer, s.min_per_peer, s.step) == (16, 4, 1, 128 * KIB)
    size = 8 * GIB
    b = size / 16
    net_rate = 8 * 48.0 / 8  # the node's 8 NDR NICs at NCCL's 48 GB/s step, shared by its 8 ranks
    # peers go in groups of 8 (ncclP2pSchedule), a group's rounds on one set of 4 channels: the
    # own node's group and the other node's, 8 channels at work, 4 of them for the network
    net_share = 4 * 15.0  # 4 channels at half H100's ring channel speed of 30 GB/s
    rate = min(net_rate, net_share)
    net = (8 * b + 128 * KIB * 8 * 4) / (rate * 1e3)
    hop = tuning.HOP_LATENCY_US["net"]["ring"][2] + c.fabric.nic.latency_us
    expected = tuning.BASE_LATENCY_US["ring"][2] + 2 * hop + net  # a network step per group of 8 peers
    cost = collective_cost(c, "all_to_all", size)
    assert cost.time_us == pytest.approx(expected)


@pytest.mark.parametrize("version, per_peer, step", [
    ("2.28.7", 1, 128 * KIB),  # two channels a network peer, halved while 2 x 128 > 4 x 32
    ("2.29.3", 2, 256 * KIB),  # ceil(48 / 14) = 4, halved while 4 x ceil(128 / 8) > 32; Arm + Blackwell: 2 x 128 KiB
])
def test_two_nvl72_racks_get_each_releases_network_peer_channels(version, per_peer, step):
    c = Cluster.from_config({"machine": "gb200_nvl72", "machines": 32, "nvlink_domain": 64,
                             "nccl": {"measured": "spec", "version": version}})
    s = p2p.schedule(Comm.of(c.fabric))
    assert (s.channels, s.per_peer, s.min_per_peer, s.step) == (32, per_peer, 1, step)


@pytest.mark.parametrize("table, median, large", [
    # spec-only (no measured constant): NCCL's schedule on the vendors' NVLink figures
    ("gb300_oci_nvl72_2tray_8gpu_alltoall_nccl2.28.7.txt", 5.0, 5.0),
    ("gb300_oci_nvl72_16tray_64gpu_alltoall_nccl2.28.7.txt", 10.0, 8.0),
    ("b200_vultr_1node_8gpu_alltoall.txt", 20.0, 8.0),
])
def test_public_all_to_all_tables_within_what_the_docs_claim(table, median, large):
    sys.path.insert(0, str(REPO / "bench"))
    import nccl_accuracy

    loaded = {entry["file"]: (entry, t, c) for entry, t, c in nccl_accuracy.load(REPO / "bench" / "nccl_tests")
              if entry["file"] == table}
    entry, t, c = loaded[table]
    found = nccl_accuracy.evaluate(entry, t, c)
    assert found["median_pct"] <= median
    assert found["large_median_pct"] <= large
    assert statistics.median(abs(r["error_pct"]) for r in found["rows"] if not r["spike"]) == found["median_pct"]
