"""The scenario's parallelism block, and a parallel configuration through the prediction pipeline."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from trace_corpus import REPO

from whatif.pipeline import Request, predict
from whatif.report.tables import results_table
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.distributed import ClusterConfig
from whatif.sim.graph import TaskKind
from whatif.sim.parallel import PASSES, Parallelism
from whatif.sim.parallel.job import comm_bytes, comm_dimension, comm_name, parallelize
from whatif.sim.parallel.units import PHASE_FORWARD, find_units
from whatif.study import TraceStudy
from whatif.topology import Cluster, collective_cost

TRANSFORMER = REPO / "data" / "transformer_cpu.bundle"  # batch 8
TRANSFORMER_MICRO = REPO / "data" / "transformer_cpu_batch2.bundle"  # the same model at batch 2: a microbatch of 8 in 4
LINKS = {"intra_node": {"bandwidth": "1.5GB/s", "latency": "340us", "efficiency": 0.8},
         "inter_node": {"bandwidth": "100Mbps", "latency": "960us", "efficiency": 0.94}}


def _scenario(parallelism, gpus: int = 4, **extra) -> Scenario:
    doc = {"trace": str(TRANSFORMER), "cluster": {"machines": 1, "gpus_per_machine": gpus, **LINKS},
           "parallelism": parallelism, **extra}
    return Scenario.from_dict(doc, name="s.yaml")


def _tensor_stand_in(graph, units, par, cluster, ranks_of):
    """A stand-in tensor pass, the contract's shape: in every step, an all-reduce of each
    block's output after its forward, priced on rank 0's tensor group, which the next block
    waits for."""
    graph = graph.copy()
    tasks = graph.tasks
    start = tasks["measured_start_us"].to_numpy(dtype=float)
    step = tasks["context"].astype(str).str.extract(r"^(ProfilerStep#\d+)")[0].to_numpy()
    cpu = tasks["kind"].to_numpy() == int(TaskKind.CPU)
    steps = sorted({s for s in step[units.task_unit >= 0] if isinstance(s, str)})
    for name in steps:  # in time order: a resource runs its tasks in the order they were inserted
        for unit in range(len(units)):
            nbytes = float(units.table["activation_bytes"].iat[unit])
            cost = collective_cost(cluster, "all_reduce", nbytes, ranks=ranks_of["tensor"])
            here = units.tasks_of(unit, PHASE_FORWARD)
            here = here[cpu[here] & (step[here] == name)]
            after = units.tasks_of(unit + 1, PHASE_FORWARD) if unit + 1 < len(units) else np.zeros(0, dtype=np.int64)
            after = after[cpu[after] & (step[after] == name)]
            last = int(here[np.argmax(start[here])])
            before = int(after[np.argmin(start[after])]) if len(after) else None
            graph.insert(last, before, comm_name("all_reduce", "tensor", nbytes), cost.time_us,
                         resource="network tensor", kind=TaskKind.COMM)
    return graph


@pytest.fixture
def tensor_pass(monkeypatch):
    monkeypatch.setitem(PASSES, "tensor", _tensor_stand_in)


def test_the_block_is_parsed_and_data_fills_the_cluster(tensor_pass):
    scenario = _scenario({"tensor": [1, 2], "recompute": "selective",
                          "pipeline": {"stages": 1, "schedule": "gpipe"}}, gpus=2)
    found = [p.parallelism for p in scenario.points]
    assert [(p.data, p.tensor) for p in found] == [(2, 1), (1, 2)]
    assert all(p.recompute == "selective" and p.schedule == "gpipe" for p in found)
    assert {p.framework for p in scenario.points} == {"ddp"}  # ddp by default beside parallelism
    configs = scenario.request().clusters
    assert [c.parallelism for c in configs] == found


def test_sequence_parallel_grads_is_a_key_and_a_grid_axis(tensor_pass):
    scenario = _scenario({"tensor": 2, "sequence_parallel": True,
                          "sequence_parallel_grads": ["coalesced", "Per_Parameter"]}, gpus=2)
    assert [p.parallelism.sequence_parallel_grads for p in scenario.points] == ["coalesced", "per_parameter"]


def test_tensor_dispatch_is_three_durations_per_pair_zero_where_left_out(tensor_pass):
    scenario = _scenario({"tensor": 2, "tensor_dispatch": {"forward": "3ms", "backward": "4.8 ms"}}, gpus=2)
    assert [p.parallelism.tensor_dispatch for p in scenario.points] == [(3000.0, 4800.0, 0.0)]
    assert _scenario({"tensor": 2}, gpus=2).points[0].parallelism.tensor_dispatch == (0.0, 0.0, 0.0)
    point = _scenario({"tensor": 2, "tensor_dispatch": {"forward": "3ms", "collective": "450us"}}, gpus=2).points[0]
    assert (point.parallelism.tensor_dispatch, point.parallelism.tensor_collective) == ((3000.0, 0.0, 0.0), 450.0)
    with pytest.raises(ScenarioError, match=r"parallelism.fsdp_dispatch.collective: unknown key"):
        _scenario({"fsdp": True, "fsdp_dispatch": {"collective": "1ms"}})


def test_fsdp_dispatch_is_three_durations_per_unit_and_needs_fsdp():
    scenario = _scenario({"fsdp": True, "fsdp_dispatch": {"forward": "2.1ms", "step": "1.5ms"}})
    assert [p.parallelism.fsdp_dispatch for p in scenario.points] == [(2100.0, 0.0, 1500.0)]
    with pytest.raises(ScenarioError, match=r"parallelism.fsdp_dispatch.backward"):
        _scenario({"fsdp": True, "fsdp_dispatch": {"backward": "-1ms"}})
    with pytest.raises(ScenarioError, match=r"parallelism.fsdp_dispatch: .*needs fsdp \(zero 3\), not zero 1"):
        _scenario({"zero": 1, "fsdp_dispatch": {"forward": "1ms"}})


def test_the_what_ifs_change_a_pipelines_microbatch_trace_as_they_change_the_trace():
    """A pipeline's stages take their time from the microbatch trace: a host twice as fast must
    shorten them too, not only the whole-batch trace (the CPU bundles: their step is CPU work)."""
    block = {"pipeline": {"stages": 2, "microbatches": 4, "microbatch_trace": str(TRANSFORMER_MICRO)}}
    plain = predict(_scenario(block, gpus=2).request()).results["iteration_ms"].iloc[0]
    faster = predict(_scenario(block, gpus=2, optimizations=["faster-cpu=2"]).request()).results["iteration_ms"].iloc[0]
    assert 1.7 < plain / faster <= 2.0 + 1e-9, (plain, faster)


def test_a_microbatch_trace_of_another_batch_than_the_microbatch_is_not_taken_for_it():
    """The batch-8 bundle is not the microbatch of batch 8 in 2: the pipeline is built as
    without it, and a warning says so. The batch-2 bundle is the microbatch of 8 in 4: used."""
    from whatif.collectors.diagnostics import Diagnostics, collecting
    from whatif.sim.parallel.pipeline import PipelineSchedule

    def step(pipeline, trace=None):
        block = {"pipeline": {"stages": 2, **pipeline, **({"microbatch_trace": str(trace)} if trace else {})}}
        with collecting(Diagnostics()) as diagnostics:
            prediction = predict(_scenario(block, gpus=2).request())
        note = next(iter(prediction.runs.values())).schedule.graph.last_note(PipelineSchedule)
        return prediction.results["iteration_ms"].iloc[0], note.scaling, diagnostics.messages

    mismatched, scaling, warned = step({"microbatches": 2}, TRANSFORMER)
    assert (mismatched, scaling) == step({"microbatches": 2})[:2] and scaling.startswith("linear in the batch")
    assert warned == [f"parallelism.pipeline.microbatch_trace {TRANSFORMER}: traced at batch 8, which is not the "
                      "microbatch of batch 8 in 2 microbatches: those configurations scale the traced units to "
                      "their microbatch instead"]
    matched, scaling, warned = step({"microbatches": 4}, TRANSFORMER_MICRO)
    assert warned == [] and scaling.startswith("from the microbatch trace")
    assert matched != step({"microbatches": 4})[0]


def test_list_valued_keys_make_a_grid_only_as_lists_of_lists():
    one = _scenario({"placement": ["data", "tensor", "pipeline"], "recompute": "full"})
    assert [p.parallelism.placement for p in one.points] == [("data", "tensor", "pipeline")]
    grid = _scenario({"placement": [["tensor", "data", "pipeline"], ["data", "tensor", "pipeline"]]})
    assert len(grid.points) == 2


def test_memory_options():
    scenario = _scenario({"zero": 0, "optimizer": "sgd", "gpu_memory": "16GB"})
    request = scenario.request()
    assert (request.optimizer, request.gpu_memory_bytes) == ("sgd", 16e9)


@pytest.mark.parametrize("block, gpus, message", [
    ({"data": 3}, 4, "parallelism: data x tensor x pipeline = 3 x 1 x 1 = 3 ranks, but the cluster has 4 GPUs"),
    ({"pipeline": 3}, 4, "parallelism: tensor x pipeline = 1 x 3 does not divide the cluster's 4 GPUs"),
    ({"fsdp": True, "zero": 1}, 4, "parallelism.fsdp: fsdp is zero 3"),
    ({"tensr": 2}, 4, "parallelism.tensr: unknown key; did you mean 'tensor'?"),
    ({"pipeline": {"stages": 2, "micro": 4}}, 4, "parallelism.pipeline.micro: unknown key"),
    ({"pipeline": 2, "microbatches": 8}, 4,
     "parallelism.microbatches: unknown key; it belongs under parallelism: {pipeline: {stages: N, microbatches: ...}}"),
    ({"pipeline": {"stages": 2, "tensor": 2}}, 4,
     "parallelism.pipeline.tensor: unknown key; it belongs under parallelism: {tensor: ...}"),
    ({"machines": 2}, 4, "parallelism.machines: unknown key; it belongs under cluster: {machines: ...}"),
    ({"pipeline": {"stages": 1, "microbatches": 8}}, 4,
     "parallelism.pipeline.microbatches: no point of the scenario has pipeline stages to use them"),
    ({"recompute": []}, 4, "parallelism.recompute: an empty list"),
    ({"zero": 5}, 4, "parallelism.zero: expected 0, 1, 2 or 3"),
    ({"tensor": 2, "tensor_dispatch": {"forward": 3}}, 2, "parallelism.tensor_dispatch.forward: '3' has no unit"),
    ({"tensor": 2, "tensor_dispatch": {"fwd": "3ms"}}, 2, "parallelism.tensor_dispatch.fwd: unknown key"),
    ({"tensor": 2, "tensor_dispatch": "3ms"}, 2, "parallelism.tensor_dispatch: expected {forward: DURATION"),
    ({"optimizer": "lamb"}, 4, "parallelism.optimizer: unknown value 'lamb'"),
    ({}, 4, "cluster.cores_per_machine: must be positive, got 0", ),
    ({"pipeline": {"stages": 2, "microbatches": 2, "microbatch_trace": "nowhere.bundle"}}, 4,
     "parallelism.pipeline.microbatch_trace: no such trace or bundle: nowhere.bundle"),
    ({"pipeline": {"stages": 2, "microbatches": 2, "microbatch_trace": 3}}, 4,
     "parallelism.pipeline.microbatch_trace: expected the path of a trace or bundle, got 3"),
    ({"pipeline": {"stages": 1, "microbatch_trace": str(TRANSFORMER)}}, 4,
     "parallelism.pipeline.microbatch_trace: no point of the scenario has pipeline stages to use it"),
    ({"pipeline": {"stages": 2, "microbatches": [2, 4], "microbatch_trace": str(TRANSFORMER)}}, 4,
     "parallelism.pipeline.microbatch_trace: a trace of one microbatch fits one microbatch count; the grid has "
     "microbatches 2, 4"),
])
def test_mistakes_are_one_line_naming_the_key(block, gpus, message):
    with pytest.raises(ScenarioError) as err:
        if message.startswith("cluster."):
            Scenario.from_dict({"trace": str(TRANSFORMER), "cluster": {"machines": 1, "gpus_per_machine": gpus,
                                                                      "cores_per_machine": 0, **LINKS}}, name="s.yaml")
        _scenario(block, gpus)
    assert str(err.value).startswith("s.yaml: " + message) and "\n" not in str(err.value)


@pytest.mark.parametrize("doc, message", [
    ({"tensor": 2}, "tensor: unknown key; it belongs under parallelism: {tensor: ...}"),
    ({"machines": 2}, "machines: unknown key; it belongs under cluster: {machines: ...}"),
    ({"schedule": "1f1b"}, "schedule: unknown key; it belongs under parallelism: {pipeline: {stages: N, schedule: ...}}"),
])
def test_a_key_in_the_wrong_block_says_where_it_belongs(doc, message):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict({"trace": str(TRANSFORMER), "cluster": {"machines": 1, "gpus_per_machine": 2, **LINKS},
                            **doc}, name="s.yaml")
    assert str(err.value).startswith("s.yaml: " + message) and "\n" not in str(err.value)
    with pytest.raises(ScenarioError, match=r"^s.yaml: cluster.pipeline: unknown key; it belongs under parallelism: "
                                            r"\{pipeline: \.\.\.\}$"):
        Scenario.from_dict({"trace": str(TRANSFORMER), "cluster": {"machines": 1, "gpus_per_machine": 2,
                                                                   "pipeline": 2, **LINKS}}, name="s.yaml")


def test_comm_names_carry_dimension_and_bytes():
    name = comm_name("reduce_scatter", "fsdp", 3159040)
    assert comm_dimension(name) == "fsdp" and comm_bytes(name) == pytest.approx(3159040)
    assert comm_dimension("ncclKernel_AllReduce_RING_LL") == "other"
    # as the family passes write them
    assert comm_bytes("all-reduce tensor 1048576 B") == 1048576
    assert comm_bytes("all_gather data 3.159 MB unit 3 forward") == pytest.approx(3.159e6)
    assert comm_dimension("send_recv pipeline 0.524288MB activation stage 0->1") == "pipeline"


def test_a_parallel_job_and_plain_data_parallelism_through_the_pipeline(tensor_pass):
    """One prediction, two configurations of two GPUs: plain data parallelism takes the cluster
    path with memory columns; tensor parallel runs the (stand-in) pass on rank 0's graph."""
    study = TraceStudy.from_trace(TRANSFORMER)
    cluster = Cluster.from_config({"machines": 1, "gpus_per_machine": 2, **LINKS})
    data = ClusterConfig(cluster, framework="ddp", parallelism=Parallelism(data=2))
    tensor = ClusterConfig(cluster, framework="ddp", parallelism=Parallelism(tensor=2))
    prediction = predict(Request(study, clusters=[data, tensor], gpu_memory_bytes=1e9))
    rows = prediction.results.set_index("parallelism")
    assert list(rows.index) == ["dp2", "dp1 tp2"]
    assert (rows["fits"] == "yes").all() and (rows["memory_gb"] > 0).all()
    assert rows.at["dp1 tp2", "memory_gb"] < rows.at["dp2", "memory_gb"]
    # four blocks, an all-reduce after each one's forward, in every iteration: exposed
    assert rows.at["dp1 tp2", "exposed_tensor_ms"] > 0
    assert rows.at["dp1 tp2", "messages_per_iteration"] == 4
    assert np.isnan(rows.at["dp2", "exposed_tensor_ms"])
    # plain data parallelism's exposed communication is all of its one dimension's; the table
    # shows a dimension a layout does not have as "-"
    assert rows.at["dp2", "exposed_data_ms"] == rows.at["dp2", "exposed_comm_ms"] > 0
    table = results_table(prediction.results)
    assert "nan" not in table.lower() and table.splitlines()[1].split()[-1] == "-"
    job = parallelize(prediction.worker, find_units(prediction.worker), Parallelism(tensor=2), cluster)
    assert job.passes == ["tensor"] and job.ranks_of["tensor"] == (0, 1)
    assert len(job.comm_tasks()) == 4 * len(prediction.report)


