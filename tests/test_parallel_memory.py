"""Memory per GPU against hand counts on the bundled transformer (examples/transformer.py)."""

from __future__ import annotations

import pytest
from trace_corpus import REPO

from whatif.sim.parallel import Parallelism, ParallelismError
from whatif.sim.parallel.memory import (
    MemoryBreakdown,
    fits,
    gpu_memory_bytes,
    in_flight_microbatches,
    memory_per_gpu,
    stage_units,
)
from whatif.sim.parallel.units import find_units
from whatif.study import TraceStudy
from whatif.topology import Cluster

# the model: 4 blocks of d 256, feed-forward 1024; embeddings 16384 x 256 and 64 x 256; a norm and
# a 256 -> 10 head; batch 8 of 64 tokens; float32
D, FF, VOCAB, SEQ, BATCH = 256, 1024, 16384, 64, 8
BLOCK = (D * 3 * D + 3 * D) + (D * D + D) + (D * FF + FF) + (FF * D + D) + 2 * (2 * D)
EMBEDDINGS = VOCAB * D + SEQ * D
HEAD_AND_NORM = (D * 10 + 10) + 2 * D
PSI = 4 * BLOCK + EMBEDDINGS + HEAD_AND_NORM
SBH = BATCH * SEQ * D


@pytest.fixture(scope="module")
def job():
    graph = TraceStudy.from_trace(REPO / "data" / "transformer_cpu.bundle").graph
    return graph, find_units(graph)


def test_the_bundle_holds_the_hand_counted_parameters(job):
    graph, _ = job
    assert PSI == 7_372_810 == int(graph.workload.parameters["numel"].sum())


def test_model_state_of_plain_data_parallel_is_zero_papers(job):
    graph, units = job
    fp32 = memory_per_gpu(graph, units, Parallelism(data=4), optimizer="adam")
    assert (fp32.parameters, fp32.gradients, fp32.optimizer, fp32.gathered) == (4 * PSI, 4 * PSI, 8 * PSI, 0)
    mixed = memory_per_gpu(graph, units, Parallelism(data=4), optimizer="adam", dtype_bytes=2)
    assert mixed.parameters + mixed.gradients + mixed.optimizer == 16 * PSI  # 2 + 2 + 12
    assert mixed.activations < fp32.activations  # 2-byte activations
    sgd = memory_per_gpu(graph, units, Parallelism(data=4), optimizer="sgd")
    assert sgd.optimizer == 4 * PSI  # the momentum buffer


@pytest.mark.parametrize("zero, parameters, gradients, optimizer, gathered", [
    (1, 4 * PSI, 4 * PSI, 8 * PSI / 4, 0),
    (2, 4 * PSI, 4 * PSI / 4, 8 * PSI / 4, 4 * BLOCK),
    (3, 4 * PSI / 4, 4 * PSI / 4, 8 * PSI / 4, 2 * 4 * BLOCK + 4 * BLOCK),
])
def test_zero_stages_shard_over_the_data_ranks(job, zero, parameters, gradients, optimizer, gathered):
    graph, units = job
    found = memory_per_gpu(graph, units, Parallelism(data=4, zero=zero), optimizer="adam")
    assert (found.parameters, found.gradients, found.optimizer, found.gathered) == pytest.approx(
        (parameters, gradients, optimizer, gathered))


def test_tensor_parallel_splits_blocks_and_embeddings(job):
    graph, units = job
    found = memory_per_gpu(graph, units, Parallelism(tensor=2), optimizer="sgd")
    assert found.parameters == pytest.approx(4 * (4 * BLOCK / 2 + EMBEDDINGS / 2 + HEAD_AND_NORM))


