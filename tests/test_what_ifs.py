"""What-ifs: the transformation primitives and built-in optimizations, and the predictions they
lead to. Most properties are bounds the answer must respect whatever the model's details
(doing less work never takes longer; a 2x faster GPU at most halves the time)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trace_corpus import (
    A100_DDP2,
    BUNDLED,
    DLRM_RANK0,
    EVENT_SYNC,
    EVENT_SYNC_MULTISTREAM,
    RECSYS,
    RESNET50,
    RESNET50_WORKERS4,
    V100_1GPU,
    predicted,
)
from whatif import GraphError, WhatIf, simulate
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind, TaskKind
from whatif.sim.passes.optimizations import OPTIMIZER_STEP, TENSOR_CORE_ELIGIBLE

TOLERANCE_US = 1e-6


def iteration_ends_us(schedule, iterations: pd.DataFrame) -> np.ndarray:
    """When each iteration's last task on its thread ends in ``schedule`` (tasks are placed in an
    iteration by their measured times, as the report does; inserted tasks have none)."""
    tasks = schedule.graph.tasks
    start, end = tasks["measured_start_us"].to_numpy(), tasks["measured_end_us"].to_numpy()
    resource = tasks["resource"].astype(str).to_numpy()
    ends = []
    for it in iterations.itertuples():
        inside = (start >= it.start_us - TOLERANCE_US) & (end <= it.end_us + TOLERANCE_US)
        if it.thread is not None:
            inside &= resource == f"cpu {it.thread}"
        ends.append(schedule.end_us[inside].max())
    return np.asarray(ends)


def assert_never_slower(study, what_if: WhatIf):
    """No iteration takes longer, and none ends later, than in the replay."""
    schedule, report = predicted(study, what_if)
    assert np.isfinite(report["predicted_ms"]).all()
    assert (report["predicted_ms"] <= report["replay_ms"] * (1 + 1e-12)).all(), report.to_string()
    assert (iteration_ends_us(schedule, study.iterations) <= iteration_ends_us(study.replay, study.iterations) + TOLERANCE_US).all()
    return schedule, report


def resource_sequence(graph, resource: str) -> np.ndarray:
    for seq in graph.resource_order():
        if str(graph.tasks["resource"].iat[int(seq[0])]) == resource:
            return seq
    raise AssertionError(f"no resource {resource}")


# -- scaling --------------------------------------------------------------------------------------


def test_scaling_every_task_by_one_changes_nothing(traces, any_trace):
    study = traces.study(any_trace)
    schedule, report = predicted(study, WhatIf(scale=[(".", 1.0)]))
    assert np.array_equal(schedule.start_us, study.replay.start_us)
    assert np.array_equal(schedule.end_us, study.replay.end_us)
    assert (report["speedup"] == 1.0).all()


def test_scaling_by_a_pattern_halves_exactly_the_tasks_named_or_enclosed_by_it(traces):
    graph = traces.study(RESNET50).graph
    scaled = WhatIf(scale=[("conv", 0.5)]).apply(graph)
    names = graph.tasks["name"].astype(str)
    context = graph.tasks["context"].astype(str)
    matched = (names.str.contains("conv") | context.str.contains("conv")).to_numpy()
    assert matched.sum() > 1000
    before = graph.tasks["duration_us"].to_numpy()
    after = scaled.tasks["duration_us"].to_numpy()
    np.testing.assert_array_equal(after[matched], before[matched] * 0.5)
    np.testing.assert_array_equal(after[~matched], before[~matched])
    # the forward convolutions' kernels are matched through the operator that launched them
    kernels = (graph.tasks["kind"] == int(TaskKind.KERNEL)).to_numpy()
    assert (matched & kernels & ~names.str.contains("conv").to_numpy()).any()


def test_scaling_takes_one_factor_per_task_and_refuses_a_negative_one(traces):
    graph = traces.study(RESNET50).graph.copy()
    before = graph.tasks["duration_us"].to_numpy().copy()
    ids, factors = np.array([3, 5, 8]), np.array([2.0, 0.5, 1.5])
    graph.scale(ids, factors)
    np.testing.assert_array_equal(graph.tasks["duration_us"].to_numpy()[ids], before[ids] * factors)
    with pytest.raises(GraphError, match="non-negative"):
        graph.scale(ids, np.array([1.0, -1.0, 1.0]))


def test_scaling_conv_down_never_predicts_slower(traces):
    assert_never_slower(traces.study(RESNET50), WhatIf(scale=[("conv", 0.5)]))


# -- built-in optimizations -------------------------------------------------------------------------


def test_amp_never_predicts_a_slower_iteration(traces, kineto_trace):
    assert_never_slower(traces.study(kineto_trace), WhatIf(optimizations=["amp"]))


def test_amp_runs_tensor_core_kernels_three_times_and_other_kernels_twice_as_fast(traces):
    """On the A100 trace: fp32 GEMMs and convolutions 3x, those already on Tensor Cores in TF32
    (``sm80_xmma_..._tf32f32_...``) and every other kernel 2x."""
    graph = traces.study(A100_DDP2).graph
    amp = WhatIf(optimizations=["amp"]).apply(graph)
    kinds = graph.tasks["kind"].to_numpy()
    names = graph.tasks["name"].astype(str)
    eligible = names.str.contains(TENSOR_CORE_ELIGIBLE).to_numpy() & ~names.str.contains("tf32").to_numpy()
    before, after = graph.tasks["duration_us"].to_numpy(), amp.tasks["duration_us"].to_numpy()
    kernel = kinds == int(TaskKind.KERNEL)
    assert (kernel & eligible).sum() > 100 and (kernel & ~eligible).sum() > 100
    assert (kernel & names.str.contains("tf32").to_numpy()).sum() > 10
    np.testing.assert_allclose(after[kernel & eligible], before[kernel & eligible] / 3)
    np.testing.assert_allclose(after[kernel & ~eligible], before[kernel & ~eligible] / 2)
    untouched = ~kernel  # CPU work, copies, memsets, and NCCL kernels (all-reduced in fp32)
    assert (kinds == int(TaskKind.COMM)).sum() == 21
    np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.mark.parametrize("name, eligible", [
    # GEMMs and convolutions, as the shared V100, A100 and H100 traces name them
    ("volta_sgemm_64x64_nt", True),
    ("cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", True),
    ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int, int)", True),
    ("void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int)", True),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused::Param)", True),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x4_nn_align1>(Params)", True),
    ("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize256x64x32", True),
    ("ampere_sgemm_128x128_tn", True),
    # memory-bound kernels of cuDNN and FBGEMM, which a library name alone made eligible
    ("void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 128, true, 1>(float, float)", False),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 128, true, 1, true>(cudnnTensorStruct)", False),
    ("void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>(params)", False),
    ("void cudnn::ops::scalePackedTensor_kernel<float, float>(long, float*, float)", False),
    ("void fbgemm_gpu::permute_indices_weights_kernel<false, int, decltype(nullptr)>(int, int)", False),
    ("void at::native::(anonymous namespace)::max_pool_backward_nchw<float, float>(float const*)", False),
    ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel<3, float, int>(float const*)", False),
])
def test_the_tensor_core_kernels_are_the_gemms_and_convolutions(name, eligible):
    assert bool(TENSOR_CORE_ELIGIBLE.search(name)) == eligible


def test_amp_changes_nothing_on_a_cpu_only_trace(traces):
    study = traces.study(BUNDLED)
    schedule, report = predicted(study, WhatIf(optimizations=["amp"]))
    assert np.array_equal(schedule.end_us, study.replay.end_us)
    assert (report["speedup"] == 1.0).all()


def test_a_faster_gpu_never_predicts_a_slower_iteration(traces, kineto_trace):
    assert_never_slower(traces.study(kineto_trace), WhatIf(optimizations=["faster-gpu=2"]))


@pytest.mark.parametrize("option, kinds", [
    ("faster-gpu=4", (TaskKind.KERNEL, TaskKind.MEMCPY, TaskKind.MEMSET)),  # not communication, not the CPU
    ("faster-cpu=4", (TaskKind.CPU, TaskKind.RUNTIME, TaskKind.GAP)),  # not waits, the GPU or communication
])
def test_a_faster_gpu_or_cpu_speeds_up_its_own_work_and_nothing_else(traces, option, kinds):
    graph = traces.study(A100_DDP2).graph
    faster = WhatIf(optimizations=[option]).apply(graph)
    before, after = graph.tasks["duration_us"].to_numpy(), faster.tasks["duration_us"].to_numpy()
    own = np.isin(graph.tasks["kind"].to_numpy(), [int(k) for k in kinds])
    assert own.any() and (~own).any()
    np.testing.assert_allclose(after[own], before[own] / 4)
    np.testing.assert_array_equal(after[~own], before[~own])


def test_a_faster_cpu_never_ends_an_iteration_later_and_shortens_a_cpu_workers_step(traces, kineto_trace):
    """On a GPU trace an iteration may hold more GPU work once the host runs ahead (a step's
    kernels launched earlier run inside it), so it is the iterations' ends that never move later."""
    study = traces.study(kineto_trace)
    schedule, _ = predicted(study, WhatIf(optimizations=["faster-cpu=1.5"]))
    assert (iteration_ends_us(schedule, study.iterations) <= iteration_ends_us(study.replay, study.iterations) + TOLERANCE_US).all()
    study = traces.study(BUNDLED)  # a CPU worker: its step is its threads' work
    _, report = assert_never_slower(study, WhatIf(optimizations=["faster-cpu=2"]))
    assert (report["speedup"] > 1.8).all(), report.to_string()


