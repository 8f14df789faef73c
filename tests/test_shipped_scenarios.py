"""The scenarios in ``scenarios/``: each loads, predicts, and its answer obeys what the question
it asks takes for granted.

Every scenario runs on a trace the repository ships, or on one of the real GPU traces in
``../shared/traces`` beside the repository (its tests are skipped where that folder is not).
Each scenario is predicted once per session (all of them in about 30 s).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from whatif.pipeline import Prediction, predict
from whatif.report.iterations import iteration_report, union_within
from whatif.scenario import Scenario
from whatif.sim.frameworks import FrameworkOptions

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"
NCCL_SCENARIO = "nccl_resnet50_dgx_v100.yaml"
SCENARIOS = [
    pytest.param(p, id=p.name, marks=pytest.mark.skipif(
        "shared/traces" in p.read_text() and not SHARED.is_dir(), reason="../shared/traces is not beside the repository"))
    for p in sorted((REPO / "scenarios").glob("*.yaml"))
]
BANDWIDTH_SCENARIOS = ["bandwidth_10_20_40.yaml", "bandwidth_cpu_analogue.yaml", "bandwidth_wide_mlp.yaml"]
CYCLE_MS = FrameworkOptions().cycle_time_us / 1e3  # Horovod's background loop: one tick per 5 ms


@lru_cache(maxsize=None)
def predicted(name: str) -> tuple[Scenario, Prediction]:
    scenario = Scenario.from_file(REPO / "scenarios" / name)
    return scenario, predict(scenario.request())


@lru_cache(maxsize=None)
def iteration_times_ms(name: str) -> dict:
    """Per configuration label, the predicted time of every iteration of worker 0."""
    _, outcome = predicted(name)
    iterations = outcome.study.iterations
    return {
        label: iteration_report(run.schedule, iterations, run.worker0)["predicted_ms"].to_numpy()
        for label, run in outcome.runs.items()
    }


def test_the_shipped_scenarios_are_there():
    names = {p.values[0].name for p in SCENARIOS}
    assert {"p3_vs_fifo.yaml", "ring_vs_ps.yaml", "straggler.yaml", NCCL_SCENARIO, *BANDWIDTH_SCENARIOS} <= names


@pytest.mark.parametrize("path", SCENARIOS)
def test_a_scenario_says_what_it_asks_and_uses_a_shipped_trace(path):
    header = path.read_text().split("\ntrace:")[0]
    assert header.startswith("# Question:"), "a scenario opens with the question it answers"
    scenario = Scenario.from_file(path)
    assert not Path(path.read_text().split("\ntrace:")[1].split()[0]).is_absolute(), "trace is relative"
    trace = scenario.trace.resolve()
    assert trace.is_relative_to(REPO / "data") or trace.is_relative_to(SHARED.resolve()), "only shipped or shared traces"
    assert scenario.points


@pytest.mark.parametrize("path", SCENARIOS)
def test_a_scenario_predicts_every_configuration_no_faster_than_linear(path):
    scenario, outcome = predicted(path.name)
    results = outcome.results
    assert len(results) == len(scenario.points)
    assert np.isfinite(results["iteration_ms"]).all() and (results["iteration_ms"] > 0).all()
    assert (results["speedup"] <= results["workers"] * (1 + 1e-9)).all(), results.to_string()
    assert (results["exposed_comm_ms"] <= results["iteration_ms"] + 1e-9).all()
    one = results["workers"] == 1
    assert np.allclose(results.loc[one, "iteration_ms"], outcome.iteration_ms), "1x1 is the replay"


def test_p3_is_never_slower_than_fifo_and_faster_where_communication_is_exposed():
    _, outcome = predicted("p3_vs_fifo.yaml")
    keys = ["machines", "gpus_per_machine", "inter_node_gbps", "framework"]
    table = outcome.results.pivot_table(index=keys, columns="policy", values="iteration_ms")
    assert len(table) == len(outcome.results) // 2 and not table.isna().any().any()
    assert (table["p3"] <= table["fifo"] * (1 + 1e-9)).all(), table.to_string()
    fifo = outcome.results[outcome.results["policy"] == "fifo"].set_index(keys)
    exposed = fifo["exposed_comm_ms"] > 0.1 * fifo["iteration_ms"]
    assert exposed.any(), "the scenario is meant to be communication-bound somewhere"
    assert (table.loc[exposed[exposed].index, "p3"] < table.loc[exposed[exposed].index, "fifo"]).all(), table.to_string()


@pytest.mark.parametrize("name", BANDWIDTH_SCENARIOS)
def test_more_bandwidth_is_never_slower_under_fifo(name):
    """Up to one Horovod cycle: its loop fuses and starts all-reduces only on 5 ms ticks, so a
    faster network can shift the ticks so that the last gradient of a step just misses one; and
    the median iteration can be a different one of the (unequal) measured iterations."""
    _, outcome = predicted(name)
    times = iteration_times_ms(name)
    results = outcome.results.assign(label=list(outcome.runs))
    assert (results["policy"] == "fifo").all()
    for _, group in results.groupby(["machines", "gpus_per_machine", "framework"]):
        group = group.sort_values("inter_node_gbps")
        median = group["iteration_ms"].to_numpy()
        assert (np.diff(median) <= CYCLE_MS).all(), group.to_string()
        total = np.array([times[label].sum() for label in group["label"]])
        assert (np.diff(total) <= CYCLE_MS).all(), f"time of all iterations {total} ms at {group['inter_node_gbps'].tolist()} Gbps"


def test_the_wide_mlp_bandwidth_question_has_an_answer():
    """The shipped bandwidth question on a job whose gradients the network feels: inside one
    machine the bandwidth between machines plays no part, across machines each doubling wins
    (4x2: 6.41, 7.12, 7.46 times 1x1), as the scenario's header says."""
    _, outcome = predicted("bandwidth_wide_mlp.yaml")
    table = outcome.results.pivot_table(index=["machines", "gpus_per_machine"], columns="inter_node_gbps", values="speedup")
    assert table.loc[(1, 2)].nunique() == 1
    np.testing.assert_allclose(table.loc[(4, 2)].to_numpy(), [6.41, 7.12, 7.46], atol=0.005)
    across = table[table.index.get_level_values("machines") > 1]
    assert (across[20.0] > across[10.0] * 1.02).all() and (across[40.0] > across[20.0] * 1.02).all(), table.to_string()