def test_pipeline_stages_hold_their_blocks(job):
    graph, units = job
    par = Parallelism(pipeline=2, microbatches=4)
    assert [s.tolist() for s in stage_units(4, par)] == [[0, 1], [2, 3]]
    found = memory_per_gpu(graph, units, par, optimizer="sgd")
    assert found.stage == 0  # the embeddings outweigh the head
    assert found.parameters == 4 * (2 * BLOCK + EMBEDDINGS)
    with pytest.raises(ParallelismError, match="add up to 3, but the model has 4"):
        memory_per_gpu(graph, units, Parallelism(pipeline=2, microbatches=2, partition=(1, 2)))


def test_activations_follow_korthikanti(job):
    """The blocks run fused attention (scaled_dot_product_attention): no a s^2 b term;
    34 sbh at 2 bytes, so 68 sbh in float32, per block."""
    graph, units = job
    plain = memory_per_gpu(graph, units, Parallelism(), optimizer="sgd").activations
    outside = plain - 4 * 68 * SBH
    assert 0 < outside < 68 * SBH  # embeddings' sum, final norm, mean: a few sbh
    tp = memory_per_gpu(graph, units, Parallelism(tensor=2), optimizer="sgd").activations
    assert tp - outside == pytest.approx(4 * (10 + 24 / 2) * 2 * SBH)
    sp = memory_per_gpu(graph, units, Parallelism(tensor=2, sequence_parallel=True), optimizer="sgd").activations
    assert sp == pytest.approx((4 * 68 * SBH + outside) / 2)
    full = memory_per_gpu(graph, units, Parallelism(recompute="full"), optimizer="sgd").activations
    assert full - outside == pytest.approx(4 * 4 * SBH)  # each block's input, float32
    piped = memory_per_gpu(graph, units, Parallelism(pipeline=2, microbatches=4), optimizer="sgd").activations
    assert piped == pytest.approx(2 * 68 * SBH / 4 * 2 + outside / 4)  # 2 blocks, 2 microbatches in flight


def test_microbatches_without_pipeline_stages_keep_the_whole_batchs_activations(job):
    """Only a pipeline's schedule splits the batch; a 1-stage point given microbatches (a grid of
    stages [1, 2] with microbatches 8) was counted at an eighth of its activations while its
    time was the whole batch's: VGG-13 at batch 512 on an H100 reported 8.85 GB, not 55.9."""
    graph, units = job
    whole = memory_per_gpu(graph, units, Parallelism(), optimizer="sgd")
    assert memory_per_gpu(graph, units, Parallelism(microbatches=8), optimizer="sgd") == whole


def test_in_flight_microbatches_by_schedule():
    assert in_flight_microbatches(Parallelism(pipeline=4, microbatches=8, schedule="gpipe")) == 8
    assert in_flight_microbatches(Parallelism(pipeline=4, microbatches=8)) == 4
    assert in_flight_microbatches(Parallelism(pipeline=4, microbatches=8), stage=3) == 1
    interleaved = Parallelism(pipeline=4, microbatches=8, schedule="interleaved", virtual_stages=2)
    assert in_flight_microbatches(interleaved) == pytest.approx(4 * (1 + 3 / 8))


def test_every_gpu_preset_says_its_memory():
    from whatif.topology.fabric import Gpu, preset_names

    for name in preset_names("gpus"):
        memory = Gpu.from_config(name, "gpu").memory_bytes
        assert memory is not None and 8e9 <= memory <= 300e9, name


def test_fits_and_the_gpus_memory():
    breakdown = MemoryBreakdown(1e9, 1e9, 2e9, 0.0, 4e9)
    assert breakdown.total_gb == 8
    assert fits(breakdown, 80e9) is True and fits(breakdown, 7e9) is False and fits(breakdown, None) is None
    assert gpu_memory_bytes(Cluster.from_config({"machine": "dgx_h100", "machines": 2})) == 80e9
    assert gpu_memory_bytes(Cluster.from_config({"machine": "p4d", "machines": 2})) == 40e9  # A100 40GB
    assert gpu_memory_bytes(Cluster.from_config({"machine": "p4d", "machines": 2, "gpu": "a100"})) == 80e9
    assert gpu_memory_bytes(Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": "pcie3",
                                                 "inter_node": "10gbe"})) is None
