"""The ``whatif`` command: what ``replay`` and ``simulate`` print, as JSON and as a table, and the
timeline they write."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_corpus import BUNDLED, BUNDLED_TRACE, EVENT_SYNC_MULTISTREAM, RESNET50
from whatif.cli import main
from whatif.scenario import Scenario

BUNDLED_STEPS = [f"ProfilerStep#{n}" for n in range(1, 6)]


NOTE_ONE_ITERATION = "whatif: note: "  # a trace without ProfilerStep#N ranges is one iteration
LITTLE_GAIN = "whatif: note: speed-up 1.0"  # a what-if that gains under 2 % says what bounds the step


def run_cli(capsys, *argv, said=()):
    """stdout of ``whatif ARGV``; stderr must be one line starting with each of ``said``, in
    order (none: empty)."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    lines = err.splitlines()
    assert len(lines) == len(said) and all(line.startswith(s) for line, s in zip(lines, said)), err
    return out


def run_json(capsys, *argv, said=()) -> dict:
    out = run_cli(capsys, *argv, "--json", said=said)
    assert out.endswith("\n") and out.count("\n") == 1, "one JSON object on one line"
    return json.loads(out)


def test_replay_json_reports_every_iteration(capsys, traces):
    doc = run_json(capsys, "replay", BUNDLED_TRACE)
    assert doc["trace"] == str(BUNDLED_TRACE)
    iterations = doc["iterations"]
    assert [it["name"] for it in iterations] == BUNDLED_STEPS
    study = traces.study(BUNDLED)
    expected = study.replay_report()
    for it, row in zip(iterations, expected.itertuples()):
        assert it["measured_ms"] == pytest.approx(row.measured_ms)
        assert it["predicted_ms"] == pytest.approx(row.predicted_ms)
        assert abs(it["error_pct"]) <= 2.0
    assert doc["summary"]["tasks"] == len(study.graph.tasks)
    assert doc["summary"]["edges"] == len(study.graph.edges)


def test_replay_json_of_a_cpu_trace_has_no_gpu_figures(capsys):
    doc = run_json(capsys, "replay", BUNDLED_TRACE)
    assert all(it["gpu_busy_ms"] is None for it in doc["iterations"]), "NaN is written as null"


def test_simulate_json_reports_the_prediction_beside_the_replay(capsys):
    doc = run_json(capsys, "simulate", BUNDLED_TRACE, "--optimization", "amp",
                   said=["whatif: warning: optimization 'amp': changes no task of this trace"])
    assert doc["optimizations"] == ["amp"]
    for it in doc["iterations"]:
        assert {"name", "measured_ms", "replay_ms", "predicted_ms", "speedup"} <= set(it)
        assert it["speedup"] == pytest.approx(it["replay_ms"] / it["predicted_ms"])
        assert it["speedup"] == 1.0, "AMP does nothing without a GPU"


def test_simulate_json_on_a_gpu_trace_predicts_a_speed_up(capsys, traces):
    path = traces.path(EVENT_SYNC_MULTISTREAM)
    doc = run_json(capsys, "simulate", path, "--optimization", "amp", said=[NOTE_ONE_ITERATION])
    (it,) = doc["iterations"]
    assert it["predicted_ms"] < it["replay_ms"]
    assert it["speedup"] > 1.0


def test_simulate_json_lists_every_what_if_asked(capsys):
    doc = run_json(
        capsys, "simulate", BUNDLED_TRACE, "--scale", "conv=0.5", "--scale", "relu=0", "--remove", "DataLoader"
    )
    assert doc["scale"] == ["conv=0.5", "relu=0"]
    assert doc["remove"] == ["DataLoader"]
    assert all(it["predicted_ms"] < it["replay_ms"] for it in doc["iterations"])


def test_a_user_named_iteration_is_reported_per_occurrence(capsys, traces):
    doc = run_json(capsys, "replay", traces.path(RESNET50), "--iteration", "Optimizer.step#SGD.step")
    assert [it["name"] for it in doc["iterations"]] == ["Optimizer.step#SGD.step"] * 6


def test_the_table_has_a_header_and_one_row_per_iteration(capsys):
    lines = run_cli(capsys, "replay", BUNDLED_TRACE).splitlines()
    assert lines[0].startswith(f"{BUNDLED_TRACE}: ") and "tasks" in lines[0]
    header, rows = lines[1], lines[2:]
    for column in ("iteration", "measured ms", "predicted ms", "error %"):
        assert column in header
    assert [row.split()[0] for row in rows] == BUNDLED_STEPS


