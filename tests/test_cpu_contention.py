"""CPU workers whose own core drives communication: transfers overlapping compute run slower,
and compute overlapping transfers runs slower (``Link.comm_slowdown`` / ``compute_slowdown``,
measured by ``whatif lab calibrate``).

On the wide MLP captured here (75.6 MB of gradients, backward overlapping their all-reduce),
the contended prediction must lie between the uncontended one and the one that slows every
transfer and every CPU task by the whole factor. Horovod's cycle makes its predictions move by
up to a cycle either way when the gradients' timing shifts (which fuse together changes), so
there "slower" means "not faster by more than one cycle".
"""

from __future__ import annotations

import pytest

from whatif.predict import steady_median
from whatif.report.cluster import cluster_breakdown
from whatif.report.iterations import iteration_report
from whatif.sim.distributed import ClusterConfig, simulate_cluster
from whatif.sim.frameworks import FrameworkOptions
from whatif.topology import Cluster, TopologyError

SLACK_MS = {"horovod": FrameworkOptions().cycle_time_us / 1e3, "ddp": 0.0}


def predict(wide_mlp, framework: str, comm: float = 1.0, compute: float = 1.0, machines: int = 2, gpus: int = 1):
    study, worker, gradients = wide_mlp
    link = {"bandwidth": "1Gbps", "latency": "100us", "cpu_contention": {"comm": comm, "compute": compute}}
    cluster = Cluster.from_config({"machines": machines, "gpus_per_machine": gpus, "intra_node": link, "inter_node": link})
    run = simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster, framework))
    report = iteration_report(run.schedule, study.iterations, run.worker0)
    breakdown = cluster_breakdown(run, report)
    return steady_median(report["predicted_ms"]), steady_median(breakdown["comm_ms"]), steady_median(breakdown["compute_ms"])


@pytest.mark.parametrize("framework", ["horovod", "ddp"])
def test_a_slower_transfer_on_a_busy_core_slows_the_iteration_by_at_most_the_whole_factor(wide_mlp, framework):
    free_ms, comm_ms, _ = predict(wide_mlp, framework)
    contended_ms, _, _ = predict(wide_mlp, framework, comm=1.5)
    assert free_ms - SLACK_MS[framework] < contended_ms <= free_ms + 0.5 * comm_ms + SLACK_MS[framework] + 1e-6


@pytest.mark.parametrize("framework", ["horovod", "ddp"])
def test_slower_compute_during_transfers_slows_the_iteration_by_at_most_the_whole_factor(wide_mlp, framework):
    free_ms, _, compute_ms = predict(wide_mlp, framework)
    contended_ms, _, _ = predict(wide_mlp, framework, compute=1.5)
    assert free_ms - SLACK_MS[framework] <= contended_ms <= free_ms + 0.5 * compute_ms + SLACK_MS[framework] + 1e-6


def test_contention_grows_with_its_factor(wide_mlp):
    times = [predict(wide_mlp, "ddp", comm=f, compute=f)[0] for f in (1.0, 1.2, 1.5, 2.0)]
    assert times == sorted(times) and times[0] < times[-1]


def test_inside_one_machine_the_loopback_links_contention_applies(wide_mlp):
    study, worker, gradients = wide_mlp
    nic_only = Cluster.from_config({
        "machines": 1, "gpus_per_machine": 2, "intra_node": {"bandwidth": "1Gbps", "latency": "100us"},
        "inter_node": {"bandwidth": "1Gbps", "latency": "100us", "cpu_contention": {"comm": 2.0, "compute": 2.0}},
    })
    run = simulate_cluster(worker, gradients, study.iterations, ClusterConfig(nic_only, "ddp"))
    unaffected = steady_median(iteration_report(run.schedule, study.iterations, run.worker0)["predicted_ms"])
    assert unaffected == pytest.approx(predict(wide_mlp, "ddp", machines=1, gpus=2)[0], rel=1e-9)
    assert predict(wide_mlp, "ddp", comm=2.0, compute=2.0, machines=1, gpus=2)[0] > unaffected


@pytest.mark.parametrize("contention, key", [
    ({"comm": 0.5}, "cpu_contention.comm"),
    ({"compute": "fast"}, "cpu_contention.compute"),
    ({"comms": 1.2}, "cpu_contention"),
    (1.2, "cpu_contention"),
])
def test_a_contention_factor_below_one_or_misspelt_is_refused_naming_the_key(contention, key):
    with pytest.raises(TopologyError) as error:
        Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": "pcie3",
                             "inter_node": {"bandwidth": "1Gbps", "latency": "1us", "cpu_contention": contention}})
    assert key in str(error.value)
