"""DDP and Horovod copy the gradients on a CPU worker's core (``sim/frameworks/copies.py``): the
copies make an iteration slower by at most the passes they add, DDP's copies back wait for
every all-reduce of their iteration and the optimizer waits for them, and a GPU trace, whose
copies are kernels, gets none.

On the wide MLP captured here (75.6 MB of gradients), over a network without CPU contention,
so that the bounds are exact. Horovod's predictions may move by up to a cycle either way when
the gradients' timing shifts (which fuse together changes).
"""

from __future__ import annotations

import numpy as np
import pytest

from trace_corpus import V100_1GPU
from whatif.report.iterations import steady_median
from whatif.report.iterations import iteration_report
from whatif.sim.distributed import ClusterConfig, simulate_cluster
from whatif.sim.frameworks import FrameworkOptions
from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
from whatif.sim.frameworks.horovod import FUSED_PASSES
from whatif.topology import Cluster

CYCLE_MS = FrameworkOptions().cycle_time_us / 1e3


def run(wide_mlp, framework: str, rate):
    study, worker, gradients = wide_mlp
    link = {"bandwidth": "1Gbps", "latency": "100us"}
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": link, "inter_node": link})
    result = simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster, framework, pass_bytes_per_us=rate))
    return result, steady_median(iteration_report(result.schedule, study.iterations, result.worker0)["predicted_ms"])


def test_the_pass_rate_is_what_the_cpu_optimizer_streams_in_place(wide_mlp):
    study, _, _ = wide_mlp
    rate = pass_rate_bytes_per_us(study.graph)
    assert rate is not None and 1e3 < rate < 1e5  # between 1 and 100 GB/s on one CPU core


def test_a_gpu_trace_has_no_pass_rate(traces):
    study = traces.study(V100_1GPU)
    assert study.trace.has_gpu
    assert pass_rate_bytes_per_us(study.graph) is None


@pytest.mark.parametrize("framework, passes, slack_ms", [("ddp", 2, 0.0), ("horovod", FUSED_PASSES, CYCLE_MS)])
def test_the_copies_slow_an_iteration_by_at_most_their_passes(wide_mlp, framework, passes, slack_ms):
    study, _, gradients = wide_mlp
    rate = pass_rate_bytes_per_us(study.graph)
    _, free_ms = run(wide_mlp, framework, None)
    _, copied_ms = run(wide_mlp, framework, rate)
    passes_ms = passes * gradients.bytes_per_iteration() / rate / 1e3
    assert free_ms - slack_ms <= copied_ms <= free_ms + passes_ms + slack_ms + 1e-6


def test_ddps_copy_back_is_never_hidden(wide_mlp):
    study, _, _ = wide_mlp
    assert run(wide_mlp, "ddp", pass_rate_bytes_per_us(study.graph))[1] > run(wide_mlp, "ddp", None)[1]


def test_ddp_copies_its_buckets_back_after_every_all_reduce_and_before_the_optimizer(wide_mlp):
    study, _, _ = wide_mlp
    result, _ = run(wide_mlp, "ddp", pass_rate_bytes_per_us(study.graph))
    tasks, schedule = result.schedule.graph.tasks, result.schedule
    names = tasks["name"].astype(str).to_numpy()
    backs = np.flatnonzero(names == "DDP: copy buckets back into gradients")
    copies_in = np.flatnonzero(names == "DDP: copy gradient into bucket")
    assert len(backs) == len(study.iterations) and len(copies_in) > 0
    edges = result.schedule.graph.edges
    for back in backs.tolist():
        waits_for = edges.loc[edges["dst"] == back, "src"].to_numpy()
        comm = np.intersect1d(waits_for, result.comm_tasks)
        assert len(comm) > 0
        assert schedule.start_us[back] >= schedule.end_us[comm].max() - 1e-6
        for consumer in edges.loc[edges["src"] == back, "dst"].tolist():
            assert schedule.start_us[consumer] >= schedule.end_us[back] - 1e-6
