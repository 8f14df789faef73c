"""Capturing trace bundles: the capture API, what a bundle holds, and reading it back.

A tiny model defined here is trained for a few steps under :class:`Capture` once per session;
the tests hold the bundle it writes to the trace inside it: the hooks' times must land on the
operators they describe. ``whatif collect`` runs a script written to a temporary folder as a
real subprocess. The tests that capture need torch (the ``test`` extra installs it); without it
they are skipped and the ones on the bundled ``data/convnet_cpu.bundle`` still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trace_corpus import REPO
from whatif import TraceStudy
from whatif.cli import main
from whatif.collectors.bundle import MANIFEST, BundleError, is_bundle, read_bundle
from whatif.collectors.iterations import find_iterations
from whatif.collectors.load import load_trace
from whatif.scenario import Scenario
from whatif.sim.gradients import BUNDLE_SOURCE, find_gradients
from whatif.sim.workload import Workload

try:
    import torch
    from torch import nn

    from whatif.collectors.capture import Capture, CaptureError
except ImportError:  # the capture tests are skipped below
    torch = None

needs_torch = pytest.mark.skipif(
    torch is None, reason="torch is not importable: pip install -e '.[test]' (torch==2.13.0) to run the capture tests"
)
BUNDLED = REPO / "data" / "convnet_cpu.bundle"
WARMUP, STEPS, BATCH = 2, 3, 8
LINEAR_LAYERS = ["body.0", "body.2", "head"]  # in forward order


if torch is not None:

    class TinyNet(nn.Module):
        """Three linear layers with ReLUs, one of them in place, and a frozen parameter."""

        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.ReLU())
            self.head = nn.Linear(64, 4)
            self.temperature = nn.Parameter(torch.full((4,), 2.0), requires_grad=False)

        def forward(self, x):
            return self.head(self.body(x)) / self.temperature


def train(model, capture, steps: int = 100) -> int:
    """A plain training loop with the capture's one line in it; the number of steps run."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x, y = torch.randn(BATCH, 16, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if not capture.step():
            return step
    return steps


@pytest.fixture(scope="session")
def captured(tmp_path_factory):
    """The tiny model, trained under Capture once: (model, bundle folder, steps the loop ran)."""
    if torch is None:
        pytest.skip("torch is not importable")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = TinyNet()
        out = tmp_path_factory.mktemp("capture") / "tiny.bundle"
        with Capture(out, model=model, warmup=WARMUP, steps=STEPS, batch_size=BATCH) as capture:
            ran = train(model, capture)
        assert capture.bundle == out
        return model, out, ran
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny(captured):
    """The captured bundle read back: trace events with their times on the bundle's clock."""
    _, out, _ = captured
    trace = load_trace(out)
    events = trace.events.assign(start=trace.events["ts_us"] + trace.origin_us)
    events["end"] = events["start"] + events["dur_us"]
    return trace, events


def named(events: pd.DataFrame, name: str) -> pd.DataFrame:
    return events[events["name"].astype(str) == name]


def within(events: pd.DataFrame, start: float, end: float) -> pd.DataFrame:
    return events[(events["start"] >= start) & (events["end"] <= end)]


# -- the capture API -------------------------------------------------------------------------


@needs_torch
def test_the_loop_runs_warmup_plus_profiled_steps_and_step_then_returns_false(captured):
    model, out, ran = captured
    assert ran == WARMUP + STEPS


