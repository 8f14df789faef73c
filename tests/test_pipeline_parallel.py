"""Pipeline parallelism (``sim/parallel/pipeline.py``): schedules against their closed forms on a
synthetic model, and the pass's structure on a real trace."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from whatif.sim.engine import simulate
from whatif.sim.graph import EdgeKind, TaskGraph, TaskKind
from whatif.sim.parallel.pipeline import (
    BACKWARD,
    FORWARD,
    PipelineSchedule,
    Slot,
    apply_pipeline,
    bubbles,
    partition_units,
    schedule_order,
)
from whatif.sim.workload import Workload


def synthetic(n_units: int, forward_us: float, backward_us: float, activation_bytes: float = 0.0):
    """One iteration of a model of ``n_units`` equal units on one CPU thread: every unit's forward
    task, then every unit's backward task in reverse, chained; and its Units."""
    names, unit, phase = [], [], []
    for u in range(n_units):
        names.append((f"forward {u}", forward_us)); unit.append(u); phase.append(FORWARD)
    for u in reversed(range(n_units)):
        names.append((f"backward {u}", backward_us)); unit.append(u); phase.append(BACKWARD)
    rows = [{"name": name, "kind": int(TaskKind.CPU), "resource": "cpu 1/1", "duration_us": float(dur),
             "release_us": -np.inf, "order_key": float(i), "measured_start_us": np.nan, "measured_end_us": np.nan,
             "context": "", "operator": "", "layer": "", "event": -1} for i, (name, dur) in enumerate(names)]
    tasks = pd.DataFrame(rows).astype({c: "category" for c in ("name", "resource", "context", "operator", "layer")})
    tasks["kind"] = tasks["kind"].astype(np.int8)
    n = len(rows)
    edges = pd.DataFrame({"src": np.arange(n - 1, dtype=np.int64), "dst": np.arange(1, n, dtype=np.int64),
                          "lag_us": np.zeros(n - 1), "kind": np.full(n - 1, int(EdgeKind.USER), dtype=np.int8)})
    table = pd.DataFrame({"unit": range(n_units), "name": [f"blocks.{u}" for u in range(n_units)],
                          "param_bytes": 1.0, "activation_bytes": activation_bytes,
                          "forward_us": forward_us, "backward_us": backward_us})
    units = SimpleNamespace(pattern="blocks", task_unit=np.array(unit), task_phase=np.array(phase), table=table)
    return TaskGraph(tasks, edges, workload=Workload("synthetic")), units


def par(p, m, schedule="1f1b", v=1, partition="balanced"):
    return SimpleNamespace(pipeline=p, microbatches=m, schedule=schedule, virtual_stages=v, partition=partition,
                           units=None, tensor=1)


def run(graph, units, parallelism, cluster=None):
    built = apply_pipeline(graph, units, parallelism, cluster, {"pipeline": tuple(range(parallelism.pipeline))})
    return built, simulate(built)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5), (8, 16)])
def test_bubble_is_the_closed_form(schedule, p, m):
    """Equal stages, free transfers: every stage idles (p-1)/(m+p-1) of the step, whatever the
    forward/backward ratio (here 1:2, traced at the whole batch: m times a microbatch's)."""
    graph, units = synthetic(2 * p, forward_us=3.0 * m, backward_us=6.0 * m)
    built, schedule_ = run(graph, units, par(p, m, schedule))
    table = bubbles(schedule_)
    assert np.allclose(table["bubble"], (p - 1) / (m + p - 1), atol=1e-6)
    assert np.allclose(table["fill_drain"], (p - 1) / (m + p - 1), atol=1e-6)
    assert schedule_.makespan_us == pytest.approx((m + p - 1) * 2 * 9.0)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (2, 6, 3), (4, 8, 4)])
def test_interleaved_bubble_is_the_closed_form(p, m, v):
    """Narayanan et al. 2021: the interleaved schedule's bubble is (1/v)(p-1)/m of the ideal
    time, so (p-1)/(v m + p - 1) of the step."""
    graph, units = synthetic(p * v, forward_us=2.0 * m, backward_us=4.0 * m)
    built, schedule_ = run(graph, units, par(p, m, "interleaved", v))
    table = bubbles(schedule_)
    ideal = m * (2.0 + 4.0) * v  # a device's compute: v chunks of m microbatches
    bubble_time = table["step_us"] - table["busy_us"]
    assert np.allclose(bubble_time / ideal, (p - 1) / (v * m), atol=1e-6)
    assert np.allclose(table["bubble"], (p - 1) / (v * m + p - 1), atol=1e-6)