def test_a_twice_as_fast_gpu_nearly_halves_a_gpu_bound_step(traces):
    """The single-V100 ResNet-50 run is GPU-bound: in its steady steps (#103 to #105) the GPU is
    busy 94.5 of 95.7 ms, while the CPU threads do only about 10.5 ms (main thread) and 14 to
    16 ms (autograd thread) of work per step. With a GPU twice as fast the GPU work of a step
    takes about 47 ms, still more than either thread's work, so the GPU stays the bottleneck and
    a step should take about half as long. The model must show at least 1.5x for each steady
    step; over the whole run a 2x faster GPU can at most halve the time."""
    study = traces.study(V100_1GPU)
    _, report = assert_never_slower(study, WhatIf(optimizations=["faster-gpu=2"]))
    steady = report.set_index("name").loc[["ProfilerStep#103", "ProfilerStep#104", "ProfilerStep#105"]]
    assert (steady["speedup"] > 1.5).all(), steady.to_string()
    assert report["predicted_ms"].sum() >= report["replay_ms"].sum() / 2 * (1 - 1e-3)


def test_the_fused_optimizer_runs_one_kernel_per_step_doing_the_same_gpu_work(traces):
    graph = traces.study(RESNET50).graph
    fused = WhatIf(optimizations=["fused-optimizer"]).apply(graph)
    before = graph.select(pattern=OPTIMIZER_STEP, kinds=[TaskKind.KERNEL])
    after = fused.select(pattern=OPTIMIZER_STEP, kinds=[TaskKind.KERNEL])
    assert len(before) > 1000  # SGD with momentum: several small kernels per parameter, 6 steps
    assert len(after) == 6
    assert fused.tasks["duration_us"].iloc[after].sum() == pytest.approx(graph.tasks["duration_us"].iloc[before].sum())
    launches_after = fused.select(pattern=OPTIMIZER_STEP, kinds=[TaskKind.RUNTIME])
    assert len(launches_after) == 6, "one launch call per fused kernel is kept"


