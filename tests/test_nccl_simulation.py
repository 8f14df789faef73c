"""Specification of the cluster simulation's communication on an NCCL cluster: every message is
priced by ``topology.collective_cost`` on the cluster's backend, NCCL's choice is recorded on
each communication task, and a cluster of two links keeps today's models.

On the real ResNet-50 V100 trace (102 MB of gradients), as ``whatif predict`` simulates it.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from trace_corpus import RESNET50
from whatif.report.cluster import collective_mix, collective_notes
from whatif.sim.distributed import ClusterConfig, simulate_cluster
from whatif.sim.gradients import find_gradients
from whatif.sim.graph import TaskKind
from whatif.topology import Cluster, Network, collective_cost, collective_plan, ring_allreduce_time_us, simulate_plan
from whatif.topology.nccl.graphs import Comm
from whatif.topology.nccl.model import choose


def dgx_v100(machines: int, **keys) -> Cluster:
    return Cluster.from_config({"machine": "dgx_v100", "machines": machines, **keys})


@pytest.fixture(scope="module")
def resnet50(traces):
    study = traces.study(RESNET50)
    worker = study.graph.copy()
    worker.remove(worker.select(kinds=[TaskKind.COMM]))
    gradients = find_gradients(worker, study.iterations)

    def run(cluster: Cluster, framework: str = "ddp", **config):
        return simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster, framework, **config))

    return run


def durations(run) -> np.ndarray:
    return run.schedule.end_us[run.comm_tasks] - run.schedule.start_us[run.comm_tasks]


def test_a_ddp_bucket_on_an_nccl_cluster_costs_what_collective_cost_says_with_nccls_choice(resnet50):
    cluster = dgx_v100(2)
    run = resnet50(cluster)
    collectives = run.collectives.loc[run.comm_tasks]
    comm = Comm.of(cluster.fabric)
    for took, c in zip(durations(run), collectives.itertuples()):
        assert c.collective_bytes == c.task_bytes, "DDP's buckets are each one all-reduce"
        cost = collective_cost(cluster, "all_reduce", c.collective_bytes)
        assert took == pytest.approx(cost.time_us, rel=1e-12)
        assert (c.op, c.algorithm, c.protocol, c.channels) == ("all_reduce", cost.algorithm, cost.protocol, cost.channels)
        assert c.algorithm == choose(comm, "all_reduce", c.collective_bytes).algorithm, "the algorithm NCCL's tuner picks"
    assert set(collectives["algorithm"]) <= {"ring", "tree"}, "no NVLS or CollNet on a DGX-1V"
    notes = collective_notes(run)
    first = int(run.comm_tasks[0])
    assert notes[first]["collective"].startswith(f"all_reduce of {collectives.loc[first, 'collective_bytes'] / 1e6:.4g} MB: ")


def test_a_clusters_nccl_algo_and_proto_price_every_bucket(resnet50):
    forced = dgx_v100(2, nccl={"algorithm": "ring", "protocol": "simple"})
    run = resnet50(forced)
    assert set(zip(run.collectives["algorithm"], run.collectives["protocol"])) == {("ring", "simple")}
    assert collective_mix(run) == "ring/simple 100%"
    nbytes = run.collectives.loc[run.comm_tasks, "collective_bytes"].to_numpy()
    expected = [collective_cost(dgx_v100(2), "all_reduce", b, algorithm="ring", protocol="simple").time_us for b in nbytes]
    assert np.allclose(durations(run), expected, rtol=1e-12)


def test_horovods_fused_all_reduce_is_priced_and_chosen_at_its_fused_size(resnet50):
    cluster = dgx_v100(4)
    run = resnet50(cluster, "horovod")
    collectives = run.collectives.loc[run.comm_tasks]
    fused = collectives[collectives["collective_bytes"] > collectives["task_bytes"]]
    assert len(fused), "Horovod fuses the gradients ready in one cycle"
    start, end = run.schedule.start_us, run.schedule.end_us
    for nbytes, group in fused.groupby("collective_bytes"):
        tasks = group.index.to_numpy()
        together = (start[tasks] == start[tasks[0]]) & (end[tasks] == end[tasks[0]])
        in_it = tasks[together]
        assert collectives.loc[in_it, "task_bytes"].sum() == pytest.approx(nbytes)
        cost = collective_cost(cluster, "all_reduce", nbytes)
        # end - start of times near 1e5 us: the subtraction keeps about 1e-10 us of precision
        assert end[in_it[0]] - start[in_it[0]] == pytest.approx(cost.time_us, rel=1e-9)
        assert set(collectives.loc[in_it, "algorithm"]) == {cost.algorithm}


def test_more_nics_and_one_machine_on_an_nccl_cluster(resnet50):
    one_nic, four = resnet50(dgx_v100(4, nics_per_machine=1)), resnet50(dgx_v100(4))
    assert durations(four).sum() < durations(one_nic).sum(), "four EDR NICs carry the all-reduces faster than one"
    alone, alone_one_nic = resnet50(dgx_v100(1)), resnet50(dgx_v100(1, nics_per_machine=1))
    assert np.array_equal(durations(alone), durations(alone_one_nic)), "one machine never uses a NIC"


def test_a_cluster_of_two_links_keeps_todays_ring(resnet50):
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 2, "intra_node": "nvlink2", "inter_node": "25gbe"})
    assert cluster.backend == "gloo"
    chosen, ring = resnet50(cluster), resnet50(cluster, algorithm="ring")
    assert np.array_equal(chosen.schedule.start_us, ring.schedule.start_us)
    assert np.array_equal(chosen.schedule.end_us, ring.schedule.end_us)
    nbytes = chosen.collectives.loc[chosen.comm_tasks, "collective_bytes"].to_numpy()
    assert np.allclose(durations(chosen), [ring_allreduce_time_us(cluster, b) for b in nbytes], rtol=1e-12)
    assert set(zip(chosen.collectives["algorithm"], chosen.collectives["protocol"])) == {("ring", "tcp")}


def test_a_parameter_server_on_a_fabric_crosses_its_nics_on_shared_links(resnet50):
    cluster = dgx_v100(2)
    run = resnet50(cluster, "ps")
    assert set(run.collectives["op"]) == {"push", "pull"}
    assert set(zip(run.collectives["algorithm"], run.collectives["protocol"])) == {("parameter_server", "ib")}
    # the Network fuses a machine's four EDR NICs into one link of their summed rate
    network = Network(simpy.Environment(), cluster)
    assert network.capacity_bytes_per_us[0] == pytest.approx(4 * 100e9 / 8 / 1e6)
    push = collective_plan(cluster, "push", 4e6)
    assert simulate_plan(push, cluster) == pytest.approx(collective_cost(cluster, "push", 4e6).time_us, rel=0.01)
    slower = resnet50(dgx_v100(2, nics_per_machine=1), "ps")
    assert durations(run).sum() < durations(slower).sum(), "the pushes and pulls cross the NICs"