def test_schedules_run_every_slot_once():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for d in range(4):
            order = schedule_order(schedule, 4, 8, d, v)
            assert len(order) == len(set(order)) == 2 * 8 * v
    assert schedule_order("1f1b", 4, 8, 0)[:4] == [Slot(FORWARD, j, 0) for j in range(4)]
    last = schedule_order("1f1b", 4, 8, 3)
    assert [s.phase for s in last[:4]] == [FORWARD, BACKWARD, FORWARD, BACKWARD]


def test_balanced_partition_minimises_the_largest_stage():
    assert partition_units([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    assert partition_units([2, 2, 2, 1, 1, 1, 1, 1, 1], 3) == [range(0, 2), range(2, 5), range(5, 9)]
    assert partition_units([1] * 6, 2, (2, 4)) == [range(0, 2), range(2, 6)]


def test_unequal_stages_bubble_the_faster_ones_more():
    graph, units = synthetic(4, forward_us=4.0, backward_us=8.0)
    built, schedule_ = run(graph, units, par(2, 4, partition=(1, 3)))
    table = bubbles(schedule_)
    assert table["bubble"].iat[0] > table["bubble"].iat[1]


def test_transfers_cost_and_order():
    from whatif.topology import Cluster

    graph, units = synthetic(4, forward_us=40.0, backward_us=80.0, activation_bytes=4e6)
    free, free_schedule = run(graph, units, par(2, 4))
    note = free.last_note(PipelineSchedule)
    assert len(note.transfers) == 2 * (2 - 1) * 4
    assert (note.transfers["nbytes"] == 1e6).all()  # the boundary activation of a microbatch
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 1, "intra_node": "nvlink2", "inter_node": "25GbE"})
    priced, priced_schedule = run(graph, units, par(2, 4), cluster)
    assert (priced.last_note(PipelineSchedule).transfers["time_us"] > 0).all()
    assert priced_schedule.makespan_us > free_schedule.makespan_us


# -- on a real trace -------------------------------------------------------------------------------

REAL = {
    "convnet bundle": ("data/convnet_cpu.bundle", None),
    "transformer bundle": ("data/transformer_cpu.bundle", None),
    # a GPU trace with module names, its units found by a pattern (its convolutions; the
    # classifier's linear layers, outside them, go with the last stage)
    "vgg13 h100": ("../shared/traces/triosim-vgg13-h100/vgg13_bs512_iter41.json.gz", r"nn\.Module: Conv2d_\d+"),
}


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request):
    """A real trace's graph, its units, and its chosen iteration's simulated time."""
    units_module = pytest.importorskip("whatif.sim.parallel.units", reason="find_units is not merged yet (par-backbone)")
    from trace_corpus import REPO
    from whatif import TraceStudy

    path, pattern = REAL[request.param]
    if not (REPO / path).exists():
        pytest.skip(f"{path} is absent (the shared traces are checked out beside the repository)")
    study = TraceStudy.from_trace(REPO / path)
    units = units_module.find_units(study.graph, pattern)
    return study.graph, units, simulate(study.graph)


def lab_cluster(gpus: int):
    from whatif.topology import Cluster

    return Cluster.from_config({"machines": gpus, "gpus_per_machine": 1, "intra_node": "nvlink2", "inter_node": {"bandwidth": "1Gbps", "latency": "50us"}})


