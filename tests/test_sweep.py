"""A grid's configurations give the same prediction whichever way they run: one after the other,
on two processes of this machine, or on a local Dask or Ray cluster of two workers; and the sweep keeps
the grid's order, the warnings, the errors and stdout as a serial run would.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from trace_corpus import BUNDLED_TRACE
from whatif.cli import main
from whatif.collectors.diagnostics import Diagnostics, collecting, warn
from whatif.pipeline import predict
from whatif.scenario import Scenario
from whatif.sim.distributed import simulate_cluster, with_graph, without_graph
from whatif.sim.gradients import find_gradients
from whatif.sim.graph import GraphError, TaskKind
from whatif.study import TraceStudy
from whatif import sweep as sweep_module
from whatif.sweep import Sweep, SweepError, run_sweep

# 1 or 2 machines of 1 or 2 workers; machine 1 is a straggler (a heterogeneous cluster, whose
# every worker is simulated)
GRID = {
    "trace": str(BUNDLED_TRACE),
    "cluster": {"machines": [1, 2], "gpus_per_machine": [1, 2], "intra_node": "nvlink2", "inter_node": "10gbe"},
    "stragglers": [{"machine": 1, "slowdown": 1.5}],
}


@pytest.fixture(scope="module")
def serial():
    return predict(Scenario.from_dict(GRID).request())


def assert_same_prediction(got, expected):
    pd.testing.assert_frame_equal(got.results, expected.results, check_exact=True)
    assert list(got.runs) == list(expected.runs)
    for label, run in expected.runs.items():
        other = got.runs[label]
        np.testing.assert_array_equal(other.schedule.start_us, run.schedule.start_us, err_msg=label)
        np.testing.assert_array_equal(other.schedule.end_us, run.schedule.end_us, err_msg=label)
        np.testing.assert_array_equal(other.comm_tasks, run.comm_tasks, err_msg=label)
        pd.testing.assert_frame_equal(other.collectives, run.collectives, check_exact=True)
        assert_same_graph(other.schedule.graph, run.schedule.graph)


def assert_same_graph(got, expected):
    pd.testing.assert_frame_equal(got.tasks, expected.tasks, check_exact=True)
    pd.testing.assert_frame_equal(got.edges, expected.edges, check_exact=True)
    assert [n.describe() for n in got.notes] == [n.describe() for n in expected.notes]


def test_the_grid_has_configurations_that_differ(serial):
    assert len(serial.results) == 4
    assert serial.results["iteration_ms"].nunique() > 1


def test_two_processes_predict_exactly_what_one_does(serial):
    assert_same_prediction(predict(Scenario.from_dict(GRID).request(), Sweep(jobs=2)), serial)


@pytest.mark.parametrize("jobs", [1, 2])
def test_rows_alone_are_the_rows_of_a_prediction_that_keeps_its_runs(serial, jobs):
    """What ``whatif predict`` asks for without ``--timeline``: the same rows, no run kept or
    sent back (the processes lay their own cluster graphs then)."""
    got = predict(replace(Scenario.from_dict(GRID).request(), keep_runs=False), Sweep(jobs=jobs))
    pd.testing.assert_frame_equal(got.results, serial.results, check_exact=True)
    assert got.runs == {} and len(serial.runs) == 4


def test_a_local_dask_cluster_of_two_workers_predicts_exactly_what_one_process_does(serial):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        got = predict(Scenario.from_dict(GRID).request(), Sweep(executor="dask", address=cluster.scheduler_address))
        assert len(cluster.scheduler.workers) == 2
    assert_same_prediction(got, serial)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two nodes of one CPU each: two workers, as a user's cluster has
    several; the sweep connects to it by its address, as to any existing one."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_a_local_ray_cluster_of_two_workers_predicts_exactly_what_one_process_does(serial, ray_cluster):
    import ray

    assert len([node for node in ray_cluster.list_all_nodes()]) == 2
    got = predict(Scenario.from_dict(GRID).request(), Sweep(executor="ray", address=ray_cluster.address))
    assert not ray.is_initialized(), "the sweep disconnects from the cluster it connected to"
    assert_same_prediction(got, serial)


def test_on_ray_the_items_order_stays_and_an_error_is_raised_as_it_is(ray_cluster, monkeypatch):
    """Builtins run on any worker: ``operator.truediv(shared, item)``. The sweep leaves the
    configurations still running to end with its job: cancelling them raced their replies in
    Ray 2.60 and aborted this process about one run in ten (the CI run of 2026-12-05)."""
    import operator

    import ray

    def cancel(*args, **kwargs):
        raise AssertionError("ray.cancel can abort the driver")

    monkeypatch.setattr(ray, "cancel", cancel)

    assert run_sweep(operator.truediv, 1.0, [1, 2, 4, 8], Sweep(executor="ray", address=ray_cluster.address)) == \
        [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(ZeroDivisionError) as raised:
        run_sweep(operator.truediv, 1.0, [1, 0, 2], Sweep(executor="ray", address=ray_cluster.address))
    assert str(raised.value) == "float division by zero", "the error itself, not Ray's wrapping with its traceback"


# -- the sweep itself, with small functions ------------------------------------------------------

def later_for_earlier_items(shared, item):
    """The first items finish last."""
    time.sleep(shared * (3 - item))
    return item * item


def warns_for_odd_items(shared, item):
    warn(f"item {item}", item % 2, "is odd")
    return item


def fails_on_two(shared, item):
    if item == 2:
        raise GraphError(f"item {item} cannot be simulated")
    return item


def test_a_run_sent_back_leaves_out_the_cluster_graph_both_sides_hold():
    study = TraceStudy.from_trace(BUNDLED_TRACE)
    worker = study.graph.copy()
    worker.remove(worker.select(kinds=[TaskKind.COMM]))
    gradients = find_gradients(worker, study.iterations)
    config = Scenario.from_dict({**GRID, "cluster": {**GRID["cluster"], "machines": 2, "gpus_per_machine": 2}}).request().clusters[0]
    laid: dict = {}
    run = simulate_cluster(worker, gradients, study.iterations, replace(config, pass_bytes_per_us=1e3), laid)
    sent, durations = without_graph(run, frozenset(laid))
    assert sent.schedule.graph is None and len(pickle.dumps(sent)) < len(pickle.dumps(run)) / 2
    back = with_graph(pickle.loads(pickle.dumps(sent)), durations, laid)
    assert_same_graph(back.schedule.graph, run.schedule.graph)
    np.testing.assert_array_equal(back.schedule.end_us, run.schedule.end_us)
    whole, no_durations = without_graph(run, frozenset())  # the other side has no such graph: all of it goes
    assert whole is run and no_durations is None


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_results_come_in_the_items_order_whichever_finishes_first(jobs):
    assert run_sweep(later_for_earlier_items, 0.2, [0, 1, 2, 3], Sweep(jobs=jobs)) == [0, 1, 4, 9]


@pytest.mark.parametrize("jobs", [1, 2])
def test_warnings_of_each_item_are_recorded_in_the_items_order(jobs):
    diagnostics = Diagnostics()
    with collecting(diagnostics):
        assert run_sweep(warns_for_odd_items, None, [1, 2, 3, 5], Sweep(jobs=jobs)) == [1, 2, 3, 5]
    assert diagnostics.messages == ["item 1: is odd", "item 3: is odd", "item 5: is odd"]


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_error_in_one_item_is_raised_as_it_is(jobs):
    with pytest.raises(GraphError, match="item 2 cannot be simulated"):
        run_sweep(fails_on_two, None, [0, 1, 2, 3], Sweep(jobs=jobs))


def test_the_progress_bar_counts_the_items_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(sweep_module, "PROGRESS_DELAY_S", 0.0)
    run_sweep(later_for_earlier_items, 0.0, [0, 1, 2], Sweep(jobs=2, progress=True))
    out, err = capsys.readouterr()
    assert out == ""
    assert "predicting" in err and "/3" in err


def test_no_progress_bar_unless_asked(capsys):
    run_sweep(later_for_earlier_items, 0.0, [0, 1, 2], Sweep(jobs=2))
    assert capsys.readouterr() == ("", "")


def test_dask_without_a_scheduler_address_is_one_sentence(monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    with pytest.raises(SweepError, match="address"):
        run_sweep(later_for_earlier_items, 0.0, [0], Sweep(executor="dask"))


def test_ray_without_an_address_is_one_sentence(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SweepError, match="address"):
        run_sweep(later_for_earlier_items, 0.0, [0], Sweep(executor="ray"))


# -- the command line ------------------------------------------------------------------------------

def scenario_file(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(f"trace: {BUNDLED_TRACE}\ncluster: {{machines: [1, 2], intra_node: nvlink2, inter_node: 10gbe}}\n")
    return path


@pytest.mark.parametrize("options, named", [
    (["--jobs", "0"], "--jobs 0"),
    (["--address", "tcp://127.0.0.1:8786"], "--address"),
    (["--executor", "dask"], "address"),
    (["--executor", "ray"], "address"),
    (["--executor", "ray", "--address", "127.0.0.1:1"], "cannot connect"),  # not minutes of Ray's retries
])
def test_a_sweep_that_cannot_run_is_one_line(capsys, tmp_path, monkeypatch, options, named):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    status = main(["predict", str(scenario_file(tmp_path)), *options])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith("whatif: error: ") and err.count("\n") == 1 and named in err


def test_the_json_of_two_jobs_is_byte_for_byte_that_of_one(capsys, tmp_path):
    outputs = []
    for jobs in ("1", "2"):
        assert main(["predict", str(scenario_file(tmp_path)), "--json", "--jobs", jobs]) == 0
        out, err = capsys.readouterr()
        assert err == "", "no progress bar off a terminal"
        outputs.append(out)
    assert outputs[0] == outputs[1]
