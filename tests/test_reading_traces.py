"""Reading Kineto traces: every real trace loads, events get the right kinds in both schema
generations, and iterations are found the way the profiler marked them."""

from __future__ import annotations

import collections
import gzip
import json

import numpy as np
import pandas.testing as pd_testing
import pytest

from trace_corpus import BUNDLED, EXECUTION_TRACE, RESNET18, RESNET50, V100_1GPU
from whatif import TraceError, load_trace
from whatif.collectors.iterations import WHOLE_TRACE, as_pattern, find_iterations, whole_trace_note
from whatif.collectors.kineto import CPU_KINDS, GPU_KINDS, EventKind

#: What each Kineto category is, written out independently of the reader: the 2021 schema's
#: categories (Kernel, Runtime, ...) beside the current ones (kernel, cuda_runtime, ...).
CATEGORY_KIND = {
    "kernel": EventKind.KERNEL,
    "gpu_memcpy": EventKind.MEMCPY,
    "memcpy": EventKind.MEMCPY,
    "gpu_memset": EventKind.MEMSET,
    "memset": EventKind.MEMSET,
    "cuda_runtime": EventKind.RUNTIME,
    "cuda_driver": EventKind.RUNTIME,
    "runtime": EventKind.RUNTIME,
    "cuda_sync": EventKind.CUDA_SYNC,
}
CPU_CATEGORIES = {"cpu_op", "operator", "user_annotation", "python_function"}


def count_raw_events(path) -> collections.Counter:
    """Complete ('X') events with a duration, by kind, straight from the JSON."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    counts = collections.Counter()
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("dur", -1) < 0:
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat in CATEGORY_KIND:
            counts[CATEGORY_KIND[cat]] += 1
        elif cat in CPU_CATEGORIES:
            counts["cpu"] += 1
    return counts


def kind_counts(trace) -> collections.Counter:
    return collections.Counter(EventKind(k) for k in trace.events["kind"].tolist())


def test_every_kineto_trace_loads_with_timed_gpu_events(traces, kineto_trace):
    trace = traces.trace(kineto_trace)
    ev = trace.events
    assert len(ev) > 0
    assert ev["ts_us"].min() == 0.0, "timestamps are relative to the first event"
    assert (ev["dur_us"] >= 0).all()
    assert trace.has_gpu
    assert kind_counts(trace)[EventKind.KERNEL] > 0


def test_every_timed_event_is_read_as_the_kind_of_its_category(traces, kineto_trace):
    trace = traces.trace(kineto_trace)
    raw = count_raw_events(traces.path(kineto_trace))
    read = kind_counts(trace)
    for kind in (*GPU_KINDS, EventKind.RUNTIME, EventKind.CUDA_SYNC):
        assert read[kind] == raw[kind], kind.name
    assert sum(read[k] for k in CPU_KINDS if k != EventKind.RUNTIME) == raw["cpu"]


@pytest.mark.parametrize("name", [RESNET50, V100_1GPU], ids=["2021-schema", "current-schema"])
def test_both_schema_generations_map_to_the_same_kinds(traces, name):
    """The same ResNet-50 training loop profiled in 2021 (categories Operator, Runtime, Kernel,
    Memcpy, Memset) and with a current Kineto (cpu_op, user_annotation, cuda_runtime, kernel,
    gpu_memcpy, gpu_memset) reads into the same event kinds."""
    ev = traces.trace(name).events
    ev = ev[ev["kind"] != int(EventKind.GPU_ANNOTATION)]  # the current schema's GPU-side copies of ranges
    names = ev["name"].astype(str)
    kinds = ev["kind"].to_numpy()

    def kinds_of(mask):
        return {EventKind(k) for k in np.unique(kinds[mask.to_numpy()])}

    assert kinds_of(names.str.startswith("ProfilerStep#")) == {EventKind.ANNOTATION}
    assert kinds_of(names.str.startswith("Optimizer.step#")) == {EventKind.ANNOTATION}
    assert kinds_of(names == "aten::conv2d") == {EventKind.CPU_OP}
    assert kinds_of(names == "cudaLaunchKernel") == {EventKind.RUNTIME}
    assert kinds_of(names.str.contains("sgemm|scudnn|volta_", regex=True)) == {EventKind.KERNEL}
    assert kinds_of(names.str.startswith("Memcpy ")) == {EventKind.MEMCPY}
    assert kinds_of(names.str.startswith("Memset")) == {EventKind.MEMSET}


def test_an_execution_trace_is_refused_as_one(shared_traces):
    path = shared_traces / EXECUTION_TRACE
    with pytest.raises(TraceError, match="execution trace") as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_the_bundled_cpu_trace_has_no_gpu_events(traces):
    trace = traces.trace(BUNDLED)
    assert not trace.has_gpu
    read = kind_counts(trace)
    assert all(read[k] == 0 for k in GPU_KINDS)
    assert read[EventKind.CPU_OP] > 0 and read[EventKind.RUNTIME] == 0


def test_a_plain_json_trace_reads_like_its_gzip(traces, tmp_path):
    plain = tmp_path / "convnet.pt.trace.json"
    plain.write_bytes(gzip.decompress(traces.path(BUNDLED).read_bytes()))
    pd_testing.assert_frame_equal(load_trace(plain).events, traces.trace(BUNDLED).events)


def test_a_bare_list_of_events_is_a_trace(traces, tmp_path):
    """Chrome's trace format also allows the event array alone, without the wrapping object."""
    doc = json.loads(gzip.decompress(traces.path(BUNDLED).read_bytes()))
    bare = tmp_path / "events.json"
    bare.write_text(json.dumps(doc["traceEvents"]))
    pd_testing.assert_frame_equal(load_trace(bare).events, traces.trace(BUNDLED).events)


