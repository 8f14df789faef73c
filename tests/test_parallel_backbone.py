"""The parallelism backbone: the Parallelism block, process groups, units on real traces."""

from __future__ import annotations

import numpy as np
import pytest
from trace_corpus import REPO

from whatif.sim.graph import GPU_TASK_KINDS
from whatif.sim.parallel import Parallelism, ParallelismError
from whatif.sim.parallel.placement import groups, ranks_of
from whatif.sim.parallel.units import PHASE_BACKWARD, PHASE_FORWARD, UnitsError, find_units, parameters_from_shapes
from whatif.study import TraceStudy
from whatif.topology import Cluster

TRANSFORMER = REPO / "data" / "transformer_cpu.bundle"
CONVNET = REPO / "data" / "convnet_cpu.bundle"
VGG13 = "triosim-vgg13-h100/vgg13_bs512_iter41.json.gz"

# examples/transformer.py: d_model 256, feed-forward 1024, float32
D, FF = 256, 1024
BLOCK_PARAMETERS = (D * 3 * D + 3 * D) + (D * D + D) + (D * FF + FF) + (FF * D + D) + 2 * (2 * D)


@pytest.fixture(scope="module")
def transformer():
    return TraceStudy.from_trace(TRANSFORMER).graph


def _cluster(machines: int, gpus: int) -> Cluster:
    return Cluster.from_config({"machines": machines, "gpus_per_machine": gpus,
                                "intra_node": "nvlink2", "inter_node": "10gbe"})


# -- Parallelism -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, key", [
    ({"tensor": 0}, "parallelism.tensor"),
    ({"data": 2.0}, "parallelism.data"),
    ({"zero": 4}, "parallelism.zero"),
    ({"pipeline": 2, "microbatches": 4, "schedule": "zigzag"}, "parallelism.pipeline.schedule"),
    ({"pipeline": 2, "microbatches": 4, "virtual_stages": 2}, "parallelism.pipeline.virtual_stages"),
    ({"pipeline": 4, "microbatches": 2}, "parallelism.pipeline.microbatches"),
    ({"data": 4, "expert": 3}, "parallelism.expert"),
    ({"recompute": "some"}, "parallelism.recompute"),
    ({"sequence_parallel": True}, "parallelism.sequence_parallel"),
    ({"tensor": 2, "sequence_parallel": True, "sequence_parallel_grads": "bucketed"},
     "parallelism.sequence_parallel_grads"),
    ({"placement": ("tensor", "data")}, "parallelism.placement"),
    ({"pipeline": 2, "microbatches": 2, "partition": (1,)}, "parallelism.pipeline.partition"),
])
def test_parallelism_refuses_with_one_line_naming_the_key(kwargs, key):
    with pytest.raises(ParallelismError) as err:
        Parallelism(**kwargs)
    assert str(err.value).startswith(key + ":") and "\n" not in str(err.value)


def test_parallelism_world_and_families():
    par = Parallelism(data=4, tensor=2, pipeline=2, expert=2, zero=3, microbatches=8)
    assert par.world == 16
    assert par.families() == ("tensor", "expert", "fsdp", "pipeline")
    assert Parallelism(data=8).families() == ()
    assert Parallelism(pipeline=2, microbatches=1, schedule="gpipe").world == 2


# -- groups ----------------------------------------------------------------------------------------


