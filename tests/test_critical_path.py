"""The critical path of a simulated iteration: the chain of tasks and waits that decided when it
ended. On hand-written graphs, which branch and which kinds of time it takes; on real traces,
that it tiles each iteration's predicted time, that it is causal (speeding up a task on it
shortens the iteration, one off it changes nothing), and ``whatif critical-path``."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from test_bad_input import assert_one_line_error, broken_traces, run_cli
from test_engine import make_graph
from trace_corpus import A100_DDP2, BUNDLED, BUNDLED_TRACE, DLRM_RANK0, RECSYS, V100_1GPU
from whatif import simulate
from whatif.report.iterations import iteration_report
from whatif.sim.critical_path import PATH_KINDS, critical_path, find_deciders, iteration_critical_paths
from whatif.sim.graph import EdgeKind, TaskKind

TOLERANCE_US = 1e-6


def with_kinds(graph, task_kinds: dict, edge_kinds: list):
    """``graph`` with the given tasks' kinds (index -> TaskKind) and its edges' kinds, in order."""
    kinds = graph.tasks["kind"].to_numpy().copy()
    for task, kind in task_kinds.items():
        kinds[task] = int(kind)
    graph.tasks["kind"] = kinds
    graph.edges["kind"] = np.asarray([int(k) for k in edge_kinds], dtype=np.int8)
    return graph


def path_to_end(graph, from_us=-np.inf):
    schedule = simulate(graph)
    return schedule, critical_path(schedule, int(np.argmax(schedule.end_us)), from_us)


def assert_tiles(path, start_us, end_us):
    steps = path.steps
    assert steps["start_us"].iat[0] == pytest.approx(start_us)
    assert steps["end_us"].iat[-1] == pytest.approx(end_us)
    assert steps["start_us"].to_numpy()[1:] == pytest.approx(steps["end_us"].to_numpy()[:-1])
    assert (steps["duration_us"] >= 0).all()
    assert path.by_kind().sum() == pytest.approx(end_us - start_us)


# -- on hand-written graphs -----------------------------------------------------------------------


def fork_join(b_us: float, c_us: float):
    """a launches b and c on two streams; d waits for both."""
    graph = make_graph(
        [("a", "cpu 0", 10, 0.0), ("b", "gpu 0/stream 7", b_us), ("c", "gpu 0/stream 8", c_us), ("d", "cpu 0", 5)],
        [(0, 1, 0.0), (0, 2, 0.0), (1, 3, 0.0), (2, 3, 0.0)],
    )
    return with_kinds(graph, {}, [EdgeKind.LAUNCH, EdgeKind.LAUNCH, EdgeKind.SYNC, EdgeKind.SYNC])


def test_the_path_takes_the_longer_branch_of_a_fork():
    _, path = path_to_end(fork_join(b_us=50, c_us=20))
    assert path.tasks.tolist() == [0, 1, 3]
    assert path.by_kind()["gpu"] == 50 and path.by_kind()["cpu"] == 15
    _, path = path_to_end(fork_join(b_us=10, c_us=20))
    assert path.tasks.tolist() == [0, 2, 3]


def test_lags_are_synchronisation_on_waiting_edges_and_idle_on_the_others():
    graph = make_graph(
        [("cudaLaunchKernel", "cpu 0", 2, 0.0), ("kernel", "gpu 0/stream 7", 10), ("cudaStreamSynchronize", "cpu 0", 1)],
        [(0, 1, 3.0), (1, 2, 4.0)],
    )
    graph = with_kinds(graph, {0: TaskKind.RUNTIME, 2: TaskKind.RUNTIME}, [EdgeKind.LAUNCH, EdgeKind.SYNC])
    schedule, path = path_to_end(graph)
    assert path.tasks.tolist() == [0, 1, 2]
    kinds = path.by_kind()
    assert kinds["cpu overhead"] == 2, "the launch call"
    assert kinds["idle"] == 3, "the launch latency"
    assert kinds["gpu"] == 10
    assert kinds["synchronisation"] == 4 + 1, "the lag of the wait and the tail of the call that waited"
    assert_tiles(path, 0.0, schedule.end_us.max())


def test_time_before_a_task_that_nothing_started_is_idle():
    graph = make_graph([("late", "cpu 0", 5, 7.0)])
    _, path = path_to_end(graph, from_us=0.0)
    assert path.by_kind()["idle"] == 7 and path.by_kind()["cpu"] == 5
    assert_tiles(path, 0.0, 12.0)


def test_a_kernel_that_starts_before_its_launch_returns_is_not_counted_twice():
    graph = make_graph([("launch", "cpu 0", 10, 0.0), ("kernel", "gpu 0/stream 7", 5)], [(0, 1, -4.0)])
    graph = with_kinds(graph, {0: TaskKind.RUNTIME}, [EdgeKind.LAUNCH])
    _, path = path_to_end(graph)
    assert path.tasks.tolist() == [0, 1]
    assert path.by_kind()["cpu overhead"] == 6, "the launch call up to the kernel's start"
    assert path.by_kind()["gpu"] == 5
    assert_tiles(path, 0.0, 11.0)


def test_the_task_before_on_the_resource_decides_when_no_edge_does():
    graph = make_graph([("a", "cpu 0", 4, 0.0), ("b", "cpu 0", 6), ("x", "gpu 0/stream 7", 1, 0.0)], [(2, 1, 0.0)])
    schedule = simulate(graph)
    deciders = find_deciders(schedule)
    assert deciders.task[1] == 0, "a ends at 4, after x's 1"
    assert deciders.task[0] == -1 and deciders.task[2] == -1, "released, started by nothing"


# -- on real traces -------------------------------------------------------------------------------


def iteration_paths(study, schedule=None):
    schedule = schedule if schedule is not None else study.replay
    report = iteration_report(schedule, study.iterations)
    return report, iteration_critical_paths(schedule, report.assign(thread=study.iterations["thread"].to_numpy()))


def test_the_path_of_every_iteration_tiles_its_predicted_time(any_trace, traces):
    study = traces.study(any_trace)
    report, paths = iteration_paths(study)
    assert len(paths) == len(report)
    for row, path in zip(report.itertuples(), paths):
        assert_tiles(path, row.span_start_us, row.span_end_us)
        assert path.by_kind().sum() / 1e3 == pytest.approx(row.predicted_ms, rel=1e-9)
        assert set(path.steps["kind"]) <= set(PATH_KINDS)


def test_each_task_on_the_path_was_started_by_the_one_before_it(any_trace, traces):
    study = traces.study(any_trace)
    schedule = study.replay
    edges = study.graph.edges
    ready = dict(zip(zip(edges["src"], edges["dst"]), schedule.end_us[edges["src"].to_numpy()] + edges["lag_us"].to_numpy()))
    resource = study.graph.tasks["resource"].astype(str).to_numpy()
    _, paths = iteration_paths(study)
    for path in paths:
        chain = path.tasks
        for a, b in zip(chain[:-1].tolist(), chain[1:].tolist()):
            by_edge = (a, b) in ready and abs(ready[(a, b)] - schedule.start_us[b]) <= TOLERANCE_US
            by_resource = resource[a] == resource[b] and abs(schedule.end_us[a] - schedule.start_us[b]) <= TOLERANCE_US
            assert by_edge or by_resource, f"task {b} did not start when task {a} let it"


def test_a_cpu_trace_has_no_gpu_communication_or_synchronisation_on_its_path(traces):
    _, paths = iteration_paths(traces.study(BUNDLED))
    for path in paths:
        kinds = path.by_kind()
        assert kinds[["gpu", "communication", "synchronisation"]].sum() == 0
        assert kinds["cpu"] > kinds["cpu overhead"], "a CPU-only step is operator compute"


def test_a_gpu_bound_iteration_is_mostly_gpu_and_a_host_bound_one_mostly_cpu(traces):
    """SOURCES.md: the V100 run is GPU-bound after its two warm-up steps, the A100 DDP run is
    host-bound."""
    _, paths = iteration_paths(traces.study(V100_1GPU))
    for path in paths[2:]:
        kinds = path.by_kind()
        assert kinds["gpu"] > 0.5 * kinds.sum()
    _, paths = iteration_paths(traces.study(A100_DDP2))
    for path in paths:
        kinds = path.by_kind()
        assert kinds["cpu"] + kinds["cpu overhead"] > 0.5 * kinds.sum()


@pytest.mark.parametrize("name", [BUNDLED, V100_1GPU, A100_DDP2, DLRM_RANK0])
def test_speeding_up_the_longest_task_on_the_path_shortens_its_iteration(name, traces):
    study = traces.study(name)
    report, paths = iteration_paths(study)
    k = len(paths) // 2
    steps = paths[k].steps[paths[k].steps["task"] >= 0]
    longest = int(steps.loc[steps["duration_us"].idxmax(), "task"])
    saved_us = 0.5 * study.graph.tasks["duration_us"].iat[longest]
    graph = study.graph.copy()
    graph.scale([longest], 0.5)
    faster = iteration_report(simulate(graph), study.iterations)
    gained_us = (report["predicted_ms"].iat[k] - faster["predicted_ms"].iat[k]) * 1e3
    assert 0 < gained_us <= saved_us + TOLERANCE_US


@pytest.mark.parametrize("name", [V100_1GPU, A100_DDP2, DLRM_RANK0, RECSYS])
def test_speeding_up_a_task_off_the_path_leaves_the_iteration_as_it_was(name, traces):
    """Off the whole chain back to the start of the trace, not only the iteration's part of it:
    a task before the iteration could otherwise move the chain's beginning."""
    study = traces.study(name)
    schedule = study.replay
    report, paths = iteration_paths(study)
    k = len(paths) // 2
    whole_chain = critical_path(schedule, int(paths[k].tasks[-1]))
    inside = (schedule.start_us >= report["span_start_us"].iat[k]) & (schedule.end_us <= report["span_end_us"].iat[k])
    inside[whole_chain.tasks] = False
    candidates = np.flatnonzero(inside)
    off_path = int(candidates[np.argmax((schedule.end_us - schedule.start_us)[candidates])])
    assert schedule.end_us[off_path] - schedule.start_us[off_path] > 100.0, "a task worth speeding up"
    graph = study.graph.copy()
    graph.scale([off_path], 0.0)
    faster = iteration_report(simulate(graph), study.iterations)
    assert faster["span_end_us"].iat[k] == report["span_end_us"].iat[k]
    assert faster["predicted_ms"].iat[k] == pytest.approx(report["predicted_ms"].iat[k], rel=1e-12)