def _one_step_stand_in(graph, units, par, cluster, ranks_of):
    """A stand-in pipeline pass in the shape of the real one: one step's graph, every resource
    named after its stage, so no traced iteration span holds it."""
    graph = graph.copy()
    keep = graph.tasks["context"].astype(str).str.startswith("ProfilerStep#5").to_numpy()
    graph.remove(np.flatnonzero(~keep))
    graph.tasks["resource"] = graph.tasks["resource"].cat.rename_categories(lambda r: f"stage 0: {r}")
    return graph


def test_a_job_of_one_built_step_is_reported_by_its_span(monkeypatch):
    monkeypatch.setitem(PASSES, "pipeline", _one_step_stand_in)
    study = TraceStudy.from_trace(TRANSFORMER)
    cluster = Cluster.from_config({"machines": 1, "gpus_per_machine": 2, **LINKS})
    config = ClusterConfig(cluster, framework="ddp", parallelism=Parallelism(pipeline=2, microbatches=2))
    prediction = predict(Request(study, clusters=[config]))
    run = next(iter(prediction.runs.values()))
    row = prediction.results.iloc[0]
    span = run.schedule.end_us.max() - run.schedule.start_us.min()
    assert row["iteration_ms"] == pytest.approx(span / 1e3)
    assert row["compute_ms"] + row["idle_ms"] == pytest.approx(row["iteration_ms"])
    assert row["speedup"] == pytest.approx(prediction.iteration_ms / row["iteration_ms"])  # one data replica


