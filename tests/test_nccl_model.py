"""Specification of the NCCL model: each algorithm against its closed form, and NCCL's choice."""

import pytest

from whatif.topology import Cluster, TopologyError, collective_cost, collective_plan, simulate_plan
from whatif.topology.nccl import tuning
from whatif.topology.nccl.graphs import Comm, ring_graph, tree_graph
from whatif.topology.nccl.measured import public
from whatif.topology.nccl.model import nvls_traffic_factor, options

GB = 1e9
BIG = 2**33  # 8 GiB: every channel busy, no tree correction, NVLS at its largest chunk


def cluster(machine="dgx_a100", machines=1, measured="spec", nccl_version=None, **overrides) -> Cluster:
    """A cluster priced from NCCL's constants and the specs alone (``measured: spec``), so that
    the closed forms below hold; ``measured=None`` takes the public tables' constants."""
    nccl = {"measured": measured} if measured else {}
    if nccl_version:
        nccl["version"] = nccl_version
    return Cluster.from_config({"machine": machine, "machines": machines, **overrides, "nccl": nccl})


def time_us(c, op, nbytes, **force):
    return collective_cost(c, op, nbytes, **force).time_us


# -- closed forms on toy topologies --------------------------------------------------------------


def test_a_ring_all_reduce_on_one_nvswitch_node_is_steps_times_hop_plus_bytes_over_the_ring():
    c = cluster("dgx_a100", gpus_per_machine=4, nics_per_machine=4)
    # four A100s: 12 NVLinks x 20 GB/s = 240 GB/s each; the search takes 6 channels of 40,
    # duplicated to 12 of 20 (search.cc); bus bandwidth 240, algorithm bandwidth 240 n / 2(n-1)
    graph = ring_graph(Comm.of(c.fabric))
    assert (graph.channels, graph.bw_intra) == (12, 20.0)
    n = 4
    latency = tuning.BASE_LATENCY_US["ring"][2] + 2 * (n - 1) * tuning.HOP_LATENCY_US["nvlink"]["ring"][2]
    bandwidth_bytes_per_us = 240 * n / (2 * (n - 1)) * 1e3
    expected = latency + BIG / bandwidth_bytes_per_us
    assert time_us(c, "all_reduce", BIG, algorithm="ring", protocol="simple") == pytest.approx(expected)


def test_all_gather_and_reduce_scatter_are_rings_of_n_minus_one_steps():
    c = cluster("dgx_a100")
    n = 8
    latency = tuning.BASE_LATENCY_US["ring"][2] + (n - 1) * tuning.HOP_LATENCY_US["nvlink"]["ring"][2]
    expected = latency + BIG / (240 * n / (n - 1) * 1e3)
    for op in ("all_gather", "reduce_scatter"):
        assert time_us(c, op, BIG, algorithm="ring", protocol="simple") == pytest.approx(expected)


def test_broadcast_is_a_pipelined_chain_at_the_full_bus_bandwidth():
    c = cluster("dgx_a100")
    latency = tuning.BASE_LATENCY_US["ring"][2] + tuning.HOP_LATENCY_US["nvlink"]["ring"][2]
    for op in ("broadcast", "reduce"):
        assert time_us(c, op, BIG, protocol="simple") == pytest.approx(latency + BIG / 240e3)


def test_ll_keeps_half_the_ring_and_at_most_the_architectures_ceiling():
    c = cluster("dgx_h100")  # ring 360 GB/s; LL: min(141, 180) = 141 (Hopper, one node)
    n = 8
    latency = tuning.BASE_LATENCY_US["ring"][0] + 2 * (n - 1) * tuning.HOP_LATENCY_US["nvlink"]["ring"][0]
    expected = latency + BIG / (141.0 * n / (2 * (n - 1)) * 1e3)
    assert time_us(c, "all_reduce", BIG, algorithm="ring", protocol="ll") == pytest.approx(expected)


