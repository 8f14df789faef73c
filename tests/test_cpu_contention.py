"""CPU workers whose own core drives communication: transfers overlapping compute run slower,
and compute overlapping transfers runs slower (``Link.comm_slowdown`` / ``compute_slowdown``,
measured by ``whatif lab calibrate``).

On the wide MLP captured here (75.6 MB of gradients, backward overlapping their all-reduce),
the contended prediction must lie between the uncontended one and the one that slows every
transfer and every CPU task by the whole factor. Horovod's cycle makes its predictions move by
up to a cycle either way when the gradients' timing shifts (which fuse together changes), so
there "slower" means "not faster by more than one cycle".

A Horovod worker's core is also busy while its training thread waits for an all-reduce:
``synchronize()`` polls with ``sched_yield`` (Horovod 0.28's ``WaitAndClear``), where DDP's wait
blocks.

Horovod's background loop takes ``horovod_loop`` of the core every cycle, whatever is in flight:
a Horovod worker's CPU work gets the rest of the core, and a DDP worker, which has no such
loop, is untouched.
"""

from __future__ import annotations

import pytest

from whatif.report.iterations import steady_median
from whatif.report.cluster import cluster_breakdown
from whatif.report.iterations import iteration_report
from whatif.sim.distributed import ClusterConfig, ClusterSchedule, simulate_cluster
from whatif.sim.frameworks import FrameworkOptions
from whatif.sim.graph import GraphError
from whatif.topology import Cluster, TopologyError

SLACK_MS = {"horovod": FrameworkOptions().cycle_time_us / 1e3, "ddp": 0.0}


def simulate(wide_mlp, framework: str, comm=1.0, compute: float = 1.0, machines: int = 2, gpus: int = 1,
             horovod_loop: str = "0us", options: FrameworkOptions = FrameworkOptions()):
    study, worker, gradients = wide_mlp
    contention = {"comm": comm, "compute": compute, "horovod_loop": horovod_loop}
    link = {"bandwidth": "1Gbps", "latency": "100us", "cpu_contention": contention}
    cluster = Cluster.from_config({"machines": machines, "gpus_per_machine": gpus, "intra_node": link, "inter_node": link})
    return simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster, framework, options=options))


def predict(wide_mlp, framework: str, **kwargs):
    study = wide_mlp[0]
    run = simulate(wide_mlp, framework, **kwargs)
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


def test_horovods_loop_slows_a_horovod_workers_cpu_work_by_its_share_of_the_cycle(wide_mlp):
    free_ms, _, compute_ms = predict(wide_mlp, "horovod")
    quarter_ms, _, quarter_compute_ms = predict(wide_mlp, "horovod", horovod_loop="1250us")  # a quarter of 5 ms
    assert quarter_compute_ms == pytest.approx(compute_ms / 0.75, rel=0.02)
    assert free_ms < quarter_ms <= free_ms + compute_ms / 3 + SLACK_MS["horovod"], "compute overlaps the transfers"


def test_ddp_has_no_background_loop(wide_mlp):
    assert predict(wide_mlp, "ddp", horovod_loop="1250us") == predict(wide_mlp, "ddp")


def test_a_loop_that_takes_the_whole_cycle_cannot_be_simulated(wide_mlp):
    with pytest.raises(GraphError, match="never compute"):
        predict(wide_mlp, "horovod", horovod_loop="5ms")


@pytest.mark.parametrize("contention, key", [
    ({"horovod_loop": "-3us"}, "cpu_contention.horovod_loop"),
    ({"comm": 0.5}, "cpu_contention.comm"),
    ({"comm": {"16MB": 1.5, "64MB": 0.9}}, "cpu_contention.comm.64MB"),
    ({"comm": {"-16MB": 1.5}}, "cpu_contention.comm.-16MB"),
    ({"comm": {"16 lbs": 1.5}}, "cpu_contention.comm.16 lbs"),
    ({"comm": {}}, "cpu_contention.comm"),
    ({"compute": "fast"}, "cpu_contention.compute"),
    ({"comms": 1.2}, "cpu_contention"),
    (1.2, "cpu_contention"),
])
def test_a_contention_factor_below_one_or_misspelt_is_refused_naming_the_key(contention, key):
    with pytest.raises(TopologyError) as error:
        Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": "pcie3",
                             "inter_node": {"bandwidth": "1Gbps", "latency": "1us", "cpu_contention": contention}})
    assert key in str(error.value) and "latency" not in str(error.value)


def test_a_horovod_worker_spinning_in_synchronize_slows_every_transfer_it_waits_for(wide_mlp):
    # at 1 Gbps the wide MLP's worker mostly waits for its transfers; Horovod's synchronize()
    # polls with sched_yield, so its core stays busy and every transfer runs at the busy speed
    _, free_comm_ms, _ = predict(wide_mlp, "horovod")
    _, busy_comm_ms, _ = predict(wide_mlp, "horovod", comm=2.0)
    assert busy_comm_ms == pytest.approx(2 * free_comm_ms, rel=0.05)