def test_stages_cover_every_unit_once_in_order(real):
    graph, units, _ = real
    n = len(units.table)
    for p in range(1, min(n, 4) + 1):
        built = apply_pipeline(graph, units, par(p, 2), lab_cluster(p), {"pipeline": tuple(range(p))})
        stages = built.last_note(PipelineSchedule).stages
        assert stages["first_unit"].tolist() == [0] + (stages["last_unit"] + 1).tolist()[:-1]
        assert stages["last_unit"].iat[-1] == n - 1
        assert (stages["last_unit"] >= stages["first_unit"]).all()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_send_recv_each_way_per_boundary_and_microbatch(real, schedule):
    graph, units, _ = real
    p, m = min(len(units.table), 3), 4
    built = apply_pipeline(graph, units, par(p, m, schedule), lab_cluster(p), {"pipeline": tuple(range(p))})
    note = built.last_note(PipelineSchedule)
    sends = built.tasks["name"].astype(str).str.startswith("send_recv ").to_numpy()
    assert sends.sum() == len(note.transfers) == 2 * (p - 1) * m
    assert (built.tasks["kind"].to_numpy()[sends] == int(TaskKind.COMM)).all()
    forward = note.transfers[note.transfers["to_stage"] > note.transfers["from_stage"]]
    assert len(forward) == (p - 1) * m and (note.transfers["time_us"] > 0).all()
    # each transfer waits for its stage and holds up the next one
    edges = built.edges
    for task in note.transfers["task"]:
        assert (edges["dst"] == task).any() and (edges["src"] == task).any()
    # every device runs every microbatch's forward and backward of its stage (a task of no time
    # where the trace attributed none to it)
    compute = built.tasks["kind"].to_numpy() != int(TaskKind.COMM)
    for d in range(p):
        for phase in (FORWARD, BACKWARD):
            mine = (note.task_device == d) & (note.task_phase == phase) & compute
            assert sorted(set(note.task_microbatch[mine])) == list(range(m))


def test_one_stage_keeps_the_iteration_time(real):
    graph, units, traced = real
    built = apply_pipeline(graph, units, par(1, 1), None, {"pipeline": (0,)})
    note = built.last_note(PipelineSchedule)
    copied = np.unique(note.task_source[note.task_source >= 0])
    span = traced.end_us[copied].max() - traced.start_us[copied].min()
    assert simulate(built).makespan_us == pytest.approx(span, rel=0.02)


def test_more_microbatches_never_bubble_more(real):
    """The schedule's own bubble (fill and drain: the busiest device's idle) shrinks as microbatches
    are added. A less busy device's idle need not: a microbatch keeps the traced CPU time between
    operators, so the stages' balance moves with m (the transformer's two stages at 4 and 8
    microbatches idle 20 and 20 %, then 25 and 9 %)."""
    graph, units, _ = real
    for p in sorted({2, min(len(units.table), 3)}):
        fill = []
        for m in (1, 2, 4, 8):
            built = apply_pipeline(graph, units, par(p, m), lab_cluster(p), {"pipeline": tuple(range(p))})
            table = bubbles(simulate(built))
            assert np.allclose(table["bubble"], table["fill_drain"] + table["imbalance"])
            assert table["imbalance"].min() == 0.0
            fill.append(table["fill_drain"].iat[0])
        assert all(later <= earlier + 1e-9 for earlier, later in zip(fill, fill[1:])), (p, fill)


def test_the_pass_is_registered_with_the_units_of_its_graph(real):
    from whatif.sim.parallel import PASSES, Parallelism

    graph, units, _ = real
    p = min(len(units.table), 2)
    built, built_units = PASSES["pipeline"](graph, units, Parallelism(pipeline=p, microbatches=4), lab_cluster(p),
                                            {"pipeline": tuple(range(p))})
    note = built.last_note(PipelineSchedule)
    assert len(built_units.task_unit) == len(built_units.task_phase) == len(built.tasks)
    copied = note.task_source >= 0
    assert (built_units.task_unit[copied] == np.asarray(units.task_unit)[note.task_source[copied]]).all()
    sends = (built.tasks["kind"].to_numpy() == int(TaskKind.COMM)) & ~copied
    assert (built_units.task_unit[sends] == -1).all()
    assert built.tasks["name"][sends].astype(str).str.startswith("send_recv pipeline ").all()


