"""Bad input gets a one-line error that names the file or the bad value, a non-zero exit status,
and never a traceback; the input file is never touched."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys

import numpy as np
import pytest

from trace_corpus import BUNDLED, BUNDLED_TRACE
from whatif import GraphError, simulate
from whatif.cli import main
from whatif.sim.graph import EdgeKind


@pytest.fixture
def good_trace(tmp_path):
    """A copy of the bundled CPU trace, so a misbehaving command can only damage the copy."""
    path = tmp_path / "convnet.pt.trace.json.gz"
    shutil.copyfile(BUNDLED_TRACE, path)
    return path


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def broken_traces(tmp_path) -> dict:
    return {
        "truncated gzip": write(tmp_path / "truncated.json.gz", BUNDLED_TRACE.read_bytes()[: BUNDLED_TRACE.stat().st_size // 2]),
        "not JSON": write(tmp_path / "notes.json", b"this is a profiler trace, honest\n"),
        "JSON that is not a trace": write(tmp_path / "config.json", b'{"a": 1}'),
        "no timed events": write(tmp_path / "empty.json", b'{"traceEvents": []}'),
        "gzip of no timed events": write(tmp_path / "empty.json.gz", gzip.compress(b'{"traceEvents": []}')),
        "empty file": write(tmp_path / "nothing.json", b""),
        "truncated JSON": write(tmp_path / "cut.json", gzip.decompress(BUNDLED_TRACE.read_bytes())[:5000]),
    }


def run_cli(capsys, argv):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status, err, *mentions):
    assert status != 0
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, f"expected one line on stderr, got {err!r}"
    assert err.startswith("whatif: error: ")
    for text in mentions:
        assert str(text) in err, f"{text!r} not named in {err!r}"


@pytest.mark.parametrize(
    "case",
    ["truncated gzip", "not JSON", "JSON that is not a trace", "no timed events", "gzip of no timed events",
     "empty file", "truncated JSON"],
)
@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_a_file_that_is_not_a_usable_trace_is_one_line_naming_it(tmp_path, capsys, case, command):
    path = broken_traces(tmp_path)[case]
    before = path.read_bytes()
    status, out, err = run_cli(capsys, [command, path])
    assert_one_line_error(status, err, path)
    assert out == ""
    assert path.read_bytes() == before


def test_a_missing_file_is_one_line_naming_it(tmp_path, capsys):
    missing = tmp_path / "no_such_trace.json.gz"
    status, _, err = run_cli(capsys, ["replay", missing])
    assert_one_line_error(status, err, missing)
    assert not missing.exists()


def test_a_directory_is_not_a_trace(tmp_path, capsys):
    status, _, err = run_cli(capsys, ["replay", tmp_path])
    assert_one_line_error(status, err, tmp_path)


@pytest.mark.parametrize(
    "args, named",
    [
        (["replay", "--iteration", "ProfilerStep#99"], "ProfilerStep#99"),
        (["replay", "--iteration", "Optimizer.step#Adam"], "Optimizer.step#Adam"),
        (["replay", "--iteration", "ProfilerStep#(1"], "ProfilerStep#(1"),
        (["simulate", "--scale", "conv"], "conv"),
        (["simulate", "--scale", "conv=fast"], "fast"),
        (["simulate", "--scale", "conv=-1"], "conv=-1"),
        (["simulate", "--scale", "conv=nan"], "conv=nan"),
        (["simulate", "--scale", "=0.5"], "=0.5"),
        (["simulate", "--optimization", "warp-drive"], "warp-drive"),
        (["simulate", "--optimization", "fused-adam"], "did you mean 'fused-optimizer'?"),
        (["simulate", "--optimization", "bf16"], "did you mean 'amp'?"),
        (["simulate", "--optimization", "faster-gpu=twice"], "twice"),
        (["simulate", "--optimization", "faster-gpu=0"], "faster"),
        (["simulate", "--optimization", "amp=2"], "amp"),
        (["simulate", "--optimization", "fused-optimizer", "--iteration", "ProfilerStep#2"], "launches no GPU kernels"),
        (["simulate", "--optimization", "amp", "--iteration", "ProfilerStep#2"], None),
        (["simulate", "--remove", "aten::(conv"], "aten::(conv"),
        (["simulate", "--scale", "aten::[conv=0.5"], "aten::[conv"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_value_is_one_line_naming_it_and_the_trace_is_untouched(good_trace, capsys, args, named):
    before = good_trace.read_bytes()
    command, *options = args
    status, out, err = run_cli(capsys, [command, good_trace, *options])
    if named is None:  # a valid request
        assert status == 0, err
    else:
        assert_one_line_error(status, err, named)
    assert good_trace.read_bytes() == before


def test_a_timeline_over_the_input_trace_is_refused(good_trace, capsys):
    before = good_trace.read_bytes()
    status, _, err = run_cli(capsys, ["replay", good_trace, "--timeline", good_trace])
    assert_one_line_error(status, err, good_trace)
    assert good_trace.read_bytes() == before


def test_a_timeline_over_the_input_trace_by_another_spelling_is_refused(good_trace, capsys, monkeypatch):
    before = good_trace.read_bytes()
    monkeypatch.chdir(good_trace.parent)
    status, _, err = run_cli(capsys, ["simulate", good_trace, "--timeline", f"./{good_trace.name}"])
    assert_one_line_error(status, err, good_trace.name)
    assert good_trace.read_bytes() == before


def test_a_timeline_into_a_missing_folder_is_one_line(good_trace, tmp_path, capsys):
    target = tmp_path / "no" / "such" / "folder" / "timeline.json.gz"
    status, _, err = run_cli(capsys, ["replay", good_trace, "--timeline", target])
    assert_one_line_error(status, err, target.parent)
    assert not target.exists()


def test_a_timeline_into_a_missing_folder_names_the_path_given(good_trace, tmp_path, capsys):
    target = tmp_path / "no" / "such" / "folder" / "timeline.json.gz"
    status, _, err = run_cli(capsys, ["replay", good_trace, "--timeline", target])
    assert_one_line_error(status, err, target)


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "{broken}"],
        ["simulate", "{good}", "--scale", "conv=-1"],
        ["replay", "{good}", "--iteration", "NoSuchStep"],
    ],
    ids=["truncated gzip", "negative scale", "unknown iteration"],
)
def test_the_installed_command_exits_non_zero_with_one_line_and_no_traceback(tmp_path, good_trace, args):
    broken = broken_traces(tmp_path)["truncated gzip"]
    argv = [a.format(broken=broken, good=good_trace) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "whatif.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""


def test_a_cycle_added_by_a_transformation_cannot_be_simulated(traces):
    """Two tasks a before b on one thread; an edge b -> a makes each wait for the other."""
    graph = traces.study(BUNDLED).graph.copy()
    thread = graph.resource_order()[0]
    a, b = int(thread[10]), int(thread[20])
    graph.add_edges([(b, a, 0.0, int(EdgeKind.USER))])
    with pytest.raises(GraphError, match="cycle") as err:
        simulate(graph)
    assert "\n" not in str(err.value)


def test_the_unmodified_graph_still_simulates_after_a_failed_copy(traces):
    """The cycle above went into a copy: the study's own graph is unchanged and schedulable."""
    study = traces.study(BUNDLED)
    edges_before = len(study.graph.edges)
    graph = study.graph.copy()
    graph.add_edges([(1, 0, 0.0, int(EdgeKind.USER))])
    assert len(study.graph.edges) == edges_before
    assert np.isfinite(simulate(study.graph).end_us).all()


def test_a_what_if_that_removes_every_task_is_an_error_not_an_empty_table(good_trace, capsys):
    status, out, err = run_cli(capsys, ["simulate", good_trace, "--remove", "ProfilerStep"])
    assert_one_line_error(status, err, "removed every task")
    assert out == ""


@pytest.mark.parametrize("option", ["--shared-memory-into", "--floor-into"])
@pytest.mark.parametrize("content", [None, b"machines: 2\n", b"intra_node: [\n"])
def test_a_topology_to_add_a_measurement_to_must_be_a_calibrated_one(tmp_path, capsys, content, option):
    path = tmp_path / "links.yaml"
    if content is not None:
        path.write_bytes(content)
    status, out, err = run_cli(capsys, ["lab", "calibrate", option, path])
    assert_one_line_error(status, err, path)
    assert out == ""
    assert (path.read_bytes() if path.exists() else None) == content