def test_the_simulate_table_shows_the_speed_up(capsys):
    lines = run_cli(capsys, "simulate", BUNDLED_TRACE, "--remove", "Optimizer", said=[LITTLE_GAIN]).splitlines()
    header, rows, steady = lines[1], lines[2:-1], lines[-1]
    assert steady.startswith("steady iteration: ") and "% interval" in steady
    assert "replay ms" in header and "speed-up" in header and "error %" not in header
    assert len(rows) == 5
    speedups = [float(row.split()[-1]) for row in rows]
    assert all(s >= 1.0 for s in speedups)


def test_the_timeline_is_a_chrome_trace_with_one_event_per_task(capsys, tmp_path, traces):
    out = tmp_path / "timeline.json.gz"
    printed = run_cli(capsys, "replay", BUNDLED_TRACE, "--timeline", out)
    assert f"timeline written to {out}" in printed
    doc = json.load(gzip.open(out))
    events = doc["traceEvents"]
    graph = traces.study(BUNDLED).graph
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(graph.tasks)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == set(graph.tasks["resource"].cat.categories)
    replay = traces.study(BUNDLED).replay
    assert sorted(e["ts"] for e in complete) == pytest.approx(sorted(replay.start_us.tolist()))
    assert all(e["dur"] >= 0 for e in complete)
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json.gz"], "no temporary file left behind"


def test_timelines_written_together_are_each_what_one_writes_and_stop_at_a_file_there(tmp_path, traces):
    """``write_timelines`` (a grid's, each compressed on a thread while the next is made) writes
    each file byte for byte as ``write_timeline`` does; at a target that exists it raises, and
    keeps what it wrote before."""
    from whatif.report.timeline import write_timeline, write_timelines

    replay = traces.study(BUNDLED).replay
    notes = {0: {"collective": "a note on the first task"}}
    one = tmp_path / "one.json.gz"
    write_timeline(replay, one, notes=notes)
    paths = [tmp_path / f"t{i}.json.gz" for i in range(3)]
    write_timelines((replay, p, notes) for p in paths)
    assert all(p.read_bytes() == one.read_bytes() for p in paths)
    taken = [tmp_path / f"u{i}.json.gz" for i in range(3)]
    taken[1].write_bytes(b"the user's")
    with pytest.raises(OSError, match="already exists"):
        write_timelines((replay, p, None) for p in taken)
    assert taken[0].exists() and taken[1].read_bytes() == b"the user's" and not taken[2].exists()


def test_the_timeline_of_a_gpu_trace_has_cpu_and_gpu_tracks(capsys, tmp_path, traces):
    out = tmp_path / "timeline.json.gz"
    run_cli(capsys, "simulate", traces.path(EVENT_SYNC_MULTISTREAM), "--optimization", "faster-gpu=2", "--timeline", out,
            said=[NOTE_ONE_ITERATION, "whatif: note: speed-up 1.00 (under 2 %): the step is CPU-bound"])
    events = json.load(gzip.open(out))["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {"CPU threads (simulated)", "GPU streams (simulated)"}
    gpu_tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2}
    assert gpu_tracks == {"gpu 0/stream 20", "gpu 0/stream 24", "gpu 0/stream 28"}
    assert len([e for e in events if e["ph"] == "X"]) == len(traces.study(EVENT_SYNC_MULTISTREAM).graph.tasks)