def test_a_two_node_tree_moves_the_message_once_each_way_at_the_faster_intra_node_speed():
    c = cluster("p4d", 2)  # 4 x 100G EFA: the ring runs 4 channels of 12 GB/s, the tree 4 of 24 inside
    comm = Comm.of(c.fabric)
    assert (ring_graph(comm).bw_inter, tree_graph(comm).bw_intra) == (12.0, 24.0)
    bus = min(4 * 24 * tuning.TREE_ALLREDUCE_FACTOR, 4 * tuning.TREE_MAX_BW["ampere"][1])
    p, ppn = 2, 8
    nic = c.fabric.nic.latency_us
    latency = tuning.BASE_LATENCY_US["tree"][p] + 2 * (
        (ppn - 1) * tuning.HOP_LATENCY_US["nvlink"]["tree"][p] + (tuning.HOP_LATENCY_US["net"]["tree"][p] + 2 * nic))
    expected = latency + BIG / (bus * 0.5 * 1e3)
    # and the chain's fill: 512 KiB over 7 NVLink hops and one network level, each way
    # (tree_chain_fill_us; 8 channels: NCCL's 12 x 20 GB/s of NVLink over 8, half a 100G NIC
    # each), less two of the slowest hop, a chunk's steady pace, which the transfer counts
    cost = collective_cost(c, "all_reduce", BIG, algorithm="tree", protocol="simple")
    chunk = 2**19
    fill = 2 * 7 * chunk / (240e3 / cost.channels)
    assert cost.channels == 8 and cost.time_us == pytest.approx(expected + fill)


def test_nvls_on_one_h100_node_is_nvlink_sharps_efficiency_on_each_gpus_nvlink_traffic():
    c = cluster("dgx_h100")
    n = 8  # each GPU's NVLink carries S (n+1)/n each way: bus = 2 (n-1)/(n+1) x 18 x 20.6 x 0.85
    bus = 2 * (n - 1) / (n + 1) * 18 * 20.6 * tuning.NVLS_EFFICIENCY["hopper"]
    algbw = bus * n / (2 * (n - 1)) * 1e3
    fill = 128 * 1024 / (algbw / (16 * 8))  # one 128 KiB chunk through one of 16 x 8 lanes
    expected = tuning.HOP_LATENCY_US["nvlink"]["nvls"][2] + BIG / algbw + fill
    assert time_us(c, "all_reduce", BIG, algorithm="nvls") == pytest.approx(expected)


def test_nvls_traffic_law_departs_from_nccls_heads_by_n_over_n_plus_one_on_a_toy_domain():
    # a toy NVSwitch domain of 4 B200s: NCCL's graph is 4 heads of 90 GB/s (4 x 90 <= 18 x 40.1)
    # and prices 2 (h-1)/h of it; the NVLink carries S (n+1)/n each way, so our time's bandwidth
    # is 18 x 40.1 x 2 (n-1)/(n+1) over NCCL's 4 x 90 x 2 (h-1)/h
    c = cluster("dgx_b200", gpus_per_machine=4, nvlink_domain=4)
    comm = Comm.of(c.fabric)
    option = next(o for o in options(comm, "all_reduce") if o.algorithm == "nvls")
    n = 4
    assert nvls_traffic_factor(comm, option) == pytest.approx(
        (18 * 40.1 * 2 * (n - 1) / (n + 1)) / (4 * 90 * 2 * (n - 1) / n))
    # neither all-gather nor a ring, nor a communicator with more ranks than NCCL's 32 heads
    ring = next(o for o in options(comm, "all_reduce") if o.algorithm == "ring")
    assert nvls_traffic_factor(comm, ring) == 1.0
    big = Comm.of(cluster("gb200_nvl72", machines=16).fabric)
    wide = next(o for o in options(big, "all_reduce") if o.algorithm == "nvls")
    assert big.n_ranks == 64 and nvls_traffic_factor(big, wide) == 1.0