def test_a_ddp_worker_blocks_while_it_waits_so_only_transfers_under_backward_slow_down(wide_mlp):
    _, free_comm_ms, _ = predict(wide_mlp, "ddp")
    _, busy_comm_ms, _ = predict(wide_mlp, "ddp", comm=2.0)
    assert free_comm_ms < busy_comm_ms < 1.5 * free_comm_ms


def fused_all_reduces(run: ClusterSchedule) -> list:
    """The transfers of each all-reduce, in order: those that start and end together went as one."""
    start, end = run.schedule.start_us[run.comm_tasks], run.schedule.end_us[run.comm_tasks]
    batches: dict = {}
    for task, key in zip(run.comm_tasks.tolist(), zip(start.tolist(), end.tolist())):
        batches.setdefault(key, []).append(task)
    return [batches[key] for key in sorted(batches)]


def test_contention_makes_a_fused_all_reduce_slower_but_not_smaller(wide_mlp):
    # Horovod fuses tensors by their own bytes: a busy core slows the all-reduce, not the buffer
    free = simulate(wide_mlp, "horovod", machines=1, gpus=2)
    busy = simulate(wide_mlp, "horovod", comm=2.5, compute=1.5, machines=1, gpus=2)
    assert max(len(batch) for batch in fused_all_reduces(free)) > 1, "the wide MLP's tensors fuse"
    assert fused_all_reduces(busy) == fused_all_reduces(free)
    assert busy.schedule.makespan_us > free.schedule.makespan_us


def test_a_transfer_is_slowed_as_much_as_the_all_reduce_it_went_in(wide_mlp):
    # a slowdown only all-reduces longer than the largest tensor suffer (the lab measures one
    # that grows with the size: the scheduler favours a short one that wakes on a busy core)
    largest = max(g.nbytes for g in wide_mlp[2].of_iteration(0))
    grows = {f"{largest:.0f}B": 1.0, "64MiB": 2.0}
    unfused = FrameworkOptions(fusion_buffer_bytes=1)
    assert predict(wide_mlp, "horovod", comm=grows, options=unfused) == predict(wide_mlp, "horovod", options=unfused)
    free_ms = predict(wide_mlp, "horovod")[0]
    assert predict(wide_mlp, "horovod", comm=grows)[0] > free_ms + SLACK_MS["horovod"], "fused into up to 64 MiB"
    assert predict(wide_mlp, "horovod", comm=grows)[0] < predict(wide_mlp, "horovod", comm=2.0)[0]


def test_a_slowdown_by_size_is_read_between_its_sizes_by_log_size_and_as_the_nearest_beyond_them():
    link = {"bandwidth": "1Gbps", "latency": "1us", "cpu_contention": {"comm": {"16MB": 1.6, "4MB": 1.2}}}
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": "pcie3", "inter_node": link})
    assert cluster.inter_node.comm_slowdown_at([1e6, 4e6, 8e6, 16e6, 1e9]) == pytest.approx([1.2, 1.2, 1.4, 1.6, 1.6])
    assert cluster.inter_node.has_cpu_contention


def test_fused_bytes_sums_each_batch_as_a_groupby_would():
    """The bytes of the all-reduce each transfer went in (transfers on one queue that start and
    end together): held to pandas' groupby, bit for bit, on random batches of whole and of
    fractional bytes (pandas sums those with compensation), ties of time across queues
    included, and to its rules where a time is missing (no batch: NaN)."""
    import numpy as np
    import pandas as pd

    from whatif.sim.cpu_contention import fused_bytes

    def by_groupby(resource, start, end, nbytes):
        frame = pd.DataFrame({"resource": resource, "start": start, "end": end, "nbytes": nbytes})
        return frame.groupby(["resource", "start", "end"])["nbytes"].transform("sum").to_numpy(dtype=float)

    rng = np.random.default_rng(7)
    queues = np.array(["network", "network push", "network pull"], dtype=object)
    for fractional in (False, True):  # whole bytes, and scaled gradients' or P3 slices' fractional ones
        for _ in range(200):
            n = int(rng.integers(1, 40))
            start = rng.integers(0, 4, n).astype(float)
            end = start + rng.integers(0, 3, n)
            nbytes = rng.random(n) * 1e6 if fractional else rng.integers(1, 2**40, n).astype(float)
            resource = rng.choice(queues, n)
            assert np.array_equal(fused_bytes(resource, start, end, nbytes), by_groupby(resource, start, end, nbytes))
    start, end = np.array([0.0, np.nan, 0.0]), np.array([1.0, np.nan, 1.0])
    resource, nbytes = queues[[0, 0, 0]], np.array([1.0, 2.0, 4.0])
    assert np.array_equal(fused_bytes(resource, start, end, nbytes), by_groupby(resource, start, end, nbytes), equal_nan=True)
    assert fused_bytes(queues[:0], np.zeros(0), np.zeros(0), np.zeros(0)).shape == (0,)
