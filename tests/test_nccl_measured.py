"""The measured constants: what they add, how a cluster names them, and how they are estimated."""

import dataclasses

import pytest

from whatif.topology import Cluster, TopologyError, collective_cost
from whatif.topology.calibrate import decompose, table_comm, table_time_us
from whatif.topology.nccl.graphs import Comm
from whatif.topology.nccl.measured import SPEC, Measured, Row, fit, predict_rows, public
from whatif.topology.nccl.model import predict
from whatif.topology.nccl_tests import parse_text


def cluster(machine="dgx_h100", machines=1, measured="spec", **nccl) -> Cluster:
    return Cluster.from_config({"machine": machine, "machines": machines, "nccl": {"measured": measured, **nccl}})


CONSTANTS = {"kernel_us": {"hopper": 3.0, "ampere": 2.0}, "hop_us": {"ib": 4.0, "efa2": 25.0},
             "p2p_efficiency": 0.5, "host_launch_us": 4.0, "host_call_us": 0.5}


def test_the_kernel_start_comes_on_top_of_nccls_latency_by_gpu_generation():
    spec, measured = cluster(), cluster(measured=CONSTANTS)
    for size in (8, 1 << 30):
        gap = collective_cost(measured, "all_reduce", size).time_us - collective_cost(spec, "all_reduce", size).time_us
        assert gap == pytest.approx(3.0)
    a100 = collective_cost(cluster("dgx_a100", measured=CONSTANTS), "all_reduce", 8).time_us
    assert a100 - collective_cost(cluster("dgx_a100"), "all_reduce", 8).time_us == pytest.approx(2.0)


def test_every_network_hop_pays_its_nic_kinds_latency():
    spec, measured = cluster(machines=4), cluster(machines=4, measured=CONSTANTS)
    found = predict(Comm.of(spec.fabric), "all_reduce", 8)  # a tree: 2 log2(4) network hops
    assert (found.option.algorithm, found.hops) == ("tree", 4.0)
    gap = collective_cost(measured, "all_reduce", 8).time_us - collective_cost(spec, "all_reduce", 8).time_us
    assert gap == pytest.approx(3.0 + 4 * 4.0)
    p5 = collective_cost(cluster("p5", 2, measured=CONSTANTS), "all_reduce", 8).time_us
    assert p5 - collective_cost(cluster("p5", 2), "all_reduce", 8).time_us == pytest.approx(3.0 + 2 * 25.0)  # EFAv2


def test_all_to_all_between_nodes_moves_at_the_point_to_point_efficiency():
    spec, measured = cluster(machines=2), cluster(machines=2, measured=CONSTANTS)
    size = 1 << 32  # bandwidth-bound: the network share (half the buffer) sets the time
    base = predict(Comm.of(spec.fabric), "all_reduce", 8)
    assert base.kind == "ib"
    slow = collective_cost(measured, "all_to_all", size).time_us
    fast = collective_cost(spec, "all_to_all", size).time_us
    assert slow / fast == pytest.approx(2.0, rel=0.01)


def test_a_cluster_names_its_constants_spec_public_or_its_own():
    assert cluster().fabric.calibration.constants == SPEC
    assert Cluster.from_config({"machine": "dgx_h100", "machines": 1}).fabric.calibration.constants == public()
    own = cluster(measured=CONSTANTS).fabric.calibration.constants
    assert (own.kernel("hopper"), own.hop("efa2"), own.p2p_efficiency) == (3.0, 25.0, 0.5)
    assert Measured.from_config(own.as_config()) == own
    for bad in ({"kernel_us": {"hopper": -1}}, {"hop_us": {"carrier_pigeon": 1}}, {"colour": 1}, 7):
        with pytest.raises(TopologyError, match="measured"):
            cluster(measured=bad)


def test_the_public_constants_are_shipped_and_sane():
    found = public()
    assert found != SPEC and 0 < found.kernel("hopper") < 20 and found.hop("efa1") > found.hop("ib")
    assert len(found.fitted_on) >= 15


