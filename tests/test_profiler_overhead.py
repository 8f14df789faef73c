"""Removing the profiler's own cost from a prediction (``sim/passes/profiler_overhead.py``).

A capture times warm-up steps that run without profiler or hooks; ``whatif predict`` takes the
difference between the profiled iterations and those out of the trace's CPU tasks, so that a
1x1 prediction is the plain step's time, not the profiled one's. A small MLP of many short
operators, captured here, is where the profiler costs most.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from whatif.cli import main
from whatif.collectors.bundle import read_bundle
from whatif.pipeline import predict
from whatif.report.iterations import iteration_report, steady_median
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.engine import simulate
from whatif.sim.passes.profiler_overhead import PROFILER_COST_CAP_US, ProfilerOverhead, remove_profiler_overhead, water_level
from whatif.study import TraceStudy

torch = pytest.importorskip("torch", reason="torch is not importable: pip install -e '.[test]' to capture")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import short_mlp  # noqa: E402  (examples/short_mlp.py, which bench/profiler_cost_short_ops.py runs too)

WARMUP, STEPS = 8, 5


def capture_mlp(tmp_path_factory, width: int, depth: int, batch: int):
    out = tmp_path_factory.mktemp("overhead") / "mlp.bundle"
    return short_mlp.capture_mlp(out, width=width, depth=depth, batch=batch, warmup=WARMUP, steps=STEPS)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """Short operators: the profiler's worst case."""
    return capture_mlp(tmp_path_factory, width=32, depth=8, batch=8)


@pytest.fixture(scope="module")
def long_operators(tmp_path_factory):
    """GEMMs of milliseconds, as in the wide MLP whose faulting steps the cap is for."""
    return capture_mlp(tmp_path_factory, width=1024, depth=3, batch=256)


def scenario(tmp_path, bundle, **extra):
    doc = {"trace": str(bundle), "cluster": {"machines": 1, "gpus_per_machine": 1, "intra_node": "pcie3", "inter_node": "10gbe"}, **extra}
    return Scenario.from_dict(doc, base_dir=tmp_path)


def test_a_capture_times_its_warmup_steps_without_profiler_and_its_profiled_steps(bundle):
    times = read_bundle(bundle).manifest["step_wall_ms"]
    assert len(times["unprofiled"]) == WARMUP - 2  # the first step and the profiler's warm-up step left out
    assert len(times["profiled"]) == STEPS
    assert all(t > 0 for t in times["unprofiled"] + times["profiled"])


def test_a_capture_counts_the_page_faults_of_the_same_steps(bundle):
    manifest = read_bundle(bundle).manifest
    for steps in ("unprofiled", "profiled"):
        faults = manifest["step_page_faults"][steps]
        assert len(faults) == len(manifest["step_wall_ms"][steps])
        assert all(isinstance(f, int) and f >= 0 for f in faults)


FILL_AND_FREE_64_MB = """
import sys, torch
from whatif.collectors.capture import Capture
model = torch.nn.Linear(4, 4)
with Capture(sys.argv[1], model=model, warmup=int(sys.argv[2]), steps=int(sys.argv[3])) as capture:
    while True:
        model(torch.ones(2, 4)).sum().backward()
        torch.ones(64 * 2**20 // 4)  # 64 MB of float32, written and freed
        if not capture.step():
            break
"""


def test_a_step_that_fills_memory_returned_to_the_kernel_faults_once_per_page(tmp_path):
    # In a fresh process glibc maps an allocation over 32 MB afresh and unmaps it when freed. In a
    # process with a long past (this test runner's) a freed hole of the heap can hold it instead,
    # already faulted in, so the capture runs in a process of its own.
    pages = 64 * 2**20 // 4096
    out = tmp_path / "fresh.bundle"
    subprocess.run([sys.executable, "-c", FILL_AND_FREE_64_MB, str(out), str(WARMUP), str(STEPS)], check=True)
    faults = read_bundle(out).unprofiled_page_faults
    assert faults and min(faults) >= 0.9 * pages


def test_the_profiled_steps_of_short_operators_are_slower_than_the_plain_ones(bundle):
    times = read_bundle(bundle).manifest["step_wall_ms"]
    assert np.median(times["profiled"]) > 1.1 * np.median(times["unprofiled"])


def test_predicting_one_worker_from_a_bundle_gives_the_plain_steps_time(bundle, tmp_path):
    outcome = predict(scenario(tmp_path, bundle).request())
    plain_ms = steady_median(pd.Series(read_bundle(bundle).unprofiled_step_ms))
    assert outcome.profiler_overhead is not None and outcome.profiler_overhead.removed_ms > 0
    assert outcome.iteration_ms == pytest.approx(plain_ms, rel=0.05)


def test_the_plain_steps_are_summarised_as_runs_are_without_their_first_and_last(bundle):
    # a run is held to its steady median; a plain reference of another statistic set the traced
    # batch 5.6 % off its own run in one round of the batch-size validation
    study = TraceStudy.from_trace(bundle)
    plain_ms = [50.0, 10.0, 11.0, 12.0, 13.0, 40.0]  # median 12.5; without the first and last 11.5
    removed = remove_profiler_overhead(study.graph, study.iterations, plain_ms).last_note(ProfilerOverhead)
    assert removed.unprofiled_ms == 11.5