def test_the_plot_splits_exposed_communication_by_dimension(tmp_path):
    from whatif.report.plots import _exposed_by_dimension, plot_scenario

    results = pd.DataFrame({
        "machines": [1, 1], "gpus_per_machine": [2, 2], "workers": [2, 2], "inter_node_gbps": [0.1, 0.1],
        "framework": ["ddp", "ddp"], "policy": ["fifo", "fifo"], "parallelism": ["dp2", "dp1 tp2"],
        "speedup": [1.8, 1.5], "compute_ms": [300.0, 200.0], "exposed_comm_ms": [20.0, 30.0], "idle_ms": [10.0, 5.0],
        "exposed_tensor_ms": [np.nan, 20.0], "exposed_data_ms": [np.nan, 20.0],
    })
    frame = results.copy()
    colours, names = _exposed_by_dimension(frame)
    assert list(colours)[1:3] == ["plot_exposed_tensor_ms", "plot_exposed_data_ms"]
    assert frame.loc[1, ["plot_exposed_tensor_ms", "plot_exposed_data_ms"]].tolist() == [15.0, 15.0]
    assert frame.loc[0, "plot_exposed_other"] == 20.0  # communication no dimension names
    named = results.assign(exposed_data_ms=[20.0, 20.0])  # as the pipeline names plain data parallelism's
    colours, _ = _exposed_by_dimension(named)
    assert "plot_exposed_other" not in colours and "plot_exposed_other" not in named, "no empty legend entry"
    plot_scenario(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_the_scaling_panel_shows_ideal_scaling_for_a_single_configuration(tmp_path, monkeypatch):
    """A grid of one cluster size (layouts compared at 1x2): ideal scaling is a dash at the GPUs'
    count across that configuration, not a line through one point, which would not show."""
    import matplotlib.figure
    from whatif.report.plots import plot_scenario

    drawn = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    results = pd.DataFrame({
        "machines": [1, 1], "gpus_per_machine": [2, 2], "workers": [2, 2], "inter_node_gbps": [0.1, 0.1],
        "framework": ["ddp", "ddp"], "policy": ["fifo", "fifo"], "parallelism": ["dp2", "dp1 tp2"],
        "speedup": [1.8, 1.5], "compute_ms": [300.0, 200.0], "exposed_comm_ms": [20.0, 30.0], "idle_ms": [10.0, 5.0],
    })
    plot_scenario(results, tmp_path / "plot.png")
    curve = drawn[0].axes[0]
    dashes = [segment for collection in curve.collections for segment in getattr(collection, "get_segments", list)()]
    assert any(np.allclose(segment[:, 1], 2.0) and np.ptp(segment[:, 0]) > 0.5 for segment in dashes)
    assert curve.get_ylim()[1] >= 2.0


def test_a_microbatch_trace_prices_the_pipeline_microbatches():
    """``parallelism.pipeline.microbatch_trace`` reaches the pipeline pass: with a trace of the
    microbatch (batch 2 of 8), a microbatch costs what it measured there, not the linear rule's
    quarter of the batch's, and the pass says which rule it used. (Which is longer depends on
    the box's speed at the two captures as much as on the fixed per-operator costs: the batch-8
    bundle's steps ran 298 to 637 ms on a busy box, the batch-2 one's 70 to 79 on a quiet one.)"""
    from whatif.sim.parallel.pipeline import PipelineSchedule

    block = {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "gpipe"}}
    linear = _scenario(block, gpus=2)
    measured = _scenario({"pipeline": {**block["pipeline"], "microbatch_trace": str(TRANSFORMER_MICRO)}}, gpus=2)
    assert linear.microbatch_trace is None and measured.microbatch_trace == TRANSFORMER_MICRO
    assert measured.request().microbatch_trace == TRANSFORMER_MICRO
    steps = {}
    for name, scenario in (("linear", linear), ("measured", measured)):
        prediction = predict(scenario.request())
        steps[name] = float(prediction.results["iteration_ms"].iloc[0])
        note = next(iter(prediction.runs.values())).schedule.graph.last_note(PipelineSchedule)
        assert note.scaling.startswith("from the microbatch trace" if name == "measured" else "linear in the batch")
    assert abs(steps["measured"] - steps["linear"]) > 0.05 * steps["linear"]