def test_nccl_tests_host_thread_bounds_a_table_when_one_thread_drives_several_gpus():
    text = "# nThread 1 nGpus 8 minBytes 8 maxBytes 8 step: 2(factor)\n" \
           "           8             2     float     sum      -1    35.00    0.00    0.00      0\n"
    table = parse_text(text, "t.txt", "all_reduce")
    assert table.gpus_per_thread == 8
    c = cluster("dgx_a100", measured=CONSTANTS)
    comm = table_comm(c.fabric, dataclasses.replace(table, n_ranks=8))[1]
    found = predict(comm, "all_reduce", 8, calibration=c.fabric.calibration)
    assert table_time_us(table, comm, found, c.fabric.calibration.constants) == pytest.approx(8 * (4.0 + 0.5))


def test_the_fit_recovers_constants_it_generated():
    truth = Measured(kernel_us=(("hopper", 5.0),), hop_us=(("efa2", 30.0), ("ib", 2.0)), p2p_efficiency=0.4)
    rows = []
    for table, kind, hops in (("a", "efa2", 2), ("b", "ib", 4), ("c", "ib", 2)):
        for latency in (20.0, 25.0, 30.0):
            rows.append(Row(table, "hopper", 0.0, latency, hops, kind, 0.5, 0.0, False, "sum", 1, 1))
    for net in (2000.0, 4000.0):
        rows.append(Row("d", "hopper", 0.0, 30.0, 2, "ib", 100.0, net, True, "max", 1, 32))
    rows = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(rows, predict_rows(rows, truth))]
    found = fit(rows)
    assert found.kernel("hopper") == pytest.approx(5.0, abs=0.2)
    assert found.hop("efa2") == pytest.approx(30.0, rel=0.02) and found.hop("ib") == pytest.approx(2.0, abs=0.2)
    assert found.p2p_efficiency == pytest.approx(0.4, rel=0.02)


def test_decompose_splits_a_table_into_what_the_constants_act_on():
    text = "\n".join(f"{s:>12} {s // 4:>12}     float     sum      -1    100.0    1.00    1.00      0"
                     for s in (8, 1 << 30))
    c = cluster(machines=2)
    table = parse_text(text, "two_node_allreduce.txt", "all_reduce")
    table = dataclasses.replace(table, n_ranks=16)
    comm = table_comm(c.fabric, table)[1]
    small, large = decompose(table, comm)
    assert small.hops == 2 and small.kind == "ib" and small.latency_us > small.local_us + small.net_us
    # NVLS tree on two H100 nodes: its per-channel ceiling (57.7 GB/s) binds before the NICs (96)
    assert large.net_us < 0.3 * (large.local_us + large.net_us)
    _, ring = decompose(table, comm, (frozenset({"ring"}), None))
    assert ring.net_us == pytest.approx(ring.local_us + ring.net_us)  # a ring across nodes: the NICs


def test_nccl_min_nchannels_lifts_per_channel_ceilings_but_not_the_nics():
    plain, more = cluster(machines=16), cluster(machines=16, min_channels=64)
    size = 1 << 34
    forced = dict(algorithm="ring", protocol="ll128")
    assert collective_cost(more, "all_reduce", size, **forced).time_us < collective_cost(plain, "all_reduce", size,
                                                                                        **forced).time_us
    simple = dict(algorithm="ring", protocol="simple")  # the NICs bound Simple: more channels, same time
    assert collective_cost(more, "all_reduce", size, **simple).time_us == pytest.approx(
        collective_cost(plain, "all_reduce", size, **simple).time_us)


def test_link_efficiency_slows_only_what_crosses_no_network():
    nvlink = {"link_efficiency": {"nvlink": 0.5}}
    one, slow = cluster(), cluster(measured=nvlink)
    size = 1 << 30
    fast_ring = predict(Comm.of(one.fabric), "all_reduce", size, {"ring"}, calibration=one.fabric.calibration)
    slow_ring = predict(Comm.of(slow.fabric), "all_reduce", size, {"ring"}, calibration=slow.fabric.calibration)
    assert slow_ring.latency_us == pytest.approx(fast_ring.latency_us)
    assert slow_ring.transfer_us == pytest.approx(2 * fast_ring.transfer_us)  # T = L + S / (0.5 B)
    ring = dict(algorithm="ring", protocol="simple")  # two nodes, a ring: every byte waits for the NICs
    assert collective_cost(cluster(machines=2, measured=nvlink), "all_reduce", size, **ring).time_us == pytest.approx(
        collective_cost(cluster(machines=2), "all_reduce", size, **ring).time_us)
    assert Measured.from_config(slow.fabric.calibration.constants.as_config()) == slow.fabric.calibration.constants
    with pytest.raises(TopologyError, match="link_efficiency.carrier_pigeon"):
        cluster(measured={"link_efficiency": {"carrier_pigeon": 0.5}})


