"""Data-parallel training on a cluster (``simulate_cluster``): bounds and orderings that any
faithful prediction respects, on the real ResNet-50 trace.

Each configuration is simulated as ``whatif predict`` does (whatif/pipeline.py): the worker graph
is the trace's graph without its own communication kernels, the gradients are those of the
trace, and the iteration time is the steady-state median (``steady_median``) of worker 0's
iterations. Configurations are simulated once per module and shared by the tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from trace_corpus import BUNDLED, RESNET50, V100_1GPU
from whatif import GraphError
from whatif.report.iterations import steady_median
from whatif.report.cluster import cluster_breakdown
from whatif.report.iterations import iteration_report
from whatif.sim.distributed import ClusterConfig, ClusterSchedule, Straggler, _Asked, simulate_cluster
from whatif.sim.engine import Schedule
from whatif.sim.frameworks import FrameworkOptions
from whatif.sim.gradients import find_gradients
from whatif.sim.graph import EdgeKind, TaskKind
from whatif.topology import Cluster

VGG13 = "triosim-vgg13-h100/vgg13_bs512_iter41.json.gz"  # GPU-bound, AccumulateGrad shapes
BANDWIDTHS_GBPS = (10, 20, 40, 100)
CYCLE_MS = FrameworkOptions().cycle_time_us / 1e3  # Horovod's default 5 ms


def cluster(machines: int, gpus: int, gbps: int) -> Cluster:
    """Machines of NVLink-2 GPUs (V100, as the trace) joined by ``gbps`` Ethernet NICs (presets)."""
    return Cluster.from_config(
        {"machines": machines, "gpus_per_machine": gpus, "intra_node": "nvlink2", "inter_node": f"{gbps}gbe"}
    )


@dataclass
class Prediction:
    iteration_ms: float
    comm_ms: float
    compute_ms: float
    exposed_comm_ms: float
    report: pd.DataFrame
    run: ClusterSchedule


class Predictor:
    """One trace's worker graph and gradients, and every configuration simulated on it so far."""

    def __init__(self, study):
        self.study = study
        self.worker = study.graph.copy()
        self.worker.remove(self.worker.select(kinds=[TaskKind.COMM]))
        self.gradients = find_gradients(self.worker, study.iterations)
        self.cache: dict = {}

    def __call__(self, machines, gpus, gbps, framework="horovod", policy="fifo", **config) -> Prediction:
        key = (machines, gpus, gbps, framework, policy, tuple(sorted(config.items())))
        if key not in self.cache:
            self.cache[key] = self.simulate(
                ClusterConfig(cluster(machines, gpus, gbps), framework, policy, **config)
            )
        return self.cache[key]

    def simulate(self, config: ClusterConfig) -> Prediction:
        graph = self.study.graph if config.workers == 1 else self.worker
        run = simulate_cluster(graph, self.gradients, self.study.iterations, config)
        report = iteration_report(run.schedule, self.study.iterations, run.worker0)
        breakdown = cluster_breakdown(run, report)
        return Prediction(
            steady_median(report["predicted_ms"]),
            steady_median(breakdown["comm_ms"]),
            steady_median(breakdown["compute_ms"]),
            steady_median(breakdown["exposed_comm_ms"]),
            report,
            run,
        )


@pytest.fixture(scope="module")
def resnet50(traces) -> Predictor:
    return Predictor(traces.study(RESNET50))


@pytest.fixture(scope="module")
def one_gpu(resnet50) -> Prediction:
    return resnet50(1, 1, 10)


def comm_of_iteration(run: ClusterSchedule, iteration: int) -> np.ndarray:
    """The communication tasks of one iteration, in the order the framework queued them."""
    context = run.schedule.graph.tasks["context"].astype(str).to_numpy()
    return np.asarray([t for t in run.comm_tasks if context[t].startswith(f"iteration {iteration} >")], dtype=np.int64)


