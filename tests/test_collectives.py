"""Specification of collective plans, their closed forms and the network that times them."""

import time

import numpy as np
import pytest
import simpy

from whatif.topology import (
    GLOO_OPS,
    Cluster,
    Link,
    Network,
    Plan,
    Step,
    TopologyError,
    allreduce_time_us,
    collective_cost,
    collective_plan,
    fair_rates,
    gbps,
    gigabytes_per_s,
    hierarchical_allreduce_time_us,
    nic_traffic,
    parameter_server_time_us,
    plan_allreduce,
    plan_hierarchical_allreduce,
    plan_parameter_server,
    plan_ring_allreduce,
    ring_allreduce_time_us,
    simulate_plan,
)

MB = 1e6
SHAPES = [(1, 2), (2, 1), (4, 2), (8, 8), (64, 8)]  # machines x GPUs per machine


def cluster(machines, gpus, intra="nvlink2", inter="25gbe", server_machines=0) -> Cluster:
    return Cluster.from_config(
        {
            "machines": machines,
            "gpus_per_machine": gpus,
            "intra_node": intra,
            "inter_node": inter,
            "server_machines": server_machines,
        }
    )


def run_together(c: Cluster, plans, start_us=None) -> list:
    """End times of ``plans`` run on one network, started at ``start_us`` (default all at 0)."""
    env = simpy.Environment()
    network = Network(env, c)
    ends = [None] * len(plans)

    def run(i, plan, start):
        yield env.timeout(start)
        yield network.execute(plan)
        ends[i] = env.now

    for i, plan in enumerate(plans):
        env.process(run(i, plan, (start_us or [0.0] * len(plans))[i]))
    env.run()
    return ends


# -- plans ---------------------------------------------------------------------------------------


class TestRingPlan:
    def test_two_n_minus_one_steps_of_one_nth_per_gpu(self):
        c = cluster(4, 2)
        plan = plan_ring_allreduce(c, 80 * MB)
        assert len(plan) == 2 * (8 - 1)
        for step in plan.steps:
            assert sorted(step.src.tolist()) == list(range(8)) and sorted(step.dst.tolist()) == list(range(8))
            assert np.all(step.nbytes == 10 * MB)
        assert plan.steps[0].transfers()[:2] == [(0, 1, 10 * MB), (1, 2, 10 * MB)]

    @pytest.mark.parametrize("machines, gpus", [(2, 1), (4, 2), (8, 8), (64, 8)])
    def test_each_step_crosses_each_nic_exactly_once_each_way(self, machines, gpus):
        c = cluster(machines, gpus)
        for step in set(plan_ring_allreduce(c, 100 * MB).steps):
            traffic = nic_traffic(step, c)
            assert np.all(traffic.egress_transfers == 1)
            assert np.all(traffic.ingress_transfers == 1)

    def test_a_single_machine_ring_never_touches_a_nic(self):
        c = cluster(1, 8)
        assert nic_traffic(plan_ring_allreduce(c, 100 * MB), c).max_bytes == 0

    def test_one_gpu_has_nothing_to_do(self):
        c = cluster(1, 1)
        plan = plan_ring_allreduce(c, 100 * MB)
        assert len(plan) == 0 and simulate_plan(plan, c) == 0 and ring_allreduce_time_us(c, 100 * MB) == 0


class TestHierarchicalPlan:
    def test_phases(self):
        c = cluster(4, 8)
        plan = plan_hierarchical_allreduce(c, 64 * MB)
        assert len(plan) == (8 - 1) + 2 * (4 - 1) + (8 - 1)
        intra, inter = plan.steps[0], plan.steps[7]
        assert nic_traffic(intra, c).max_bytes == 0
        assert np.all(intra.nbytes == 8 * MB)  # S / g
        traffic = nic_traffic(inter, c)
        assert np.all(traffic.egress_transfers == 8) and np.all(traffic.ingress_transfers == 8)  # g rings
        assert np.all(inter.nbytes == 2 * MB)  # S / (g m)
        assert set(zip(inter.src.tolist(), inter.dst.tolist())) >= {(0, 8), (8, 16), (24, 0), (1, 9)}

    def test_degenerates_to_a_ring_on_one_machine_or_one_gpu_per_machine(self):
        for c in (cluster(1, 8), cluster(8, 1)):
            assert hierarchical_allreduce_time_us(c, 100 * MB) == pytest.approx(ring_allreduce_time_us(c, 100 * MB))

    def test_fewer_network_latencies_than_the_ring(self):
        c = cluster(8, 8)
        tiny = 1.0  # bytes: latency only
        assert hierarchical_allreduce_time_us(c, tiny) < ring_allreduce_time_us(c, tiny) / 3