def test_the_fit_recovers_both_efficiencies_and_keeps_the_prior_where_no_row_informs():
    truth = Measured(kernel_us=(("hopper", 5.0),), hop_us=(("ib", 3.0),), efficiency=(("ib", 0.7),),
                     link_efficiency=(("nvlink", 0.9),))
    prior = Measured(kernel_us=(("hopper", 1.0), ("ampere", 7.0)), hop_us=(("ib", 1.0), ("efa2", 25.0)))
    rows = [Row("lat", "hopper", 0.0, latency, 2, "ib", 0.1, 0.0, False, "sum", 1, 1, "ring")
            for latency in (20.0, 25.0, 30.0)]
    rows += [Row("lat4", "hopper", 0.0, latency, 4, "ib", 0.1, 0.0, False, "sum", 1, 1, "tree")
             for latency in (20.0, 30.0)]
    rows += [Row("nvlink", "hopper", 0.0, 10.0, 0, "ib", local, 0.0, False, "sum", 1, 1, "ring")
             for local in (500.0, 1000.0, 2000.0)]
    rows += [Row("net", "hopper", 0.0, 10.0, 2, "ib", 0.0, net, False, "sum", 1, 1, "ring")
             for net in (500.0, 1000.0, 2000.0)]
    rows = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(rows, predict_rows(rows, truth))]
    assert fit(rows).net_efficiency("ib") == 1.0 and fit(rows).local_efficiency("nvlink") == 1.0  # public: not fitted
    found = fit(rows, fit_efficiency=True, prior=prior)
    assert found.net_efficiency("ib") == pytest.approx(0.7, rel=0.01)
    assert found.local_efficiency("nvlink") == pytest.approx(0.9, rel=0.01)
    assert found.kernel("hopper") == pytest.approx(5.0, abs=0.3) and found.hop("ib") == pytest.approx(3.0, abs=0.2)
    assert found.hop("efa2") == 25.0 and found.kernel("ampere") == 7.0  # no row of theirs: the prior's


def _table(truth: Cluster, machines: int, name: str):
    """An nccl-tests all-reduce table as ``truth`` would print it on ``machines`` of its machines."""
    sized = Cluster.from_config({"machine": "dgx_h100", "machines": machines,
                                 "nccl": truth.fabric.calibration.as_config()})
    n = sized.n_gpus
    lines = []
    for size in (4**k * 8 for k in range(16)):
        time = collective_cost(sized, "all_reduce", size).time_us
        algbw = size / time / 1e3
        lines.append(f"{size:>12} {size // 4:>12} float sum -1 {time:10.2f} {algbw:7.2f} "
                     f"{algbw * 2 * (n - 1) / n:7.2f} 0")
    return dataclasses.replace(parse_text("\n".join(lines) + "\n", name, "all_reduce"), n_ranks=n)


def test_a_calibration_at_one_scale_carries_its_physical_constants_to_another():
    from whatif.topology.calibrate import fit_tables

    measured = {"kernel_us": {"hopper": 6.0}, "hop_us": {"ib": 9.0}, "efficiency": {"ib": 0.6},
                "link_efficiency": {"nvlink": 0.8, "nvls": 0.8}}
    truth = cluster(machines=8, measured=measured)
    tables = [_table(truth, 1, "one_node.txt"), _table(truth, 2, "two_nodes.txt")]
    found = fit_tables(tables, cluster(machines=8), per_algorithm=False).cluster
    constants = found.fabric.calibration.constants
    assert constants.local_efficiency("nvls") == pytest.approx(0.8, rel=0.02)
    assert constants.net_efficiency("ib") == pytest.approx(0.6, rel=0.05)
    assert constants.kernel("hopper") == pytest.approx(6.0, abs=0.5) and constants.hop("ib") == pytest.approx(9.0, abs=1)
    eight = _table(truth, 8, "eight_nodes.txt")  # never seen: predicted from the constants alone
    comm = table_comm(found.fabric, eight)[1]
    for row in eight.rows:
        predicted = predict(comm, "all_reduce", row.size_bytes, calibration=found.fabric.calibration)
        assert predicted.time_us == pytest.approx(row.time_us, rel=0.03)