def ready_us(schedule: Schedule, tasks: np.ndarray) -> np.ndarray:
    """When each task's last predecessor ended (plus the edge's lag) in ``schedule``."""
    edges = schedule.graph.edges
    incoming = edges[edges["dst"].isin(tasks)]
    ready = pd.Series(schedule.end_us[incoming["src"].to_numpy()] + incoming["lag_us"].to_numpy())
    return ready.groupby(incoming["dst"].to_numpy()).max().reindex(tasks).to_numpy()


# -- bandwidth, workers ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 1), (3, 1), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_more_bandwidth_never_predicts_a_slower_ddp_iteration(resnet50, shape):
    times = [resnet50(*shape, gbps, "ddp").iteration_ms for gbps in BANDWIDTHS_GBPS]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), dict(zip(BANDWIDTHS_GBPS, times))
    assert times[0] > times[-1] or shape == (2, 1), "10 Gbps is communication-bound beyond two machines"


@pytest.mark.parametrize("shape", [(2, 1), (3, 1), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_more_bandwidth_never_predicts_a_slower_horovod_iteration_by_more_than_a_cycle(resnet50, shape):
    """Horovod's background loop starts all-reduces only on its 5 ms ticks, fusing what is ready
    at each: a faster network changes which tensors each tick finds ready, so the last all-reduce
    of a step can just miss a tick it made before, and the steady-state median can be another of
    the (unequal) iterations. That costs up to one cycle; beyond it more bandwidth never costs."""
    times = [resnet50(*shape, gbps, "horovod").iteration_ms for gbps in BANDWIDTHS_GBPS]
    assert all(b <= a + CYCLE_MS for a, b in zip(times, times[1:])), dict(zip(BANDWIDTHS_GBPS, times))
    assert times[0] > times[-1] + CYCLE_MS, "10 Gbps is communication-bound for Horovod"


@pytest.mark.parametrize("shape", [(4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_without_cycle_ticks_more_bandwidth_never_predicts_a_slower_horovod_iteration(resnet50, shape):
    options = FrameworkOptions(cycle_time_us=1.0)
    times = [resnet50(*shape, gbps, "horovod", options=options).iteration_ms for gbps in BANDWIDTHS_GBPS]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), dict(zip(BANDWIDTHS_GBPS, times))


# chains of clusters, each with more workers than the one before it
MORE_WORKERS = [
    [(1, 1), (2, 1), (3, 1), (4, 1)],
    [(1, 2), (2, 2), (4, 2)],
    [(1, 1), (1, 2)],
    [(2, 1), (2, 2)],
    [(4, 1), (4, 2)],
]
FEWER_CHAINS = [[(1, 1), (2, 1), (4, 1)], [(2, 1), (2, 2)]]


@pytest.mark.parametrize("framework", ["horovod", "ddp", "ps"])
def test_more_workers_never_predict_less_communication(resnet50, framework):
    chains = MORE_WORKERS if framework != "ps" else FEWER_CHAINS  # a parameter server is slow to simulate
    for chain in chains:
        comm = [resnet50(m, g, 10, framework).comm_ms for m, g in chain]
        assert all(b >= a * (1 - 1e-9) for a, b in zip(comm, comm[1:])), dict(zip(chain, comm))
    assert resnet50(1, 1, 10, framework).comm_ms == 0.0
    assert resnet50(4, 1, 10, framework).comm_ms > resnet50(2, 1, 10, framework).comm_ms


@pytest.mark.parametrize("framework", ["horovod", "ddp", "ps"])
def test_every_gradient_byte_is_sent_once_per_iteration(resnet50, framework):
    run = resnet50(2, 1, 10, framework).run
    assert run.bytes_per_iteration == pytest.approx(resnet50.gradients.bytes_per_iteration(), rel=1e-12)
    messages = len(resnet50.gradients.of_iteration(0))
    if framework == "horovod":
        assert run.messages_per_iteration == messages
    elif framework == "ddp":
        assert 1 < run.messages_per_iteration < messages / 10, "buckets"
    else:
        assert run.messages_per_iteration > 2 * messages, "push and pull of every partition"


# -- the fast path, stragglers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "machines, gpus, framework, policy",
    [(2, 2, "horovod", "fifo"), (2, 2, "ddp", "p3"), (2, 1, "ps", "fifo")],
)
def test_one_worker_and_the_network_predict_what_every_worker_would(resnet50, machines, gpus, framework, policy):
    """Identical workers compute identical schedules, so simulating one of them with the network
    (the fast path) gives exactly what replicating all of them gives."""
    fast = resnet50(machines, gpus, 10, framework, policy)
    full = resnet50(machines, gpus, 10, framework, policy, replicate=True)
    workers = machines * gpus
    assert len(full.run.schedule.graph.tasks) > workers * len(resnet50.worker.tasks), "really replicated"
    assert len(fast.run.schedule.graph.tasks) < 2 * len(resnet50.worker.tasks)
    np.testing.assert_allclose(full.report["predicted_ms"], fast.report["predicted_ms"], rtol=1e-9, atol=0)
    assert full.comm_ms == pytest.approx(fast.comm_ms, rel=1e-9)


@pytest.mark.parametrize(
    "framework, policy, stragglers, gpu_slowdowns",
    [
        ("horovod", "fifo", (Straggler(machine=1, slowdown=1.5),), ()),
        ("ddp", "fifo", (Straggler(machine=0, gpu_slowdown=1.2),), (1.0, 1.3, 1.1, 0.9)),
        ("ps", "p3", (Straggler(machine=1, slowdown=1.2),), (1.25, 1.0, 1.1, 1.0)),
    ],
)
def test_the_deciding_workers_predict_what_every_worker_would(resnet50, framework, policy, stragglers, gpu_slowdowns):
    """Workers that differ: worker 0 and the kinds no other kind dominates, simulated with the
    network, give exactly what replicating all four gives, worker 0's iterations and the
    communication alike."""
    config = dict(stragglers=stragglers, gpu_slowdowns=gpu_slowdowns)
    fast = resnet50(2, 2, 10, framework, policy, **config)
    full = resnet50(2, 2, 10, framework, policy, replicate=True, **config)
    n = len(resnet50.worker.tasks)
    assert len(full.run.schedule.graph.tasks) > 4 * n, "really replicated"
    assert len(fast.run.schedule.graph.tasks) < 3 * n, "at most two workers simulated"
    np.testing.assert_array_equal(full.report["predicted_ms"], fast.report["predicted_ms"])
    assert full.comm_ms == fast.comm_ms
    comm_full, comm_fast = full.run.schedule, fast.run.schedule
    np.testing.assert_array_equal(comm_full.start_us[full.run.comm_tasks], comm_fast.start_us[fast.run.comm_tasks])


@pytest.mark.parametrize("framework", ["horovod", "ddp"])
def test_a_straggling_machine_slows_the_iteration_within_bounds(resnet50, one_gpu, framework):
    """Machine 1 of 2x2 runs 1.5x slower. Everyone waits for it, so the iteration is slower than
    without it, and no faster than its GPU alone needs (1.5x the 1x1 GPU time); and it is no
    slower than the straggler's own 1x1 iteration stretched 1.5x plus all the communication."""
    even = resnet50(2, 2, 10, framework)
    slow = resnet50(2, 2, 10, framework, stragglers=(Straggler(machine=1, slowdown=1.5),))
    assert slow.iteration_ms > even.iteration_ms
    assert slow.iteration_ms >= 1.5 * one_gpu.compute_ms
    assert slow.iteration_ms <= 1.5 * one_gpu.iteration_ms + slow.comm_ms


def test_a_gpu_straggler_changes_nothing_on_a_cpu_trace(traces):
    predict = Predictor(traces.study(BUNDLED))
    even = predict(2, 1, 10)
    slow = predict(2, 1, 10, stragglers=(Straggler(machine=1, gpu_slowdown=2.0),))
    assert slow.iteration_ms == pytest.approx(even.iteration_ms, rel=1e-9)
    assert predict(2, 1, 10, stragglers=(Straggler(machine=1, slowdown=2.0),)).iteration_ms > even.iteration_ms


# -- policies --------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["ddp", "horovod"])
def test_p3_is_never_slower_than_fifo_when_communication_bound(resnet50, framework):
    """ResNet-50 on 4 machines at 10 Gbps: 102 MB of gradients take longer than the backward
    pass, so the order of the messages matters; P3 sends the layers the next forward pass needs
    first and overlaps the rest with it."""
    fifo = resnet50(4, 1, 10, framework, "fifo")
    p3 = resnet50(4, 1, 10, framework, "p3")
    assert fifo.exposed_comm_ms > 1.0, "the setting is communication-bound"
    assert p3.iteration_ms <= fifo.iteration_ms


@pytest.mark.parametrize("gbps", [10, 100])
def test_horovod_fuses_ready_gradients_once_per_cycle(resnet50, gbps):
    """With Horovod's 5 ms cycle the first all-reduce of an iteration starts once the first
    gradient is ready on the workers, and within a cycle of it; later fused all-reduces start a
    cycle or more apart; each holds at most the 64 MiB fusion buffer (or one bigger tensor)."""
    options = FrameworkOptions()
    prediction = resnet50(4, 1, gbps, "horovod")
    schedule = prediction.run.schedule
    for it in range(len(resnet50.study.iterations)):
        gradients = resnet50.gradients.of_iteration(it)
        comm = comm_of_iteration(prediction.run, it)
        assert len(comm) == len(gradients)
        first_ready = ready_us(schedule, comm).min()
        starts = schedule.start_us[comm]
        batches = np.unique(starts)
        assert first_ready <= batches[0] <= first_ready + options.cycle_time_us
        assert (np.diff(batches) >= options.cycle_time_us - 1e-6).all()
        assert len(batches) < len(gradients) / 10, "tensors are fused"
        nbytes = np.asarray([g.nbytes for g in gradients])
        for start in batches:
            members = starts == start
            assert (schedule.end_us[comm][members] == schedule.end_us[comm][members][0]).all(), "one all-reduce"
            assert nbytes[members].sum() <= options.fusion_buffer_bytes or members.sum() == 1


def test_an_unknown_policy_is_refused(resnet50):
    config = ClusterConfig(cluster(2, 1, 10), "ddp", "lifo")
    with pytest.raises(GraphError, match="lifo"):
        simulate_cluster(resnet50.worker, resnet50.gradients, resnet50.study.iterations, config)


# -- a grid's configurations share what they can -------------------------------------------------------


def test_a_configuration_the_inter_node_link_cannot_change_reuses_the_schedule_simulated(resnet50):
    """One machine of two GPUs communicates over NVLink alone: at 40 Gbps between machines it
    has the durations and prices of 10 Gbps, and the schedule kept then is its own, the one it
    would simulate; two machines at 40 Gbps are simulated."""
    args = (resnet50.worker, resnet50.gradients, resnet50.study.iterations)
    laid: dict = {}
    at_10 = simulate_cluster(*args, ClusterConfig(cluster(1, 2, 10)), laid)
    at_40 = simulate_cluster(*args, ClusterConfig(cluster(1, 2, 40)), laid)
    assert at_40.schedule is at_10.schedule
    alone = simulate_cluster(*args, ClusterConfig(cluster(1, 2, 40)))  # nothing laid: simulated
    np.testing.assert_array_equal(alone.schedule.start_us, at_40.schedule.start_us)
    np.testing.assert_array_equal(alone.schedule.end_us, at_40.schedule.end_us)
    pd.testing.assert_frame_equal(alone.collectives, at_40.collectives, check_exact=True)
    two_at_10 = simulate_cluster(*args, ClusterConfig(cluster(2, 1, 10)), laid)
    two_at_40 = simulate_cluster(*args, ClusterConfig(cluster(2, 1, 40)), laid)
    assert two_at_40.schedule is not two_at_10.schedule
    assert two_at_40.schedule.makespan_us < two_at_10.schedule.makespan_us


def test_a_kept_schedule_is_not_reused_where_a_price_asked_answers_otherwise(resnet50):
    args = (resnet50.worker, resnet50.gradients, resnet50.study.iterations)
    laid: dict = {}
    simulate_cluster(*args, ClusterConfig(cluster(1, 2, 10)), laid)
    (built,) = laid.values()
    durations, answers, schedule = built.kept[0]
    asked = [(phase, nbytes, value) for phase, of_phase in answers.items() for nbytes, value in of_phase.items()]
    assert asked, "the policy priced its fused batches"
    phase, nbytes, value = asked[-1]

    def prices(otherwise: float) -> dict:
        return {p: _Asked(lambda b, p=p: otherwise if (p, b) == (phase, nbytes) else answers[p].get(b, value))
                for p in answers}

    assert built.simulated_already(durations, prices(value)) is schedule
    assert built.simulated_already(durations, prices(value * 1.5)) is None
    assert built.simulated_already(durations * 1.5, prices(value)) is None


# -- communication waits for the GPU -----------------------------------------------------------------


def last_kernel_launched_before(graph, task: int) -> int:
    """The GPU task that the thread of ``task`` launched last before ``task`` ended: in stream
    order, the gradient that ``task`` marks ready exists on the GPU only once that has run."""
    tasks, edges = graph.tasks, graph.edges
    launch = edges[edges["kind"] == int(EdgeKind.LAUNCH)]
    src, dst = launch["src"].to_numpy(), launch["dst"].to_numpy()
    resource = tasks["resource"].astype(str).to_numpy()
    end = tasks["measured_end_us"].to_numpy()
    mine = np.flatnonzero((resource[src] == resource[task]) & (end[src] <= end[task]))
    return int(dst[mine[np.argmax(end[src[mine]])]])


@pytest.mark.parametrize("name", [VGG13, V100_1GPU], ids=["vgg13 AccumulateGrad", "v100 DDP buckets"])
def test_a_gradient_is_sent_only_after_the_gpu_has_computed_it(traces, name):
    """On a GPU-bound trace the CPU runs tens of ms ahead of the GPU: an AccumulateGrad (or DDP's
    launch of a bucket) ends long before the kernels computing that gradient have run. An
    all-reduce reads the gradient on the GPU, so it starts only after those kernels."""
    predict = Predictor(traces.study(name))
    run = predict(2, 1, 10, "ddp").run
    schedule: Schedule = run.schedule
    early_ms = []
    for it in range(len(predict.study.iterations)):
        kernels = {g.ready_task: last_kernel_launched_before(predict.worker, g.ready_task)
                   for g in predict.gradients.of_iteration(it)}
        comm = comm_of_iteration(run, it)
        graph_edges = schedule.graph.edges
        for c in comm:
            ready = graph_edges.loc[graph_edges["dst"] == c, "src"].to_numpy()
            gpu_ready = max(schedule.end_us[kernels[r]] for r in ready if r in kernels)
            early_ms.append((gpu_ready - schedule.start_us[c]) / 1e3)
    assert max(early_ms) <= 1e-6, f"an all-reduce started up to {max(early_ms):.1f} ms before its gradient was computed"


# -- speed ---------------------------------------------------------------------------------------


def test_a_512_gpu_cluster_is_predicted_in_seconds(resnet50):
    # A speed check, not a behaviour: the target is 64 machines x 8 GPUs of ResNet-50 at
    # 10 Gbps in under 5 s on the fast path (one worker graph plus the network).
    config = ClusterConfig(cluster(64, 8, 10), "horovod", "fifo")
    started = time.perf_counter()
    run = simulate_cluster(resnet50.worker, resnet50.gradients, resnet50.study.iterations, config)
    elapsed = time.perf_counter() - started
    assert len(run.schedule.graph.tasks) < 2 * len(resnet50.worker.tasks), "the fast path"
    assert elapsed < 5.0