class TestParameterServerPlan:
    def test_every_worker_pushes_a_shard_to_every_server_and_pulls_it_back(self):
        c = cluster(4, 2)
        plan = plan_parameter_server(c, 100 * MB)
        push, pull = plan.steps
        assert len(push) == 8 * 4 and np.all(push.nbytes == 25 * MB)
        assert sorted(set(push.dst.tolist())) == [c.host(k) for k in range(4)]
        assert np.array_equal(pull.src, push.dst) and np.array_equal(pull.dst, push.src)
        assert plan.total_bytes == 2 * 8 * 100 * MB

    def test_dedicated_servers_live_on_server_machines(self):
        c = cluster(4, 2, server_machines=2)
        plan = plan_parameter_server(c, 100 * MB, placement="dedicated")
        assert set(c.machine_of(plan.steps[0].dst).tolist()) == {4, 5}
        assert len(set(plan.steps[0].dst.tolist())) == 2  # one server per server machine by default

    def test_server_nic_bytes_grow_with_workers(self):
        for placement, server_machines in (("colocated", 0), ("dedicated", 2)):
            busiest = []
            for machines in (1, 2, 3, 4, 8, 16):
                c = cluster(machines, 4, server_machines=server_machines)
                servers = 2 if placement == "dedicated" else None
                busiest.append(nic_traffic(plan_parameter_server(c, 100 * MB, servers, placement), c).max_bytes)
            assert busiest == sorted(busiest), (placement, busiest)
            assert busiest[-1] > busiest[1]

    def test_errors(self):
        with pytest.raises(TopologyError, match="^server_machines: dedicated parameter servers need"):
            plan_parameter_server(cluster(2, 2), MB, placement="dedicated")
        with pytest.raises(TopologyError, match="^placement: .*did you mean 'colocated'"):
            plan_parameter_server(cluster(2, 2), MB, placement="colocate")
        with pytest.raises(TopologyError, match="^servers: "):
            plan_parameter_server(cluster(2, 2), MB, servers=0)


def test_algorithms_by_name():
    c = cluster(4, 2)
    for name in ("ring", "hierarchical", "parameter_server", "ps"):
        assert isinstance(plan_allreduce(c, MB, name), Plan)
        assert allreduce_time_us(c, MB, name) > 0
    with pytest.raises(TopologyError, match="^algorithm: .*did you mean 'hierarchical'"):
        plan_allreduce(c, MB, "hierarchichal")
    with pytest.raises(TopologyError, match="^size_bytes: "):
        plan_allreduce(c, -1.0)


# -- the interface the simulation prices communication through -----------------------------------


@pytest.mark.parametrize("machines, gpus", SHAPES)
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_an_all_reduce_costs_its_algorithms_closed_form_and_runs_its_plan(machines, gpus, algorithm):
    c = cluster(machines, gpus)
    cost = collective_cost(c, "all_reduce", 10 * MB, algorithm=algorithm)
    assert (cost.op, cost.nbytes, cost.algorithm, cost.protocol, cost.channels) == ("all_reduce", 10 * MB, algorithm, "tcp", 1)
    assert cost.time_us == allreduce_time_us(c, 10 * MB, algorithm)
    plan = collective_plan(c, "all_reduce", 10 * MB, algorithm=algorithm)
    assert [s.transfers() for s in plan.steps] == [s.transfers() for s in plan_allreduce(c, 10 * MB, algorithm).steps]
    assert collective_cost(c, "all_reduce", 10 * MB).time_us == ring_allreduce_time_us(c, 10 * MB), "ring by default"


@pytest.mark.parametrize("machines, gpus", SHAPES)
@pytest.mark.parametrize("placement, server_machines", [("colocated", 0), ("dedicated", 2)])
def test_a_push_and_a_pull_are_the_two_halves_of_a_parameter_server(machines, gpus, placement, server_machines):
    c = cluster(machines, gpus, server_machines=server_machines)
    algorithm = f"parameter_server/{placement}"
    push, pull = (collective_cost(c, op, 10 * MB, algorithm=algorithm) for op in ("push", "pull"))
    assert push.time_us == pull.time_us == parameter_server_time_us(c, 10 * MB, placement=placement) / 2
    whole = plan_parameter_server(c, 10 * MB, placement=placement)
    for step, op in enumerate(("push", "pull")):
        plan = collective_plan(c, op, 10 * MB, algorithm=algorithm)
        assert plan.algorithm == whole.algorithm and plan.steps[0].transfers() == whole.steps[step].transfers()
    assert collective_cost(c, "push", MB).algorithm == "parameter_server", "servers on the worker machines by default"
    assert collective_cost(c, "push", MB).time_us == parameter_server_time_us(c, MB) / 2