@needs_torch
def test_a_capture_writes_a_complete_bundle_whose_manifest_lists_what_is_inside(captured):
    _, out, _ = captured
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "whatif-trace-bundle" and manifest["version"] == 1
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *manifest["files"].values()])
    assert manifest["files"]["trace"].endswith(".json.gz")
    assert manifest["steps"] == [f"ProfilerStep#{i}" for i in range(WARMUP, WARMUP + STEPS)]
    assert manifest["warmup_steps"] == WARMUP
    env = manifest["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert env["torch_threads"] == 1 and env["batch_size"] == BATCH
    assert env["hostname"] and env["cpu_model"] and env["pid"] == os.getpid()
    assert not list(out.parent.glob(".tiny.bundle.*")), "no staging folder left behind"


@needs_torch
def test_the_trace_inside_has_one_profiler_step_per_profiled_step(captured, tiny):
    _, out, _ = captured
    trace, events = tiny
    assert trace.bundle is not None and trace.bundle.path == out
    assert find_iterations(trace)["name"].tolist() == read_bundle(out).steps
    assert len(named(events, "aten::addmm")) == len(LINEAR_LAYERS) * STEPS, "shapes and operators recorded"
    assert trace.input_dims, "record_shapes=True"


@needs_torch
def test_every_parameter_is_listed_with_its_shape_numel_and_dtype(captured):
    model, out, _ = captured
    listed = read_bundle(out).parameters.set_index("name")
    expected = dict(model.named_parameters())
    assert list(listed.index) == list(expected)
    for name, p in expected.items():
        row = listed.loc[name]
        assert (row["numel"], row["shape"], row["dtype"], row["element_size"], row["requires_grad"]) == (
            p.numel(), list(p.shape), "float32", 4, p.requires_grad
        )
    assert listed.loc["head.weight", "layer"] == "head"


@needs_torch
def test_each_trained_parameter_has_one_gradient_ready_time_per_step_and_frozen_ones_none(captured):
    model, out, _ = captured
    bundle = read_bundle(out)
    counts = bundle.ready.groupby("parameter")["step"].apply(list)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(counts.index) == sorted(trained)
    assert all(steps == bundle.steps for steps in counts)


@needs_torch
def test_gradients_become_ready_inside_their_steps_backward_pass_in_reverse_layer_order(captured, tiny):
    _, out, _ = captured
    trace, events = tiny
    bundle = read_bundle(out)
    for step in find_iterations(trace).itertuples():
        span = within(events, step.start_us + trace.origin_us, step.end_us + trace.origin_us)
        backward = span[span["name"].astype(str).str.startswith("autograd::engine::evaluate_function")]
        optimizer = span[span["name"].astype(str).str.startswith("Optimizer.step#")]
        ready = bundle.ready[bundle.ready["step"] == step.name].set_index("parameter")["ts_us"]
        assert len(ready) and len(optimizer) == 1
        assert (ready > backward["start"].min()).all()
        assert (ready < optimizer["start"].iat[0]).all()
        layer_times = [ready[[f"{layer}.weight", f"{layer}.bias"]] for layer in LINEAR_LAYERS]
        for earlier, later in zip(layer_times, layer_times[1:]):
            assert later.max() < earlier.min(), "a later layer's gradients are ready before an earlier one's"


@needs_torch
def test_each_gradient_ready_time_falls_inside_its_accumulate_grad(captured, tiny):
    _, out, _ = captured
    _, events = tiny
    accumulate = named(events, "torch::autograd::AccumulateGrad")
    for t in read_bundle(out).ready["ts_us"]:
        assert ((accumulate["start"] <= t) & (accumulate["end"] >= t)).sum() == 1


@needs_torch
def test_hook_clock_agrees_with_the_trace_clock_within_a_few_microseconds(captured):
    _, out, _ = captured
    clock = read_bundle(out).manifest["clock"]
    assert clock["markers"] == STEPS
    low, high = clock["marker_bounds_us"]
    assert low <= clock["shift_us"] <= high
    assert clock["alignment_error_us"] < 20


@needs_torch
def test_a_linear_layers_forward_and_backward_intervals_hold_its_operators(captured, tiny):
    _, out, _ = captured
    _, events = tiny
    intervals = read_bundle(out).intervals
    for op, which in (("aten::linear", "forward"), ("aten::addmm", "forward"), ("AddmmBackward0", "backward")):
        layer_of_op = []
        for e in named(events, op).sort_values("start").itertuples():
            holding = intervals[
                (intervals["pass"] == which) & (intervals["start_us"] <= e.start) & (intervals["end_us"] >= e.end)
            ]
            assert len(holding) == 1, f"{op} at {e.start} lies in {len(holding)} {which} intervals"
            layer_of_op.append(holding["layer"].iat[0])
        assert layer_of_op == (LINEAR_LAYERS if which == "forward" else LINEAR_LAYERS[::-1]) * STEPS


@needs_torch
def test_a_layers_backward_interval_holds_its_parameters_gradient_accumulations(captured):
    _, out, _ = captured
    bundle = read_bundle(out)
    backward = bundle.intervals[bundle.intervals["pass"] == "backward"].set_index(["step", "layer"])
    ready = bundle.ready.merge(bundle.parameters[["name", "layer"]], left_on="parameter", right_on="name")
    assert len(ready) == len(bundle.ready)
    for r in ready.itertuples():
        interval = backward.loc[(r.step, r.layer)]
        assert interval["start_us"] < r.ts_us < interval["end_us"]


@needs_torch
def test_an_in_place_relus_backward_interval_holds_its_relu_backward(captured, tiny):
    _, out, _ = captured
    _, events = tiny
    intervals = read_bundle(out).intervals
    relu = intervals[(intervals["pass"] == "backward") & intervals["layer"].isin(["body.1", "body.3"])]
    for e in named(events, "ReluBackward0").itertuples():
        assert ((relu["start_us"] <= e.start) & (relu["end_us"] >= e.end)).sum() == 1


@needs_torch
def test_layers_are_leaf_modules_and_backward_runs_in_reverse_forward_order(captured):
    _, out, _ = captured
    bundle = read_bundle(out)
    assert bundle.layers["name"].tolist() == ["body.0", "body.1", "body.2", "body.3", "head"]
    assert bundle.layers.set_index("name").loc["body.1", "type"] == "ReLU"
    for step, rows in bundle.intervals.groupby("step"):
        forward = rows[rows["pass"] == "forward"].sort_values("start_us")["layer"].tolist()
        backward = rows[rows["pass"] == "backward"].sort_values("start_us")["layer"].tolist()
        assert backward == forward[::-1] == bundle.layers["name"].tolist()[::-1]
        assert (rows["end_us"] >= rows["start_us"]).all()


@needs_torch
def test_gradients_from_a_bundle_have_the_parameters_exact_sizes_and_win_over_accumulate_grad_shapes(captured):
    model, out, _ = captured
    study = TraceStudy.from_trace(out)
    found = find_gradients(study.graph, study.iterations)
    assert found.source == BUNDLE_SOURCE
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
    for i in range(STEPS):
        grads = found.of_iteration(i)
        assert {g.name: g.nbytes for g in grads} == sizes
        assert [g.name for g in grads][:2] == ["head.bias", "head.weight"], "in the order they became ready"
    tasks = study.graph.tasks
    assert set(tasks["name"].astype(str).iloc[[g.ready_task for g in found.gradients]]) == {
        "torch::autograd::AccumulateGrad"
    }
    alone = TraceStudy.from_trace(out / "trace.pt.trace.json.gz")
    assert find_gradients(alone.graph, alone.iterations).source.startswith("AccumulateGrad")


@needs_torch
def test_a_scenarios_sizes_or_total_still_win_over_the_bundle(captured):
    _, out, _ = captured
    study = TraceStudy.from_trace(out)
    total = find_gradients(study.graph, study.iterations, total_bytes=1e6)
    assert total.source.startswith("scenario: total 1.0 MB, divided as the capture bundle")
    assert total.bytes_per_iteration() == pytest.approx(1e6)
    sized = find_gradients(study.graph, study.iterations, sizes=[100.0, 200.0])
    assert sized.source.startswith("scenario: 2 sizes")


@needs_torch
def test_replay_and_scenarios_accept_a_bundle_folder(captured, tmp_path, capsys):
    _, out, _ = captured
    assert main(["replay", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [it["name"] for it in report["iterations"]] == read_bundle(out).steps
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"trace: {out}\ncluster: {{machines: 2, intra_node: pcie3, inter_node: 10gbe}}\n")
    assert Scenario.from_file(scenario).trace == out
    assert main(["predict", str(scenario), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gradients"]["source"] == BUNDLE_SOURCE


@needs_torch
def test_a_loop_that_ends_before_the_profiled_steps_are_done_is_an_error(tmp_path):
    model = TinyNet()
    with pytest.raises(CaptureError, match="ended after 3 steps; the capture needs 2 warm-up and 3 profiled"):
        with Capture(tmp_path / "short.bundle", model=model, warmup=2, steps=3) as capture:
            train(model, capture, steps=3)
    assert not (tmp_path / "short.bundle").exists()


def test_a_warmup_below_three_warns_that_the_profiler_overhead_cannot_be_removed(tmp_path, capsys):
    """Steps 2 .. warm-up - 1 are the ones timed without the profiler: a warm-up of 2 times none,
    and the bundle's predictions keep the profiler's overhead. Said once, on stderr."""
    Capture(tmp_path / "short.bundle", model=None, warmup=2)
    err = capsys.readouterr().err
    assert "warm-up of 2 steps times no step without the profiler" in err
    assert "cannot remove the profiler's overhead" in err and "use --warmup 3 or more" in err
    Capture(tmp_path / "short.bundle", model=None, warmup=3)
    assert capsys.readouterr().err == ""


@needs_torch
def test_capture_refuses_a_folder_that_is_not_a_bundle_before_training(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("keep me")
    with pytest.raises(CaptureError, match="exists and is not a bundle"):
        Capture(tmp_path / "results", model=TinyNet()).__enter__()
    assert (tmp_path / "results" / "notes.txt").read_text() == "keep me"


# -- whatif collect --------------------------------------------------------------------------

SCRIPT = """
    import torch
    from torch import nn
    from whatif.collectors.capture import Capture

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Capture("hard-coded.bundle", model=model, warmup=5, steps=5) as capture:
        while True:
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            if not capture.step():
                break
"""


def collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``whatif collect ARGS`` run in ``tmp_path``, with ``python`` meaning this interpreter."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(
        [sys.executable, "-m", "whatif.cli", "collect", *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )


@needs_torch
def test_whatif_collect_runs_a_script_and_its_capture_writes_where_collect_says(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    run = collect(tmp_path, "--out", "run.bundle", "--steps", "2", "--warmup", "1", "--", "python", "train.py")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote run.bundle: 2 profiled steps") and len(run.stdout.splitlines()) == 1
    bundle = read_bundle(tmp_path / "run.bundle")
    assert bundle.steps == ["ProfilerStep#1", "ProfilerStep#2"] and bundle.manifest["warmup_steps"] == 1
    assert bundle.parameters["numel"].tolist() == [128, 16, 32, 2]
    assert not (tmp_path / "hard-coded.bundle").exists(), "collect's --out overrides the script's folder"
    again = collect(tmp_path, "--out", "run.bundle", "--steps", "1", "--warmup", "1", "--", "python", "train.py")
    assert again.returncode == 0, again.stderr
    assert read_bundle(tmp_path / "run.bundle").steps == ["ProfilerStep#1"], "an earlier bundle is replaced"


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("whatif: error: "), err
    return err


def test_collect_refuses_an_existing_folder_that_is_not_a_bundle(tmp_path, capsys):
    (tmp_path / "script.py").write_text("print('never run')\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("keep me")
    err = one_line_error(capsys, ["collect", "--out", str(tmp_path / "results"), "--", "python", str(tmp_path / "script.py")])
    assert "exists and is not a bundle" in err
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["notes.txt"]


def test_collect_of_a_missing_script_is_a_one_line_error(tmp_path, capsys):
    err = one_line_error(capsys, ["collect", "--out", str(tmp_path / "x.bundle"), "--", "python", str(tmp_path / "nope.py")])
    assert "nope.py: no such script" in err


@pytest.mark.parametrize(
    "script, message",
    [
        ("raise SystemExit(3)\n", "exited with status 3; no bundle written"),
        ("print('training without the capture API')\n", "wrote no bundle"),
    ],
    ids=["script-fails", "script-without-capture"],
)
def test_collect_says_when_the_script_wrote_no_bundle(tmp_path, capsys, script, message):
    (tmp_path / "script.py").write_text(script)
    err = one_line_error(capsys, ["collect", "--out", str(tmp_path / "x.bundle"), "--", sys.executable, str(tmp_path / "script.py")])
    assert message in err
    assert not (tmp_path / "x.bundle").exists()


def test_collect_without_a_command_is_a_one_line_error(capsys):
    assert "no command to run" in one_line_error(capsys, ["collect", "--steps", "2"])


# -- reading bundles -------------------------------------------------------------------------


def test_the_bundled_convnet_bundle_reads_and_its_gradients_come_from_its_hooks():
    assert is_bundle(BUNDLED)
    study = TraceStudy.from_trace(BUNDLED)
    bundle = study.trace.bundle
    assert len(study.iterations) == len(bundle.steps) == 5
    found = find_gradients(study.graph, study.iterations)
    assert found.source == BUNDLE_SOURCE
    trained = bundle.parameters[bundle.parameters["requires_grad"]]
    assert found.bytes_per_iteration() == float((trained["numel"] * trained["element_size"]).sum())
    without_bundle = study.graph.copy()
    without_bundle.workload = Workload(without_bundle.workload.source, without_bundle.workload.has_gpu)
    from_shapes = find_gradients(without_bundle, study.iterations)
    assert from_shapes.bytes_per_iteration() == found.bytes_per_iteration(), "the shapes in the trace agree"


def test_a_folder_that_is_not_a_bundle_is_a_one_line_trace_error(tmp_path, capsys):
    err = one_line_error(capsys, ["replay", str(tmp_path)])
    assert "neither a trace file nor a trace bundle" in err


def test_a_bundle_with_a_missing_trace_or_an_unknown_version_is_refused(tmp_path):
    manifest = json.loads((BUNDLED / MANIFEST).read_text())
    broken = tmp_path / "broken.bundle"
    broken.mkdir()
    (broken / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="trace.pt.trace.json.gz named in bundle.json is missing"):
        load_trace(broken)
    (broken / MANIFEST).write_text(json.dumps(dict(manifest, version=99)))
    with pytest.raises(BundleError, match="bundle version 99"):
        load_trace(broken)
