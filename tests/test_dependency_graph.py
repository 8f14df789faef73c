"""The dependency graph built from a trace: what its tasks are and which causes link them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trace_corpus import A100_DDP2, BUNDLED, COMPILED_DDP, EVENT_SYNC, EVENT_SYNC_MULTISTREAM, RESNET50, predicted
from whatif import WhatIf, simulate
from whatif.collectors.kineto import EventKind
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind, TaskKind

GPU_KIND_VALUES = [int(k) for k in GPU_TASK_KINDS]


def edges_of(graph, kind: EdgeKind) -> pd.DataFrame:
    edges = graph.edges[graph.edges["kind"] == int(kind)]
    tasks = graph.tasks
    return edges.assign(
        src_name=tasks["name"].astype(str).to_numpy()[edges["src"].to_numpy()],
        dst_name=tasks["name"].astype(str).to_numpy()[edges["dst"].to_numpy()],
        src_kind=tasks["kind"].to_numpy()[edges["src"].to_numpy()],
        src_resource=tasks["resource"].astype(str).to_numpy()[edges["src"].to_numpy()],
        dst_resource=tasks["resource"].astype(str).to_numpy()[edges["dst"].to_numpy()],
    )


def is_gpu(kind_values) -> np.ndarray:
    return np.isin(kind_values, GPU_KIND_VALUES)


# -- GPU -> CPU and GPU -> GPU synchronisation ---------------------------------------------------


@pytest.mark.parametrize("call", ["cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"])
def test_a_synchronize_call_waits_for_the_gpu_work_it_synchronises_on(traces, call):
    graph = traces.study(EVENT_SYNC).graph
    sync = edges_of(graph, EdgeKind.SYNC)
    into_call = sync[sync["dst_name"] == call]
    assert len(into_call) >= 1, f"no SYNC edge into {call}"
    assert is_gpu(into_call["src_kind"]).all()
    tasks = graph.tasks
    # the GPU work ended before the call returned: that is what the call waited for
    src_end = tasks["measured_end_us"].to_numpy()[into_call["src"].to_numpy()]
    call_end = tasks["measured_end_us"].to_numpy()[into_call["dst"].to_numpy()]
    assert (src_end <= call_end + 1.0).all()


def test_event_synchronize_waits_for_the_kernel_before_the_recorded_event(traces):
    """The trace records an event after the spin kernel, then cudaEventSynchronize on it."""
    sync = edges_of(traces.study(EVENT_SYNC).graph, EdgeKind.SYNC)
    sources = set(sync.loc[sync["dst_name"] == "cudaEventSynchronize", "src_name"])
    assert sources == {"at::cuda::(anonymous namespace)::spin_kernel(long)"}


def test_device_synchronize_waits_for_the_last_task_of_every_stream(traces):
    graph = traces.study(EVENT_SYNC_MULTISTREAM).graph
    sync = edges_of(graph, EdgeKind.SYNC)
    into_device_sync = sync[sync["dst_name"] == "cudaDeviceSynchronize"]
    last_of_stream = {
        int(seq[-1]) for seq in graph.resource_order() if str(graph.tasks["resource"].iat[int(seq[0])]).startswith("gpu")
    }
    assert len(last_of_stream) == 3
    assert set(into_device_sync["src"].tolist()) == last_of_stream


def test_stream_wait_event_links_tasks_on_different_streams(traces):
    graph = traces.study(EVENT_SYNC_MULTISTREAM).graph
    waits = edges_of(graph, EdgeKind.STREAM_WAIT)
    assert len(waits) >= 1
    assert (waits["src_resource"] != waits["dst_resource"]).all()
    assert waits["src_resource"].str.startswith("gpu").all() and waits["dst_resource"].str.startswith("gpu").all()
    # cudaEventRecord after the sgemm on stream 20; cudaStreamWaitEvent makes stream 24 wait
    row = waits.iloc[0]
    assert row["src_name"] == "ampere_sgemm_128x64_nn" and row["src_resource"].endswith("stream 20")
    assert row["dst_resource"].endswith("stream 24")


def test_a_slower_kernel_delays_the_stream_that_waits_on_its_event(traces):
    graph = traces.study(EVENT_SYNC_MULTISTREAM).graph.copy()
    row = edges_of(graph, EdgeKind.STREAM_WAIT).iloc[0]
    before = simulate(graph)
    graph.scale(np.array([row["src"]]), 200.0)
    after = simulate(graph)
    assert after.end_us[row["src"]] > before.start_us[row["dst"]]
    assert after.start_us[row["dst"]] >= after.end_us[row["src"]] + row["lag_us"] - 1e-9


# -- CPU -> GPU launches ------------------------------------------------------------------------


def gpu_tasks_with_a_launch_call(trace) -> int:
    ev = trace.events
    runtime_correlations = ev.loc[(ev["kind"] == int(EventKind.RUNTIME)) & (ev["correlation"] >= 0), "correlation"]
    gpu = ev[ev["kind"].isin([int(EventKind.KERNEL), int(EventKind.MEMCPY), int(EventKind.MEMSET)])]
    return int(gpu["correlation"].isin(set(runtime_correlations)).sum())


def test_every_launched_gpu_task_has_one_launch_edge_from_its_runtime_call(traces):
    study = traces.study(RESNET50)
    launch = edges_of(study.graph, EdgeKind.LAUNCH)
    assert len(launch) == gpu_tasks_with_a_launch_call(study.trace) == 9096
    assert not launch["dst"].duplicated().any()
    assert (launch["src_kind"] == int(TaskKind.RUNTIME)).all()
    assert set(launch["src_name"]) <= {"cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync"}
    assert is_gpu(study.graph.tasks["kind"].to_numpy()[launch["dst"].to_numpy()]).all()


def test_launch_edges_match_the_correlation_ids_in_every_trace(traces, kineto_trace):
    """A synchronous copy's launch edge starts on its thread just before the call that waited
    for it; every other launch edge starts at the runtime call."""
    study = traces.study(kineto_trace)
    launch = edges_of(study.graph, EdgeKind.LAUNCH)
    assert len(launch) == gpu_tasks_with_a_launch_call(study.trace)
    assert not launch["dst"].duplicated().any()
    assert launch["src_resource"].str.startswith("cpu").all()
    assert launch["src_kind"].isin([int(TaskKind.RUNTIME), int(TaskKind.CPU), int(TaskKind.GAP)]).all()


def test_tasks_on_a_gpu_stream_follow_each_other(traces, kineto_trace):
    graph = traces.study(kineto_trace).graph
    tasks = graph.tasks
    seq_edges = edges_of(graph, EdgeKind.GPU_SEQ)
    expected = set()
    for seq in graph.resource_order():
        if str(tasks["resource"].iat[int(seq[0])]).startswith("gpu"):
            assert (np.diff(tasks["measured_start_us"].to_numpy()[seq]) >= 0).all(), "stream order is time order"
            expected |= set(zip(seq[:-1].tolist(), seq[1:].tolist()))
    assert set(zip(seq_edges["src"].tolist(), seq_edges["dst"].tolist())) == expected


# -- CPU threads --------------------------------------------------------------------------------


def test_cpu_threads_tile_their_timeline_from_zero(traces, any_trace):
    graph = traces.study(any_trace).graph
    tasks = graph.tasks
    cpu_sequences = [seq for seq in graph.resource_order() if str(tasks["resource"].iat[int(seq[0])]).startswith("cpu")]
    assert cpu_sequences
    for seq in cpu_sequences:
        start = tasks["measured_start_us"].to_numpy()[seq]
        end = tasks["measured_end_us"].to_numpy()[seq]
        assert start[0] == 0.0
        np.testing.assert_array_equal(end[:-1], start[1:])
        assert not is_gpu(tasks["kind"].to_numpy()[seq]).any()


def test_the_autograd_thread_waits_for_the_main_thread_and_back(traces):
    """ResNet-50 (2021): the main thread runs forward, hands backward to the autograd thread and
    sleeps until backward ends; each hand-over is a THREAD edge into a WAIT task."""
    graph = traces.study(RESNET50).graph
    tasks = graph.tasks
    waits = tasks[tasks["kind"] == int(TaskKind.WAIT)]
    assert set(waits["resource"].astype(str)) == {"cpu 25738/25738", "cpu 25738/25772"}
    thread_edges = edges_of(graph, EdgeKind.THREAD)
    assert set(thread_edges["dst"]) == set(waits.index)
    assert (thread_edges["src_resource"] != thread_edges["dst_resource"]).all()
    # six steps: six hand-overs each way
    assert (thread_edges["dst_resource"] == "cpu 25738/25772").sum() == 6
    assert (thread_edges["dst_resource"] == "cpu 25738/25738").sum() == 6


def test_the_backward_pass_moves_with_the_forward_pass(traces):
    """Less work on the main thread before backward lets the autograd thread finish earlier."""
    study = traces.study(RESNET50)
    schedule, _ = predicted(study, WhatIf(remove=["DataLoader"]))
    autograd = "cpu 25738/25772"
    before = study.replay.end_us[(study.graph.tasks["resource"] == autograd).to_numpy()].max()
    after = schedule.end_us[(schedule.graph.tasks["resource"] == autograd).to_numpy()].max()
    assert after < before - 10_000  # six steps of data loading are well over 10 ms


# -- what the tasks are -------------------------------------------------------------------------


def test_nccl_kernels_are_communication_tasks(traces):
    """SOURCES.md: a100_ddp2 rank 0 runs 15 NCCL AllReduce and 6 Broadcast kernels."""
    tasks = traces.study(A100_DDP2).graph.tasks
    names = tasks["name"].astype(str)
    nccl = names.str.contains("nccl", case=False).to_numpy()
    comm = (tasks["kind"] == int(TaskKind.COMM)).to_numpy()
    np.testing.assert_array_equal(comm, nccl)
    assert names[comm].str.contains("AllReduce").sum() == 15
    assert names[comm].str.contains("Broadcast").sum() == 6


def test_torch_compile_all_reduces_are_communication_tasks(traces):
    """SOURCES.md: 404 small NCCL AllReduce per step, five steps, on their own stream."""
    tasks = traces.study(COMPILED_DDP).graph.tasks
    comm = tasks[tasks["kind"] == int(TaskKind.COMM)]
    assert len(comm) == 5 * 404
    assert comm["resource"].nunique() == 1


def test_kernels_belong_to_the_operator_that_launched_them(traces):
    """Forward convolutions are launched under aten::conv2d on the main thread, backward ones under
    the autograd node on the autograd thread; either way the context names the convolution."""
    graph = traces.study(RESNET50).graph
    tasks = graph.tasks
    conv = tasks[(tasks["kind"] == int(TaskKind.KERNEL)) & tasks["name"].astype(str).str.contains("scudnn|conv")]
    assert len(conv) > 100
    assert conv["context"].astype(str).str.contains("conv", case=False).all()
    launch = edges_of(graph, EdgeKind.LAUNCH).set_index("dst")
    from_main = launch.loc[conv.index, "src_resource"].to_numpy() == "cpu 25738/25738"
    assert from_main.any() and (~from_main).any()
    assert set(conv["operator"].astype(str)[from_main]) == {"aten::conv2d"}
    assert set(conv["operator"].astype(str)[~from_main]) == {"CudnnConvolutionBackward"}


def test_selecting_by_pattern_matches_the_enclosing_context(traces):
    graph = traces.study(RESNET50).graph
    tasks = graph.tasks
    selected = graph.select(pattern="DataLoader")
    assert len(selected) > 0
    chosen = tasks.iloc[selected]
    assert (chosen["kind"].isin([int(TaskKind.CPU), int(TaskKind.GAP), int(TaskKind.RUNTIME)])).all()
    names = chosen["name"].astype(str)
    assert (~names.str.contains("DataLoader")).sum() > 0, "operators called by the data loader"
    assert {"aten::empty", "aten::copy_"} <= set(names)
    assert chosen["context"].astype(str).str.contains("DataLoader").all()
    # every data-loading step is found: six steps of enumerate(DataLoader)
    assert chosen["context"].astype(str).str.startswith("ProfilerStep#").all()
    assert chosen["context"].astype(str).str.extract(r"^(ProfilerStep#\d+)")[0].nunique() == 6


def test_selection_conditions_combine(traces):
    graph = traces.study(RESNET50).graph
    in_optimizer = set(graph.select(pattern=r"Optimizer\.step").tolist())
    kernels = set(graph.select(kinds=[TaskKind.KERNEL]).tolist())
    both = graph.select(pattern=r"Optimizer\.step", kinds=[TaskKind.KERNEL])
    assert set(both.tolist()) == in_optimizer & kernels and len(both) > 0
    long_ones = graph.select(pattern=r"Optimizer\.step", kinds=[TaskKind.KERNEL], where=lambda t: t["duration_us"] > 20)
    assert set(long_ones.tolist()) < set(both.tolist())


def test_the_bundled_cpu_trace_is_one_thread_of_cpu_tasks(traces):
    graph = traces.study(BUNDLED).graph
    kinds = set(graph.tasks["kind"].tolist())
    assert kinds <= {int(TaskKind.CPU), int(TaskKind.GAP), int(TaskKind.WAIT)}
    assert graph.tasks["resource"].astype(str).unique().tolist() == ["cpu 3401/3401"]
    assert len(graph.edges) == 0, "one thread and no GPU: the thread's order is the only dependency"


def test_a_thread_of_python_frames_alone_is_left_out_so_it_holds_up_no_what_if(shared_traces):
    """VGG-13's H100 trace has a thread the Python tracer saw only in frames (tqdm's monitor, a
    multiprocessing queue's feeder) whose ``threading.py: wait`` lasts the whole trace. Kept, it
    held every prediction at the traced 351 ms (a GPU twice as fast: speed-up 1.00); left out,
    with a counted warning, the replay is as exact and the what-if moves."""
    import warnings

    from whatif.collectors.diagnostics import InputWarning
    from whatif.study import TraceStudy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        study = TraceStudy.from_trace(shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz")
    said = [str(w.message) for w in caught if issubclass(w.category, InputWarning)]
    assert any("left out 10 Python frames of 1 thread that ran no operator" in text for text in said)
    assert not study.graph.tasks["name"].astype(str).str.contains("tqdm/_monitor").any()
    assert study.replay_report()["error_pct"].abs().max() < 1e-9
    _, report = predicted(study, WhatIf(optimizations=["faster-gpu=2"]))
    assert report["speedup"].iat[0] > 1.8  # its critical path is 346 of 351 ms of GPU time


def test_a_range_opened_inside_the_tracers_enter_frame_holds_what_it_spans(shared_traces):
    """With Python stacks, torch.profiler's Optimizer.step range (27.3 ms in VGG-13's H100 trace)
    begins inside the tracer's 36 us frame of ``_record_function_enter_new``, which returns long
    before the range closes. Clipped to that frame, the range held one 19 us gap and none of
    Adam's work, so nothing could find the optimizer; now the frame ends where the range begins
    and the step's frames, operators and launches nest in the range."""
    from whatif.study import TraceStudy

    graph = TraceStudy.from_trace(shared_traces / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz").graph
    tasks = graph.tasks
    inside = graph.match(r"Optimizer\.step#Adam\.step")
    cpu = inside & tasks["resource"].astype(str).str.startswith("cpu").to_numpy()
    assert tasks["duration_us"].to_numpy()[cpu].sum() == pytest.approx(27324, abs=1)  # the range's own length
    kernels = inside & (tasks["kind"].to_numpy() == int(TaskKind.KERNEL))
    assert kernels.sum() > 20  # Adam's multi-tensor kernels, by their launches' context
