"""The five CPU overheads of the DLRM performance model, measured around every top-level operator
of real traces: what each type covers, that together they account for the CPU timeline exactly,
the distributions per operator type, and ``whatif overheads``."""

from __future__ import annotations

import csv
import json

import numpy as np
import pandas as pd
import pytest

from test_bad_input import assert_one_line_error, broken_traces, run_cli
from trace_corpus import BUNDLED, BUNDLED_TRACE, REPO, RESNET50
from whatif.collectors.kineto import GPU_KINDS, EventKind
from whatif.collectors.load import load_trace
from whatif.report.overheads import LAUNCH_TYPES, NO_OPERATOR, OVERHEAD_TYPES, measure_overheads
from whatif.sim.build import IDLE_GAP_US

CPU_ONLY_TRACES = sorted((REPO / "data").glob("*.json.gz"))
TOLERANCE_US = 1e-6


def samples_of(overheads, kind: str) -> pd.DataFrame:
    return overheads.samples[overheads.samples["type"] == kind]


def event_end_us(trace, rows) -> np.ndarray:
    ev = trace.events
    return (ev["ts_us"] + ev["dur_us"]).to_numpy()[np.asarray(rows, dtype=np.int64)]


# -- what the types cover -------------------------------------------------------------------------


def test_the_top_level_operators_are_the_operators_no_other_operator_encloses(any_trace, traces):
    trace = traces.trace(any_trace)
    overheads = measure_overheads(trace)
    ops = samples_of(overheads, "op")
    assert len(ops) == overheads.operators > 0
    ev = trace.events
    every_op = ev[ev["kind"] == int(EventKind.CPU_OP)]
    assert set(ops["event"]) <= set(every_op.index)
    for thread, mine in ops.groupby("thread", observed=True):
        mine = mine.sort_values("ts_us")
        ends = mine["ts_us"].to_numpy() + mine["duration_us"].to_numpy()
        assert (mine["ts_us"].to_numpy()[1:] >= ends[:-1]).all(), f"top-level operators overlap on {thread}"
        # every operator of the thread lies inside one of them
        others = every_op[every_op["thread"] == thread]
        pos = np.searchsorted(mine["ts_us"].to_numpy(), others["ts_us"].to_numpy(), side="right") - 1
        assert (pos >= 0).all()
        assert (others["ts_us"].to_numpy() < ends[pos] + TOLERANCE_US).all()


def test_operators_gaps_and_waits_tile_each_thread_from_its_first_operator_to_its_last(any_trace, traces):
    overheads = measure_overheads(traces.trace(any_trace))
    s = overheads.samples
    for thread, mine in s[s["type"].isin(["op", "T1", "wait"])].groupby("thread", observed=True):
        ops = mine[mine["type"] == "op"]
        span_us = (ops["ts_us"] + ops["duration_us"]).max() - ops["ts_us"].min()
        assert mine["duration_us"].sum() == pytest.approx(span_us, rel=1e-9, abs=1e-6), thread
        assert (mine["duration_us"] >= 0).all()
        gaps = mine[mine["type"] != "op"]
        assert len(gaps) == len(ops) - 1, "one gap before every operator but the first"


def test_an_operator_that_launches_is_exactly_its_t2_launches_t5_and_t3(kineto_trace, traces):
    overheads = measure_overheads(traces.trace(kineto_trace))
    if not overheads.has_launches:
        pytest.skip(f"{kineto_trace} launches nothing")
    s = overheads.samples
    assert (s.loc[s["type"].isin(LAUNCH_TYPES), "duration_us"] >= 0).all()
    inside = s[s["type"].isin(LAUNCH_TYPES) & (s["event"] >= 0)]
    parts_us = inside.groupby("event")["duration_us"].sum()
    launches = inside[inside["type"] == "T4"].groupby("event").size()
    ops = samples_of(overheads, "op").set_index("event")
    assert parts_us.to_numpy() == pytest.approx(ops.loc[parts_us.index, "duration_us"].to_numpy(), abs=1e-6)
    per_op = inside.groupby(["event", "type"], observed=True).size().unstack(fill_value=0)
    assert (per_op["T2"] == 1).all() and (per_op["T3"] == 1).all()
    assert (per_op.get("T5", 0) == launches.reindex(per_op.index) - 1).all(), "one T5 between each two launches"


def test_every_runtime_call_that_launched_gpu_work_is_one_t4_sample(kineto_trace, traces):
    trace = traces.trace(kineto_trace)
    ev = trace.events
    gpu_correlations = ev.loc[ev["kind"].isin([int(k) for k in GPU_KINDS]), "correlation"]
    runtime = ev[ev["kind"] == int(EventKind.RUNTIME)]
    launch_calls = runtime[runtime["correlation"].isin(gpu_correlations[gpu_correlations >= 0])]
    t4 = samples_of(measure_overheads(trace), "T4")
    assert len(t4) == len(launch_calls)
    assert sorted(t4["ts_us"]) == sorted(launch_calls["ts_us"])
    assert sorted(t4["duration_us"]) == pytest.approx(sorted(launch_calls["dur_us"]))


def test_a_launch_is_filed_under_the_operator_it_ran_in(kineto_trace, traces):
    trace = traces.trace(kineto_trace)
    t4 = samples_of(measure_overheads(trace), "T4")
    filed = t4[t4["event"] >= 0]
    op_start = trace.events["ts_us"].to_numpy()[filed["event"].to_numpy()]
    op_end = event_end_us(trace, filed["event"])
    assert (filed["ts_us"].to_numpy() >= op_start).all()
    assert (filed["ts_us"].to_numpy() < op_end).all()
    assert (t4.loc[t4["event"] < 0, "operator"] == NO_OPERATOR).all()