# -- whatif critical-path -------------------------------------------------------------------------


def test_the_command_as_json_gives_each_iteration_its_kinds(capsys, traces):
    status, out, err = run_cli(capsys, ["critical-path", traces.path(V100_1GPU), "--json"])
    assert status == 0, err
    doc = json.loads(out)
    assert doc["kinds"] == list(PATH_KINDS)
    report = traces.study(V100_1GPU).replay_report()
    assert [it["name"] for it in doc["iterations"]] == list(report["name"])
    for it in doc["iterations"]:
        assert sum(it["kinds_ms"].values()) == pytest.approx(it["predicted_ms"])
    shares = [task["share_pct"] for task in doc["top_tasks"]]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 100.0 + 1e-9


def test_the_command_prints_the_kinds_and_the_top_tasks(capsys):
    status, out, err = run_cli(capsys, ["critical-path", BUNDLED_TRACE])
    assert status == 0, err
    for kind in PATH_KINDS:
        assert kind in out
    assert "ProfilerStep#1" in out and "tasks with the most time" in out


def test_the_timeline_marks_exactly_the_tasks_on_the_paths(capsys, tmp_path, traces):
    out_json = tmp_path / "critical.json.gz"
    status, _, err = run_cli(capsys, ["critical-path", traces.path(V100_1GPU), "--timeline", out_json])
    assert status == 0, err
    events = json.load(gzip.open(out_json))["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    study = traces.study(V100_1GPU)
    assert len(slices) == len(study.graph.tasks)
    _, paths = iteration_paths(study)
    on_path = set(np.concatenate([p.tasks for p in paths]).tolist())
    marked = {i for i, e in enumerate(slices) if e["args"].get("critical")}
    assert marked == on_path
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows, "the path crosses between the CPU and the GPU"
    by_id = {}
    for flow in flows:
        by_id.setdefault(flow["id"], []).append(flow["ph"])
    assert all(sorted(phases) == ["f", "s"] for phases in by_id.values())


@pytest.mark.parametrize("case", ["truncated gzip", "not JSON", "no timed events"])
def test_a_file_that_is_not_a_trace_is_one_line_naming_it(tmp_path, capsys, case):
    path = broken_traces(tmp_path)[case]
    status, out, err = run_cli(capsys, ["critical-path", path])
    assert_one_line_error(status, err, path)
    assert out == ""


def test_an_iteration_name_that_matches_nothing_is_one_line(capsys):
    status, _, err = run_cli(capsys, ["critical-path", BUNDLED_TRACE, "--iteration", "NoSuchStep"])
    assert_one_line_error(status, err, BUNDLED_TRACE, "NoSuchStep")


def test_a_timeline_over_the_input_trace_is_refused(capsys, tmp_path):
    trace = tmp_path / "convnet.pt.trace.json.gz"
    trace.write_bytes(BUNDLED_TRACE.read_bytes())
    status, _, err = run_cli(capsys, ["critical-path", trace, "--timeline", trace])
    assert_one_line_error(status, err, trace)
    assert trace.read_bytes() == BUNDLED_TRACE.read_bytes()
