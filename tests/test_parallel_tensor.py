"""The tensor-parallel and expert-parallel passes (``sim/parallel/tensor.py``, ``expert.py``) on
real traces: small models built from the lab's own blocks (``examples/transformer.py``'s
``EncoderBlock``, ``examples/moe.py``'s ``MoEBlock``, a DLRM-style bag of embeddings) captured
under :class:`Capture` on CPU once per session, and the shared DLRM GPU trace.

The collectives are counted per block (or MoE layer) and iteration and their bytes held to the
shard sizes computed by hand from the models' configuration below.
"""

from __future__ import annotations

import importlib
import math
import sys

import numpy as np
import pytest

from trace_corpus import REPO, SHARED_TRACES
from whatif.collectors.load import load_trace
from whatif.sim.build import build_graph
from whatif.sim.engine import simulate
from whatif.sim.graph import EdgeKind, GraphError, TaskKind
from whatif.sim.parallel import Parallelism
from whatif.sim.parallel.expert import ExpertParallelChange, apply_expert
from whatif.sim.parallel.fsdp import ShardedDataParallel, apply_fsdp
from whatif.sim.parallel.job import comm_dimension
from whatif.sim.workload import decode_inputs, first_input_bytes
from whatif.sim.parallel.tensor import TensorParallelChange, apply_tensor, shard_dims, with_collectives
from whatif.sim.perfmodels.models import load_models
from whatif.sim.parallel.units import PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, find_units
from whatif.topology import Cluster, collective_cost

torch = pytest.importorskip("torch", reason="the passes are tested on traces captured with torch (pip install -e '.[test]')")
from torch import nn  # noqa: E402

from whatif.collectors.capture import Capture  # noqa: E402

D_MODEL, HEADS, FEED_FORWARD, LENGTH, BATCH, VOCAB, BLOCKS = 64, 4, 256, 16, 4, 512, 2
STEPS, WARMUP = 3, 2
TABLES, BAG_DIM, ROWS, BAG = 3, 32, 1000, 5
FAST = Cluster.from_config({"machine": "dgx_h100", "machines": 1})


def examples():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        return importlib.import_module("transformer"), importlib.import_module("moe")
    finally:
        sys.path.remove(str(REPO / "examples"))


class Blocks(nn.Module):
    """Token embeddings, ``BLOCKS`` of the lab's blocks and a linear head on the mean token."""

    def __init__(self, kind: str):
        super().__init__()
        transformer, moe = examples()
        self.token_embedding = nn.Embedding(VOCAB, D_MODEL)
        make = (lambda: transformer.EncoderBlock(D_MODEL, HEADS, FEED_FORWARD)) if kind == "dense" else (
            lambda: moe.MoEBlock(D_MODEL, HEADS))
        self.blocks = nn.Sequential(*(make() for _ in range(BLOCKS)))
        self.head = nn.Linear(D_MODEL, 10)

    def forward(self, x):
        return self.head(self.blocks(self.token_embedding(x)).mean(1))