@pytest.mark.parametrize("call, key", [
    (lambda c: collective_cost(c, "allreduce", MB), "op: .*did you mean 'all_reduce'"),
    (lambda c: collective_cost(c, "all_reduce", MB, algorithm="parameter_server"), "algorithm: "),
    (lambda c: collective_plan(c, "push", MB, algorithm="ring"), "algorithm: "),
    (lambda c: collective_cost(c, "all_reduce", MB, protocol="LL128"), "protocol: "),
    (lambda c: collective_cost(c, "all_reduce", MB, ranks=[0, 1, 4]), "ranks: .*as many ranks on every machine"),
    (lambda c: collective_cost(c, "all_reduce", MB, ranks=[0, 8]), "ranks: "),
])
def test_a_collective_that_is_not_modelled_is_refused_naming_the_argument(call, key):
    with pytest.raises(TopologyError, match=f"^{key}"):
        call(cluster(2, 4))
    assert collective_cost(cluster(2, 4), "all_reduce", MB, ranks=range(8)).time_us > 0, "all the GPUs are fine"


# -- simulated plans agree with the closed forms ------------------------------------------------


@pytest.mark.parametrize("machines, gpus", SHAPES)
@pytest.mark.parametrize(
    "links",
    [
        ("nvlink2", "25gbe"),
        ("pcie3", "10gbe"),
        ("nvlink3", "100gbe"),
        ({"bandwidth": "1GB/s", "latency": "1us"}, "100gbe"),  # a slow intra-node link with less latency
    ],
    ids=["nvlink2-25gbe", "pcie3-10gbe", "nvlink3-100gbe", "slow_intra-100gbe"],
)
@pytest.mark.parametrize("size", [100 * MB, 64 * 1024.0])
def test_ring_and_hierarchical_simulate_to_their_closed_forms(machines, gpus, links, size):
    c = cluster(machines, gpus, *links)
    ring = simulate_plan(plan_ring_allreduce(c, size), c)
    hierarchical = simulate_plan(plan_hierarchical_allreduce(c, size), c)
    assert ring == pytest.approx(ring_allreduce_time_us(c, size), rel=0.01)
    assert hierarchical == pytest.approx(hierarchical_allreduce_time_us(c, size), rel=0.01)


@pytest.mark.parametrize("machines, gpus", SHAPES)
@pytest.mark.parametrize(
    "placement, servers, server_machines",
    [("colocated", None, 0), ("colocated", "2m", 0), ("dedicated", None, 2), ("dedicated", 4, 2)],
)
def test_parameter_server_simulates_to_its_closed_form(machines, gpus, placement, servers, server_machines):
    c = cluster(machines, gpus, server_machines=server_machines)
    servers = 2 * machines if servers == "2m" else servers
    simulated = simulate_plan(plan_parameter_server(c, 100 * MB, servers, placement), c)
    assert simulated == pytest.approx(parameter_server_time_us(c, 100 * MB, servers, placement), rel=0.01)


