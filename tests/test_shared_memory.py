"""CPU workers that share a memory system slow each other's streaming, not their cached compute
(``sim/passes/shared_memory.py``, ``topology.SharedMemory``, measured by ``whatif lab calibrate``).

Data-parallel workers run the same step in lockstep, so where one streams memory (the optimizer
updating every parameter) its peers on the same memory system stream at the same moment, and
the bandwidth is split among them. The lab puts every worker on one box: there, the workers of
different machines share it too.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from whatif.report.iterations import steady_median
from whatif.report.iterations import iteration_report
from whatif.sim.distributed import ClusterConfig, simulate_cluster
from whatif.sim.passes.optimizations import OPTIMIZER_STEP
from whatif.sim.passes.shared_memory import MEMORY_BYTES, add_memory_bytes, operator_bytes, shared_memory_factors
from whatif.topology import Cluster, SharedMemory, TopologyError

LINK = {"bandwidth": "1Gbps", "latency": "100us"}
SHARED = {"core_bandwidth": "40GB/s", "total_bandwidth": "48GB/s"}


@pytest.fixture(scope="module")
def counted(wide_mlp):
    """The wide MLP's worker graph with each task's bytes counted."""
    study, worker, gradients = wide_mlp
    return study, add_memory_bytes(worker), gradients


def cluster(machines: int, gpus: int, among=None) -> Cluster:
    config = {"machines": machines, "gpus_per_machine": gpus, "intra_node": LINK, "inter_node": LINK}
    if among:
        config["shared_memory"] = {"among": among, **SHARED}
    return Cluster.from_config(config)


def iteration_ms(counted, machines: int, gpus: int, among=None) -> float:
    study, worker, gradients = counted
    run = simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster(machines, gpus, among), "ddp"))
    return steady_median(iteration_report(run.schedule, study.iterations, run.worker0)["predicted_ms"])


def test_an_operator_moves_its_inputs_read_and_its_first_input_written():
    assert operator_bytes("aten::clamp_min_", [[1000], []], ["float", "Scalar"]) == 8000
    lists = operator_bytes("aten::_foreach_add_", [[[1000], [500]], [[1000], [500]]], ["TensorList", "TensorList"])
    assert lists == 3 * 4 * 1500, "a tensor list counts all its tensors"
    assert operator_bytes("aten::view", [[1000], [2]], ["float", "int[]"]) == 0
    gemm = operator_bytes("aten::mm", [[64, 128], [128, 32]], ["float", "float"])
    assert gemm == 4 * (64 * 128 + 128 * 32 + 64 * 32), "a modelled family counts its roofline's bytes"


def test_the_optimizer_step_streams_memory_and_the_matrix_products_compute(counted):
    _, worker, _ = counted
    tasks = worker.tasks
    streaming = (tasks[MEMORY_BYTES] / 40e3 / tasks["duration_us"]).clip(0, 1).fillna(0)
    step = worker.match(OPTIMIZER_STEP)
    gemms = tasks["name"].astype(str).isin(["aten::mm", "aten::addmm"]).to_numpy()
    weighted = lambda mask: np.average(streaming[mask], weights=tasks["duration_us"][mask])  # noqa: E731
    assert weighted(step) > 0.4, "SGD reads and writes every parameter, its momentum and gradient"
    assert weighted(gemms) < 0.1, "a matrix product does many operations per byte"
    assert (tasks[MEMORY_BYTES][tasks["event"] < 0] == 0).all(), "gaps and inserted tasks move nothing"


def test_sharing_slows_the_streaming_part_of_a_task_by_the_memory_slowdown():
    tasks = pd.DataFrame({"duration_us": [100.0, 100.0, 100.0, 0.0], MEMORY_BYTES: [0.0, 2e6, 8e6, 1e6]})
    factors = shared_memory_factors(tasks, np.arange(4), core_bytes_per_us=40e3, memory_slowdown=1.5, compute_slowdown=1.1)
    assert factors.tolist() == pytest.approx([1.1, 1.5 * 0.5 + 1.1 * 0.5, 1.5, 1.1])


def test_bandwidth_is_split_among_the_workers_streaming_at_once_and_never_exceeds_a_cores_own():
    shared = SharedMemory("machine", core_bandwidth_bytes_per_us=40e3, total_bandwidth_bytes_per_us=48e3)
    assert shared.memory_slowdown(1) == 1.0
    assert shared.memory_slowdown(2) == pytest.approx(40 / 24)
    assert shared.memory_slowdown(4) == pytest.approx(40 / 12)
    roomy = SharedMemory("machine", core_bandwidth_bytes_per_us=40e3, total_bandwidth_bytes_per_us=200e3)
    assert roomy.memory_slowdown(2) == 1.0, "a memory system that feeds both cores in full slows neither"


def test_who_shares_is_a_machines_workers_or_the_whole_lab():
    assert cluster(2, 2, "machine").workers_sharing_memory == 2
    assert cluster(2, 2, "cluster").workers_sharing_memory == 4
    assert cluster(2, 2).workers_sharing_memory == 1, "GPU workers: nothing shared"


def test_workers_on_one_memory_system_take_longer_and_workers_on_their_own_do_not(counted):
    alone = iteration_ms(counted, 1, 2)
    assert iteration_ms(counted, 1, 2, "machine") > alone * 1.01
    across = iteration_ms(counted, 2, 1)
    assert iteration_ms(counted, 2, 1, "machine") == pytest.approx(across, rel=1e-9), "one worker per machine"
    assert iteration_ms(counted, 2, 1, "cluster") > across, "the lab's machines are one box"


def test_a_graph_without_counted_bytes_is_slowed_as_compute_only(wide_mlp):
    study, worker, gradients = wide_mlp
    config = ClusterConfig(Cluster.from_config({"machines": 1, "gpus_per_machine": 2, "intra_node": LINK, "inter_node": LINK,
                                                "shared_memory": {"among": "machine", **SHARED}}), "ddp")
    run = simulate_cluster(worker, gradients, study.iterations, config)
    free = simulate_cluster(worker, gradients, study.iterations, ClusterConfig(cluster(1, 2), "ddp"))
    assert run.schedule.makespan_us == pytest.approx(free.schedule.makespan_us, rel=1e-9), "compute slowdown 1 by default"


@pytest.mark.parametrize("config, key", [
    ({"among": "box", **SHARED}, "shared_memory.among"),
    ({"among": "machine", "core_bandwidth": "-40GB/s", "total_bandwidth": "48GB/s"}, "shared_memory.core_bandwidth"),
    ({"among": "machine", "core_bandwidth": "40GB/s"}, "shared_memory.total_bandwidth"),
    ({"among": "machine", **SHARED, "compute": 0.5}, "shared_memory.compute"),
    ({"among": "machine", **SHARED, "computer": 1.1}, "shared_memory.computer"),
])
def test_a_wrong_shared_memory_names_its_key(config, key):
    with pytest.raises(TopologyError) as err:
        Cluster.from_config({"machines": 1, "gpus_per_machine": 2, "intra_node": LINK, "inter_node": LINK, "shared_memory": config})
    assert err.value.key == key


def test_calibration_fits_the_rates_it_measured():
    from whatif.lab.calibrate import fit_shared_memory

    measured = {"stream_bytes_per_s_alone": 42e9, "stream_bytes_per_s_shared": [25e9, 24e9],
                "gemm_flops_per_s_alone": 100e9, "gemm_flops_per_s_shared": [101e9, 95e9], "world_size": 2}
    fitted = fit_shared_memory(measured)
    assert fitted == {"among": "cluster", "core_bandwidth": "42.00GB/s", "total_bandwidth": "49.00GB/s", "compute": 1.0526}
    shared = SharedMemory.from_config(fitted)
    assert shared.memory_slowdown(2) == pytest.approx(42 / 24.5)
