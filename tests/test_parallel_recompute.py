"""Activation recomputation's time (sim/parallel/recompute.py) on real traces: the bundled
transformer (CPU, fused attention) and the VGG-13 H100 trace (GPU kernels on one stream)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from trace_corpus import NO_SHARED, REPO, SHARED_TRACES

from whatif.pipeline import predict
from whatif.scenario import Scenario
from whatif.sim.graph import TaskKind
from whatif.sim.parallel import Parallelism
from whatif.sim.parallel.recompute import ATTENTION_CORE, apply_recompute, recompute_us
from whatif.sim.parallel.units import PHASE_BACKWARD, PHASE_FORWARD, find_units
from whatif.study import TraceStudy

TRANSFORMER = REPO / "data" / "transformer_cpu.bundle"
VGG = SHARED_TRACES / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
GPU_KINDS = [int(TaskKind.KERNEL), int(TaskKind.MEMCPY), int(TaskKind.MEMSET)]


@pytest.fixture(scope="module")
def transformer():
    graph = TraceStudy.from_trace(TRANSFORMER).graph
    return graph, find_units(graph)


def test_full_recompute_charges_each_units_forward_to_the_first_task_of_its_backward(transformer):
    graph, units = transformer
    charged = recompute_us(graph, units, Parallelism(recompute="full"))
    duration = graph.tasks["duration_us"].to_numpy(dtype=float)
    start = graph.tasks["measured_start_us"].to_numpy(dtype=float)
    forward = (units.task_phase == PHASE_FORWARD) & (units.task_unit >= 0)
    # every iteration of the trace has each block's backward: all of the blocks' forward is charged
    assert charged.sum() == pytest.approx(duration[forward].sum())
    targets = np.flatnonzero(charged)
    assert len(targets) == len(units) * 4  # a task per block and iteration (4 profiled steps)
    for t in targets:
        unit = units.task_unit[t]
        assert units.task_phase[t] == PHASE_BACKWARD
        earlier = np.flatnonzero((units.task_phase == PHASE_BACKWARD) & (units.task_unit == unit)
                                 & (start < start[t]) & (start > start[t] - 50e3))
        assert not len(earlier), "the charge lands on the first task of the unit's backward"
    recomputed = apply_recompute(graph, units, Parallelism(recompute="full"))
    assert recomputed is not graph
    assert recomputed.tasks["duration_us"].to_numpy() == pytest.approx(duration + charged)


def test_selective_recompute_of_fused_attention_costs_nothing(transformer):
    """The blocks run scaled_dot_product_attention: no scores kept, none recomputed (memory.py
    saves nothing more for them either)."""
    graph, units = transformer
    assert not recompute_us(graph, units, Parallelism(recompute="selective")).any()
    assert apply_recompute(graph, units, Parallelism(recompute="selective")) is graph
    assert apply_recompute(graph, units, Parallelism()) is graph


@pytest.mark.parametrize("name, core", [("aten::bmm", True), ("aten::baddbmm", True), ("aten::_softmax", True),
                                        ("aten::native_dropout", True), ("aten::masked_fill_", True),
                                        ("aten::linear", False), ("aten::addmm", False), ("aten::layer_norm", False)])
def test_the_attention_core_is_the_scores_their_softmax_and_dropout(name, core):
    assert bool(ATTENTION_CORE.search(name)) is core


def test_on_a_gpu_trace_each_streams_forward_is_charged_on_that_stream():
    if not VGG.is_file():
        pytest.skip(NO_SHARED)
    graph = TraceStudy.from_trace(VGG).graph
    units = find_units(graph)
    charged = recompute_us(graph, units, Parallelism(recompute="full"))
    kind = graph.tasks["kind"].to_numpy()
    duration = graph.tasks["duration_us"].to_numpy(dtype=float)
    forward = (units.task_phase == PHASE_FORWARD) & (units.task_unit >= 0)
    gpu = np.isin(kind, GPU_KINDS)
    assert charged[gpu].sum() == pytest.approx(duration[forward & gpu].sum())  # 80.9 ms of convolutions
    assert charged[~gpu].sum() == pytest.approx(duration[forward & ~gpu].sum())
    resource = graph.tasks["resource"].astype(str).to_numpy()
    assert set(resource[(charged > 0) & gpu]) == set(resource[forward & gpu])


def test_a_scenario_charges_recompute_to_plain_data_parallel_and_parallel_jobs():
    """The time and the memory of a grid of recompute none and full, on one worker, four data-
    parallel workers and a tensor-parallel job: full is slower and needs less memory."""
    cluster = {"machines": 2, "gpus_per_machine": 2, "intra_node": "nvlink2", "inter_node": "10gbe"}
    results = {}
    for recompute in ("none", "full"):
        for machines, tensor in ((1, 1), (2, 1), (2, 2)):
            scenario = Scenario.from_dict({
                "trace": str(TRANSFORMER), "framework": "ddp",
                "cluster": {**cluster, "machines": machines, "gpus_per_machine": 2 if machines > 1 else 1},
                "parallelism": {"recompute": recompute, "tensor": tensor}}, name="s.yaml")
            (row,) = predict(scenario.request()).results.to_dict("records")
            results[recompute, machines, tensor] = row
    for point in ((1, 1), (2, 1), (2, 2)):
        none, full = results[("none", *point)], results[("full", *point)]
        assert full["iteration_ms"] > 1.15 * none["iteration_ms"], point
        assert full["memory_gb"] < none["memory_gb"], point


def test_full_recompute_of_single_convolutions_keeps_what_they_kept():
    """VGG-13's units are single convolutions, which keep their input alone: recomputing one
    keeps that same input. The count used the unit's output instead: 65.0 GB a GPU against
    55.9 GB without recomputation at batch 512."""
    if not VGG.is_file():
        pytest.skip(NO_SHARED)
    from whatif.sim.parallel.memory import memory_per_gpu

    graph = TraceStudy.from_trace(VGG).graph
    units = find_units(graph)
    plain = memory_per_gpu(graph, units, Parallelism(), optimizer="adam")
    full = memory_per_gpu(graph, units, Parallelism(recompute="full"), optimizer="adam")
    assert full.activations == pytest.approx(plain.activations)
    assert plain.activations > 50e9


def test_mixed_precision_halves_the_activations_in_the_memory_count():
    """optimizations: [amp] made VGG-13's step 2.5 times faster and left its memory count in
    float32 (55.9 GB a GPU); the count now takes half-precision activations and ZeRO's
    2 + 2 + 12 bytes a parameter, as memory_per_gpu does for a half-precision trace."""
    if not VGG.is_file():
        pytest.skip(NO_SHARED)
    from whatif.sim.parallel.memory import memory_per_gpu

    rows = {}
    for optimizations in ([], ["amp"]):
        scenario = Scenario.from_dict({"trace": str(VGG), "framework": "ddp", "optimizations": optimizations,
                                       "cluster": {"machine": "dgx_h100", "machines": 1},
                                       "parallelism": {"zero": [0, 3]}}, name="s.yaml")
        rows[bool(optimizations)] = predict(scenario.request()).results.set_index("parallelism")["memory_gb"]
    graph = TraceStudy.from_trace(VGG).graph
    units = find_units(graph)
    for label, par in (("dp8", Parallelism(data=8)), ("dp8 fsdp", Parallelism(data=8, zero=3))):
        activations = memory_per_gpu(graph, units, par).activations / 1e9
        assert memory_per_gpu(graph, units, par, dtype_bytes=2).activations / 1e9 == pytest.approx(activations / 2)
        # Adam's model state is 16 bytes a parameter either way (4 + 4 + 8, or 2 + 2 + 12)
        assert rows[True][label] == pytest.approx(rows[False][label] - activations / 2, rel=1e-3)
        assert rows[True][label] < 0.6 * rows[False][label]


def _unfused_attention_block(d_model: int = 64, heads: int = 4):
    """A pre-norm block whose attention is written out, scores by matmul, their softmax and
    dropout, as Megatron's unfused core attention (made on use: torch is the test extra's)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.qkv, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            self.dropout = nn.Dropout(0.1)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d_model // heads)
            attended = torch.matmul(self.dropout(torch.softmax(scores, dim=-1)), v)
            x = x + self.out(attended.transpose(1, 2).reshape(b, s, -1))
            return x + self.mlp(x)

    return Block()


