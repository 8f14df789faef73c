"""Daydream's remaining recipes (``sim/passes/recipes.py``), each held to its paper's rule on the
real GPU traces, and ``whatif advise``'s ranking of them and of a scenario's alternatives."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from trace_corpus import A100_DDP2, REPO, RESNET50
from whatif import GraphError
from whatif.advice import RECIPES, advise
from whatif.pipeline import Request, WhatIf, predict
from whatif.scenario import Scenario
from whatif.study import TraceStudy
from whatif.sim.graph import TaskKind
from whatif.sim.passes.optimizations import OPTIMIZER_STEP
from whatif.sim.passes.recipes import (BATCH_NORM_BACKWARD, BATCH_NORM_FORWARD, PCIE_BYTES_PER_US, RELU_BACKWARD,
                                       RELU_FORWARD, CommunicationChange, MemorySaved, _kernels_of, _operator_rows,
                                       _stream_neighbours)
from whatif.sim.passes.registry import OPTIMIZATIONS, apply_optimization, parse_optimization
from whatif.sim.workload import first_input_bytes

WIDE_MLP = REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz"


def kernel_names(graph, name: str) -> int:
    return int((graph.tasks["name"].astype(str) == name).sum())


def test_every_recipe_is_registered_for_simulate_and_scenarios():
    for name in ("restructure-bn", "gradient-compression", "vdnn", "gist", "metaflow-fusion", "blueconnect"):
        assert name in OPTIMIZATIONS
    assert parse_optimization("gradient-compression=500") == ("gradient-compression", 500.0)
    with pytest.raises(GraphError, match="at least 1"):
        parse_optimization("gradient-compression=0.5")
    with pytest.raises(GraphError, match="takes no value"):
        parse_optimization("vdnn=2")
    with pytest.raises(GraphError, match="did you mean 'fused-optimizer'"):
        parse_optimization("fused-optimiser")  # the British spelling: the registry's is suggested
    with pytest.raises(GraphError) as err:
        parse_optimization("xyz")
    assert "did you mean" not in str(err.value) and "choose from amp," in str(err.value)


def test_restructured_batch_norm_scales_bn_forward_and_fuses_the_relus_beside_it(traces):
    graph = traces.study(RESNET50).graph
    bn_fw, bn_bw = _kernels_of(graph, BATCH_NORM_FORWARD), _kernels_of(graph, BATCH_NORM_BACKWARD)
    relu_fw, relu_bw = _kernels_of(graph, RELU_FORWARD), _kernels_of(graph, RELU_BACKWARD)
    before, after = _stream_neighbours(graph)
    fused = np.concatenate([relu_fw[np.isin(before[relu_fw], bn_fw)], relu_bw[np.isin(after[relu_bw], bn_bw)]])
    assert len(fused) > 0
    changed = apply_optimization(graph, "restructure-bn")
    duration = graph.tasks["duration_us"].to_numpy()
    kernel_us = lambda g: g.tasks["duration_us"].to_numpy()[g.tasks["kind"].to_numpy() == int(TaskKind.KERNEL)].sum()  # noqa: E731
    count = lambda g: int((g.tasks["kind"].to_numpy() == int(TaskKind.KERNEL)).sum())  # noqa: E731
    assert count(graph) - count(changed) == len(fused)
    assert kernel_us(changed) == pytest.approx(kernel_us(graph) - duration[bn_fw].sum() / 3 - duration[fused].sum())


def test_restructured_batch_norm_needs_batch_norm(traces):
    with pytest.raises(GraphError, match="restructure-bn: the trace has no GPU"):
        apply_optimization(traces.study("bundled/convnet_cpu").graph, "restructure-bn")


def test_gist_encodes_after_every_forward_relu_and_decodes_before_every_backward_one(traces):
    graph = traces.study(RESNET50).graph
    changed = apply_optimization(graph, "gist")
    relu_rows = _operator_rows(graph, r"^aten::relu_$")
    back_rows = _operator_rows(graph, RELU_BACKWARD)
    assert kernel_names(changed, "gist binarize encode") == len(relu_rows)
    assert kernel_names(changed, "gist binarize decode") == len(back_rows)
    # the encode costs (1 + 1/32) / 2 of the ReLU kernels it follows
    relu_us = graph.tasks["duration_us"].to_numpy()[_kernels_of(graph, RELU_FORWARD)].sum()
    encode = changed.tasks["name"].astype(str).to_numpy() == "gist binarize encode"
    assert changed.tasks["duration_us"].to_numpy()[encode].sum() == pytest.approx(relu_us * (1 + 1 / 32) / 2)
    saved = changed.last_note(MemorySaved)
    expected = sum(first_input_bytes(graph.ops, int(r)) for r in relu_rows) * 31 / 32
    assert saved.tensors == len(relu_rows) and saved.nbytes == pytest.approx(expected)


def test_vdnn_offloads_each_convolution_input_over_pcie_and_prefetches_it(traces):
    graph = traces.study(RESNET50).graph
    changed = apply_optimization(graph, "vdnn")
    convs = _operator_rows(graph, r"^aten::cudnn_convolution$")
    nbytes = sum(first_input_bytes(graph.ops, int(r)) for r in convs)
    tasks = changed.tasks
    offload = (tasks["name"].astype(str) == "vdnn offload DtoH").to_numpy()
    prefetch = (tasks["name"].astype(str) == "vdnn prefetch HtoD").to_numpy()
    assert offload.sum() == len(convs) and prefetch.sum() == len(convs)
    assert (tasks["kind"].to_numpy()[offload | prefetch] == int(TaskKind.MEMCPY)).all()
    assert tasks["duration_us"].to_numpy()[offload].sum() == pytest.approx(nbytes / PCIE_BYTES_PER_US)
    assert changed.last_note(MemorySaved).nbytes == pytest.approx(nbytes)
    # copies never make the step shorter
    assert predict(Request(traces.study(RESNET50), what_if=WhatIf(["vdnn"]))).iteration_ms >= \
        predict(Request(traces.study(RESNET50))).iteration_ms


def test_vdnn_without_recorded_shapes_is_refused_with_why(traces):
    with pytest.raises(GraphError, match="record_shapes"):
        apply_optimization(traces.study(A100_DDP2).graph, "vdnn")


def test_metaflow_fusion_removes_only_forward_epilogues_after_a_convolution_or_gemm(traces):
    graph = traces.study(RESNET50).graph
    changed = apply_optimization(graph, "metaflow-fusion")
    backward = lambda g: int(g.tasks["context"].astype(str).str.contains("Backward|backward").to_numpy()  # noqa: E731
                             [g.tasks["kind"].to_numpy() == int(TaskKind.KERNEL)].sum())
    assert backward(changed) == backward(graph)
    kernels = lambda g: int((g.tasks["kind"].to_numpy() == int(TaskKind.KERNEL)).sum())  # noqa: E731
    assert 0 < kernels(graph) - kernels(changed) <= len(_kernels_of(graph, RELU_FORWARD)) + len(
        _kernels_of(graph, r"^aten::add_?$"))


def test_gradient_compression_shrinks_traced_collectives_and_adds_codec_kernels(traces):
    study = traces.study(A100_DDP2)
    graph = study.graph
    comm = graph.tasks["kind"].to_numpy() == int(TaskKind.COMM)
    changed = apply_optimization(graph, "gradient-compression=32")
    comm_after = changed.tasks["kind"].to_numpy() == int(TaskKind.COMM)
    assert changed.tasks["duration_us"].to_numpy()[comm_after].sum() == pytest.approx(
        graph.tasks["duration_us"].to_numpy()[comm].sum() / 32)
    assert kernel_names(changed, "gradient compression encode") == comm.sum()
    assert kernel_names(changed, "gradient compression decode") == comm.sum()
    note = changed.last_note(CommunicationChange)
    step = graph.match(OPTIMIZER_STEP) & (graph.tasks["kind"].to_numpy() == int(TaskKind.KERNEL))
    steps = int(graph.ops["name"].astype(str).str.startswith("Optimizer.step").sum())
    assert note.codec_us_per_iteration == pytest.approx(graph.tasks["duration_us"].to_numpy()[step].sum() * 4 / 6 / steps)


def test_communication_recipes_refuse_a_job_that_communicates_nothing(traces):
    for name in ("gradient-compression", "blueconnect"):
        with pytest.raises(GraphError, match=name):
            predict(Request(traces.study(RESNET50), what_if=WhatIf([name])))


def cluster_scenario(machines: int, gpus: int, bandwidth="10gbe", frameworks="horovod") -> Scenario:
    return Scenario.from_dict({"trace": str(WIDE_MLP), "cluster": {
        "machines": machines, "gpus_per_machine": gpus, "intra_node": "nvlink2", "inter_node": bandwidth},
        "framework": frameworks, "policy": "fifo"}, name="test")


def test_gradient_compression_on_a_cluster_sends_fewer_bytes():
    request = cluster_scenario(2, 1).request()
    plain = predict(request).results.iloc[0]
    compressed = predict(Request(request.trace, clusters=request.clusters,
                                 what_if=WhatIf(["gradient-compression=32"]))).results.iloc[0]
    assert compressed["comm_mb_per_iteration"] == pytest.approx(plain["comm_mb_per_iteration"] / 32)
    assert compressed["comm_ms"] < plain["comm_ms"]


def test_blueconnect_runs_the_hierarchical_all_reduce_where_the_cluster_has_a_hierarchy():
    request = cluster_scenario(2, 2).request()
    ring = predict(request).results.iloc[0]
    blue = predict(Request(request.trace, clusters=request.clusters, what_if=WhatIf(["blueconnect"]))).results.iloc[0]
    hierarchical = predict(Request(request.trace, clusters=[
        type(request.clusters[0])(**{**request.clusters[0].__dict__, "algorithm": "hierarchical"})])).results.iloc[0]
    assert blue["comm_ms"] == pytest.approx(hierarchical["comm_ms"]) and blue["comm_ms"] != pytest.approx(ring["comm_ms"])
    one_gpu = cluster_scenario(2, 1).request()
    with pytest.raises(GraphError, match="blueconnect"):
        predict(Request(one_gpu.trace, clusters=one_gpu.clusters, what_if=WhatIf(["blueconnect"])))


def test_advise_ranks_removing_the_data_loader_first_on_the_resnet50_trace(traces):
    """A third of the V100 ResNet-50 step's critical path is its data loader: no-dataloader is
    the clear first; every recipe is ranked or listed as not applicable, with a reason."""
    advice = advise(traces.path(RESNET50))
    assert advice.ranked[0].name == "no-dataloader"
    assert "data loading" in advice.ranked[0].reason and "no-dataloader gains" in advice.ranked[0].reason
    gains = [o.gain_pct for o in advice.ranked]
    assert gains == sorted(gains, reverse=True)
    assert all(o.low_ms < o.predicted_ms < o.high_ms for o in [advice.baseline, *advice.ranked]), "each with its interval"
    assert sorted(o.name for o in advice.options) == sorted(RECIPES)
    not_applicable = {o.name: o.reason for o in advice.not_applicable}
    assert set(not_applicable) == {"gradient-compression", "blueconnect"}
    assert all(not_applicable.values())


def test_advise_ranks_the_higher_bandwidth_above_the_lower_on_a_communication_bound_job():
    advice = advise(WIDE_MLP, cluster_scenario(2, 1, ["10gbe", "40gbe"]), recipes=())
    by_name = {o.name: o for o in advice.ranked}
    assert advice.baseline.name.startswith("2x1 10Gbps horovod fifo")
    assert by_name["2x1 40Gbps horovod fifo"].gain_pct > 0
    assert all(o.low_ms < o.predicted_ms < o.high_ms for o in [advice.baseline, *advice.ranked]), "each with its interval"
    assert "critical path is communication" in by_name["2x1 40Gbps horovod fifo"].reason


def test_advise_command_prints_json_with_every_recipe(shared_traces):
    trace = shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
    out = subprocess.run([sys.executable, "-m", "whatif.cli", "advise", str(trace), "--json"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    names = [o["name"] for o in doc["ranked"]] + [o["name"] for o in doc["not_applicable"]]
    assert sorted(names) == sorted(RECIPES)
    assert [o["rank"] for o in doc["ranked"]] == list(range(1, len(doc["ranked"]) + 1))
    assert all({"low_ms", "high_ms"} <= set(o) for o in [doc["baseline"], *doc["ranked"]])


def test_the_lab_bench_holds_only_what_the_lab_runs_against_the_ranking():
    """bench/advise_lab.py compares advise's first among the grid's frameworks with FIFO (the
    baseline included), never a parameter server or P3, which the lab does not run."""
    import importlib.util

    from whatif.advice import Advice, Option

    spec = importlib.util.spec_from_file_location("advise_lab", REPO / "bench" / "advise_lab.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = lambda f, p: {"framework": f, "policy": p}  # noqa: E731
    advice = Advice("t", "s", Option("2x1 horovod", "baseline", True, "", 700.0, 0.0, configuration=config("horovod", "fifo")),
                    [Option("ps", "alternative", True, "", 600.0, 16.7, configuration=config("ps", "fifo")),
                     Option("ddp p3", "alternative", True, "", 650.0, 7.7, configuration=config("ddp", "p3")),
                     Option("amp", "recipe", True, "", 690.0, 1.4),
                     Option("ddp", "alternative", True, "", 720.0, -2.8, configuration=config("ddp", "fifo"))])
    assert [r["framework"] for r in bench.ranked_runnable(advice, ["horovod", "ddp"])] == ["horovod", "ddp"]


def _vgg13_on_h100s(shared_traces) -> tuple:
    trace = shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
    return trace, Scenario.from_dict({"trace": str(trace), "cluster": {"machine": "dgx_h100", "machines": 1},
                                      "framework": "ddp"}, name="vgg13 on one DGX H100")


def test_a_recipe_on_a_cluster_gains_its_throughput_over_the_job_as_it_runs(shared_traces):
    """Mixed precision on 8 DDP workers against the 8 workers as they are (each configuration's
    speed-up is over its own one worker, so a recipe's is over a faster worker): before, amp
    "lost 9.7 %" at 166 ms a step against 375."""
    trace, scenario = _vgg13_on_h100s(shared_traces)
    advice = advise(trace, scenario, recipes=("amp", "vdnn"))
    by_name = {o.name: o for o in advice.ranked}
    for name in ("amp", "vdnn"):  # the same 8 workers: throughput goes as 1 / step
        expected = 100 * (advice.baseline.predicted_ms / by_name[name].predicted_ms - 1)
        assert by_name[name].gain_pct == pytest.approx(expected, rel=1e-6)
    assert by_name["amp"].gain_pct > 50 and by_name["vdnn"].gain_pct < -50


def test_ddp_on_a_gpu_trace_makes_the_optimizers_kernels_wait_not_its_thread(shared_traces):
    """VGG-13's thread launched Adam's step at 35 ms, long before its GPU got there (349 ms).
    DDP's reducer makes the stream wait for the all-reduces, so 532 MB over NVLS on 8 H100s
    (2.4 ms) hides under backward; before, the thread waited too and then launched the step:
    375 ms against 351. Where no kernel carries the Optimizer.step range (as none did here
    before the range was read whole), the step's first kernel is the first the thread launched
    from the step's first task on: the same kernel."""
    from whatif.sim.frameworks.sync_points import SyncPoints

    trace, scenario = _vgg13_on_h100s(shared_traces)
    prediction = predict(scenario.request())
    row = prediction.results.iloc[0]
    assert row["comm_ms"] > 2 and row["iteration_ms"] == pytest.approx(prediction.iteration_ms, rel=2e-3)
    study = TraceStudy.from_trace(trace)
    points = SyncPoints(study.graph, study.iterations, "cpu 42741/42741")
    first_cpu = points.optimizer(0, on_gpu=False)
    launched = points._launched_after(first_cpu, 0)
    assert points.optimizer(0, on_gpu=True) == launched[np.argmin(points.start[launched])]


def test_a_pipeline_alternative_says_what_sets_its_throughput_and_where_its_step_goes(shared_traces, tmp_path):
    """A pipeline of 2 stages on the same 64 GPUs trains 32 replicas instead of 64: the reason
    says so, and names the parts of its step that are not compute (the activations' send/recv
    between the stages, the schedule's bubble), each from the alternative's own row."""
    trace = shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
    scenario = tmp_path / "pipeline.yaml"
    scenario.write_text(f"trace: {trace}\ncluster: {{machine: dgx_h100, machines: 8}}\nframework: ddp\n"
                        "parallelism: {pipeline: {stages: [1, 2], microbatches: 4}}\n")
    out = subprocess.run([sys.executable, "-m", "whatif.cli", "advise", str(scenario), "--json"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr  # a scenario alone is advised on its own trace
    doc = json.loads(out.stdout)
    assert doc["trace"] == str(trace) and doc["baseline"]["configuration"]["parallelism"] == "dp64"
    pipeline = next(o for o in doc["ranked"] if "pp2" in o["name"])
    config = pipeline["configuration"]
    assert "(32 model replicas instead of 64)" in pipeline["reason"]
    assert "workers instead of" not in pipeline["reason"]  # the same 64 GPUs
    assert f"{config['exposed_pipeline_ms']:.1f} ms exposed pipeline communication" in pipeline["reason"]
    assert f"{config['bubble_ms']:.1f} ms pipeline bubble" in pipeline["reason"]
    assert config["exposed_pipeline_ms"] > config["bubble_ms"] > 0.01 * pipeline["predicted_ms"]
    assert pipeline["reason"].index("exposed pipeline") < pipeline["reason"].index("pipeline bubble")  # largest first


def test_advice_says_what_does_not_fit_and_ranks_such_alternatives_last(shared_traces):
    """VGG-13 at batch 512 on GPUs of 55 GB: the job as it runs needs 55.9 GB a GPU, FSDP 54.0.
    Advice said nothing of memory: the baseline that cannot run, FSDP that can, and recomputing
    a convolution (saving nothing, costing its forward) were ranked on time alone."""
    trace = shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
    scenario = Scenario.from_dict({"trace": str(trace), "cluster": {"machine": "dgx_h100", "machines": 1},
                                   "framework": "ddp", "parallelism": {"zero": [0, 3], "recompute": ["none", "full"],
                                                                       "gpu_memory": "55GB"}}, name="vgg13")
    advice = advise(trace, scenario, recipes=("amp",))
    from whatif.commands.advise import advice_table

    assert advice_table(advice).splitlines()[0].endswith("; 55.9 GB a GPU (does not fit)")
    alternatives = [o for o in advice.ranked if o.kind == "alternative"]
    assert [o.name.split(" ddp fifo ")[1] for o in alternatives] == ["dp8 fsdp", "dp8 fsdp recompute-full",
                                                                     "dp8 recompute-full"]
    fsdp, fsdp_recompute, recompute = alternatives
    assert fsdp.reason.endswith("; 55.9 -> 54.0 GB a GPU") and fsdp_recompute.gain_pct < 0 < fsdp.gain_pct
    assert recompute.reason.endswith("; 55.9 GB a GPU (does not fit)")
    assert advice.ranked[-1] is recompute  # below amp and the fitting ones, though amp is no alternative
    assert advice.ranked[0].name == "amp"  # a recipe keeps its place: memory does not follow what it changes


def test_a_fused_optimizer_on_a_cluster_still_waits_for_the_gradients_all_reduce(shared_traces):
    """The fused step keeps its wait for DDP's all-reduce: across 10 Gb Ethernet VGG-13's 532 MB
    of gradients stay as exposed as without the fusion, which saves only launch work."""
    trace = shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"
    rows = {}
    for optimizations in ([], ["fused-optimizer"]):
        scenario = Scenario.from_dict({"trace": str(trace), "framework": "ddp", "optimizations": optimizations,
                                       "cluster": {"machines": 2, "intra_node": "nvlink2", "inter_node": "10gbe"}},
                                      name="vgg13 on two machines")
        rows[bool(optimizations)] = predict(scenario.request()).results.iloc[0]
    plain, fused = rows[False], rows[True]
    assert plain["exposed_comm_ms"] > 100, "10 Gb Ethernet cannot hide 532 MB"
    assert fused["exposed_comm_ms"] == pytest.approx(plain["exposed_comm_ms"], rel=0.05)
    assert fused["iteration_ms"] <= plain["iteration_ms"] + 1e-6
    assert fused["iteration_ms"] > plain["iteration_ms"] - 0.05 * plain["iteration_ms"]


def test_a_recipe_that_changes_no_task_is_not_applicable_not_ranked_at_zero():
    """amp and faster-gpu on a CPU worker's trace change nothing: listed as not applicable, with
    why, as the GPU-only recipes are, not ranked with a gain of 0 %."""
    advice = advise(WIDE_MLP, recipes=("amp", "faster-gpu=2", "faster-cpu=2"))
    reasons = {o.name: o.reason for o in advice.not_applicable}
    assert reasons == {"amp": "amp: changes no task of this trace (it has no GPU)",
                       "faster-gpu=2": "faster-gpu=2: changes no task of this trace (it has no GPU)"}
    assert [o.name for o in advice.ranked] == ["faster-cpu=2"] and advice.ranked[0].gain_pct > 50