def test_nvls_on_eight_b200s_moves_bytes_at_the_nvlink_traffic_laws_rate():
    # textbook: 8 B200s on NVSwitch, 8 GiB all-reduce: 18 x 40.1 GB/s x 0.74 x 2 x 7/9 = 831 GB/s
    c = cluster("dgx_b200")
    comm = Comm.of(c.fabric)
    option = next(o for o in options(comm, "all_reduce") if o.algorithm == "nvls")
    n = 8
    bus = 18 * 40.1 * tuning.NVLS_EFFICIENCY["blackwell"] * 2 * (n - 1) / (n + 1)
    assert option.bandwidth_gbs * nvls_traffic_factor(comm, option) * 2 * (n - 1) / n == pytest.approx(bus)
    cost = collective_cost(c, "all_reduce", BIG, algorithm="nvls")
    busbw = BIG / cost.time_us / 1e3 * 2 * (n - 1) / n
    assert 0.97 * bus < busbw < bus


def test_send_recv_and_all_to_all_move_their_bytes_over_the_link_they_cross():
    # their closed forms, from NCCL's p2p schedule, are in test_nccl_p2p.py
    one, two = cluster("dgx_a100"), cluster("dgx_a100", 2)
    assert time_us(one, "all_to_all", BIG) > BIG * 7 / 8 / 240e3
    # across nodes half of each rank's bytes leave through the node's 8 HDR NICs (24 GB/s each)
    assert time_us(two, "all_to_all", BIG) > BIG * 8 / 16 / 24e3 > time_us(one, "all_to_all", BIG)
    assert time_us(one, "send_recv", BIG) > BIG / 240e3


def test_fewer_channels_move_small_messages_more_slowly_than_the_tuners_estimate():
    c = cluster("dgx_a100")
    small = collective_cost(c, "all_reduce", 256 * 1024, algorithm="ring", protocol="simple")
    large = collective_cost(c, "all_reduce", 64 * 2**20, algorithm="ring", protocol="simple")
    assert small.channels < large.channels == 24


@pytest.mark.parametrize("version, nbytes, channels", [
    # 4 DGX A100 with SHARP: 16 channels, 8 heads (one per NIC); NCCL 2.12 gives CollNet 512
    # threads, each owed 512 bytes per head: 2 MiB a channel, halved at 12, 6, 3 channels
    ("2.12.12", 64 << 20, 16),   # 64 MiB >= 16 x 2 MiB: every channel
    ("2.12.12", 16 << 20, 11),   # 16 -> 12 at 2 MiB each, then 1 MiB each: 11 carry 16 MiB
    ("2.12.12", 2 << 20, 4),     # ... 8 at 1 MiB, 6 -> 4 at 512 KiB: 4 x 512 KiB = 2 MiB
    ("2.12.12", 256 << 10, 1),
    ("2.18.3", 2 << 20, 3),      # 640 threads from 2.18: 640 KiB a channel at the 4-channel step
])
def test_collnet_direct_steps_down_its_channels_by_ncswitch(version, nbytes, channels):
    c = cluster("dgx_a100", 4, network={"sharp": True}, nccl_version=version)
    cost = collective_cost(c, "all_reduce", nbytes, algorithm="collnet_direct")
    assert cost.channels == channels
    full = collective_cost(c, "all_reduce", 64 << 20, algorithm="collnet_direct")
    if channels < full.channels:  # fewer channels, each as fast: more time per byte
        assert cost.time_us / nbytes > 1.2 * full.time_us / (64 << 20)


def test_an_oversubscribed_spine_slows_all_to_all_between_leaves():
    flat = cluster("dgx_h100", 64)
    tapered = cluster("dgx_h100", 64, network={"machines_per_leaf": 16, "oversubscription": 2})
    assert time_us(tapered, "all_to_all", GB) > 1.4 * time_us(flat, "all_to_all", GB)