def corrected_to_plain(bundle, plain_share: float):
    """The bundle's graph corrected as if its plain steps took ``plain_share`` of the profiled
    ones: what was removed, the tasks' durations before and after, and the predicted and
    profiled iteration times."""
    study = TraceStudy.from_trace(bundle)
    profiled_ms = steady_median(iteration_report(study.replay, study.iterations)["measured_ms"])
    before = study.graph.tasks["duration_us"].to_numpy().copy()
    graph = remove_profiler_overhead(study.graph, study.iterations, [plain_share * profiled_ms] * 6)
    removed = graph.last_note(ProfilerOverhead)
    predicted_ms = steady_median(iteration_report(simulate(graph), study.iterations)["predicted_ms"])
    return removed, before, graph.tasks["duration_us"].to_numpy(), predicted_ms, profiled_ms


def test_profiled_steps_faster_than_plain_ones_stretch_every_cpu_task_to_the_plain_time(bundle):
    # on CPU the plain run's heap can page-fault where the profiled one's did not (sim/passes/profiler_overhead.py)
    added, before, after, predicted, profiled_ms = corrected_to_plain(bundle, 1.25)
    assert added.removed_ms == pytest.approx(-0.25 * profiled_ms) and added.stretch > 1.0
    assert "faster than plain ones" in added.describe()
    assert predicted == pytest.approx(1.25 * profiled_ms, rel=0.02)
    changed = after != before
    ratios = after[changed] / before[changed]
    assert ratios.min() > 1.0 and ratios.max() / ratios.min() < 1.5, "every iteration's tasks stretch by one factor"


def test_a_difference_beyond_what_the_profiler_costs_shrinks_every_task_by_one_factor(long_operators):
    # time the profiled steps lost to page faults lies in the operators that faulted, not at events
    removed, before, after, predicted, profiled_ms = corrected_to_plain(long_operators, 0.5)
    assert removed.per_task_us == PROFILER_COST_CAP_US and 0 < removed.stretch < 1
    assert "shrunk" in removed.describe()
    assert predicted == pytest.approx(0.5 * profiled_ms, rel=0.05)
    long = (before > 2 * PROFILER_COST_CAP_US) & (after != before)  # the iterations' long CPU tasks
    kept = after[long] / (before[long] - PROFILER_COST_CAP_US)
    assert kept.min() > 0 and kept.max() / kept.min() < 1.5, "past the cap, every iteration's tasks shrink by one factor"


def test_keeping_the_overhead_predicts_the_trace_as_replayed(bundle, tmp_path):
    outcome = predict(scenario(tmp_path, bundle, profiler_overhead="keep").request())
    study = TraceStudy.from_trace(bundle)
    assert outcome.profiler_overhead is None
    assert outcome.iteration_ms == pytest.approx(steady_median(iteration_report(study.replay, study.iterations)["predicted_ms"]), rel=1e-9)


def simulate_json(capsys, *argv) -> dict:
    assert main(["simulate", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_predicts_a_what_if_from_the_plain_steps_as_predict_does(bundle, tmp_path, capsys):
    what_if = simulate_json(capsys, bundle, "--scale", ".=0.5")
    plain_ms = steady_median(pd.Series(read_bundle(bundle).unprofiled_step_ms))
    replay_ms = pd.Series([it["replay_ms"] for it in what_if["iterations"]])
    assert what_if["profiler_overhead"]["removed_ms"] > 0
    assert steady_median(replay_ms) == pytest.approx(plain_ms, rel=0.05), "the unchanged job runs without the profiler"
    at_one_worker = predict(scenario(tmp_path, bundle).request()).iteration_ms
    unchanged = simulate_json(capsys, bundle)
    assert unchanged["summary"]["steady_predicted_ms"] == pytest.approx(at_one_worker, rel=1e-12), "as predict's 1x1"
    speedups = [it["speedup"] for it in what_if["iterations"] if it["speedup"] is not None]  # None: emptied
    assert speedups and speedups == pytest.approx([2.0] * len(speedups)), "the speed-up is the what-if's alone"


def test_simulate_keeps_the_overhead_when_asked_and_replays_the_trace(bundle, capsys):
    kept = simulate_json(capsys, bundle, "--profiler-overhead", "keep")
    assert "profiler_overhead" not in kept
    study = TraceStudy.from_trace(bundle)
    replayed = study.replay_report()["predicted_ms"].tolist()
    assert [it["predicted_ms"] for it in kept["iterations"]] == pytest.approx(replayed, rel=1e-12)


def test_an_unknown_profiler_overhead_choice_names_the_key(bundle, tmp_path):
    with pytest.raises(ScenarioError, match="profiler_overhead"):
        scenario(tmp_path, bundle, profiler_overhead="drop")


@pytest.mark.parametrize("seed", range(5))
def test_every_task_gives_up_the_same_time_or_all_it_has_and_together_the_total(seed):
    durations = np.random.default_rng(seed).exponential(50.0, size=200)
    total = 0.3 * durations.sum()
    level = water_level(durations, total)
    given = np.minimum(durations, level)
    assert given.sum() == pytest.approx(total, rel=1e-9)
    assert np.all((given == durations) | np.isclose(given, level))


def test_more_than_the_tasks_hold_takes_everything():
    assert water_level(np.array([1.0, 2.0, 3.0]), 10.0) == 3.0