def test_workers_sharing_a_core_share_its_time():
    """A machine of two CPU workers on one core (``cores_per_machine: 1``, the lab's 2 x 2): every
    CPU task of the rank takes twice as long, its communication as long as on a core each."""
    from whatif.sim.graph import cpu_work
    from whatif.sim.parallel.job import cores_shared, simulate_job

    study = TraceStudy.from_trace(TRANSFORMER)
    graph = study.graph.copy()
    graph.remove(graph.select(kinds=[TaskKind.COMM]))
    units = find_units(graph)
    runs = {}
    for cores in (None, 1):
        cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 2, "cores_per_machine": cores, **LINKS})
        assert cores_shared(cluster) == (2.0 if cores else 1.0)
        job = parallelize(graph, units, Parallelism(data=2, tensor=2, zero=3), cluster)
        runs[cores] = (job, simulate_job(job, cluster))
    (job, alone), (_, shared) = runs[None], runs[1]
    work, comm = cpu_work(job.graph.tasks), job.comm_tasks()
    assert len(work) and len(comm)
    took = lambda s, ids: (s.end_us[ids] - s.start_us[ids]).sum()  # noqa: E731
    assert took(shared, work) == pytest.approx(2 * took(alone, work), rel=1e-6)
    assert took(shared, comm) == pytest.approx(took(alone, comm), rel=1e-6)
    assert shared.makespan_us > alone.makespan_us