# -- NCCL's choice -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "machine, machines, nbytes, algorithm, protocol",
    [
        ("dgx_a100", 1, 1 << 30, "ring", "simple"),   # large all-reduce on one node without NVLS
        ("dgx_a100", 1, 8, "ring", "ll"),             # tiny: LL's low latency
        ("dgx_a100", 4, 64 * 1024, "tree", None),     # small across nodes: the tree's log-depth latency
        ("dgx_a100", 4, 1 << 30, "ring", "simple"),   # large across more than two nodes: the ring
        ("p4d", 2, 1 << 30, "tree", "simple"),        # two nodes, few NICs: the tree sends half a ring's bytes
        ("dgx_a100", 2, 1 << 30, "ring", "simple"),   # ... unless per-channel tree ceilings cap it (A100)
        ("dgx_h100", 1, 1 << 30, "nvls", "simple"),   # H100 NVSwitch: NVLink SHARP
        ("dgx_h100", 1, 8, "ring", "ll"),
        ("dgx_h100", 2, 1 << 30, "nvls_tree", "simple"),  # NVLS inside nodes, a tree between them
        ("dgx_h100", 4, 16 << 20, "nvls_tree", "simple"),
    ],
)
def test_the_chooser_picks_what_nccl_picks_in_textbook_cases(machine, machines, nbytes, algorithm, protocol):
    cost = collective_cost(cluster(machine, machines), "all_reduce", nbytes)
    assert cost.algorithm == algorithm and (protocol is None or cost.protocol == protocol)


def test_pat_serves_small_all_gathers_with_one_gpu_per_node_and_never_all_reduce():
    c = cluster("dgx_h100", 64)
    dp = list(range(0, c.n_gpus, 8))  # one GPU of every machine
    assert collective_cost(c, "all_gather", 64 * 1024, ranks=dp).algorithm == "pat"
    assert collective_cost(c, "all_reduce", 64 * 1024, ranks=dp).algorithm != "pat"
    assert all(o.algorithm != "pat" for o in options(Comm.of(c.fabric), "all_gather"))  # eight GPUs a node


def test_nccl_algo_and_proto_force_or_exclude_like_the_environment_variables():
    c = cluster("dgx_h100")
    assert collective_cost(c, "all_reduce", 1 << 30, algorithm="ring").algorithm == "ring"
    assert collective_cost(c, "all_reduce", 1 << 30, algorithm="^nvls").algorithm == "ring"
    assert collective_cost(c, "all_reduce", 1 << 30, algorithm="Ring,Tree", protocol="LL128").protocol == "ll128"
    with pytest.raises(TopologyError, match="no algorithm nvls_tree"):
        collective_cost(c, "all_reduce", 1 << 30, algorithm="nvls_tree")  # one node: NCCL has none


def test_a_tensor_parallel_group_inside_a_node_costs_what_one_node_costs():
    big, one = cluster("dgx_h100", 16), cluster("dgx_h100", 1)
    inside = collective_cost(big, "all_reduce", 64e6, ranks=range(8, 16))
    assert inside == collective_cost(one, "all_reduce", 64e6)
    across = collective_cost(big, "all_reduce", 64e6, ranks=range(0, 128, 8))
    assert across.time_us > inside.time_us


def test_every_operation_has_a_plan_of_transfers_that_the_network_can_time():
    c = cluster("dgx_h100", 2)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv"):
        plan = collective_plan(c, op, 64e6)
        assert len(plan) >= 1 and simulate_plan(plan, c) > 0


def test_bad_arguments_are_one_line_errors():
    c = cluster("dgx_h100")
    for call, key in ((lambda: collective_cost(c, "allreduce_x", 1), "op"),
                      (lambda: collective_cost(c, "all_reduce", -1), "nbytes"),
                      (lambda: collective_cost(c, "all_reduce", 1, ranks=[0, 99]), "ranks"),
                      (lambda: collective_cost(c, "all_reduce", 1, protocol="ll256"), "protocol")):
        with pytest.raises(TopologyError) as err:
            call()
        assert err.value.key == key and "\n" not in str(err.value)