def test_parallelize_builds_the_pipeline(real):
    """The backbone's ``parallelize`` applies the registered pass to rank 0's graph: the pipeline
    group's GPUs price the transfers, and the stages run side by side."""
    from whatif.sim.parallel import Parallelism
    from whatif.sim.parallel.job import comm_dimension, parallelize

    graph, units, traced = real
    p = min(len(units.table), 2)
    job = parallelize(graph, units, Parallelism(pipeline=p, microbatches=4), lab_cluster(p))
    assert job.passes == ["pipeline"]
    note = job.graph.last_note(PipelineSchedule)
    sends = job.comm_tasks()[note.task_source[job.comm_tasks()] < 0]
    assert len(sends) == 2 * (p - 1) * 4
    assert {comm_dimension(name) for name in job.graph.tasks["name"].iloc[sends]} == {"pipeline"}
    assert set(note.transfers[["from_device", "to_device"]].itertuples(index=False)) == {(0, 1), (1, 0)}
    table = bubbles(simulate(job.graph))
    assert len(table) == p and (table["bubble"] > 0).all()


class LinearModels:
    """Operator models whose time is the size of an operator's first tensor: linear in the batch."""

    def predict_us(self, ops, dims, types, args, learned=False):
        def size(d):
            first = next((x for x in d if isinstance(x, list) and x and all(isinstance(v, int) for v in x)), None)
            return float(np.prod(first)) if first else 1.0

        return np.array([size(d) for d in dims])


def test_microbatches_scaled_through_the_operator_models(real):
    """On a CPU trace given operator models, a microbatch's operators are rescaled by them (the
    ``--batch-size`` rule, which keeps a unit's fixed helpers: the transformer's embedding
    backward does not shrink), so a microbatch costs less than the batch and no less than the
    linear rule's share."""
    graph, units, _ = real
    if graph.workload.has_gpu:
        pytest.skip("the operator models rescale CPU-only traces")
    parallelism = par(2, 4)
    linear = apply_pipeline(graph, units, parallelism, None, {}).last_note(PipelineSchedule)
    modelled = apply_pipeline(graph, units, parallelism, None, {}, models=LinearModels()).last_note(PipelineSchedule)
    assert modelled.scaling.endswith("by the operator performance models")
    assert linear.scaling.startswith("linear in the batch")
    whole = apply_pipeline(graph, units, par(2, 1), None, {}).last_note(PipelineSchedule)
    for column in ("forward_us", "backward_us"):
        assert (modelled.stages[column] < whole.stages[column]).all()
        assert (modelled.stages[column] > 0.9 * linear.stages[column]).all()


def test_interleaved_stages_alternate_devices(real):
    graph, units, _ = real
    if len(units.table) < 4:
        pytest.skip(f"{len(units.table)} units cannot fill 2 stages of 2 virtual stages")
    p, v, m = 2, 2, 4
    built = apply_pipeline(graph, units, par(p, m, "interleaved", v), lab_cluster(p), {"pipeline": (0, 1)})
    note = built.last_note(PipelineSchedule)
    assert note.stages["device"].tolist() == [0, 1, 0, 1]
    assert len(note.transfers) == 2 * (p * v - 1) * m
    assert bubbles(simulate(built))["fill_drain"].iat[0] > 0