@pytest.mark.parametrize("path", SCENARIOS)
def test_the_network_never_idles_while_a_message_is_ready(path):
    """A FIFO or P3 queue starts a ready message at once; Horovod's loop may first wait for its
    next tick, at most one cycle for each fused all-reduce it starts meanwhile."""
    _, outcome = predicted(path.name)
    for label, run in outcome.runs.items():
        if not len(run.comm_tasks):
            continue
        schedule = run.schedule
        tasks, edges = schedule.graph.tasks, schedule.graph.edges
        resource = tasks["resource"].astype(str).to_numpy()
        start, end = schedule.start_us, schedule.end_us
        incoming = edges[edges["dst"].isin(run.comm_tasks)]
        ready_us = pd.Series(end[incoming["src"].to_numpy()] + incoming["lag_us"].to_numpy()).groupby(
            incoming["dst"].to_numpy()
        ).max()
        horovod = "horovod fifo" in label
        for t in run.comm_tasks.tolist():
            lo, hi = ready_us[t], start[t]
            if hi <= lo:
                continue
            same = run.comm_tasks[resource[run.comm_tasks] == resource[t]]
            idle_ms = (hi - lo - union_within(start[same], end[same], lo, hi)) / 1e3
            batches = len(np.unique(start[same][(start[same] >= lo) & (start[same] < hi)]))
            allowed_ms = CYCLE_MS * (batches + 1) if horovod else 0.0
            assert idle_ms <= allowed_ms + 1e-6, (
                f"{label}: {resource[t]} idle {idle_ms:.2f} ms while {tasks['name'].iat[t]!r} was ready "
                f"(from {lo / 1e3:.2f} to {hi / 1e3:.2f} ms; at most {allowed_ms:.0f} ms)"
            )


def test_a_straggler_sets_the_pace_of_every_worker():
    _, outcome = predicted("straggler.yaml")
    results = outcome.results
    assert set(results["machines"]) == {2, 4}
    slowdown = 1.5
    for row in results.itertuples():
        assert row.iteration_ms >= slowdown * outcome.iteration_ms * 0.98, row
        assert row.speedup <= row.workers / slowdown * 1.02, row


def _nccl_variant(tmp_path: Path, **cluster) -> Prediction:
    """The NCCL scenario with its cluster's keys changed (the trace made absolute)."""
    doc = yaml.safe_load((REPO / "scenarios" / NCCL_SCENARIO).read_text())
    doc["trace"] = str((REPO / "scenarios" / doc["trace"]).resolve())
    doc["cluster"].update(cluster)
    path = tmp_path / f"variant_{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return predict(Scenario.from_file(path).request())


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is not beside the repository")
def test_the_nccl_scenario_is_priced_by_nccl_and_more_nics_are_never_slower(tmp_path):
    scenario, outcome = predicted(NCCL_SCENARIO)
    assert {p.cluster.backend for p in scenario.points} == {"nccl"}
    assert all(p.cluster.fabric.machine == "dgx_v100" and p.cluster.fabric.nics_per_machine == 4 for p in scenario.points)
    assert outcome.results["collectives"].str.len().gt(0).all(), "every configuration names NCCL's choice"
    four = outcome.results.set_index("machines")
    one = _nccl_variant(tmp_path, nics_per_machine=1).results.set_index("machines")
    tcp = _nccl_variant(tmp_path, nics_per_machine=1, nic="tcp_25").results.set_index("machines")
    for slower, faster in ((one, four), (tcp, one)):
        assert (faster["iteration_ms"] <= slower["iteration_ms"] * (1 + 1e-9)).all()
        assert (faster["comm_ms"] <= slower["comm_ms"] * (1 + 1e-9)).all()
        assert (faster.loc[1] == slower.loc[1]).drop(["inter_node_gbps"]).all(), "one node never pays the NIC"
    assert (tcp.loc[16, "iteration_ms"] > 1.05 * four.loc[16, "iteration_ms"]), "25 GbE sockets cost at 16 nodes"
    assert (four["iteration_ms"] < 1.01 * outcome.iteration_ms).all(), "four EDR NICs hide ResNet-50's all-reduces"