def test_a_trace_without_blocks_is_a_one_line_error_naming_the_scenario_and_what_the_trace_has(
        capsys, tmp_path, shared_traces):
    """The 2021 ResNet-50 trace names no modules, only its annotations: sharding it needs units
    the trace cannot give, and the error says which scenario, which key, and the names there are."""
    from trace_corpus import RESNET50
    from whatif.cli import main

    path = tmp_path / "fsdp.yaml"
    path.write_text(f"trace: {shared_traces / RESNET50}\ncluster: {{machine: dgx_h100, machines: 2}}\n"
                    "framework: ddp\nparallelism: {zero: 3}\n")
    assert main(["predict", str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"whatif: error: {path}: parallelism.units: no repeated blocks found") and "\n" not in err
    assert "'Optimizer.step#SGD.step'" in err


def test_fsdp_on_a_plain_gpu_trace_is_sized_by_its_operators_weights(capsys, tmp_path, shared_traces):
    """VGG-13's H100 trace is no capture bundle: its 133 M parameters come from the recorded
    shapes of its convolutions and linears, so sharding them costs communication (before, the
    job's collectives had 0 bytes and FSDP predicted perfect scaling)."""
    import json

    from whatif.cli import main

    path = tmp_path / "vgg.yaml"
    path.write_text(f"trace: {shared_traces / 'triosim-vgg13-h100' / 'vgg13_bs512_iter41.json.gz'}\n"
                    "cluster: {machine: dgx_h100, machines: 2}\nframework: ddp\nparallelism: {zero: [0, 3]}\n")
    assert main(["predict", str(path), "--json"]) == 0
    rows = {r["parallelism"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    ddp, fsdp = rows["dp16"], rows["dp16 fsdp"]
    assert fsdp["comm_ms"] > ddp["comm_ms"] > 0  # two all-gathers and a reduce-scatter of the 532 MB
    assert fsdp["memory_gb"] < ddp["memory_gb"]


def test_a_parallel_job_on_a_trace_without_parameters_or_shapes_is_refused(capsys, tmp_path, shared_traces):
    from whatif.cli import main

    path = tmp_path / "resnet.yaml"
    path.write_text(f"trace: {shared_traces / 'hta-ddp-resnet50' / 'v100_1gpu_rank0.json.gz'}\n"
                    "cluster: {machine: dgx_h100, machines: 2}\nframework: ddp\n"
                    "parallelism: {zero: 3, units: '## forward ##'}\n")
    assert main(["predict", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"whatif: error: {path}: parallelism: the trace lists no parameters") and "\n" not in err
    assert "record_shapes=True" in err


def test_a_parallel_job_on_nccl_names_each_dimensions_collectives():
    """On a GPU fabric a parallel row says which algorithm and protocol NCCL chose for each
    dimension's collectives, as the passes priced them, by their share of that dimension's
    bytes: tensor parallelism's all-reduces inside a DGX H100, FSDP's across two of them, and
    the pipeline's sends."""
    from whatif.sim.parallel.fsdp import ShardedDataParallel
    from whatif.sim.parallel.tensor import TensorParallelChange

    doc = {"trace": str(TRANSFORMER), "cluster": {"machine": "dgx_h100", "machines": 2}, "framework": "ddp",
           "parallelism": {"tensor": 4, "zero": 3, "pipeline": {"stages": 2, "microbatches": 4}}}
    prediction = predict(Scenario.from_dict(doc, name="s.yaml").request())
    mix = prediction.results["collectives"].iloc[0]
    parts = dict(part.split(" ", 1) for part in mix.split("; "))
    assert list(parts) == ["tensor", "data", "pipeline"], mix
    graph = next(iter(prediction.runs.values())).schedule.graph
    tensor = graph.last_note(TensorParallelChange).collectives
    first = tensor[tensor["iteration"] == tensor["iteration"].min()]
    chosen = (first["algorithm"] + "/" + first["protocol"]).unique().tolist()
    assert all(choice in parts["tensor"] for choice in chosen) and len(first) > 0
    data = graph.last_note(ShardedDataParallel).collectives
    assert {"all_gather", "reduce_scatter"} <= set(data["op"]) and set(data["group"]) == {"data"}
    for part in parts.values():  # each a choice, or choices whose shares add up to 100 %
        shares = [int(p.rsplit(" ", 1)[1][:-1]) for p in part.split(", ")] if "%" in part else [100]
        assert abs(sum(shares) - 100) <= len(shares), mix
    assert parts["pipeline"].startswith("p2p/")


def test_a_pipelines_row_parts_its_bubble_from_the_rest_of_its_idle():
    """A pipeline's row carries ``bubble_ms``: the schedule's fill and drain (``bubbles``' of
    the run), part of rank 0's idle time; the table prints it and the plot draws it apart."""
    from whatif.report.plots import _exposed_by_dimension
    from whatif.report.tables import results_table
    from whatif.sim.parallel.pipeline import bubbles

    study = TraceStudy.from_trace(TRANSFORMER)
    cluster = Cluster.from_config({"machines": 1, "gpus_per_machine": 2, **LINKS})
    config = ClusterConfig(cluster, framework="ddp", parallelism=Parallelism(pipeline=2, microbatches=4))
    prediction = predict(Request(study, clusters=[config]))
    row = prediction.results.iloc[0]
    table = bubbles(next(iter(prediction.runs.values())).schedule)
    assert row["bubble_ms"] == pytest.approx(table["fill_drain"].iat[0] * table["step_us"].iat[0] / 1e3)
    assert 0 < row["bubble_ms"] <= row["idle_ms"]
    assert "bubble ms" in results_table(prediction.results).splitlines()[0]
    frame = prediction.results.copy()
    colours, _ = _exposed_by_dimension(frame)
    assert {"plot_bubble_ms", "plot_idle_ms"} <= set(colours) and "idle_ms" not in colours
    assert frame["plot_bubble_ms"].iat[0] + frame["plot_idle_ms"].iat[0] == pytest.approx(row["idle_ms"])


def test_a_parallel_job_with_a_straggler_runs_at_the_slowest_ranks_pace():
    """Tensor parallelism 2 x data 2 on two machines, machine 1 1.5x slow: rank 0 stands for every
    rank, and since each waits for the others at every collective it runs at machine 1's pace,
    its work (not its waits or communication) 1.5x as long. Before, the straggler was dropped
    without a word: the job predicted as fast as with none."""
    from whatif.pipeline import slowest_rank_note
    from whatif.sim.distributed import Straggler, slowest_pace
    from whatif.sim.parallel.job import at_pace

    cluster = Cluster.from_config({"machines": 2, "gpus_per_machine": 2, **LINKS})
    par = Parallelism(data=2, tensor=2)
    slow = ClusterConfig(cluster, "ddp", stragglers=[Straggler(1, slowdown=1.5)], parallelism=par)
    assert slowest_pace(slow) == (1.5, 1.0)
    assert slowest_pace(ClusterConfig(cluster, "ddp", parallelism=par)) == (1.0, 1.0)
    assert slowest_pace(ClusterConfig(cluster, "ddp", gpu_slowdowns=(1.0, 1.2, 0.9, 1.1), parallelism=par)) == (1.0, 1.2)

    study = TraceStudy.from_trace(TRANSFORMER)
    graph = study.graph.copy()
    graph.remove(graph.select(kinds=[TaskKind.COMM]))
    job = parallelize(graph, find_units(graph), par, cluster)
    paced = at_pace(job, 1.5, 1.0)
    kinds = job.graph.tasks["kind"].to_numpy()
    kept = np.isin(kinds, [int(TaskKind.COMM), int(TaskKind.WAIT)])
    before, after = job.graph.tasks["duration_us"].to_numpy(), paced.graph.tasks["duration_us"].to_numpy()
    np.testing.assert_allclose(after[~kept], 1.5 * before[~kept])
    np.testing.assert_array_equal(after[kept], before[kept])
    assert len(job.comm_tasks()) and at_pace(job, 1.0, 1.0) is job

    rows = {}
    for stragglers in ([], [{"machine": 1, "slowdown": 1.5}]):
        fast = {"intra_node": {"bandwidth": "40Gbps", "latency": "20us"}, "inter_node": {"bandwidth": "10Gbps", "latency": "50us"}}
        scenario = Scenario.from_dict({"trace": str(TRANSFORMER), "stragglers": stragglers, "parallelism": {"tensor": 2},
                                       "cluster": {"machines": 2, "gpus_per_machine": 2, **fast}}, name="s.yaml")
        prediction = predict(scenario.request())
        rows[bool(stragglers)] = (prediction.results.iloc[0]["iteration_ms"], slowest_rank_note(prediction))
    (free, no_note), (slowed, note) = rows[False], rows[True]
    assert no_note == "" and "dp2 tp2 x1.50 (GPU x1.00)" in note
    assert 1.2 * free < slowed < 1.5 * free + 1.0  # the work 1.5x, the communication as it was


def test_what_a_parallel_job_cannot_use_is_left_out_or_said_never_dropped(recwarn):
    """A parallel job runs DDP's all-reduce in FIFO order and sizes its collectives from the
    trace's parameters. Before, its rows under horovod, ps or p3 were predicted as DDP FIFO
    and labelled otherwise, and gradients, framework_options and collective did nothing to them
    without a word (tensor 2 at 484.52 ms whatever they said)."""
    doc = {"trace": str(TRANSFORMER), "cluster": {"machines": 2, "gpus_per_machine": 2, **LINKS},
           "framework": ["ddp", "horovod"], "policy": ["fifo", "p3"], "parallelism": {"tensor": [1, 2]}}
    scenario = Scenario.from_dict(doc, name="s.yaml")
    described = [(p.framework, p.policy, p.parallelism.describe()) for p in scenario.points]
    assert described == [("ddp", "fifo", "dp4"), ("ddp", "fifo", "dp2 tp2"), ("ddp", "p3", "dp4"),
                         ("horovod", "fifo", "dp4"), ("horovod", "p3", "dp4")]
    said = [str(w.message) for w in recwarn]
    assert ("s.yaml: left out 3 configurations of a parallel job with horovod, p3: a parallel job (tensor, pipeline, "
            "expert or zero >= 1) runs DDP's all-reduce in FIFO order; horovod, p3 apply to plain data parallelism "
            "only") in said

    with pytest.raises(ScenarioError, match=r"^s.yaml: framework: a parallel job .* horovod applies to plain data "
                                            r"parallelism only \(framework: ddp, policy: fifo\)$"):
        Scenario.from_dict({**doc, "framework": "horovod", "policy": "fifo", "parallelism": {"tensor": 2}}, name="s.yaml")

    recwarn.clear()
    Scenario.from_dict({**doc, "framework": "ddp", "policy": "fifo", "gradients": {"total": "500MB"},
                        "collective": "ring", "optimizations": ["gradient-compression=4"], "network": "shared_links",
                        "replicate": True}, name="s.yaml")
    assert [str(w.message) for w in recwarn] == [
        "s.yaml: collective, gradients, optimizations: gradient-compression=4, network: shared_links, replicate: true: "
        "for plain data parallelism only; the parallel configurations (dp2 tp2) do not use them: their passes size "
        "their collectives from the trace's parameters, and the backend prices them as they are"]
    recwarn.clear()
    Scenario.from_dict({**doc, "framework": "ddp", "policy": "fifo"}, name="s.yaml")
    assert not recwarn, "nothing to say where nothing is set that a parallel job does not use"
    left = Scenario.from_dict({**doc, "framework": "horovod", "policy": "fifo", "gradients": {"total": "500MB"}},
                              name="s.yaml")
    assert [p.parallelism.describe() for p in left.points] == ["dp4"]
    assert [str(w.message)[:52] for w in recwarn] == ["s.yaml: left out 1 configuration of a parallel job w"], \
        "no parallel configuration is left for the gradients to miss: nothing more to say"


def test_a_pipelines_microbatch_times_and_gradient_adds_are_said():
    """A prediction that pipelines several microbatches says what a microbatch's times rest on
    (the microbatch trace, else the linear rule) and how the later backwards' gradient adds were
    priced (``sim/parallel/accumulation.py``): on the CPU transformer, at its optimizer's in-place
    rate; one that does not pipeline says nothing."""
    from whatif.pipeline import pipeline_note
    from whatif.sim.frameworks.copies import pass_rate_bytes_per_us

    piped = predict(_scenario({"pipeline": {"stages": 2, "microbatches": 4}}, gpus=2).request())
    rate = pass_rate_bytes_per_us(piped.study.graph)
    note = pipeline_note(piped)
    assert rate and f"in-place add at the optimizer's {rate / 1e3:.3g} GB/s" in note
    assert "microbatch times linear in the batch, each CPU operator at 1/m" in note
    measured = predict(_scenario({"pipeline": {"stages": 2, "microbatches": 4, "microbatch_trace": str(TRANSFORMER_MICRO)}},
                                 gpus=2).request())
    assert f"microbatch times as the microbatch trace measured them ({TRANSFORMER_MICRO})" in pipeline_note(measured)
    assert pipeline_note(predict(_scenario({"tensor": 2}, gpus=2).request())) == ""
