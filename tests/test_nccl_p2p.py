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


def b200_send_recv(machines: int, nbytes: float, measured: bool = False):
    """Send/recv on DGX B200s under NCCL 2.29.7: the specs alone, or with the public measured constants."""
    nccl = {"version": "2.29.7"} if measured else {"measured": "spec", "version": "2.29.7"}
    c = Cluster.from_config({"machine": "dgx_b200", "machines": machines, "nccl": nccl})
    return p2p.send_recv(Comm.of(c.fabric), nbytes, calibration=c.fabric.calibration), c


def test_a_send_recv_across_nodes_takes_one_network_step_at_any_scale():
    # one peer, so one step through the network whatever the ranks (an all-to-all's groups of 8
    # peers are not a send/recv's): 16 to 256 ranks cost the same at 1 KiB
    latencies = {n: b200_send_recv(n, KIB)[0].latency_us for n in (2, 4, 8, 32)}
    assert latencies[2] == latencies[4] == latencies[8] == latencies[32]
    assert b200_send_recv(32, KIB)[0].hops == 1.0


@pytest.mark.parametrize("machines, per_peer", [(2, 4), (4, 4), (8, 2), (16, 1), (32, 1)])
def test_a_network_peers_send_recv_moves_at_most_14_gbs_a_channel(machines, per_peer):
    # 16 p2p channels; NCCL 2.29 halves a network peer's channels while they x ceil(n / 8) > 16
    found, c = b200_send_recv(machines, 256 * MIB)
    comm = Comm.of(c.fabric)
    assert p2p.schedule(comm).per_peer == per_peer
    nic = p2p._net_gbs(comm)
    rate = min(nic, per_peer * p2p.NET_CHANNEL_GBS)  # GB/s = kB/us
    step = p2p.step_data(p2p.schedule(comm), "simple", True, 256 * MIB)
    expected = (256 * MIB + step * per_peer) / (1000.0 * rate)  # the bytes and the pipeline's fill
    assert found.net_us == pytest.approx(expected, rel=1e-9)


def test_a_send_recv_gets_the_nics_efficiency_and_an_all_to_all_its_own():
    # the measured p2p_efficiency (about half: all-to-all tables, many flows a NIC) must not slow
    # a send/recv's one flow a NIC, which the NIC kind's efficiency (1 for InfiniBand) times
    public, c = b200_send_recv(2, 256 * MIB, measured=True)
    measured = c.fabric.calibration.constants
    assert measured.p2p_efficiency < 0.6
    assert public.transfer_us == pytest.approx(public.net_us / measured.net_efficiency("ib"), rel=1e-9)
    comm = Comm.of(c.fabric)
    a2a = p2p.all_to_all(comm, 256 * MIB, calibration=c.fabric.calibration)
    local = a2a.local_us / measured.local_efficiency(comm.link_intra)
    assert a2a.transfer_us == pytest.approx(max(local, a2a.net_us / measured.p2p_efficiency), rel=1e-9)
    assert a2a.net_us / measured.p2p_efficiency > local  # the network's share sets it


@pytest.mark.parametrize("table, median", [
    # Together AI's B200 sweeps: NIC-bound at 2 and 4 nodes, one and two channels a peer beyond
    ("b200_together_2node_16gpu_sendrecv_nccl2.29.7_run1.csv", 9.0),
    ("b200_together_4node_32gpu_sendrecv_nccl2.29.7_run2.csv", 7.0),
    ("b200_together_8node_64gpu_sendrecv_nccl2.29.7_run1.csv", 7.0),
    ("b200_together_32node_256gpu_sendrecv_nccl2.29.7_run2.csv", 7.0),
])
def test_public_send_recv_sweeps_within_what_the_docs_claim(table, median):
    sys.path.insert(0, str(REPO / "bench"))
    import nccl_accuracy

    entry, t, c = next((e, t, c) for e, t, c in nccl_accuracy.load(REPO / "bench" / "nccl_tests") if e["file"] == table)
    found = nccl_accuracy.evaluate(entry, t, c)
    assert found["median_pct"] <= median
    assert len(found["rows"]) == 15 and found["coarse"] == 4  # 1 to 8 KiB are printed below 0.5 GB/s