def test_groups_follow_megatron_order():
    par = Parallelism(data=4, tensor=2, pipeline=2, expert=2, microbatches=4)
    found = groups(par, _cluster(2, 8))
    assert found["tensor"][:2] == [(0, 1), (2, 3)]
    assert found["data"][:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert found["pipeline"][0] == (0, 8)
    assert found["expert"][:2] == [(0, 2), (1, 3)]  # consecutive runs of the data group
    assert found["expert_data"][0] == (0, 4)
    for dimension, gs in found.items():
        members = sorted(r for g in gs for r in g)
        assert members == list(range(16)), dimension
    mine = ranks_of(found, 5)
    assert mine == {"tensor": (4, 5), "data": (1, 3, 5, 7), "pipeline": (5, 13), "expert": (5, 7),
                    "expert_data": (1, 5)}


def test_tensor_parallel_stays_inside_a_machine_by_default():
    cluster = _cluster(4, 4)
    found = groups(Parallelism(data=4, tensor=4), cluster)
    machines = cluster.endpoint_machines
    assert all(len({int(machines[g]) for g in group}) == 1 for group in found["tensor"])
    reordered = groups(Parallelism(data=4, tensor=4, placement=("data", "tensor", "pipeline")), cluster)
    assert reordered["tensor"][0] == (0, 4, 8, 12)


def test_groups_refuse_a_cluster_of_another_size():
    with pytest.raises(ParallelismError, match=r"= 8 ranks, but the cluster has 16 GPUs"):
        groups(Parallelism(data=4, tensor=2), _cluster(2, 8))


# -- units -----------------------------------------------------------------------------------------


def test_transformer_units_are_its_blocks_in_model_order(transformer):
    units = find_units(transformer)
    assert units.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert units.table["unit"].tolist() == [0, 1, 2, 3]
    # the bundle's parameters per block, and the hand count of examples/transformer.py's block
    parameters = transformer.workload.parameters
    for name, nbytes in zip(units.names, units.table["param_bytes"]):
        mine = parameters[parameters["name"].str.startswith(name + ".")]
        assert nbytes == float((mine["numel"] * mine["element_size"]).sum()) == BLOCK_PARAMETERS * 4
    # a block's output: batch 8 x 64 tokens x 256 features, float32
    assert units.table["activation_bytes"].tolist() == [8 * 64 * 256 * 4] * 4
    assert (units.table["forward_us"] > 0).all() and (units.table["backward_us"] > 0).all()


def test_every_task_of_a_block_is_assigned(transformer):
    """Every CPU task that starts inside a leaf module's call belongs to that leaf's block, in
    that pass; no task of another phase or unit does."""
    units = find_units(transformer)
    tasks = transformer.tasks
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    resource = tasks["resource"].astype(str).to_numpy()
    on_cpu = ~np.isin(tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    intervals = transformer.workload.layer_intervals
    checked = 0
    blocks = intervals[intervals["layer"].str.startswith("blocks.")]
    for layer, phase, begin, end, thread in zip(blocks["layer"], blocks["pass"], blocks["start_us"],
                                                blocks["end_us"], blocks["thread"]):
        inside = np.flatnonzero(on_cpu & (resource == thread) & (start >= begin) & (start < end))
        expected_phase = PHASE_FORWARD if phase == "forward" else PHASE_BACKWARD
        assert (units.task_unit[inside] == int(layer.split(".")[1])).all(), (layer, phase)
        assert (units.task_phase[inside] == expected_phase).all(), (layer, phase)
        checked += len(inside)
    assert checked > 1000
    backward_ops = tasks["context"].astype(str).str.contains("LinearBackward|AddmmBackward").to_numpy()
    assert (units.task_phase[backward_ops & (units.task_unit >= 0)] == PHASE_BACKWARD).all()


def test_convnet_units_are_found_without_a_pattern():
    graph = TraceStudy.from_trace(CONVNET).graph
    units = find_units(graph)
    assert units.names == ["features.0", "features.1", "features.2"]
    # conv weight + batch-norm weight and bias: 32*3*3*3 + 64, 64*32*3*3 + 128, 128*64*3*3 + 256
    assert units.table["param_bytes"].tolist() == [(864 + 64) * 4, (18432 + 128) * 4, (73728 + 256) * 4]
    # each block's output after its max-pool: batch 32, 32x16x16, 64x8x8, 128x4x4
    assert units.table["activation_bytes"].tolist() == [32 * 32 * 16 * 16 * 4, 32 * 64 * 8 * 8 * 4, 32 * 128 * 4 * 4 * 4]


def test_a_pattern_chooses_other_units(transformer):
    units = find_units(transformer, r"blocks\.\d+\.mlp")
    assert units.names == [f"blocks.{i}.mlp" for i in range(4)]
    assert units.table["param_bytes"].tolist() == [((D * FF + FF) + (FF * D + D)) * 4] * 4


def test_units_by_name_on_a_shared_gpu_trace(shared_traces):
    graph = TraceStudy.from_trace(shared_traces / VGG13).graph
    units = find_units(graph, r"Conv2d_\d+")
    assert units.names == [f"nn.Module: Conv2d_{i}" for i in range(10)]  # VGG-13's ten convolutions
    kernels = np.isin(graph.tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS])
    for unit in range(10):  # each convolution launched its kernels in forward, and in backward
        assert (kernels[units.tasks_of(unit, PHASE_FORWARD)]).any()
        assert (kernels[units.tasks_of(unit, PHASE_BACKWARD)]).any()
    assert (units.table["forward_us"] > 0).all() and (units.table["backward_us"] > 0).all()


def test_a_plain_traces_repeated_block_is_the_module_class_torch_profiler_names_most_alike(shared_traces):
    """Without a pattern, VGG-13's trace (torch.profiler's module names, no ``blocks.N``) gives
    its ten ``Conv2d`` calls, not its two unlike ``Sequential`` containers nor its ``ReLU``s."""
    graph = TraceStudy.from_trace(shared_traces / VGG13).graph
    found, given = find_units(graph), find_units(graph, r"Conv2d_\d+")
    assert found.names == given.names and (found.task_unit == given.task_unit).all()
    assert "nn\\.Module: Conv2d_" in found.pattern


def test_backward_tasks_join_their_forwards_unit_by_autograd_sequence_number(shared_traces):
    graph = TraceStudy.from_trace(shared_traces / VGG13).graph
    units = find_units(graph)
    names = graph.tasks["name"].astype(str).to_numpy()
    nodes = units.task_phase == PHASE_BACKWARD
    placed = set(names[nodes & (units.task_unit >= 0) & np.char.startswith(names.astype(str), "autograd::engine")])
    # each convolution's backward node, and the two AccumulateGrad nodes (weight, bias) after it
    assert placed == {"autograd::engine::evaluate_function: ConvolutionBackward0",
                      "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"}
    relu = nodes & (names == "autograd::engine::evaluate_function: ReluBackward0")
    assert (units.task_unit[relu] == -1).all()  # the ReLUs ran outside every Conv2d


def test_a_plain_traces_parameters_are_read_off_its_operators_shapes(shared_traces):
    graph = TraceStudy.from_trace(shared_traces / VGG13).graph
    units = find_units(graph)
    params = parameters_from_shapes(graph, units)
    assert int(params["numel"].sum()) == 133_047_848  # VGG-13 (torchvision): 133.0 M parameters
    conv0 = params[params["layer"] == "nn.Module: Conv2d_0"]
    assert sorted(map(tuple, conv0["shape"])) == [(64,), (64, 3, 3, 3)]
    assert (params["element_size"] * params["numel"]).sum() == pytest.approx(532.2e6, rel=1e-3)  # its gradients'


def test_no_units_is_one_line_naming_the_key():
    graph = TraceStudy.from_trace(REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz").graph
    with pytest.raises(UnitsError) as err:
        find_units(graph)
    assert "give parallelism.units" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnitsError, match="parallelism.units: .* not a valid regular expression"):
        find_units(graph, "blocks[")


def test_a_plain_gpu_traces_units_have_their_boundary_activation_and_forward_around_them(shared_traces):
    """VGG-13's convolutions are each followed by a ReLU outside every unit: the ReLU is forward
    work (as a bundle's forward span makes it), and its input, the convolution's output of
    [512, 64, 224, 224] floats for the first, is the unit's boundary activation."""
    graph = TraceStudy.from_trace(shared_traces / VGG13).graph
    units = find_units(graph)
    assert units.table["activation_bytes"].iat[0] == 512 * 64 * 224 * 224 * 4
    assert (units.table["activation_bytes"] > 0).all()
    names = graph.tasks["name"].astype(str).to_numpy()
    relu = (names == "aten::relu_") | (names == "aten::relu")
    assert relu.any() and (units.task_phase[relu] == PHASE_FORWARD).all() and (units.task_unit[relu] == -1).all()