def test_selective_recompute_of_unfused_attention_charges_its_core_alone(tmp_path):
    """A model with its attention written out (captured here on CPU): selective recomputation
    charges each block's backward with its scores' matmuls, softmax and dropout, a small part
    of the block's forward; full with all of it."""
    torch = pytest.importorskip("torch", reason="captures a model (pip install -e '.[test]')")
    from torch import nn

    from whatif.collectors.capture import Capture
    from whatif.sim.parallel.memory import memory_per_gpu

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(256, 64), nn.Sequential(*(_unfused_attention_block() for _ in range(2))))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with Capture(tmp_path / "unfused.bundle", model=model, warmup=2, steps=3, batch_size=4) as cap:
            while True:
                optimizer.zero_grad()
                model(torch.randint(0, 256, (4, 32))).pow(2).mean().backward()
                optimizer.step()
                if not cap.step():
                    break
    finally:
        torch.set_num_threads(threads)
    graph = TraceStudy.from_trace(cap.bundle).graph
    units = find_units(graph, r"1\.\d+")
    assert len(units) == 2
    selective = recompute_us(graph, units, Parallelism(recompute="selective"))
    full = recompute_us(graph, units, Parallelism(recompute="full"))
    duration = graph.tasks["duration_us"].to_numpy(dtype=float)
    forward = (units.task_phase == PHASE_FORWARD) & (units.task_unit >= 0)
    names = graph.tasks["name"].astype(str).to_numpy()
    contexts = graph.tasks["context"].astype(str).to_numpy()
    core = forward & np.array([bool(ATTENTION_CORE.search(n) or ATTENTION_CORE.search(c))
                               for n, c in zip(names, contexts)])
    assert {n.split("::")[-1] for n in names[core]} >= {"bmm", "_softmax", "dropout"}
    assert not {"addmm", "layer_norm", "gelu"} & {n.split("::")[-1] for n in names[core]}
    assert selective.sum() == pytest.approx(duration[core].sum())
    assert 0 < selective.sum() < 0.5 * full.sum()
    assert full.sum() == pytest.approx(duration[forward].sum())
    # and what it saves: the scores' 5as/h term, which fused attention never kept
    plain = memory_per_gpu(graph, units, Parallelism()).activations
    assert memory_per_gpu(graph, units, Parallelism(recompute="selective")).activations < plain