@pytest.mark.parametrize("machines, gpus", [(1, 2), (2, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("links", [("nvlink2", "25gbe"), ({"bandwidth": "1GB/s", "latency": "1us"}, "100gbe")],
                         ids=["nvlink2-25gbe", "slow_intra-100gbe"])
@pytest.mark.parametrize("op", sorted(GLOO_OPS))
def test_gloos_other_collectives_simulate_to_their_closed_forms(machines, gpus, links, op):
    c = cluster(machines, gpus, *links)
    cost = collective_cost(c, op, 24 * MB)
    assert (cost.algorithm, cost.protocol, cost.channels) == (GLOO_OPS[op], "tcp", 1)
    assert simulate_plan(collective_plan(c, op, 24 * MB), c) == pytest.approx(cost.time_us, rel=0.01)


def test_a_gloo_collective_among_some_ranks_is_the_smaller_cluster_they_make():
    c = cluster(4, 4, server_machines=1)
    ranks = [5, 4, 12, 13]  # two GPUs on machines 1 and 3
    smaller = cluster(2, 2, server_machines=1)
    for op in ("all_reduce", "all_gather", "all_to_all", "push"):
        assert collective_cost(c, op, 8 * MB, ranks=ranks).time_us == collective_cost(smaller, op, 8 * MB).time_us
        plan = collective_plan(c, op, 8 * MB, ranks=ranks)
        ends = {int(e) for step in plan.steps for e in np.r_[step.src, step.dst]}
        hosts = {c.host(1), c.host(3)} if op == "push" else set()
        assert ends <= set(ranks) | hosts, op
        assert simulate_plan(plan, c) == pytest.approx(simulate_plan(collective_plan(smaller, op, 8 * MB), smaller))
    dedicated = collective_plan(c, "pull", 8 * MB, ranks=ranks, algorithm="parameter_server/dedicated")
    assert set(dedicated.steps[0].src.tolist()) == {c.host(4)}, "the server machine keeps its host"


def test_parameter_server_closed_form_is_a_lower_bound_when_servers_are_uneven():
    c = cluster(4, 2)
    for servers in (1, 3, 5, 7):
        simulated = simulate_plan(plan_parameter_server(c, 100 * MB, servers), c)
        assert simulated >= parameter_server_time_us(c, 100 * MB, servers) * (1 - 1e-9)


def test_ring_closed_form_is_the_textbook_formula_when_the_nic_is_the_bottleneck():
    c = cluster(8, 8, "nvlink2", "10gbe")
    n, size, nic = 64, 100 * MB, c.inter_node
    textbook = 2 * (n - 1) / n * size / nic.effective_bandwidth_bytes_per_us + 2 * (n - 1) * nic.latency_us
    assert ring_allreduce_time_us(c, size) == pytest.approx(textbook)


def test_start_time_does_not_change_a_duration():
    c = cluster(4, 2)
    plan = plan_ring_allreduce(c, 10 * MB)
    assert simulate_plan(plan, c, start_us=12345.0) == pytest.approx(simulate_plan(plan, c))


# -- sharing -------------------------------------------------------------------------------------


class TestSharing:
    @pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "parameter_server"])
    def test_two_concurrent_allreduces_take_about_twice_as_long_as_one(self, algorithm):
        c = cluster(4, 4)
        plan = plan_allreduce(c, 200 * MB, algorithm)
        alone = simulate_plan(plan, c)
        together = run_together(c, [plan, plan])
        assert together[0] == together[1]
        assert 1.9 * alone <= together[0] <= 2.0 * alone

    def test_concurrent_rings_pay_latency_once_and_bandwidth_twice(self):
        c = cluster(4, 4)
        size = 100 * MB
        together = run_together(c, [plan_ring_allreduce(c, size)] * 2)[0]
        latency_only = ring_allreduce_time_us(c, 0.0)
        alone = ring_allreduce_time_us(c, size)
        assert together == pytest.approx(latency_only + 2 * (alone - latency_only), rel=1e-6)

    def test_a_later_allreduce_slows_the_earlier_only_while_they_overlap(self):
        c = cluster(4, 4)
        plan = plan_ring_allreduce(c, 100 * MB)
        alone = simulate_plan(plan, c)
        first, second = run_together(c, [plan, plan], start_us=[0.0, alone / 2])
        assert alone < first < 2 * alone
        assert second > first and second < alone / 2 + 2 * alone

    def test_transfers_on_different_links_do_not_interfere(self):
        c = Cluster(2, 4, Link(1000.0, 0.0), Link(100.0, 0.0))
        env = simpy.Environment()
        network = Network(env, c)
        a = network.transfer(0, 1, 1000.0)  # GPU port 0 -> 1
        b = network.transfer(2, 3, 1000.0)  # GPU port 2 -> 3
        c_ = network.transfer(4, 5, 1000.0)  # on machine 1
        env.run()
        assert a.value == b.value == c_.value == pytest.approx(1.0)

    def test_a_gpu_sending_to_two_peers_splits_its_port(self):
        c = Cluster(1, 4, Link(1000.0, 0.0), Link(100.0, 0.0))
        env = simpy.Environment()
        network = Network(env, c)
        done = network.transfer_all([0, 0], [1, 2], 1000.0)
        env.run()
        assert done.value == pytest.approx(2.0)

    def test_egress_and_ingress_are_separate_capacities(self):
        c = Cluster(2, 1, Link(1000.0, 0.0), Link(100.0, 0.0))
        env = simpy.Environment()
        network = Network(env, c)
        done = network.transfer_all([0, 1], [1, 0], 100.0)  # both directions at once
        env.run()
        assert done.value == pytest.approx(1.0)

    def test_a_transfer_gets_the_smaller_of_its_fair_shares_and_leftovers_go_to_others(self):
        # machine 0 sends to 1 and 2; machines 3 and 4 also send to 2. Ingress of 2 is split three
        # ways (B/3 each), so 0->2 uses only B/3 of 0's egress and 0->1 gets the other 2B/3.
        c = Cluster(5, 1, Link(1000.0, 0.0), Link(300.0, 0.0))
        env = simpy.Environment()
        network = Network(env, c)
        to_1 = network.transfer(0, 1, 200.0)
        to_2 = network.transfer_all([0, 3, 4], [2, 2, 2], 100.0)
        env.run()
        assert to_1.value == pytest.approx(1.0)  # 200 bytes at 200 bytes/us
        assert to_2.value == pytest.approx(1.0)  # 100 bytes at 100 bytes/us

    def test_rates_are_recomputed_when_a_transfer_joins_or_leaves(self):
        c = Cluster(2, 1, Link(1000.0, 0.0), Link(100.0, 0.0))
        env = simpy.Environment()
        network = Network(env, c)
        ends = {}

        def send(name, start):
            yield env.timeout(start)
            ends[name] = yield network.transfer(0, 1, 100.0)

        env.process(send("first", 0.0))
        env.process(send("second", 0.5))  # first is half done
        env.run()
        assert ends["first"] == pytest.approx(1.5)  # last 50 bytes at 50 bytes/us
        assert ends["second"] == pytest.approx(2.0)  # 50 bytes at 50, then 50 alone at 100

    def test_latency_is_paid_once_per_transfer(self):
        c = Cluster(2, 2, Link(1000.0, 2.0), Link(100.0, 10.0))
        env = simpy.Environment()
        network = Network(env, c)
        empty = network.transfer(0, 2, 0.0)
        remote = network.transfer(1, 3, 100.0)
        local = network.transfer(0, 1, 1000.0)
        itself = network.transfer(1, 1, 5000.0)
        env.run()
        assert (empty.value, remote.value, local.value, itself.value) == pytest.approx((10.0, 11.0, 3.0, 0.0))

    def test_fair_rates_by_progressive_filling(self):
        capacity = np.array([300.0, 300.0, 90.0, 1000.0])
        rates = fair_rates(capacity, np.array([0, 0, 1]), np.array([3, 2, 2]))
        assert rates == pytest.approx([255.0, 45.0, 45.0])

    def test_the_network_counts_nic_bytes(self):
        c = cluster(4, 2)
        env = simpy.Environment()
        network = Network(env, c)
        plan = plan_ring_allreduce(c, 80 * MB)
        env.run(until=network.execute(plan))
        egress, ingress = network.nic_bytes()
        expected = nic_traffic(plan, c)
        assert np.allclose(egress, expected.egress_bytes) and np.allclose(ingress, expected.ingress_bytes)

    def test_unknown_endpoints_are_refused(self):
        c = cluster(2, 2)
        network = Network(simpy.Environment(), c)
        with pytest.raises(TopologyError, match="^transfer: endpoint 99 does not exist"):
            network.transfer(0, 99, 1.0)


# -- monotonicity --------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "parameter_server"])
def test_more_bandwidth_is_never_slower(algorithm):
    previous = np.inf
    for nic in ("10gbe", "20gbe", "25gbe", "40gbe", "100gbe"):
        c = cluster(8, 4, "pcie3", nic)
        duration = simulate_plan(plan_allreduce(c, 50 * MB, algorithm), c)
        assert duration <= previous * (1 + 1e-12)  # equal when the link is not the bottleneck
        previous = duration
    previous = np.inf
    for intra in ("pcie3", "pcie4", "nvlink2", "nvlink3"):
        c = cluster(8, 4, intra, "100gbe")
        duration = simulate_plan(plan_allreduce(c, 50 * MB, algorithm), c)
        assert duration <= previous * (1 + 1e-12)  # equal when the link is not the bottleneck
        previous = duration


def test_steps_are_data():
    step = Step.of([(0, 1, 10.0), (1, 0, 10.0)])
    assert step.transfers() == [(0, 1, 10.0), (1, 0, 10.0)]
    assert step.total_bytes == 20.0
    with pytest.raises(ValueError):
        step.src[0] = 5  # plans are immutable; identical steps share arrays
    with pytest.raises(TopologyError, match="^step: "):
        Step([0], [1], [-1.0])


# -- speed ---------------------------------------------------------------------------------------


def test_a_512_gpu_ring_allreduce_simulates_in_well_under_a_second():
    c = cluster(64, 8)
    plan = plan_ring_allreduce(c, 100 * MB)
    start = time.perf_counter()
    duration = simulate_plan(plan, c)
    wall_s = time.perf_counter() - start
    assert duration == pytest.approx(ring_allreduce_time_us(c, 100 * MB), rel=0.01)
    assert wall_s < 0.5, f"{wall_s:.2f} s for {plan.n_transfers} transfers"