# -- iterations ------------------------------------------------------------------------------


def test_profiler_steps_are_the_iterations_with_their_measured_durations(traces):
    """SOURCES.md: ResNet-50 workers0 has 6 steps of 159.4, 149.0, 148.7, 151.7, 153.2, 155.7 ms."""
    iterations = find_iterations(traces.trace(RESNET50))
    assert iterations["name"].tolist() == [f"ProfilerStep#{n}" for n in range(16, 22)]
    duration_ms = (iterations["end_us"] - iterations["start_us"]).to_numpy() / 1e3
    np.testing.assert_allclose(duration_ms, [159.4, 149.0, 148.7, 151.7, 153.2, 155.7], atol=0.1)
    assert (iterations["start_us"].diff().dropna() > 0).all(), "in time order"
    assert iterations["thread"].nunique() == 1, "the thread that called prof.step()"


def test_the_bundled_trace_has_its_five_profiler_steps(traces):
    iterations = find_iterations(traces.trace(BUNDLED))
    assert iterations["name"].tolist() == [f"ProfilerStep#{n}" for n in range(1, 6)]
    duration_ms = (iterations["end_us"] - iterations["start_us"]).to_numpy() / 1e3
    np.testing.assert_allclose(duration_ms, [53.3, 60.3, 76.0, 77.9, 83.8], atol=0.1)  # data/README.md


@pytest.mark.parametrize("name, occurrences", [(RESNET50, 6), (RESNET18, 30), (BUNDLED, 5)])
def test_a_user_named_annotation_gives_one_span_per_occurrence(traces, name, occurrences):
    trace = traces.trace(name)
    spans = find_iterations(trace, "Optimizer.step#SGD.step")
    assert len(spans) == occurrences
    assert set(spans["name"]) == {"Optimizer.step#SGD.step"}
    assert (spans["end_us"] > spans["start_us"]).all()
    assert (spans["start_us"].to_numpy()[1:] >= spans["end_us"].to_numpy()[:-1]).all(), "one span per step"


def test_a_user_named_annotation_lies_inside_its_profiler_step(traces):
    trace = traces.trace(RESNET50)
    steps = find_iterations(trace)
    spans = find_iterations(trace, "Optimizer.step#SGD.step")
    for step, span in zip(steps.itertuples(), spans.itertuples()):
        assert step.start_us <= span.start_us < span.end_us <= step.end_us


def test_a_trace_without_profiler_steps_is_one_whole_trace_span(traces):
    """param-resnet18 holds 30 iterations but no ProfilerStep markers."""
    trace = traces.trace(RESNET18)
    spans = find_iterations(trace)
    assert spans["name"].tolist() == [WHOLE_TRACE]
    ev = trace.events
    timed = ev[~ev["kind"].isin([int(EventKind.CUDA_SYNC), int(EventKind.GPU_ANNOTATION)])]
    assert spans["start_us"].iat[0] == 0.0
    assert spans["end_us"].iat[0] == pytest.approx((timed["ts_us"] + timed["dur_us"]).max())


def test_a_trace_that_became_one_iteration_says_so_and_names_what_repeats(traces):
    """param-resnet18 became one 16-second iteration without a word; the note says so and names
    its three annotations that repeat, each as a pattern --iteration takes literally."""
    trace = traces.trace(RESNET18)
    note = whole_trace_note(trace, find_iterations(trace))
    assert note.startswith(f"{trace.path}: no ProfilerStep#N ranges, so the whole trace (16172.1 ms) is one iteration; ")
    assert "give --iteration NAME" in note and "\n" not in note
    assert note.endswith(
        "the annotations that repeat here are "
        "'enumerate\\(DataLoader\\)#_MultiProcessingDataLoaderIter\\.__next__' (30 times, median 110.3 ms), "
        "'Optimizer\\.step#SGD\\.step' (30 times, median 1.7 ms), "
        "'Optimizer\\.zero_grad#SGD\\.zero_grad' (30 times, median 0.2 ms)"
    )
    for pattern in ("Optimizer\\.step#SGD\\.step", as_pattern("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__")):
        assert len(find_iterations(trace, pattern)) == 30
    assert whole_trace_note(traces.trace(RESNET50), find_iterations(traces.trace(RESNET50))) == ""


def test_the_cli_notes_a_trace_that_became_one_iteration_on_stderr(traces, capsys):
    from whatif.cli import main

    assert main(["replay", str(traces.path(RESNET18)), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("whatif: note: ") and "is one iteration" in err and err.count("\n") == 1
    assert main(["replay", str(traces.path(RESNET18)), "--json", "--iteration", "Optimizer.step#SGD.step"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", [BUNDLED, RESNET50])
def test_an_unknown_iteration_name_is_an_error_that_names_it(traces, name):
    with pytest.raises(TraceError, match="Optimizer.step#Adam.step") as err:
        find_iterations(traces.trace(name), "Optimizer.step#Adam.step")
    assert str(traces.path(name)) in str(err.value)