def test_a_rings_network_steps_follow_each_release_and_our_critical_path_prices_two_per_node():
    from whatif.topology.nccl.model import pricing_tuner, ring_network_steps
    from whatif.topology.nccl.versions import tuner

    # NCCL's own counts (tuning.cc nInterSteps): 2(n-1) to 2.11 and from 2.23, 2n in 2.12-2.22
    assert [ring_network_steps(tuner(v), "all_reduce", 4, 8) for v in ((2, 11, 4), (2, 20, 3), (2, 26, 2))] == [6, 8, 6]
    # ours: 2n once a node holds two ranks, 2(n-1) when every ring link is a network link
    assert ring_network_steps(pricing_tuner(), "all_reduce", 4, 8) == 8
    assert ring_network_steps(pricing_tuner(), "all_reduce", 4, 1) == 6
    assert ring_network_steps(pricing_tuner(), "all_gather", 4, 8) == 3
    assert ring_network_steps(pricing_tuner(), "all_reduce", 1, 8) == 0
    # an 8-byte LL ring over two DGX H100s: 30 steps, 4 through the network, 26 over NVLink at
    # no less than the CPU's network post overhead (getNetOverhead), plus the base latency
    c = cluster("dgx_h100", machines=2)
    n, net_steps = 16, 4
    intra = max(tuning.HOP_LATENCY_US["nvlink"]["ring"][0], tuning.NET_OVERHEAD_US[c.fabric.cpu])
    expected = (tuning.BASE_LATENCY_US["ring"][0] + (2 * (n - 1) - net_steps) * intra
                + net_steps * tuning.HOP_LATENCY_US["net"]["ring"][0])
    # (8 bytes move in well under a nanosecond: the time is the latency)
    assert time_us(c, "all_reduce", 8, algorithm="ring", protocol="ll") == pytest.approx(expected, rel=1e-4)


def test_a_simple_tree_fills_its_chain_one_whole_chunk_per_hop():
    from whatif.topology.nccl.graphs import nic_path, intra_total
    from whatif.topology.nccl.model import TREE_SIMPLE_CHUNK, choose, tree_chain_fill_us

    # four DGX H100s: a chunk climbs 7 NVLink hops and 2 network levels and comes down again,
    # each hop 512 KiB at its channel's share of the GPU's NVLink, or at one NIC (16 channels
    # on 8 NICs: half a NIC each); two of the slowest hop are a chunk's steady pace, not fill
    c = cluster("dgx_h100", machines=4)
    comm = Comm.of(c.fabric)
    tree = choose(comm, "all_reduce", BIG, {"tree"}, {"simple"})
    channels = 16
    nvlink = intra_total(comm) * 1e3 / channels
    nic = nic_path(comm) * 1e3 * 8 / channels
    hops = [TREE_SIMPLE_CHUNK / nvlink] * 14 + [TREE_SIMPLE_CHUNK / nic] * 4
    expected = sum(hops) - 2 * max(hops)
    assert tree_chain_fill_us(comm, tree, BIG, channels, (2, 26, 2)) == pytest.approx(expected)
    # a message smaller than a chunk per channel fills with what it has; before 2.20 the chunk
    # halves while a channel holds fewer than 8 x depth of them (depth 7 + 2 + 1), to 128 KiB
    small = 16 * 2**18
    assert tree_chain_fill_us(comm, tree, small, channels, (2, 26, 2)) == pytest.approx(expected / 2)
    assert tree_chain_fill_us(comm, tree, BIG // 64, channels, (2, 19, 3)) == pytest.approx(expected / 4)
    # LL and LL128 forward line by line, rings keep every link busy, one node has no tree to fill
    for algorithm, protocol in (("tree", "ll128"), ("ring", "simple")):
        option = choose(comm, "all_reduce", BIG, {algorithm}, {protocol})
        assert tree_chain_fill_us(comm, option, BIG, channels, (2, 26, 2)) == 0.0
    one = Comm.of(cluster("dgx_h100").fabric)
    assert tree_chain_fill_us(one, choose(one, "all_reduce", BIG, {"tree"}, {"simple"}), BIG, 16, (2, 26, 2)) == 0.0


def test_one_gpu_on_each_of_two_nodes_has_no_chain_to_fill():
    from whatif.topology.nccl.model import choose, tree_chain_fill_us

    c = cluster("dgx_h100", machines=2, gpus_per_machine=1, nics_per_machine=1)
    comm = Comm.of(c.fabric)
    tree = choose(comm, "all_reduce", BIG, {"tree"}, {"simple"})
    assert tree_chain_fill_us(comm, tree, BIG, 2, (2, 26, 2)) == 0.0  # up and down: the transfer's two hops