class Bags(nn.Module):
    """DLRM's sparse side: ``TABLES`` embedding bags (sum pooling), their outputs concatenated
    into an MLP."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, BAG_DIM, mode="sum") for _ in range(TABLES))
        self.top = nn.Sequential(nn.Linear(TABLES * BAG_DIM, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.top(torch.cat([table(x[:, i]) for i, table in enumerate(self.tables)], dim=1))


def capture(kind: str, folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Bags() if kind == "bags" else Blocks(kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(0)
        with Capture(folder / f"{kind}.bundle", model=model, warmup=WARMUP, steps=STEPS, batch_size=BATCH) as cap:
            while True:
                shape = (BATCH, TABLES, BAG) if kind == "bags" else (BATCH, LENGTH)
                x = torch.randint(0, VOCAB if kind != "bags" else ROWS, shape, generator=generator)
                y = torch.randint(0, 10, (BATCH,), generator=generator)
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if not cap.step():
                    break
        graph = build_graph(load_trace(cap.bundle))
        return graph, (find_units(graph) if kind != "bags" else find_units(graph, r"tables\.\d+"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return capture("dense", tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return capture("moe", tmp_path_factory.mktemp("ep"))


def tensor(graph, units, t, sequence_parallel=False, cluster=FAST):
    par = Parallelism(data=8 // t, tensor=t, sequence_parallel=sequence_parallel)
    return apply_tensor(graph, units, par, cluster, {"tensor": tuple(range(t))})


def expert_and_other_bytes(graph):
    """The bytes of the parameters whose name holds ``expert``, and of the rest."""
    parameters = graph.workload.parameters
    size = parameters["numel"].astype(float) * parameters["element_size"].astype(float)
    expert = parameters["name"].astype(str).str.contains("expert").to_numpy()
    return float(size[expert].sum()), float(size[~expert].sum())


def per_block(collectives):
    return collectives.groupby(["unit", "iteration", "phase", "op"]).size()


# -- tensor parallelism ---------------------------------------------------------------------------


def test_tensor_parallel_all_reduces_twice_forward_and_twice_backward_per_block(dense):
    graph, units = dense
    out = tensor(graph, units, 2)
    note = out.last_note(TensorParallelChange)
    counts = per_block(note.collectives)
    assert len(counts) == BLOCKS * STEPS * 2, "every block of every iteration, forward and backward"
    assert (counts == 2).all() and set(note.collectives["op"]) == {"all_reduce"}
    assert len(note.collectives) == 4 * BLOCKS * STEPS
    # the block's activation: batch x sequence x hidden x 4 bytes (float32), forward and backward
    assert set(note.collectives["nbytes"]) == {BATCH * LENGTH * D_MODEL * 4}
    comm = out.tasks.iloc[note.collectives["task"].to_numpy()]
    assert (comm["kind"] == int(TaskKind.COMM)).all() and set(comm["resource"].astype(str)) == {"network tensor"}
    expected = collective_cost(FAST, "all_reduce", BATCH * LENGTH * D_MODEL * 4, ranks=(0, 1)).time_us
    assert np.allclose(comm["duration_us"], expected)
    assert note.pairs == 2 * BLOCKS * STEPS and note.unmatched_backward == 0


def tensor_sp(graph, units, t, grads):
    par = Parallelism(data=8 // t, tensor=t, sequence_parallel=True, sequence_parallel_grads=grads)
    return apply_tensor(graph, units, par, FAST, {"tensor": tuple(range(t))})


def the_ends(collectives):
    """The all-gathers at the units' boundary: the last block's forward and the first block's
    backward hold one more each, per iteration."""
    forward = (collectives["phase"] == PHASE_FORWARD) & (collectives["unit"] == BLOCKS - 1)
    backward = (collectives["phase"] == PHASE_BACKWARD) & (collectives["unit"] == 0)
    gathers = collectives[(forward | backward) & (collectives["op"] == "all_gather")]
    return gathers.sort_values("task").drop_duplicates(["unit", "phase", "iteration"], keep="last")


def test_sequence_parallel_turns_each_all_reduce_into_a_reduce_scatter_and_an_all_gather(dense):
    graph, units = dense
    note = tensor(graph, units, 2, sequence_parallel=True).last_note(TensorParallelChange)
    note.collectives = note.collectives[note.collectives["phase"] != PHASE_OPTIMIZER]
    note.collectives = note.collectives.drop(the_ends(note.collectives).index)
    counts = per_block(note.collectives)
    assert len(note.collectives) == 8 * BLOCKS * STEPS
    assert set(counts.index.get_level_values("op")) == {"all_gather", "reduce_scatter"} and (counts == 2).all()
    assert set(note.collectives["nbytes"]) == {BATCH * LENGTH * D_MODEL * 4}, "the same total bytes as the all-reduce"
    plain = tensor(graph, units, 2).last_note(TensorParallelChange)
    assert note.scaled_tasks > plain.scaled_tasks, "norms and residual adds shard along the sequence too"


def test_sequence_parallel_gathers_the_residual_stream_where_it_leaves_the_blocks(dense):
    graph, units = dense
    out = tensor(graph, units, 2, sequence_parallel=True)
    note = out.last_note(TensorParallelChange)
    ends = the_ends(note.collectives)
    assert len(ends) == 2 * STEPS and set(ends["nbytes"]) == {BATCH * LENGTH * D_MODEL * 4}, "the whole activation"
    edges, tasks = out.edges, out.tasks
    unit_of = with_collectives(units, out, note.collectives).task_unit
    for tid, unit, phase in zip(ends["task"], ends["unit"], ends["phase"]):
        into = edges[(edges["dst"] == tid) & (edges["kind"] == int(EdgeKind.USER))]["src"].tolist()
        out_of = edges[(edges["src"] == tid) & (edges["kind"] == int(EdgeKind.USER))]["dst"].tolist()
        assert len(into) == 1 and len(out_of) == 1 and unit_of[into[0]] == unit, "after the block's last task"
        assert unit_of[out_of[0]] != unit, "before what runs replicated after it"
    plain = tensor(graph, units, 2).last_note(TensorParallelChange)
    assert "all_gather" not in set(plain.collectives["op"])


@pytest.mark.parametrize("grads", ["coalesced", "per_parameter"])
def test_sequence_parallel_all_reduces_the_norms_and_row_biases_gradients_before_the_step(dense, grads):
    graph, units = dense
    out = tensor_sp(graph, units, 2, grads)
    note = out.last_note(TensorParallelChange)
    step = note.collectives[note.collectives["phase"] == PHASE_OPTIMIZER]
    # by hand: per block two LayerNorms (weight, bias) and, in Megatron-LM's way (coalesced), two
    # row-parallel biases (attention.out, mlp.2), each D_MODEL float32 values; DTensor adds a
    # row-parallel bias to the partial output before the reduce-scatter, so its gradient comes
    # from the gathered output gradient, whole (checked on the lab: 16 all-reduces a step for
    # the 4 blocks' norms)
    per_parameter = D_MODEL * 4
    each = 6 if grads == "coalesced" else 4
    assert note.replicated_parameters == each * BLOCKS
    assert set(step["op"]) == {"all_reduce"} and sorted(set(step["iteration"])) == list(range(STEPS))
    if grads == "coalesced":
        assert (step.groupby("iteration")["nbytes"].agg(["size", "sum"]).to_numpy() == [1, each * BLOCKS * per_parameter]).all()
    else:
        assert set(step["nbytes"]) == {per_parameter} and (step.groupby("iteration").size() == each * BLOCKS).all()
    # each holds the iteration's first optimizer task, on the thread that steps
    edges, tasks = out.edges, out.tasks
    context = tasks["context"].astype(str).to_numpy()
    schedule = simulate(out)
    for tid in step["task"]:
        after = edges[(edges["src"] == tid) & (edges["kind"] == int(EdgeKind.USER))]["dst"].tolist()
        assert len(after) == 1 and "Optimizer" in context[after[0]]
        assert schedule.start_us[after[0]] >= schedule.end_us[tid] - 1e-6
    without = tensor(graph, units, 2).last_note(TensorParallelChange)
    assert without.replicated_parameters == 0 and PHASE_OPTIMIZER not in set(without.collectives["phase"])


def test_the_collectives_sit_on_the_critical_path_of_the_thread(dense):
    graph, units = dense
    out = tensor(graph, units, 4)
    note = out.last_note(TensorParallelChange)
    edges, tasks = out.edges, out.tasks
    operator = tasks["operator"].astype(str).to_numpy()
    for tid, phase in zip(note.collectives["task"], note.collectives["phase"]):
        into = edges[(edges["dst"] == tid) & (edges["kind"] == int(EdgeKind.USER))]["src"].tolist()
        out_of = edges[(edges["src"] == tid) & (edges["kind"] == int(EdgeKind.USER))]["dst"].tolist()
        assert len(into) == 1 and len(out_of) == 1
        assert tasks["resource"].iat[into[0]] == tasks["resource"].iat[out_of[0]], "the thread waits for it"
        if phase == PHASE_FORWARD:  # after the row-parallel layer's last task
            assert operator[into[0]] == "aten::linear"
    schedule = simulate(out)
    for tid in note.collectives["task"]:
        after = edges[(edges["src"] == tid)]["dst"].iat[0]
        assert schedule.start_us[after] >= schedule.end_us[tid] - 1e-6


def test_the_librarys_host_time_lengthens_each_pairs_row_call_backward_node_and_the_step(dense):
    graph, units = dense
    plain = tensor(graph, units, 2)
    per_pair = (300.0, 500.0, 70.0)
    par = Parallelism(data=4, tensor=2, tensor_dispatch=per_pair)
    out = apply_tensor(graph, units, par, FAST, {"tensor": (0, 1)})
    note = out.last_note(TensorParallelChange)
    pairs = note.pairs // STEPS
    assert pairs == 2 * BLOCKS
    added = out.tasks["duration_us"].to_numpy() - plain.tasks["duration_us"].to_numpy()
    assert note.dispatch_us == pytest.approx(added.sum()) == pytest.approx(STEPS * pairs * sum(per_pair))
    grew = np.flatnonzero(added > 1e-9)
    operator = out.tasks["operator"].astype(str).to_numpy()[grew]
    phase = np.asarray(units.task_phase)[grew]
    # forward: each pair's row-parallel linear; backward: its column layer's backward node; one
    # optimizer task per iteration takes the step's share of every pair
    assert sorted(added[grew][phase == PHASE_FORWARD]) == [300.0] * (STEPS * pairs)
    assert set(operator[phase == PHASE_FORWARD]) == {"aten::linear"}
    assert sorted(added[grew][phase == PHASE_BACKWARD]) == [500.0] * (STEPS * pairs)
    assert sorted(added[grew][phase == PHASE_OPTIMIZER]) == pytest.approx([70.0 * pairs] * STEPS)
    assert int(TaskKind.COMM) not in set(out.tasks["kind"].to_numpy()[grew])  # host tasks, not transfers
    assert simulate(out).makespan_us >= simulate(plain).makespan_us + 0.9 * note.dispatch_us  # on the thread's path
    assert "host time added" in note.describe()


def test_the_librarys_collective_host_time_lengthens_the_cpu_task_each_collective_follows(dense):
    graph, units = dense
    plain = tensor(graph, units, 2, sequence_parallel=True)
    par = Parallelism(data=4, tensor=2, sequence_parallel=True, tensor_collective=250.0)
    out = apply_tensor(graph, units, par, FAST, {"tensor": (0, 1)})
    note = out.last_note(TensorParallelChange)
    collectives = note.collectives["task"].to_numpy()
    added = out.tasks["duration_us"].to_numpy()[:len(plain.tasks)] - plain.tasks["duration_us"].to_numpy()
    assert note.issue_us == pytest.approx(added.sum()) == pytest.approx(250.0 * len(collectives))
    edges = out.edges[out.edges["kind"] == int(EdgeKind.USER)]
    issuers = edges[edges["dst"].isin(collectives)]["src"].to_numpy()
    expected = np.zeros(len(plain.tasks))
    np.add.at(expected, issuers, 250.0)
    assert added == pytest.approx(expected)  # on the task each collective follows, once per collective it issues
    assert int(TaskKind.COMM) not in set(out.tasks["kind"].to_numpy()[np.flatnonzero(added)])
    assert simulate(out).makespan_us >= simulate(plain).makespan_us + 0.9 * note.issue_us  # the thread waits on them
    assert "issuing its collectives" in note.describe()
    with pytest.raises(Exception, match="parallelism.tensor_dispatch.collective"):
        Parallelism(data=4, tensor=2, tensor_collective=-1.0)


def test_the_librarys_host_time_is_three_durations_not_below_zero():
    with pytest.raises(Exception, match="parallelism.tensor_dispatch"):
        Parallelism(data=4, tensor=2, tensor_dispatch=(1.0, -1.0, 0.0))
    with pytest.raises(Exception, match="parallelism.tensor_dispatch"):
        Parallelism(data=4, tensor=2, tensor_dispatch=(1.0, 2.0))


def test_gemm_time_shrinks_and_the_step_gets_faster_with_more_tensor_ranks_on_nvlink(dense):
    graph, units = dense
    names = graph.tasks["name"].astype(str).to_numpy()
    in_units = (units.task_unit >= 0) & np.isin(units.task_phase, [PHASE_FORWARD, PHASE_BACKWARD])
    gemm = np.flatnonzero(in_units & np.isin(names, ["aten::addmm", "aten::mm"]))
    traced = graph.tasks["duration_us"].to_numpy()[gemm].sum()
    makespans = [simulate(graph).end_us.max()]
    for t in (2, 4, 8):
        out = tensor(graph, units, t)
        shrunk = out.tasks["duration_us"].to_numpy()[gemm].sum()
        assert shrunk < traced * (1 / t + 0.15), f"the blocks' GEMMs at t={t}"
        makespans.append(simulate(out).end_us.max())
    assert all(a > b for a, b in zip(makespans, makespans[1:])), makespans


def test_one_tensor_rank_leaves_the_graph_as_it_is(dense):
    graph, units = dense
    assert apply_tensor(graph, units, Parallelism(data=8), FAST, {"tensor": (0,)}) is graph
    with pytest.raises(GraphError, match="parallelism.tensor: 2 ranks"):
        apply_tensor(graph, units, Parallelism(data=4, tensor=2), FAST, {"tensor": (0, 1, 2)})


def test_a_shard_divides_the_dimension_megatron_splits():
    assert shard_dims("aten::linear", [[4, 16, 64], [192, 64], [192]], 2) == [[4, 16, 64], [96, 64], [96]]
    assert shard_dims("aten::addmm", [[192], [64, 64], [64, 192]], 4) == [[48], [64, 64], [64, 48]]
    assert shard_dims("aten::mm", [[64, 192], [192, 64]], 2) == [[64, 192], [192, 32]]
    assert shard_dims("aten::bmm", [[16, 16, 16], [16, 16, 16]], 4) == [[4, 16, 16], [4, 16, 16]]
    q = [4, 4, 16, 16]
    assert shard_dims("aten::scaled_dot_product_attention", [q, q, q], 2) == [[4, 2, 16, 16]] * 3
    assert shard_dims("aten::gelu", [[64, 256], []], 2) == [[64, 128], []]
    assert shard_dims("aten::linear", [[4, 16, 64], [10, 64], [10]], 4) is None, "10 outputs do not split 4 ways"


def test_with_operator_models_a_cpu_shard_takes_its_roofline_ratio(dense, quick_models_file):
    graph, units = dense
    plain = tensor(graph, units, 2).tasks["duration_us"].to_numpy()[:len(graph.tasks)]
    out = apply_tensor(graph, units, Parallelism(data=4, tensor=2), FAST, {"tensor": (0, 1)},
                       models=load_models(quick_models_file))
    assert "roofline" in out.last_note(TensorParallelChange).rule
    before = graph.tasks["duration_us"].to_numpy()
    after = out.tasks["duration_us"].to_numpy()[:len(graph.tasks)]
    shrunk = np.flatnonzero(plain < before)
    assert np.array_equal(np.flatnonzero(after < before - 1e-12), shrunk), "the same tasks shrink"
    ratio = after[shrunk] / before[shrunk]
    assert (ratio <= 1 + 1e-9).all() and (ratio > 0.4).all()
    assert not np.allclose(ratio, 0.5), "small shards are memory bound: the roofline keeps more than half"


def test_in_a_mixture_of_experts_block_only_attention_is_tensor_parallel(moe):
    graph, units = moe
    note = tensor(graph, units, 2).last_note(TensorParallelChange)
    assert (per_block(note.collectives) == 1).all() and len(note.collectives) == 2 * BLOCKS * STEPS
    assert note.pairs == BLOCKS * STEPS, "QKV and out; the router stays replicated, the experts are the expert pass's"


# -- expert parallelism ---------------------------------------------------------------------------


def test_expert_parallel_all_to_alls_around_each_moe_layer_of_the_buffer(moe):
    graph, units = moe
    _, moe_module = examples()
    experts, top_k, factor = moe_module.NUM_EXPERTS, moe_module.TOP_K, moe_module.CAPACITY_FACTOR
    capacity = math.ceil(factor * top_k * BATCH * LENGTH / experts)
    out = apply_expert(graph, units, Parallelism(data=4, expert=2), FAST, {"expert": (0, 1)})
    note = out.last_note(ExpertParallelChange)
    assert note.experts == experts and note.layers == BLOCKS * STEPS
    counts = note.collectives.groupby(["unit", "iteration", "phase"]).size()
    assert len(counts) == BLOCKS * STEPS * 2 and (counts == 2).all(), "dispatch and combine, forward and backward"
    assert len(note.collectives) == 4 * BLOCKS * STEPS and set(note.collectives["op"]) == {"all_to_all"}
    assert set(note.collectives["nbytes"]) == {experts * capacity * D_MODEL * 4}
    comm = out.tasks.iloc[note.collectives["task"].to_numpy()]
    assert set(comm["resource"].astype(str)) == {"network expert"}
    assert np.allclose(comm["duration_us"], collective_cost(FAST, "all_to_all", experts * capacity * D_MODEL * 4,
                                                            ranks=(0, 1)).time_us)


def test_data_parallelism_reduces_a_ranks_own_experts_over_their_replicas_only(moe):
    """Beside expert parallelism a rank holds 1/ep of the experts: the data group reduces the
    other parameters, and an expert's gradient goes over the ranks that hold the same expert
    (``expert_data``), none where every rank of the data group holds its own (Megatron's
    expert-data-parallel group; the lab's DDP leaves the experts out)."""
    graph, units = moe
    experts, others = expert_and_other_bytes(graph)
    assert experts > others > 0, "the MoE blocks' experts hold most of the model"

    one_each = apply_fsdp(graph, units, Parallelism(data=2, expert=2), FAST, {"data": (0, 1), "expert_data": (0,)})
    note = one_each.last_note(ShardedDataParallel)
    assert set(note.collectives["group"]) == {"data"}
    assert np.allclose(note.collectives.groupby("iteration")["nbytes"].sum(), others)
    assert note.optimizer_scale == pytest.approx((others + experts / 2) / (others + experts)), "a rank steps its own"

    replicas = apply_fsdp(graph, units, Parallelism(data=4, expert=2), FAST,
                          {"data": (0, 1, 2, 3), "expert_data": (0, 2)})
    c = replicas.last_note(ShardedDataParallel).collectives
    per_group = c.groupby(["iteration", "group"])["nbytes"].sum().unstack()
    assert np.allclose(per_group["data"], others) and np.allclose(per_group["expert_data"], experts / 2)
    own = c[c["group"] == "expert_data"]
    priced = [collective_cost(FAST, "all_reduce", b, ranks=(0, 2)).time_us for b in own["nbytes"]]
    assert np.allclose(replicas.tasks["duration_us"].to_numpy()[own["task"].to_numpy()], priced)
    names = replicas.tasks["name"].astype(str).to_numpy()[own["task"].to_numpy()]
    assert all(comm_dimension(n) == "data" for n in names), "reported with the data-parallel reduction"


def test_a_list_of_tensors_counts_its_tensors_bytes_together(moe):
    """``torch.stack`` of the experts' outputs reads a TensorList: its bytes are its tensors',
    not the product of every dimension of every tensor (1e19 bytes, which made a MoE block's
    activations 2e12 GB)."""
    graph, units = moe
    ops = graph.ops
    rows = [r for r in ops.index[(ops["name"] == "aten::stack").to_numpy()] if ops.at[r, "input_dims"]]
    assert rows, "the experts' outputs are stacked"
    for row in rows:
        tensors = decode_inputs(ops.at[row, "input_dims"])[0]
        assert first_input_bytes(ops, row) == 4 * sum(math.prod(shape) for shape in tensors)
    total = float(units.table["param_bytes"].sum())
    assert (units.table["activation_bytes"] < total).all(), "a block's output, not a product of a list"


def test_fsdp_beside_expert_parallelism_shards_a_ranks_experts_over_their_replicas(moe):
    """FSDP (zero 3) with data 4, expert 2: the other parameters gathered and reduce-scattered
    over the data group, a rank's half of the experts over the two ranks that hold it."""
    graph, units = moe
    experts, others = expert_and_other_bytes(graph)
    out = apply_fsdp(graph, units, Parallelism(data=4, expert=2, zero=3), FAST,
                     {"data": (0, 1, 2, 3), "expert_data": (0, 2)})
    c = out.last_note(ShardedDataParallel).collectives
    per = c.groupby(["iteration", "group", "op", "phase"])["nbytes"].sum()
    for it in range(STEPS):
        assert per[it, "data", "all_gather", "forward"] == pytest.approx(others)
        assert per[it, "data", "reduce_scatter", "backward"] == pytest.approx(others)
        for op, phase in (("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")):
            assert per[it, "expert_data", op, phase] == pytest.approx(experts / 2)
    assert simulate(out).makespan_us > 0


def test_another_ranks_experts_write_no_gradient_here(moe):
    """The autograd engine writes an expert's gradients after its backward nodes (AccumulateGrad
    of fc1's bias, TBackward0, of its weight): for the other ranks' experts those take no time on
    this rank either, and the note lists them, so that a pipeline adds no later microbatch into
    them (sim/parallel/pipeline.py)."""
    graph, units = moe
    _, moe_module = examples()
    ep, experts = 2, moe_module.NUM_EXPERTS
    out = apply_expert(graph, units, Parallelism(data=4, expert=ep), FAST, {"expert": (0, 1)})
    note = out.last_note(ExpertParallelChange)
    tasks = out.tasks
    writes = np.flatnonzero((tasks["name"].astype(str) == "torch::autograd::AccumulateGrad").to_numpy())
    gone = np.intersect1d(writes, note.elsewhere)
    assert (tasks["duration_us"].to_numpy()[gone] == 0).all()
    events = np.unique(tasks["event"].to_numpy()[gone])
    # weight and bias of two linears of each other rank's expert, in every block and step
    assert len(events) == (experts - experts // ep) * 4 * BLOCKS * STEPS
    parameters = graph.workload.parameters
    size = parameters["numel"].astype(float) * parameters["element_size"].astype(float)
    others = parameters["name"].astype(str).str.contains(r"experts\.[23]\.").to_numpy()
    assert sum(first_input_bytes(graph.ops, int(e)) for e in events) == float(size[others].sum()) * STEPS


def test_a_rank_runs_its_local_experts_on_every_ranks_tokens(moe):
    graph, units = moe
    _, moe_module = examples()
    ops = graph.ops
    name = ops["name"].astype(str)
    windows = list(zip(ops.loc[name == "moe.dispatch", "start_us"], ops.loc[name == "moe.combine", "start_us"]))
    addmm = graph.tasks["name"].astype(str).to_numpy() == "aten::addmm"
    start = graph.tasks["measured_start_us"].to_numpy()
    for ep in (2, 4):
        out = apply_expert(graph, units, Parallelism(data=4, expert=ep), FAST, {"expert": tuple(range(ep))})
        before, after = graph.tasks["duration_us"].to_numpy(), out.tasks["duration_us"].to_numpy()[:len(graph.tasks)]
        for lo, hi in windows:
            mine = np.flatnonzero(addmm & (start >= lo) & (start < hi))
            kept = mine[after[mine] > 0]
            # the traced experts each have two linears; a rank keeps E / ep of them at ep times the rows
            assert len(kept) * ep == len(mine)
            assert np.allclose(after[kept], ep * before[kept])
    assert apply_expert(graph, units, Parallelism(data=8), FAST, {"expert": (0,)}) is graph
    with pytest.raises(GraphError, match="does not divide the 4 experts"):
        apply_expert(graph, units, Parallelism(data=8, expert=8), FAST, {"expert": tuple(range(8))})


def test_tensor_then_expert_parallel_compose_on_one_rank(moe):
    graph, units = moe
    par = Parallelism(data=4, tensor=2, expert=2)
    ranks = {"tensor": (0, 1), "expert": (0, 2)}
    tp = apply_tensor(graph, units, par, FAST, ranks)
    tp_units = with_collectives(units, tp, tp.last_note(TensorParallelChange).collectives)
    assert len(tp_units.task_unit) == len(tp.tasks)
    both = apply_expert(tp, tp_units, par, FAST, ranks)
    assert len(both.last_note(TensorParallelChange).collectives) == 2 * BLOCKS * STEPS
    assert len(both.last_note(ExpertParallelChange).collectives) == 4 * BLOCKS * STEPS
    comm = both.tasks["resource"].astype(str).value_counts()
    assert comm["network tensor"] == 2 * BLOCKS * STEPS and comm["network expert"] == 4 * BLOCKS * STEPS
    assert simulate(both).end_us.max() > 0


def test_sharded_embeddings_exchange_the_pooled_lookups_forward_and_backward(tmp_path):
    graph, units = capture("bags", tmp_path)
    out = apply_expert(graph, units, Parallelism(data=2, expert=2), FAST, {"expert": (0, 1)})
    note = out.last_note(ExpertParallelChange)
    assert note.kind == "embeddings" and note.layers == STEPS
    counts = note.collectives.groupby(["iteration", "phase"]).size()
    assert len(counts) == 2 * STEPS and (counts == 1).all()
    assert set(note.collectives["nbytes"]) == {TABLES * BATCH * BAG_DIM * 4}, "every table's pooled [batch, dim]"
    ranks = TABLES + 1  # more ranks than tables: some would hold none
    with pytest.raises(GraphError, match=f"{TABLES} embedding lookups an iteration, fewer tables than the {ranks} ranks"):
        apply_expert(graph, units, Parallelism(data=ranks, expert=ranks), FAST, {"expert": tuple(range(ranks))})


# -- a shared GPU trace ---------------------------------------------------------------------------


DLRM = SHARED_TRACES / "param-dlrm-8rank" / "worker0.json.gz"


@pytest.mark.skipif(not DLRM.exists(), reason=f"the shared DLRM traces are not at {DLRM}")
def test_on_a_gpu_trace_the_all_reduce_waits_for_the_gemm_kernel_and_blocks_the_stream():
    graph = build_graph(load_trace(DLRM))
    # DLRM's MLPs under DistributedDataParallel.forward: one unit (no module names); its backward
    # joins it by autograd sequence numbers, so each of the 3 pairs all-reduces forward and backward
    units = find_units(graph, r"DistributedDataParallel\.forward")
    out = apply_tensor(graph, units, Parallelism(data=4, tensor=2), FAST, {"tensor": (0, 1)})
    note = out.last_note(TensorParallelChange)
    assert note.pairs == 3 and note.unmatched_backward == 0
    assert note.collectives.groupby("phase").size().to_dict() == {PHASE_FORWARD: 3, PHASE_BACKWARD: 3}
    tasks, edges = out.tasks, out.edges
    for tid in note.collectives["task"]:
        src = edges.loc[edges["dst"] == tid, "src"].iat[0]
        dst = edges.loc[edges["src"] == tid, "dst"].iat[0]
        assert tasks["kind"].iat[src] == int(TaskKind.KERNEL) and tasks["kind"].iat[dst] == int(TaskKind.KERNEL)
        assert tasks["resource"].iat[src] == tasks["resource"].iat[dst], "the compute stream waits for it"
    kernels = graph.tasks["kind"].to_numpy() == int(TaskKind.KERNEL)
    halved = np.isclose(out.tasks["duration_us"].to_numpy()[:len(graph.tasks)], graph.tasks["duration_us"].to_numpy() / 2)
    assert (halved & kernels).sum() >= 6, "the paired GEMMs' kernels, at least"
    with pytest.raises(GraphError, match="parallelism.tensor: no pair of linear layers"):
        apply_tensor(graph, find_units(graph, r"## optimizer ##|Optimizer\.step"), Parallelism(data=4, tensor=2), FAST,
                     {"tensor": (0, 1)})
    with pytest.raises(GraphError, match="no mixture-of-experts layer"):
        apply_expert(graph, units, Parallelism(data=8, expert=8), FAST, {"expert": tuple(range(8))})


# -- a rank's collectives sharing its NIC -----------------------------------------------------------


def test_two_collectives_in_flight_at_once_each_get_half_the_nic():
    """Engine-level (a synthetic graph): two collectives of 100 us on two queues of one rank
    start together and so last 200 each; the one after them on a queue overlaps nothing."""
    from test_engine import make_graph

    from whatif.sim.parallel.job import with_nic_sharing

    graph = make_graph([("all_to_all expert", "network expert", 100.0),
                        ("all_reduce data", "network data: all_reduce", 100.0),
                        ("all_reduce data", "network data: all_reduce", 50.0)])
    shared = with_nic_sharing(graph, simulate(graph), np.arange(3), np.array([0, 1, 1]), np.zeros(3, dtype=int))
    assert list(graph.tasks["duration_us"]) == [200.0, 200.0, 50.0]
    assert list(shared.end_us) == [200.0, 200.0, 250.0]


def test_the_experts_exchange_and_the_data_parallel_reduction_share_the_nic(tmp_path, monkeypatch):
    """On the MoE capture at 2 machines x 1 worker (expert 2 = data 2), DDP's all-reduce runs
    during backward beside the all-to-alls, over the same NIC (the lab's EP run at 200 Mbps
    spent 851 ms in backward, the two one after the other): sharing lengthens the step; on one
    machine (loopback) nothing crosses a NIC and nothing changes."""
    from whatif.pipeline import predict
    from whatif.scenario import Scenario
    from whatif.sim.parallel import job

    capture("moe", tmp_path)

    def step(machines, gpus):
        doc = {"trace": str(tmp_path / "moe.bundle"), "framework": "ddp",
               "cluster": {"machines": machines, "gpus_per_machine": gpus, "intra_node": {"bandwidth": "40Gbps", "latency": "20us"},
                           "inter_node": {"bandwidth": "200Mbps", "latency": "50us"}},
               "parallelism": {"data": 2, "expert": 2, "units": r"blocks\.\d+"}}
        return float(predict(Scenario.from_dict(doc, name="ep.yaml").request()).results["iteration_ms"].iloc[0])

    shared_2x1, shared_1x2 = step(2, 1), step(1, 2)
    monkeypatch.setattr(job, "nic_users", lambda *args: None)
    alone_2x1, alone_1x2 = step(2, 1), step(1, 2)
    assert shared_2x1 > 1.02 * alone_2x1
    assert shared_1x2 == alone_1x2