def test_the_fused_optimizer_never_predicts_a_slower_step(traces):
    _, report = assert_never_slower(traces.study(RESNET50), WhatIf(optimizations=["fused-optimizer"]))
    assert (report["speedup"] > 1.05).all(), "the launch overhead of ~480 kernels per step is gone"


@pytest.mark.parametrize("name", [RESNET50_WORKERS4, V100_1GPU, A100_DDP2, DLRM_RANK0, RECSYS])
def test_the_fused_optimizer_never_makes_an_iteration_end_later(traces, name):
    """Fusing moves GPU work earlier, so in a pipelined run one step may absorb what its
    predecessor saved; but no iteration may end later than in the replay."""
    study = traces.study(name)
    schedule, _ = predicted(study, WhatIf(optimizations=["fused-optimizer"]))
    later = iteration_ends_us(schedule, study.iterations) - iteration_ends_us(study.replay, study.iterations)
    assert (later <= TOLERANCE_US).all()


def test_the_fused_optimizer_refuses_a_step_that_launches_no_kernel(traces):
    """On a CPU worker the optimizer step's CPU work is the update itself: removing it, as the
    fusion removes launch work, dropped the update and with it DDP's wait for the gradients'
    all-reduce (the 2x2 transformer at 1 Gbps came out at 320 ms a step against 687)."""
    with pytest.raises(GraphError, match="launches no GPU kernels"):
        WhatIf(optimizations=["fused-optimizer"]).apply(traces.study(BUNDLED).graph)


def test_the_fused_optimizer_needs_an_optimizer_step(traces):
    with pytest.raises(GraphError, match="optimizer"):
        WhatIf(optimizations=["fused-optimizer"]).apply(traces.study(EVENT_SYNC).graph)


# -- removing work --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, pattern",
    [
        (RESNET50, "DataLoader"),
        (BUNDLED, "DataLoader"),
        (RESNET50, "Optimizer"),
        (DLRM_RANK0, "Optimizer"),
        (A100_DDP2, "Optimizer"),
        (BUNDLED, "Optimizer"),
    ],
)
def test_removing_work_never_predicts_slower(traces, name, pattern):
    assert_never_slower(traces.study(name), WhatIf(remove=[pattern]))