@pytest.mark.parametrize("path", CPU_ONLY_TRACES, ids=lambda p: p.name)
def test_a_cpu_only_trace_has_gaps_and_operator_time_and_no_launch_overheads(path):
    overheads = measure_overheads(load_trace(path))
    assert not overheads.has_launches
    assert set(overheads.samples["type"].unique()) <= {"T1", "op", "wait"}
    summary = overheads.summary().set_index("type")
    assert (summary.loc[list(LAUNCH_TYPES), "count"] == 0).all()
    assert summary.loc["T1", "count"] > 0 and summary.loc["op", "count"] > 0


def test_a_thread_blocked_while_another_works_waits_rather_than_pays_overhead(traces):
    """ResNet-50's backward runs on an autograd thread that is idle through every forward pass,
    and the main thread is idle through backward: those stretches are waits, not T1."""
    overheads = measure_overheads(traces.trace(RESNET50))
    waits = samples_of(overheads, "wait")
    t1 = samples_of(overheads, "T1")
    assert set(waits["thread"]) == set(overheads.samples["thread"]), "both threads wait for the other"
    assert (waits["duration_us"] >= IDLE_GAP_US).all()
    assert t1["duration_us"].median() < IDLE_GAP_US <= waits["duration_us"].min()
    ops = samples_of(overheads, "op")
    for wait in waits.itertuples():
        elsewhere = ops[ops["thread"] != wait.thread]
        overlap = (elsewhere["ts_us"] < wait.ts_us + wait.duration_us) & (elsewhere["ts_us"] + elsewhere["duration_us"] > wait.ts_us)
        assert overlap.any(), "another thread ran an operator during the wait"


# -- distributions per operator type --------------------------------------------------------------


def test_the_distributions_per_operator_type_summarise_the_samples(traces):
    overheads = measure_overheads(traces.trace(BUNDLED))
    table = overheads.by_operator()
    assert list(table.columns) == ["type", "operator", "count", "mean_us", "median_us", "p90_us", "total_us"]
    assert table["count"].sum() == len(overheads.samples)
    for row in table.sample(n=min(20, len(table)), random_state=0).itertuples():
        durations = overheads.samples.loc[
            (overheads.samples["type"] == row.type) & (overheads.samples["operator"] == row.operator), "duration_us"
        ].to_numpy()
        assert row.count == len(durations)
        assert row.median_us == pytest.approx(np.median(durations))
        assert row.p90_us == pytest.approx(np.percentile(durations, 90))
        assert row.total_us == pytest.approx(durations.sum())
    assert (table["p90_us"] >= table["median_us"] - TOLERANCE_US).all()


def test_the_summary_has_one_row_per_type_in_order_with_their_totals(kineto_trace, traces):
    overheads = measure_overheads(traces.trace(kineto_trace))
    summary = overheads.summary()
    assert list(summary["type"]) == list(OVERHEAD_TYPES)
    totals = overheads.samples.groupby("type", observed=False)["duration_us"].sum()
    assert summary["total_us"].to_numpy() == pytest.approx(totals.reindex(list(OVERHEAD_TYPES)).to_numpy())


# -- whatif overheads -----------------------------------------------------------------------------


def test_the_command_prints_every_type_and_says_which_do_not_apply(capsys):
    status, out, err = run_cli(capsys, ["overheads", BUNDLED_TRACE])
    assert status == 0, err
    for description in OVERHEAD_TYPES.values():
        assert description in out
    assert "do not apply" in out


def test_the_command_on_a_gpu_trace_applies_every_type(capsys, traces):
    status, out, err = run_cli(capsys, ["overheads", traces.path(RESNET50)])
    assert status == 0, err
    assert "do not apply" not in out


def test_the_command_as_json_has_the_summary_and_every_operator_type(capsys, traces):
    status, out, err = run_cli(capsys, ["overheads", traces.path(RESNET50), "--json"])
    assert status == 0, err
    doc = json.loads(out)
    overheads = measure_overheads(traces.trace(RESNET50))
    assert doc["launch_types_apply"] is True
    assert doc["operators"] == overheads.operators and doc["launch_calls"] == overheads.launches
    assert [row["type"] for row in doc["summary"]] == list(OVERHEAD_TYPES)
    assert len(doc["by_operator"]) == len(overheads.by_operator())


def test_the_command_writes_every_operator_type_as_csv(capsys, tmp_path, traces):
    out_csv = tmp_path / "overheads.csv"
    status, out, err = run_cli(capsys, ["overheads", BUNDLED_TRACE, "--csv", out_csv])
    assert status == 0, err
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    expected = measure_overheads(traces.trace(BUNDLED)).by_operator()
    assert len(rows) == len(expected)
    assert {row["type"] for row in rows} == {"T1", "op"}


@pytest.mark.parametrize("case", ["truncated gzip", "not JSON", "JSON that is not a trace", "empty file"])
def test_a_file_that_is_not_a_trace_is_one_line_naming_it(tmp_path, capsys, case):
    path = broken_traces(tmp_path)[case]
    status, out, err = run_cli(capsys, ["overheads", path])
    assert_one_line_error(status, err, path)
    assert out == ""


def test_a_csv_into_a_missing_folder_is_one_line_naming_it(tmp_path, capsys):
    target = tmp_path / "no_such_folder" / "overheads.csv"
    status, _, err = run_cli(capsys, ["overheads", BUNDLED_TRACE, "--csv", target])
    assert_one_line_error(status, err, target)