def _gb200_racks(measured, racks=2) -> Cluster:
    """``racks`` NVLink domains of 64 GB200s (16 trays of 4, one 400G NIC per GPU) joined by InfiniBand."""
    return Cluster.from_config({"gpu": "gb200", "machines": 16 * racks, "gpus_per_machine": 4, "nvlink_domain": 64,
                                "nvswitch": True, "nics_per_machine": 4,
                                "nic": {"bandwidth": "400Gbps", "transport": "ib", "kind": "ib"},
                                "nccl": {"measured": measured}})


def test_a_ring_waits_on_its_nics_only_where_they_carry_its_bus_bandwidth():
    from whatif.topology.nccl.model import choose, ring_graph, ring_nic_share
    from whatif.topology.nccl.graphs import nic_path, comm_channels

    # two DGX H100s: 8 channels at one NIC's 48 GB/s on 8 NICs, b = c: NIC-bound, 2 b / c - 1 = 1
    comm = Comm.of(cluster(machines=2).fabric)
    graph = ring_graph(comm)
    assert ring_nic_share(comm, graph, comm_channels(comm, graph)) == 1.0
    # two 64-GPU GB200 domains: 16 channels of 45.1 GB/s (b = 722) over 32 of 64 NICs at 48 (c = 1536)
    racks = Comm.of(_gb200_racks("spec").fabric)
    graph = ring_graph(racks)
    launched = comm_channels(racks, graph)
    b, c = graph.channels * graph.bw_inter, min(racks.node_nics, launched) * 48.0
    assert nic_path(racks) == 48.0 and 2 * b / c - 1 < 0 and ring_nic_share(racks, graph, launched) == 0.0
    # half the channels on 8 NICs: c = 8 x 48, b = 192: 2 b / c - 1 = 0
    assert ring_nic_share(comm, dataclasses.replace(ring_graph(comm), channels=4), 8) == pytest.approx(0.0)
    assert choose(racks, "all_reduce", 1 << 33, {"ring"}, {"simple"}).link == "net"


def test_a_ring_across_nvlink_domains_moves_at_nvlinks_rate_not_the_nics():
    size = 1 << 33

    def ring(measured):
        c = _gb200_racks(measured)
        return predict(Comm.of(c.fabric), "all_reduce", size, {"ring"}, {"simple"}, c.fabric.calibration)

    base, nvlink, nic = ring("spec"), ring({"link_efficiency": {"nvlink": 1.25}}), ring({"efficiency": {"ib": 0.5}})
    assert nvlink.transfer_us == pytest.approx(base.transfer_us / 1.25)  # S / (1.25 B): NVLink's pace
    assert nic.transfer_us == pytest.approx(base.transfer_us)            # idle NICs at half speed: no change


def test_a_kernels_per_channel_ceiling_is_no_links_rate():
    from whatif.topology.nccl.model import _algorithm_bandwidth, _graph, link_share, priced

    # LL on one DGX H100: its share of the ring's bus bandwidth, capped per GPU (LL_MAX_BW). With
    # the links at half speed, T = S / min(cap, b / 2) against S / min(cap, b): the share the links
    # set is full / slow - 1, the rest the cap's, which no link's efficiency moves
    one = cluster()
    comm = Comm.of(one.fabric)
    size = 1 << 30
    ll = predict(comm, "all_reduce", size, {"ring"}, {"ll"}, one.fabric.calibration)
    newest, option = priced(comm, ll.option)
    graph = _graph(newest, "ring")
    full = _algorithm_bandwidth(newest, "all_reduce", "ring", "ll", graph)
    slow = _algorithm_bandwidth(newest, "all_reduce", "ring", "ll", dataclasses.replace(
        graph, bw_intra=graph.bw_intra / 2, bw_inter=graph.bw_inter / 2))
    share = link_share(newest, option, ll.channels)
    assert 0 < share < 1 and share == pytest.approx(full / slow - 1)
    assert ll.ceiling_us == pytest.approx(ll.transfer_us * (1 - share)) and ll.local_us == pytest.approx(
        ll.transfer_us * share)
    fast = cluster(measured={"link_efficiency": {"nvlink": 1.25}})
    again = predict(Comm.of(fast.fabric), "all_reduce", size, {"ring"}, {"ll"}, fast.fabric.calibration)
    assert again.transfer_us == pytest.approx(ll.local_us / 1.25 + ll.ceiling_us)
    simple = predict(Comm.of(fast.fabric), "all_reduce", size, {"ring"}, {"simple"}, fast.fabric.calibration)
    plain = predict(comm, "all_reduce", size, {"ring"}, {"simple"}, one.fabric.calibration)
    assert simple.ceiling_us == 0.0 and simple.transfer_us == pytest.approx(plain.transfer_us / 1.25)