def test_removing_the_data_loader_speeds_up_a_host_bound_run(traces):
    """ResNet-50 with workers=0 loads each batch on the main thread, 44 to 47 ms of each ~150 ms
    step, while the GPU is busy about 100 ms: without data loading a step must get clearly
    shorter, the first step included."""
    study = traces.study(RESNET50)
    _, report = predicted(study, WhatIf(remove=["DataLoader"]))
    assert (report["speedup"].iloc[1:] > 1.15).all(), report.to_string()


def test_removing_the_data_loader_speeds_up_the_first_step_too(traces):
    _, report = predicted(traces.study(RESNET50), WhatIf(remove=["DataLoader"]))
    assert report["speedup"].iloc[0] > 1.15, report.to_string()


def test_the_no_dataloader_optimization_removes_the_data_loading(traces):
    study = traces.study(RESNET50)
    _, by_name = predicted(study, WhatIf(optimizations=["no-dataloader"]))
    _, by_pattern = predicted(study, WhatIf(remove=["DataLoader"]))
    np.testing.assert_array_equal(by_name["predicted_ms"], by_pattern["predicted_ms"])


def remove_launch_call_of_first_task(graph, stream: str) -> tuple[int, int]:
    """Remove the launch call of the first task on ``stream`` (which has no stream predecessor to
    wait for); returns the task's new id and the id of the task that ran before the call."""
    kernel = int(resource_sequence(graph, stream)[0])
    launch = graph.edges[(graph.edges["dst"] == kernel) & (graph.edges["kind"] == int(EdgeKind.LAUNCH))]
    call = int(launch["src"].iat[0])
    thread = resource_sequence(graph, str(graph.tasks["resource"].iat[call]))
    before_call = int(thread[np.flatnonzero(thread == call)[0] - 1])
    assert before_call < call < kernel
    graph.remove(np.array([call]))
    return kernel - 1, before_call  # ids after the removed task shift down by one


@pytest.mark.parametrize("stream", ["gpu 0/stream 20", "gpu 0/stream 24", "gpu 0/stream 28"])
def test_a_kernel_whose_launch_call_is_removed_still_waits_for_what_preceded_the_call(traces, stream):
    graph = traces.study(EVENT_SYNC_MULTISTREAM).graph.copy()
    kernel, before_call = remove_launch_call_of_first_task(graph, stream)
    into_kernel = graph.edges[graph.edges["dst"] == kernel]
    assert before_call in into_kernel["src"].tolist()
    schedule = simulate(graph)
    assert schedule.start_us[kernel] >= schedule.end_us[before_call]


def test_a_copy_whose_launch_call_is_removed_still_waits_for_what_preceded_the_call(traces):
    """ResNet-50's first GPU task is a pageable host-to-device copy, which the driver stages while
    cudaMemcpyAsync is still running: it starts 1.6 ms before the call returns."""
    graph = traces.study(RESNET50).graph.copy()
    kernel, before_call = remove_launch_call_of_first_task(graph, "gpu 0/stream 7")
    bypass = graph.edges[(graph.edges["dst"] == kernel) & (graph.edges["src"] == before_call)]
    assert len(bypass) == 1
    assert bypass["lag_us"].iat[0] >= 0.0
    schedule = simulate(graph)
    assert schedule.start_us[kernel] >= schedule.end_us[before_call]


def test_removing_every_launch_call_keeps_every_kernel_connected(traces):
    study = traces.study(RESNET50)
    graph = WhatIf(remove=["^cudaLaunchKernel$"]).apply(study.graph)
    assert len(graph.tasks) == len(study.graph.tasks) - (study.graph.tasks["name"] == "cudaLaunchKernel").sum()
    gpu = np.flatnonzero(np.isin(graph.tasks["kind"].to_numpy(), [int(k) for k in GPU_TASK_KINDS]))
    assert np.isin(gpu, graph.edges["dst"].to_numpy()).all()
    schedule = simulate(graph)
    assert np.isfinite(schedule.start_us).all()
    assert schedule.makespan_us <= study.replay.makespan_us + TOLERANCE_US


def test_removing_the_first_task_of_a_thread_keeps_the_thread_anchored(traces):
    study = traces.study(BUNDLED)
    graph = study.graph.copy()
    thread = resource_sequence(graph, "cpu 3401/3401")
    first = int(thread[0])
    release = float(graph.tasks["release_us"].iat[first])
    graph.remove(np.array([first]))
    schedule = simulate(graph)
    assert np.isfinite(schedule.start_us).all()
    assert schedule.start_us[first] == release  # the task that was second now runs first