# -- a microbatch trace ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_later_backwards_of_a_chunk_add_their_gradients_into_the_first(real, schedule):
    """A stage's backward after its first (microbatch 0's) adds each gradient into the one
    written: on a CPU trace each ``AccumulateGrad`` takes its gradient's bytes (counted here from
    its recorded shape) at the trace's in-place update rate longer; on the GPU trace (whose
    ``AccumulateGrad`` keeps the tensor) each takes one operator's CPU time longer and the
    stage's kernels of that backward together take three times the gradients' bytes at the
    trace's element-wise rate longer. Nothing else changes between microbatches."""
    import json

    from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
    from whatif.sim.gradients import ACCUMULATE_GRAD
    from whatif.sim.parallel.accumulation import elementwise_rate

    graph, units, _ = real
    p, m = min(len(units.table), 2), 4
    built = apply_pipeline(graph, units, par(p, m, schedule), None, {})
    note = built.last_note(PipelineSchedule)
    duration = built.tasks["duration_us"].to_numpy()
    backward = (note.task_phase == BACKWARD) & (note.task_source >= 0)
    first = {(d, s): t for t, d, s in zip(np.flatnonzero(backward & (note.task_microbatch == 0)),
                                          note.task_device[backward & (note.task_microbatch == 0)],
                                          note.task_source[backward & (note.task_microbatch == 0)])}
    gpu = graph.workload.has_gpu
    if gpu:
        bytes_per_us, cpu_us = elementwise_rate(graph)
    else:
        rate = pass_rate_bytes_per_us(graph)
    kernel = np.isin(graph.tasks["kind"].to_numpy(), [int(TaskKind.KERNEL)])
    names = graph.tasks["name"].astype(str).to_numpy()
    events = graph.tasks["event"].to_numpy()
    seen, added = set(), 0
    kernels_extra, kernels_expected = {}, {}
    for t in np.flatnonzero(backward & (note.task_microbatch > 0)):
        source = note.task_source[t]
        slot = (note.task_device[t], note.task_microbatch[t])
        extra = duration[t] - duration[first[(note.task_device[t], source)]]
        if kernel[source]:
            kernels_extra[slot] = kernels_extra.get(slot, 0.0) + extra
            continue
        expected = 0.0
        if names[source] == ACCUMULATE_GRAD and (slot, events[source]) not in seen:
            seen.add((slot, events[source]))  # an operator cut into several tasks: once
            dims, types = (json.loads(graph.ops.loc[events[source], c]) for c in ("input_dims", "input_types"))
            assert types[0] == "float"
            nbytes = float(np.prod(dims[0])) * 4
            expected = cpu_us if gpu else nbytes / rate
            if gpu:
                kernels_expected[slot] = kernels_expected.get(slot, 0.0) + 3 * nbytes / bytes_per_us
            added += expected > 0
        assert extra == pytest.approx(expected, rel=1e-9, abs=1e-9), names[source]
    assert added >= (m - 1) * (1 if gpu else p)  # every stage holds parameters (the GPU trace's backward: the last)
    if gpu:
        assert kernels_extra.keys() == kernels_expected.keys()
        for slot, expected in kernels_expected.items():
            assert kernels_extra[slot] == pytest.approx(expected, rel=1e-9), slot
    else:
        assert not any(kernels_extra.values())


def test_a_tensor_parallel_rank_adds_only_its_shard_of_a_units_gradients():
    """Tensor parallel 2 with a pipeline on the transformer bundle (CPU): a rank holds half of
    each unit's parameters (the memory count's rule), so each later ``AccumulateGrad`` of a
    unit's gradient adds half its traced bytes (counted here from its recorded shape) at the
    trace's in-place update rate; a gradient outside the units (the embeddings, the head) is
    replicated and adds all of it."""
    import json

    from trace_corpus import REPO
    from whatif import TraceStudy
    from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
    from whatif.sim.gradients import ACCUMULATE_GRAD
    from whatif.sim.parallel import Parallelism
    from whatif.sim.parallel.job import parallelize
    from whatif.sim.parallel.units import find_units
    from whatif.topology import Cluster

    graph = TraceStudy.from_trace(REPO / "data/transformer_cpu.bundle").graph
    units = find_units(graph)
    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 2, "intra_node": "nvlink2",
                                   "inter_node": {"bandwidth": "10Gbps", "latency": "50us"}})
    job = parallelize(graph, units, Parallelism(tensor=2, pipeline=2, microbatches=4), cluster)
    assert job.passes == ["tensor", "pipeline"]
    note = job.graph.last_note(PipelineSchedule)
    assert "gradients split over the tensor group" in note.accumulation
    rate = pass_rate_bytes_per_us(graph)
    unit_of_event = {int(e): int(u) for e, u in zip(graph.tasks["event"].to_numpy(), units.task_unit) if e >= 0}
    duration = job.graph.tasks["duration_us"].to_numpy()
    names = job.graph.tasks["name"].astype(str).to_numpy()
    events = job.graph.tasks["event"].to_numpy()
    backward = (note.task_phase == BACKWARD) & (note.task_source >= 0)
    first = {(d, s): t for t, d, s in zip(np.flatnonzero(backward & (note.task_microbatch == 0)),
                                          note.task_device[backward & (note.task_microbatch == 0)],
                                          note.task_source[backward & (note.task_microbatch == 0)])}
    extra = {}
    for t in np.flatnonzero(backward & (note.task_microbatch > 0) & (names == ACCUMULATE_GRAD)):
        key = (int(events[t]), int(note.task_microbatch[t]))
        extra[key] = extra.get(key, 0.0) + duration[t] - duration[first[(note.task_device[t], note.task_source[t])]]
    split = {True: 0, False: 0}
    for (event, _), added in extra.items():
        dims, types = (json.loads(graph.ops.loc[event, c]) for c in ("input_dims", "input_types"))
        assert types[0] == "float"
        in_unit = unit_of_event[event] >= 0
        expected = float(np.prod(dims[0])) * 4 / rate / (2 if in_unit else 1)
        assert added == pytest.approx(expected, rel=1e-9), (event, in_unit)
        split[in_unit] += 1
    assert split[True] > 0 and split[False] > 0