def test_the_installed_command_runs_a_replay(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "whatif.cli", "replay", str(BUNDLED_TRACE), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [it["name"] for it in json.loads(result.stdout)["iterations"]] == BUNDLED_STEPS


def test_the_installed_predict_ends_without_teardown_and_leaves_its_files_whole(tmp_path, capsys):
    """``whatif predict`` as the process's own command ends once its output is flushed
    (``ends_quickly``): every file it wrote is whole, and it prints what ``main`` returns in a
    process that goes on; a failure keeps its status and its one line."""
    import yaml

    scenario = tmp_path / "grid.yaml"
    scenario.write_text(yaml.safe_dump({"trace": str(BUNDLED_TRACE), "framework": "horovod", "cluster": {
        "machines": [1, 2], "gpus_per_machine": 2, "intra_node": "nvlink2", "inter_node": ["10gbe", "40gbe"]}}))
    out = {kind: tmp_path / f"out.{kind}" for kind in ("csv", "png")}
    timeline = tmp_path / "run.json.gz"
    command = ["predict", str(scenario), "--json", "--jobs", "2", "--csv", str(out["csv"]), "--plot", str(out["png"]),
               "--timeline", str(timeline)]
    # the command as the console script runs it, with an object that says so when the teardown frees it
    code = ("import sys; from whatif.cli import main\n"
            "class Freed:\n    def __del__(self): print('torn down', file=sys.stderr)\n"
            "kept = Freed(); sys.argv[1:] = sys.argv[2:]; sys.exit(main())")
    result = subprocess.run([sys.executable, "-c", code, "whatif", *command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "torn down" not in result.stderr
    written = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.name != scenario.name}
    timelines = sorted(name for name in written if name.endswith(".json.gz"))
    assert len(timelines) == 4 and not [name for name in written if name.startswith(".")]  # no half-written file left
    for name in timelines:
        assert json.loads(gzip.decompress(written[name]))["traceEvents"]
    assert written["out.png"].startswith(b"\x89PNG") and written["out.png"].endswith(b"IEND\xaeB`\x82")
    assert written["out.csv"].count(b"\n") == 5
    assert main(command[:5]) == 0  # the same grid, no files
    assert json.loads(result.stdout)["results"] == json.loads(capsys.readouterr().out)["results"]
    failed = subprocess.run([sys.executable, "-m", "whatif.cli", "predict", str(tmp_path / "absent.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert (failed.returncode, failed.stdout, failed.stderr.count("\n")) == (2, "", 1)


def test_the_installed_command_reads_its_trace_ahead_and_says_what_it_met(tmp_path):
    """``whatif replay T`` as the process's own command reads T on a thread while its modules
    import (``collectors/tracefile.py``); a problem the thread meets is the command's one line."""
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 100_000_000 + b"]}", compresslevel=9))
    result = subprocess.run([sys.executable, "-m", "whatif.cli", "replay", str(bomb)],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"whatif: error: {bomb}: gzip data expands to more than 200 times its 0.1 MB "
                             "(WHATIF_MAX_GZIP_RATIO raises the limit); refusing to read it\n")


def test_a_trace_read_ahead_is_the_trace_read_now_and_read_once(tmp_path):
    from whatif.collectors import tracefile

    path = tmp_path / "trace.json.gz"
    path.write_bytes(BUNDLED_TRACE.read_bytes())
    tracefile.read_ahead(path)
    assert tracefile.read_bytes(path) == gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(b"changed"))  # the bytes read ahead are taken once: now, the file's
    assert tracefile.read_bytes(path) == b"changed"


def test_a_problem_met_reading_ahead_is_raised_by_the_reader(tmp_path):
    from whatif.collectors import tracefile

    missing = tmp_path / "missing.json"
    tracefile.read_ahead(missing)
    with pytest.raises(tracefile.TraceError, match="missing.json: no such file"):
        tracefile.read_bytes(missing)


def test_a_replay_imports_neither_the_pipeline_nor_the_other_commands():
    """``whatif replay`` of one trace loads only what it runs: not the cluster simulation, the
    topology or the other commands' modules, which cost it a second of its start-up."""
    code = ("import sys; from whatif.cli import main; status = main(['replay', sys.argv[1], '--json']); "
            "print(sorted(m for m in sys.modules if m.startswith('whatif.')), file=sys.stderr); sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code, str(BUNDLED_TRACE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(eval(result.stderr.strip().splitlines()[-1]))
    assert "whatif.commands.simulate" in loaded
    assert not loaded & {"whatif.pipeline", "whatif.sim.distributed", "whatif.topology", "whatif.commands.predict",
                         "whatif.commands.advise", "whatif.lab.cli", "whatif.sim.multirank",
                         "whatif.report.timeline", "whatif.sim.critical_path"}  # no --timeline asked


def test_the_command_table_names_every_command_of_each_module():
    """``whatif.cli.COMMAND_MODULES`` picks the one module to import by the command's name: its
    names must be the commands each module adds."""
    from whatif import cli

    _, owner = cli._parser([])
    added: dict = {}
    for command, module in owner.items():
        added.setdefault(module.__name__, set()).add(command)
    assert added == {module: set(commands) for module, commands in cli.COMMAND_MODULES.items()}


def test_a_what_if_that_gains_nothing_says_what_bounds_the_step(capsys, traces):
    """amp on ResNet-50 (V100): the step's critical path is the CPU launching kernels, so faster
    kernels gain nothing; the line says so instead of a bare "speed-up 1.00"."""
    assert main(["simulate", str(traces.path(RESNET50)), "--optimization", "amp"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("whatif: note: speed-up 1.00 (under 2 %): the step is CPU-bound: 99 % of its critical path is CPU work")
    assert "the GPU is idle 36 % of it; amp speeds GPU kernels only" in err
    assert err.count("\n") == 1


def test_a_what_if_that_gains_says_nothing_more(capsys, traces):
    assert main(["simulate", str(traces.path(RESNET50)), "--optimization", "fused-optimizer"]) == 0
    assert capsys.readouterr().err == ""


def test_the_trace_read_ahead_is_the_commands_trace_not_an_options_value(tmp_path, monkeypatch):
    """``whatif replay --timeline OLD.json.gz T`` reads T ahead, not the timeline it will replace;
    :data:`whatif.cli.READ_AHEAD` names every option of the command that takes a value."""
    from whatif import cli

    old, trace = tmp_path / "old.json.gz", tmp_path / "trace.json.gz"
    old.write_bytes(b"x")
    trace.write_bytes(b"y")
    asked = []
    monkeypatch.setattr(cli, "read_ahead", asked.append)
    for argv in (["replay", "--timeline", str(old), str(trace)], ["--strict", "replay", "--json", str(trace)],
                 ["replay", f"--timeline={old}", "--iteration", "Step", str(trace), str(old)]):
        asked.clear()
        cli._read_ahead(argv)
        assert asked == [str(trace)], argv
    cli._read_ahead(["collective", str(trace)])
    cli._read_ahead(["replay", str(tmp_path / "missing.json")])
    assert asked == [str(trace)]
    for command, valued in {**cli.READ_AHEAD, **cli.SCENARIO_READ_AHEAD}.items():
        parser, _ = cli._parser([command])
        leaf = parser._subparsers._group_actions[0].choices[command]
        takes_value = {s for a in leaf._actions if a.option_strings and a.nargs != 0 for s in a.option_strings}
        assert set(valued) == takes_value, command


def test_the_trace_a_scenario_names_is_read_ahead_as_the_scenario_names_it(tmp_path, monkeypatch):
    """``whatif predict S.yaml`` reads ahead the trace ``S.yaml`` names (relative to its folder,
    the path the scenario's reader builds, so that the bytes are taken), and nothing where the
    scenario names no trace file on a line of its own."""
    from whatif import cli

    (tmp_path / "data").mkdir()
    trace = tmp_path / "data" / "t.json.gz"
    trace.write_bytes(b"y")
    asked = []
    monkeypatch.setattr(cli, "read_ahead", asked.append)
    cluster = "cluster: {machines: 2, intra_node: pcie3, inter_node: 10gbe}\n"
    for text in ("trace: data/t.json.gz\n", "name: x  # trace: no\ntrace: 'data/t.json.gz'  # it\n"):
        scenario = tmp_path / "s.yaml"
        scenario.write_text(text + cluster)
        asked.clear()
        cli._read_ahead(["predict", "--jobs", "2", str(scenario)])
        assert asked == [str(Path(str(scenario)).parent / "data" / "t.json.gz")], text
        assert Scenario.from_file(scenario).trace == Path(asked[0])
    asked.clear()
    for text in ("trace:\n  - data/t.json.gz\n", "trace: data/missing.json\n", "cluster:\n  trace: data/t.json.gz\n"):
        (tmp_path / "s.yaml").write_text(text)
        cli._read_ahead(["predict", str(tmp_path / "s.yaml")])
    cli._read_ahead(["predict", str(tmp_path / "no-such.yaml")])
    assert asked == []


def test_bytes_read_ahead_of_a_trace_whose_graph_is_cached_are_let_go(tmp_path, monkeypatch):
    from whatif import graph_cache
    from whatif.collectors import tracefile

    monkeypatch.setenv("WHATIF_GRAPH_CACHE", "1")
    monkeypatch.setenv("WHATIF_CACHE_DIR", str(tmp_path / "cache"))
    trace = tmp_path / "t.json.gz"
    trace.write_bytes(BUNDLED_TRACE.read_bytes())
    graph_cache.read_and_build(trace)  # kept
    tracefile.read_ahead(trace)
    assert str(trace) in tracefile._ahead
    graph_cache.read_and_build(trace)  # from the cache
    assert str(trace) not in tracefile._ahead