# -- inserting work -------------------------------------------------------------------------------


def test_a_task_inserted_on_a_busy_gpu_stream_delays_what_follows_by_its_duration(traces):
    """On the GPU-bound V100 run the stream runs kernel after kernel, a microsecond or so apart.
    1 ms inserted there pushes the following kernels back by 1 ms (less the gap it fills, since
    it starts as soon as the kernel before it ends) and nothing anywhere by more."""
    study = traces.study(V100_1GPU)
    graph = study.graph.copy()
    stream = resource_sequence(graph, "gpu 0/stream 7")
    start, end = study.replay.start_us[stream], study.replay.end_us[stream]
    gap = start[1:] - end[:-1]
    # a place in the steady state (step #104) followed by 20 kernels at most 2 us apart
    step = study.iterations.set_index("name").loc["ProfilerStep#104"]
    busy = np.convolve(gap <= 2.0, np.ones(20), mode="valid") == 20
    candidates = np.flatnonzero(busy & (start[: len(busy)] > step.start_us))
    assert len(candidates), "the stream is saturated somewhere in step #104"
    i = int(candidates[0])
    new = graph.insert(after=int(stream[i]), before=None, name="inserted work", duration_us=1000.0)
    schedule = simulate(graph)
    assert schedule.start_us[new] == pytest.approx(end[i])
    following = stream[i + 1 : i + 21]
    delay = schedule.start_us[following] - start[i + 1 : i + 21]
    assert 1000.0 - gap[i] - 1e-6 <= delay[0] <= 1000.0 + 1e-6
    np.testing.assert_allclose(delay, delay[0], atol=1e-6)
    everywhere = schedule.end_us[: len(study.replay.end_us)] - study.replay.end_us
    assert everywhere.min() >= -TOLERANCE_US and everywhere.max() <= 1000.0 + TOLERANCE_US


def test_an_inserted_task_on_another_resource_sits_between_its_neighbours(traces):
    """A 500 us transfer on a new link after the sgemm on stream 20, which the stream-24 task
    that waits on that sgemm's event must now also wait for."""
    study = traces.study(EVENT_SYNC_MULTISTREAM)
    graph = study.graph.copy()
    wait = graph.edges[graph.edges["kind"] == int(EdgeKind.STREAM_WAIT)].iloc[0]
    src, dst = int(wait["src"]), int(wait["dst"])
    new = graph.insert(after=src, before=dst, name="transfer", duration_us=500.0, resource="link 0", kind=TaskKind.COMM)
    assert str(graph.tasks["resource"].iat[new]) == "link 0"
    schedule = simulate(graph)
    assert schedule.start_us[new] == pytest.approx(schedule.end_us[src])
    assert schedule.end_us[new] == pytest.approx(schedule.start_us[new] + 500.0)
    assert schedule.start_us[dst] >= schedule.end_us[new] - TOLERANCE_US


def test_an_insertion_needs_a_non_negative_duration(traces):
    graph = traces.study(BUNDLED).graph.copy()
    with pytest.raises(GraphError, match="duration"):
        graph.insert(after=0, before=1, name="bad", duration_us=-1.0)


def test_removing_tasks_makes_no_bypass_edge_that_another_implies(traces):
    """fused-optimizer on ResNet-50 removes chains of launches and kernels that launch-queue edges
    join to hundreds of kernels before and launches after; joining each of those to each of these
    made 607,840 dependencies. Of two sources on one stream or thread, the later one with at
    least the lag implies the other: only undominated bypass edges are made, fewer dependencies
    than the trace had, and adding the dominated ones back changes no start."""
    study = traces.study(RESNET50)
    graph = WhatIf(optimizations=["fused-optimizer"]).apply(study.graph)
    assert len(graph.edges) < len(study.graph.edges)
    bypass = graph.edges[graph.edges["kind"] == int(EdgeKind.BYPASS)]
    assert len(bypass)
    before_on_resource = {}
    for seq in graph.resource_order():
        if str(graph.tasks["resource"].iat[int(seq[0])]).startswith(("cpu ", "gpu ")):
            before_on_resource.update(zip(seq[1:].tolist(), seq[:-1].tolist()))
    dominated = [(before_on_resource[s], d, lag, int(EdgeKind.BYPASS))
                 for s, d, lag in zip(bypass["src"], bypass["dst"], bypass["lag_us"]) if s in before_on_resource]
    assert len(dominated) > 1000
    with_dominated = graph.copy()
    with_dominated.add_edges(dominated)
    np.testing.assert_array_equal(simulate(with_dominated).start_us, simulate(graph).start_us)