def test_a_gpu_traces_element_wise_kernels_move_memory_near_its_gpus_bandwidth():
    """The rate a GPU trace's gradient adds are priced at (bytes read and written over the time
    of its element-wise kernels) is a large part of its GPU's memory bandwidth and no more: the
    VGG13 H100 trace's bias adds against the H100 SXM's 3.35 TB/s, the ResNet-50 V100 trace's
    gradient adds against the V100's 900 GB/s (the datasheets)."""
    from trace_corpus import REPO
    from whatif import TraceStudy
    from whatif.sim.parallel.accumulation import elementwise_rate

    for path, bandwidth in (("../shared/traces/triosim-vgg13-h100/vgg13_bs512_iter41.json.gz", 3.35e6),
                            ("../shared/traces/kineto-resnet50-v100/resnet50_bs32_workers0.pt.trace.json.gz", 0.9e6)):
        if not (REPO / path).exists():
            pytest.skip(f"{path} is absent (the shared traces are checked out beside the repository)")
        bytes_per_us, cpu_us = elementwise_rate(TraceStudy.from_trace(REPO / path).graph)
        assert 0.5 * bandwidth < bytes_per_us <= bandwidth, path
        assert 2.0 < cpu_us < 200.0  # an operator's dispatch and launch


def test_a_traced_accumulate_grad_that_adds_already_is_not_priced_again():
    """The ResNet-50 V100 trace zeroed its gradients (each ``AccumulateGrad`` runs an
    ``aten::add_``): a pipeline's later backwards hold that add already, and nothing is added;
    the VGG13 H100 trace's ``AccumulateGrad`` keeps the tensor (``aten::detach`` inside): none
    adds."""
    from trace_corpus import REPO
    from whatif import TraceStudy
    from whatif.sim.gradients import ACCUMULATE_GRAD
    from whatif.sim.parallel.accumulation import accumulation, already_adds

    for path, adds in (("../shared/traces/kineto-resnet50-v100/resnet50_bs32_workers0.pt.trace.json.gz", True),
                       ("../shared/traces/triosim-vgg13-h100/vgg13_bs512_iter41.json.gz", False)):
        if not (REPO / path).exists():
            pytest.skip(f"{path} is absent (the shared traces are checked out beside the repository)")
        graph = TraceStudy.from_trace(REPO / path).graph
        events = graph.ops.index[graph.ops["name"] == ACCUMULATE_GRAD].to_numpy()
        assert len(events) > 20
        assert (already_adds(graph, events) == adds).all(), path
        everything = accumulation(graph, np.ones(len(graph.tasks), dtype=bool))
        assert (everything.extra_us is None) == adds, everything.rule
        assert ("already adds" in everything.rule) == adds


def _rescaled(graph, factor: float):
    """``graph`` with every task ``factor`` times as long: a stand-in for the same model traced at
    a microbatch (the same units, tasks and order)."""
    out = graph.copy()
    out.tasks["duration_us"] = out.tasks["duration_us"] * factor
    return out


