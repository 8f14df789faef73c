"""The simulation engine: when each task starts, on small graphs written out by hand, and the fast
engine against the one-event-per-task reference on real traces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trace_corpus import BUNDLED, DLRM_RANK0, EVENT_SYNC_MULTISTREAM, RECSYS, RESNET50
from whatif import GraphError, Policy, WhatIf, simulate
from whatif.sim.engine import simulate_event_per_task
from whatif.sim.graph import EdgeKind, TaskGraph, TaskKind
from whatif.sim.workload import Workload

ENGINES = [simulate, simulate_event_per_task]
ENGINE_IDS = ["fast", "event-per-task"]


def make_graph(tasks: list[tuple], edges: list[tuple] = ()) -> TaskGraph:
    """A graph from (name, resource, duration_us[, release_us]) rows and (src, dst, lag_us) edges.

    A resource runs its tasks in the order they are listed.
    """
    rows = []
    for order, (name, resource, duration, *release) in enumerate(tasks):
        rows.append(
            {
                "name": name,
                "kind": int(TaskKind.KERNEL if resource.startswith("gpu") else TaskKind.CPU),
                "resource": resource,
                "duration_us": float(duration),
                "release_us": float(release[0]) if release else -np.inf,
                "order_key": float(order),
                "measured_start_us": np.nan,
                "measured_end_us": np.nan,
                "context": "",
                "operator": "",
                "layer": "",
            }
        )
    frame = pd.DataFrame(rows).astype({c: "category" for c in ("name", "resource", "context", "operator", "layer")})
    frame["kind"] = frame["kind"].astype(np.int8)
    edge_frame = pd.DataFrame(
        {
            "src": np.array([e[0] for e in edges], dtype=np.int64),
            "dst": np.array([e[1] for e in edges], dtype=np.int64),
            "lag_us": np.array([e[2] for e in edges], dtype=np.float64),
            "kind": np.full(len(edges), int(EdgeKind.USER), dtype=np.int8),
        }
    )
    return TaskGraph(frame, edge_frame, workload=Workload("synthetic"))


def starts(schedule) -> list:
    return schedule.start_us.tolist()


# -- the model on hand-written graphs -------------------------------------------------------------


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_resource_runs_its_tasks_one_after_another_from_its_release(run):
    g = make_graph([("a", "cpu 0", 3, 10.0), ("b", "cpu 0", 4), ("c", "cpu 0", 5)])
    s = run(g)
    assert starts(s) == [10.0, 13.0, 17.0]
    assert s.end_us.tolist() == [13.0, 17.0, 22.0]
    assert s.makespan_us == 12.0


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_two_resources_without_edges_run_at_the_same_time(run):
    g = make_graph([("a", "cpu 0", 5, 0.0), ("b", "cpu 0", 5), ("x", "gpu 0", 7, 0.0), ("y", "gpu 0", 1)])
    s = run(g)
    assert starts(s) == [0.0, 5.0, 0.0, 7.0]
    assert s.makespan_us == 10.0


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_an_edge_delays_its_destination_until_the_source_ends_plus_the_lag(run):
    g = make_graph([("launch", "cpu 0", 2, 0.0), ("kernel", "gpu 0", 10, 0.0)], [(0, 1, 3.0)])
    s = run(g)
    assert starts(s) == [0.0, 5.0]  # end(launch) = 2, plus 3 us of launch latency


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_busy_resource_delays_a_task_whose_edge_is_satisfied(run):
    g = make_graph(
        [("launch", "cpu 0", 1, 0.0), ("long kernel", "gpu 0", 20, 0.0), ("kernel", "gpu 0", 5)],
        [(0, 2, 1.0)],
    )
    s = run(g)
    assert starts(s) == [0.0, 0.0, 20.0]  # ready at 2, but the stream is busy until 20


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_task_waits_for_the_latest_of_its_predecessors(run):
    g = make_graph(
        [("a", "r1", 4, 0.0), ("b", "r2", 9, 0.0), ("c", "r3", 1, 0.0), ("join", "r4", 2, 0.0)],
        [(0, 3, 1.0), (1, 3, 0.5), (2, 3, 20.0)],
    )
    s = run(g)
    assert s.start_us[3] == max(4 + 1.0, 9 + 0.5, 1 + 20.0)


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_release_time_holds_back_a_task_whose_predecessors_are_done(run):
    g = make_graph([("a", "r1", 1, 0.0), ("b", "r2", 1, 50.0)], [(0, 1, 0.0)])
    s = run(g)
    assert starts(s) == [0.0, 50.0]


def test_a_structure_hands_over_release_times_only_to_graphs_that_share_them():
    """A structure with the release times of one graph (``Structure.with_release``, a grid's
    cluster graph) gives them to that graph and to copies sharing its column; a graph of the
    same tasks and edges whose releases are its own is simulated with its own."""
    from whatif.sim.engine import compile_structure

    g = make_graph([("a", "r1", 1, 0.0), ("b", "r2", 1, 50.0)], [(0, 1, 0.0)])
    structure = compile_structure(g).with_release(g.tasks["release_us"].to_numpy())
    shared = g.copy()
    shared.tasks = g.tasks.copy(deep=False)
    shared.tasks["duration_us"] = [2.0, 1.0]  # the column of releases is still g's
    assert starts(simulate(shared, structure=structure)) == [0.0, 50.0]
    other = make_graph([("a", "r1", 1, 0.0), ("b", "r2", 1, 80.0)], [(0, 1, 0.0)])
    assert starts(simulate(other, structure=structure)) == [0.0, 80.0]


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_chain_across_resources_adds_up_durations_and_lags(run):
    g = make_graph(
        [("cpu", "cpu 0", 2, 0.0), ("h2d", "gpu 0/stream 1", 3, 0.0), ("kernel", "gpu 0/stream 2", 4, 0.0),
         ("sync", "cpu 0", 1)],
        [(0, 1, 0.5), (1, 2, 0.25), (2, 3, 0.0)],
    )
    s = run(g)
    assert starts(s) == [0.0, 2.5, 5.75, 9.75]
    assert s.makespan_us == 10.75


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_negative_lag_lets_a_task_start_before_its_cause_ended(run):
    """The trace's clocks disagree by a few microseconds: a kernel can start before the launch
    call that the CPU clock shows returning. The model keeps ``start = end(src) + lag``."""
    g = make_graph([("launch", "cpu 0", 10, 0.0), ("kernel", "gpu 0", 5, 0.0)], [(0, 1, -3.0)])
    assert starts(run(g)) == [0.0, 7.0]


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_zero_durations_and_empty_resources_are_fine(run):
    g = make_graph([("a", "r1", 0, 0.0), ("b", "r1", 0), ("c", "r2", 0, 0.0)], [(1, 2, 0.0)])
    s = run(g)
    assert starts(s) == [0.0, 0.0, 0.0] and s.makespan_us == 0.0


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_tasks_that_wait_for_each_other_are_a_cycle(run):
    g = make_graph([("a", "r1", 1, 0.0), ("b", "r2", 1, 0.0)], [(0, 1, 0.0), (1, 0, 0.0)])
    with pytest.raises(GraphError, match="cycle"):
        run(g)


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_task_of_no_number_of_microseconds_ends_at_no_time_but_is_not_stuck(run):
    # NaN is also what a task never computed becomes in the schedule's arrays: it is not a cycle
    schedule = run(make_graph([("a", "r1", float("nan"), 0.0), ("b", "r1", 1, 0.0)]))
    assert np.isnan(schedule.end_us[0]) and schedule.end_us[1] == 1.0


# -- policies -----------------------------------------------------------------------------------


class LastReady(Policy):
    def choose(self, ready, now_us):
        return ready[-1]


def test_the_default_policy_runs_ready_tasks_in_the_resources_order():
    g = make_graph([("a", "gpu", 1, 0.0), ("b", "gpu", 1, 0.0), ("c", "gpu", 1, 0.0)])
    assert starts(simulate(g, {"gpu": Policy()})) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_policy_chooses_among_the_tasks_ready_when_the_resource_is_free(run):
    g = make_graph([("a", "gpu", 1, 0.0), ("b", "gpu", 2, 0.0), ("c", "gpu", 3, 0.0)])
    s = run(g, {"gpu": LastReady()})
    assert starts(s) == [5.0, 3.0, 0.0]  # c, then b, then a


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_a_policy_only_sees_tasks_whose_predecessors_are_done(run):
    """At time 0 only a and c are ready (b waits for x on another resource until 5): the policy
    runs c, then a; b, ready at 5, runs when a ends."""
    g = make_graph(
        [("a", "gpu", 2, 0.0), ("b", "gpu", 1, 0.0), ("c", "gpu", 4, 0.0), ("x", "cpu", 5, 0.0)],
        [(3, 1, 0.0)],
    )
    s = run(g, {"gpu": LastReady()})
    assert starts(s) == [4.0, 6.0, 0.0, 0.0]


@pytest.mark.parametrize("run", ENGINES, ids=ENGINE_IDS)
def test_on_a_resource_with_a_policy_a_task_waits_for_its_predecessors_to_end(run):
    """A negative lag (a kernel the trace shows starting before its launch call returned) cannot
    pull a task ahead of its predecessor's end on a resource whose policy decides on the SimPy
    clock: the kernel starts when the launch ends, in both engines."""
    g = make_graph([("launch", "cpu 0", 10, 0.0), ("kernel", "gpu 0", 5, 0.0)], [(0, 1, -3.0)])
    assert starts(run(g, {"gpu 0": Policy()})) == [0.0, 10.0]


def test_a_policy_for_a_resource_that_does_not_exist_is_an_error():
    g = make_graph([("a", "gpu", 1, 0.0)])
    with pytest.raises(GraphError, match="nvlink"):
        simulate(g, {"nvlink": Policy()})


# -- the fast engine is the reference engine, faster ---------------------------------------------


@pytest.mark.parametrize("name", [BUNDLED, RESNET50, EVENT_SYNC_MULTISTREAM, DLRM_RANK0, RECSYS])
def test_the_fast_engine_computes_exactly_the_reference_schedule(traces, name):
    graph = traces.study(name).graph
    fast, reference = simulate(graph), simulate_event_per_task(graph)
    assert np.array_equal(fast.start_us, reference.start_us)
    assert np.array_equal(fast.end_us, reference.end_us)


def test_the_fast_engine_computes_exactly_the_reference_schedule_after_a_transformation(traces):
    graph = WhatIf(optimizations=["amp"]).apply(traces.study(RESNET50).graph)
    fast, reference = simulate(graph), simulate_event_per_task(graph)
    assert np.array_equal(fast.start_us, reference.start_us)
    assert np.array_equal(fast.end_us, reference.end_us)


def gpu_streams(graph) -> list[str]:
    return [r for r in graph.tasks["resource"].cat.categories if r.startswith("gpu")]


class ShortestReadyFirst(Policy):
    def __init__(self, graph):
        self.duration = graph.tasks["duration_us"].to_numpy()

    def choose(self, ready, now_us):
        return min(ready, key=lambda t: self.duration[t])




@pytest.mark.parametrize(
    "name, stream",
    [
        (DLRM_RANK0, "gpu 0/stream 7"),
        (DLRM_RANK0, "gpu 0/stream 84"),
        (DLRM_RANK0, "cpu 59811/59976"),  # no stream-order edges: the policy reorders the thread
        (EVENT_SYNC_MULTISTREAM, "gpu 0/stream 20"),
        (RECSYS, "gpu 3/stream 20"),
    ],
)
def test_both_engines_agree_with_a_policy_on_one_resource(traces, name, stream):
    graph = traces.study(name).graph
    assert stream in graph.tasks["resource"].cat.categories
    policies = {stream: ShortestReadyFirst(graph)}
    fast, reference = simulate(graph, policies), simulate_event_per_task(graph, policies)
    assert np.array_equal(fast.start_us, reference.start_us)
    assert np.array_equal(fast.end_us, reference.end_us)


def test_a_first_ready_policy_on_a_stream_in_order_reproduces_the_fixed_order(traces):
    """A GPU stream's tasks are chained by stream-order edges, so choosing the first ready task
    is the stream order; only the SimPy clock's rounding may differ."""
    graph = traces.study(DLRM_RANK0).graph
    fixed = simulate(graph)
    for stream in gpu_streams(graph):
        with_policy = simulate(graph, {stream: Policy()})
        np.testing.assert_allclose(with_policy.start_us, fixed.start_us, rtol=0, atol=1e-6)


def test_the_fast_engine_needs_far_fewer_simpy_events_than_tasks(traces):
    study = traces.study(RESNET50)
    n_tasks = len(study.graph.tasks)
    assert study.replay.simpy_events < n_tasks / 10
    assert simulate_event_per_task(study.graph).simpy_events >= n_tasks