def test_nvlinks_rate_is_not_fitted_where_all_to_all_hides_it_behind_the_network():
    truth = Measured(kernel_us=(("blackwell", 5.0),), p2p_efficiency=0.3)
    rows = [Row("a2a", "blackwell", 0.0, 30.0, 2, "ib", local, 2 * local, True, "max", 1, 32, "p2p")
            for local in (0.5, 1.0, 2000.0, 4000.0, 8000.0)]
    rows = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(rows, predict_rows(rows, truth))]
    found = fit(rows, fit_efficiency=True)
    assert found.link_efficiency == () and found.p2p_efficiency == pytest.approx(0.3, rel=0.01)


def test_an_algorithm_no_table_ran_takes_the_constants_and_no_other_algorithms_factor():
    from whatif.topology.calibrate import fit_tables

    # one DGX H100's tables, slowed: NVLS's NVLink rate is a constant its rows fit; a
    # tree, which no table ran, gets it and no (algorithm, protocol) factor of theirs
    truth = cluster(machines=1, measured={"kernel_us": {"hopper": 6.0}, "link_efficiency": {"nvls": 0.8}})
    found = fit_tables([_table(truth, 1, "one_node.txt")], cluster(machines=2)).cluster
    calibration = found.fabric.calibration
    assert all(row[1] != "*" for row in calibration.factors)
    assert calibration.factors_for("nvlink", "tree", "simple") == (1.0, 1.0)
    assert calibration.constants.local_efficiency("nvls") == pytest.approx(0.8, rel=0.02)


def test_rows_faster_than_the_host_estimate_are_the_gpus_and_inform_the_fit():
    from whatif.topology.calibrate import fit_tables

    # one DGX H100's all-to-all, one GPU a thread: 16 calls an iteration put the public host
    # estimate (launch + 16 calls) above the GPU's time at small sizes. A table that ran faster
    # than that estimate was not set by its host thread: every row informs the p2p factors
    c = cluster(machines=1, measured="public")
    constants = c.fabric.calibration.constants
    host = constants.host_us(1, 16)
    lines = []
    sizes = [4**k * 64 for k in range(8)]
    for size in sizes:
        time = 0.8 * collective_cost(c, "all_to_all", size).time_us
        lines.append(f"{size:>12} {size // 4:>12} float none -1 {time:10.2f} 0.1 0.1 0")
    table = dataclasses.replace(parse_text("\n".join(lines) + "\n", "a2a.txt", "all_to_all"), n_ranks=8)
    assert min(r.time_us for r in table.rows) < host
    fitted = fit_tables([table], c)
    assert sum(group[5] for group in fitted.groups) == len(sizes)


def test_a_trees_factors_fitted_on_two_nodes_stay_on_two_nodes_and_a_rings_carry():
    from whatif.topology.calibrate import factor_nodes, fit_tables

    # across two nodes NCCL's trees are one edge between them; from three a node's NIC serves a
    # parent and two children: a tree's misfit on one says nothing of the other, a ring's does
    assert (factor_nodes("tree", 2), factor_nodes("nvls_tree", 8), factor_nodes("ring", 2)) == ("2", "3+", "")
    truth = cluster(machines=8, measured="public", net={"tree/ll": {"latency": 2.0}})
    fit = fit_tables([_table(truth, 2, "two_nodes.txt")], cluster(machines=8, measured="public"))
    calibration = fit.cluster.fabric.calibration
    trees = [g for g in fit.groups if g[1] in ("tree", "nvls_tree")]
    assert trees and all(g[6] == "2" for g in trees)
    assert any((g[3], g[4]) != (1.0, 1.0) for g in trees)
    for link, algorithm, protocol, bandwidth, latency, _, _ in trees:
        assert calibration.factors_for(link, algorithm, protocol, 2) == (bandwidth, latency)
        assert calibration.factors_for(link, algorithm, protocol, 8) == (1.0, 1.0)