def test_a_microbatch_trace_gives_each_unit_phase_its_measured_time(real):
    """With the trace itself as the microbatch trace every unit keeps its traced forward and
    backward time (m=1's stages) whatever m; with a trace twice as fast it takes half of it, and
    the rule says how many unit phases it measured."""
    graph, units, _ = real
    if graph.workload.has_gpu:
        pytest.skip("its units are found by a pattern; the CPU bundles' by their layers")
    p = min(len(units.table), 2)
    whole = apply_pipeline(graph, units, par(p, 1), None, {}).last_note(PipelineSchedule)
    same = apply_pipeline(graph, units, par(p, 4), None, {}, microbatch=graph).last_note(PipelineSchedule)
    half = apply_pipeline(graph, units, par(p, 4), None, {}, microbatch=_rescaled(graph, 0.5)).last_note(PipelineSchedule)
    assert same.scaling.startswith("from the microbatch trace (")
    measured, groups = (int(n) for n in same.scaling.split("(")[1].split(" unit phases")[0].split(" of "))
    assert 0 < measured == groups
    for column in ("forward_us", "backward_us"):
        assert np.allclose(same.stages[column], whole.stages[column], rtol=1e-9)
        assert np.allclose(half.stages[column], 0.5 * whole.stages[column], rtol=1e-9)


def test_a_microbatch_trace_of_another_model_is_refused(real):
    """The convnet's bundle is no microbatch of the transformer (nor the other way round)."""
    from trace_corpus import REPO
    from whatif import TraceStudy
    from whatif.sim.graph import GraphError

    graph, units, _ = real
    if graph.workload.has_gpu:
        pytest.skip("the CPU bundles are each other's other model")
    other = "convnet" if len(units.table) != len(_bundle_units("convnet")) else "transformer"
    microbatch = TraceStudy.from_trace(REPO / f"data/{other}_cpu.bundle").graph
    with pytest.raises(GraphError, match=r"^the microbatch trace has \d+ units where the trace has \d+: it must be"):
        apply_pipeline(graph, units, par(2, 4), None, {}, microbatch=microbatch)


def _bundle_units(model: str):
    from trace_corpus import REPO
    from whatif import TraceStudy
    from whatif.sim.parallel.units import find_units

    return find_units(TraceStudy.from_trace(REPO / f"data/{model}_cpu.bundle").graph).table


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_slot_with_no_task_still_passes_the_schedules_dependencies_on(schedule):
    """A stage whose units left no backward task in the trace gets, per microbatch, a task of no
    time in its backward slot on the training loop's thread, and the transfers still wait on it."""
    p, m = 2, 3
    graph, units = synthetic(4, 100.0, 200.0, 1e6)
    keep = ~((units.task_phase == BACKWARD) & (units.task_unit <= 2))  # stage 0: units 0-2, no backward
    ids = np.flatnonzero(keep)
    remap = np.full(len(keep), -1)
    remap[ids] = np.arange(len(ids))
    src, dst = remap[graph.edges["src"].to_numpy()], remap[graph.edges["dst"].to_numpy()]
    inside = (src >= 0) & (dst >= 0)
    edges = graph.edges[inside].assign(src=src[inside], dst=dst[inside]).reset_index(drop=True)
    cut = TaskGraph(graph.tasks.iloc[ids].reset_index(drop=True), edges, workload=graph.workload)
    units.task_unit, units.task_phase = units.task_unit[ids], units.task_phase[ids]
    built, schedule_run = run(cut, units, par(p, m, schedule))
    names = built.tasks["name"].astype(str)
    empty = np.flatnonzero(names.str.startswith("empty backward of stage 0").to_numpy())
    assert len(empty) == m
    assert (built.tasks["duration_us"].to_numpy()[empty] == 0).all()
    assert (built.tasks["resource"].astype(str).to_numpy()[empty] == "stage 0: cpu 1/1").all()
    note = built.last_note(PipelineSchedule)
    gradients = note.transfers[note.transfers["from_stage"] == 1]["task"].to_numpy()  # stage 1 -> 0
    waiting = built.edges[np.isin(built.edges["src"], gradients)]["dst"].to_numpy()
    assert set(waiting) == set(empty)  # each gradient sent back is waited for by an empty slot
    ends = dict(zip(empty.tolist(), schedule_run.end_us[empty]))
    for task in waiting:
        sender = built.edges[(built.edges["dst"] == task) & np.isin(built.edges["src"], gradients)]["src"]
        assert ends[task] >= schedule_run.end_us[int(sender.iat[0])]