def test_a_row_one_of_its_two_runs_contradicts_is_left_out_of_the_fit():
    from whatif.topology.calibrate import fit_tables

    truth = cluster(machines=2, measured={"kernel_us": {"hopper": 6.0}, "hop_us": {"ib": 9.0}})

    def table(disturbed: float):
        lines = []
        for k, size in enumerate(4**k * 8 for k in range(10)):
            time = collective_cost(truth, "all_reduce", size).time_us
            out = time * (disturbed if k == 2 else 1.0)  # 128 B: the out-of-place run met something else
            lines.append(f"{size:>12} {size // 4:>12} float sum -1 {out:10.2f} 0.1 0.1 0 {time:10.2f} 0.1 0.1 0")
        return dataclasses.replace(parse_text("\n".join(lines) + "\n", "two_nodes.txt", "all_reduce"), n_ranks=16)

    clean, noisy = (fit_tables([table(d)], cluster(machines=2, measured="public")) for d in (1.0, 4.0))
    for constants in (clean.cluster.fabric.calibration.constants, noisy.cluster.fabric.calibration.constants):
        assert constants.kernel("hopper") + 2 * constants.hop("ib") == pytest.approx(6.0 + 2 * 9.0, rel=0.05)
    assert any("1 row left out of the fit (128 B)" in note for note in noisy.diagnoses)


def test_nvls_has_its_own_nvlink_efficiency_apart_from_the_rings():
    # NVLS reduces in the switch (NVLink SHARP), rings copy GPU to GPU: a rate measured on one
    # neither slows nor speeds the other, and a calibration fits each from its own rows
    size = 1 << 30
    plain = cluster()
    slow_nvls, slow_ring = cluster(measured={"link_efficiency": {"nvls": 0.5}}), cluster(
        measured={"link_efficiency": {"nvlink": 0.5}})

    def transfer(c, algorithm):
        return predict(Comm.of(c.fabric), "all_reduce", size, {algorithm}, {"simple"},
                       c.fabric.calibration).transfer_us

    assert transfer(slow_nvls, "nvls") == pytest.approx(2 * transfer(plain, "nvls"), rel=0.05)
    assert transfer(slow_nvls, "ring") == pytest.approx(transfer(plain, "ring"))
    assert transfer(slow_ring, "nvls") == pytest.approx(transfer(plain, "nvls"))
    truth = Measured(link_efficiency=(("nvls", 0.7),))
    rows = [Row("nvls", "hopper", 0.0, 10.0, 0, "ib", local, 0.0, False, "sum", 1, 1, "nvls", "nvls")
            for local in (1000.0, 2000.0, 4000.0)]
    rows = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(rows, predict_rows(rows, truth))]
    found = fit(rows, fit_efficiency=True)
    assert found.local_efficiency("nvls") == pytest.approx(0.7, rel=0.01) and found.local_efficiency("nvlink") == 1.0


def test_the_kernel_start_keeps_its_prior_where_every_latency_row_crosses_as_many_hops():
    # one two-node table: every latency-bound row crosses 2 hops, so kernel + 2 x hop is all it
    # says; the kernel keeps the prior and the hop takes the rest. A one-node row tells them apart.
    truth = Measured(kernel_us=(("blackwell", 9.0),), hop_us=(("ib", 3.0),))
    prior = Measured(kernel_us=(("blackwell", 5.0),), hop_us=(("ib", 1.0),))
    rows = [Row("two", "blackwell", 0.0, latency, 2, "ib", 0.01, 0.01, False, "sum", 1, 1, "ring")
            for latency in (10.0, 12.0, 14.0, 16.0)]
    rows = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(rows, predict_rows(rows, truth))]
    found = fit(rows, prior=prior)
    assert found.kernel("blackwell") == 5.0
    assert found.kernel("blackwell") + 2 * found.hop("ib") == pytest.approx(9.0 + 2 * 3.0, rel=0.01)
    one = [dataclasses.replace(r, table="one", hops=0) for r in rows]
    one = [dataclasses.replace(r, measured_us=float(t)) for r, t in zip(one, predict_rows(one, truth))]
    both = fit(rows + one, prior=prior)
    assert both.kernel("blackwell") == pytest.approx(9.0, rel=0.02) and both.hop("ib") == pytest.approx(3.0, rel=0.05)
