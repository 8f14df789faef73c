"""The graph cache (whatif/graph_cache.py): a second command on a trace gets what the first read
and built, says the same warnings, and reads again whatever changed.

On the bundled CPU trace and a copy of it damaged one way (three operators without a duration),
with the cache turned on in a folder of the test's own.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from trace_corpus import BUNDLED_TRACE
from whatif import graph_cache, study
from whatif.cli import main
from whatif.sim.engine import simulate
from whatif.study import TraceStudy


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WHATIF_GRAPH_CACHE", "1")
    monkeypatch.setenv("WHATIF_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "graphs"


def entries(folder):
    return sorted(folder.glob("*.pickle")) if folder.is_dir() else []


def replays(folder):
    return sorted(folder.glob("*.replay")) if folder.is_dir() else []


def not_simulated_again(monkeypatch):
    def refuse(graph, *args, **kwargs):
        raise AssertionError("the replay simulated again")

    monkeypatch.setattr(study, "simulate", refuse)


def not_read_again(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(graph_cache, "load_trace", refuse)


def same_graph(a, b):
    pd.testing.assert_frame_equal(a.tasks, b.tasks)
    pd.testing.assert_frame_equal(a.edges, b.edges)


def test_a_second_study_of_a_trace_is_the_first_ones_graph_and_replay(cache, tmp_path, monkeypatch):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    first = TraceStudy.from_trace(trace)
    assert len(entries(cache)) == 1
    not_read_again(monkeypatch)
    second = TraceStudy.from_trace(trace)
    same_graph(first.graph, second.graph)
    assert second.trace.path == first.trace.path
    np.testing.assert_array_equal(first.replay.end_us, second.replay.end_us)
    pd.testing.assert_frame_equal(first.iterations, second.iterations)


def test_a_cached_traces_recorded_inputs_are_unpacked_when_first_read(cache, tmp_path):
    """A cached trace's recorded inputs come back as one blob, unpacked the first time one of
    them is read, equal to the fresh trace's; pickled again before or after, they survive."""
    import pickle

    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    fresh = TraceStudy.from_trace(trace).trace
    assert fresh.input_dims, "the bundled trace records its operators' inputs"
    cached = TraceStudy.from_trace(trace).trace
    assert "_packed_inputs" in cached.__dict__ and "input_dims" not in cached.__dict__
    again = pickle.loads(pickle.dumps(cached))  # still packed: passed on as it is
    for got in (cached, again):
        assert got.input_dims == fresh.input_dims
        assert got.input_types == fresh.input_types
        assert got.concrete_inputs == fresh.concrete_inputs
        assert "_packed_inputs" not in got.__dict__
    assert pickle.loads(pickle.dumps(cached)).input_dims == fresh.input_dims
    with pytest.raises(AttributeError):
        cached.no_such_field


def test_a_changed_trace_is_read_again(cache, tmp_path):
    trace = tmp_path / "trace.json"
    doc = json.loads(gzip.decompress(BUNDLED_TRACE.read_bytes()))
    trace.write_text(json.dumps(doc))
    before = TraceStudy.from_trace(trace)
    name = next(e["name"] for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    kept = [e for e in doc["traceEvents"] if not (e.get("cat") == "cpu_op" and e.get("name") == name)]
    assert len(kept) < len(doc["traceEvents"])
    doc["traceEvents"] = kept
    trace.write_text(json.dumps(doc))
    after = TraceStudy.from_trace(trace)
    assert len(after.graph.tasks) < len(before.graph.tasks)
    assert len(entries(cache)) == 2
    fresh = TraceStudy.from_trace(trace)
    same_graph(after.graph, fresh.graph)


def test_an_entry_cut_short_is_rebuilt_not_an_error(cache, tmp_path):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    first = TraceStudy.from_trace(trace)
    (entry,) = entries(cache)
    entry.write_bytes(entry.read_bytes()[:1000])
    second = TraceStudy.from_trace(trace)
    same_graph(first.graph, second.graph)
    assert entry.stat().st_size > 1000


def test_the_folder_keeps_the_entries_used_last_within_its_limit(cache, tmp_path, monkeypatch):
    names = []
    for i in range(3):
        names.append(tmp_path / f"copy{i}.json.gz")
        shutil.copy(BUNDLED_TRACE, names[-1])
        TraceStudy.from_trace(names[-1])
    sizes = [e.stat().st_size for e in entries(cache)]
    assert len(sizes) == 3
    monkeypatch.setenv("WHATIF_GRAPH_CACHE_MB", str((max(sizes) * 1.5) / 2**20))
    os.utime(names[0])  # changed: its entry is stale, a new one is written and the oldest go
    TraceStudy.from_trace(names[0])
    assert len(entries(cache)) == 1
    assert len(list(cache.glob("held-*.mark"))) == 1  # the marks of traces whose entries went, gone too


def test_a_trace_whose_graph_is_kept_is_not_read_ahead(cache, tmp_path, monkeypatch):
    """The command line reads a trace ahead while it imports; a trace whose graph the cache
    keeps (its mark, collectors/cache_folder.py) is not, since its bytes would be thrown away;
    a changed trace, or any with the cache off, is."""
    from whatif import cli

    trace = tmp_path / "t.json.gz"
    shutil.copy(BUNDLED_TRACE, trace)
    asked = []
    monkeypatch.setattr(cli, "read_ahead", asked.append)
    cli._read_ahead(["replay", str(trace)])
    assert asked == [str(trace)]  # nothing kept yet
    TraceStudy.from_trace(trace)
    asked.clear()
    cli._read_ahead(["replay", str(trace)])
    assert asked == []
    st = trace.stat()
    os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another trace now
    cli._read_ahead(["replay", str(trace)])
    assert asked == [str(trace)]
    TraceStudy.from_trace(trace)
    asked.clear()
    monkeypatch.setenv("WHATIF_GRAPH_CACHE", "0")
    cli._read_ahead(["replay", str(trace)])
    assert asked == [str(trace)]


def test_no_mark_is_left_for_a_graph_the_cache_could_not_keep(cache, tmp_path, monkeypatch):
    """An entry larger than the folder's limit is trimmed as soon as it is written: no mark
    says it is kept, so the next command still reads the trace ahead."""
    from whatif import cli

    trace = tmp_path / "t.json.gz"
    shutil.copy(BUNDLED_TRACE, trace)
    monkeypatch.setenv("WHATIF_GRAPH_CACHE_MB", "0.001")
    TraceStudy.from_trace(trace)
    assert entries(cache) == [] and list(cache.glob("held-*.mark")) == []
    asked = []
    monkeypatch.setattr(cli, "read_ahead", asked.append)
    cli._read_ahead(["replay", str(trace)])
    assert asked == [str(trace)]


def test_the_cache_off_writes_nothing(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("WHATIF_GRAPH_CACHE", "0")
    TraceStudy.from_trace(BUNDLED_TRACE).replay
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_later_study_takes_the_replay_kept_with_the_graph(cache, tmp_path, monkeypatch):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    first = TraceStudy.from_trace(trace)
    fresh = simulate(first.graph)
    assert replays(cache) == []  # kept once asked for, not before
    first.replay
    assert len(replays(cache)) == 1
    not_simulated_again(monkeypatch)
    second = TraceStudy.from_trace(trace)
    for a, b in ((first.replay, second.replay), (fresh, second.replay)):
        np.testing.assert_array_equal(a.start_us, b.start_us)
        np.testing.assert_array_equal(a.end_us, b.end_us)
    assert second.replay.graph is second.graph and second.replay.simpy_events == fresh.simpy_events
    pd.testing.assert_frame_equal(first.replay_report(), second.replay_report())


def test_a_replay_cut_short_or_of_another_graph_is_simulated_again(cache, tmp_path, monkeypatch):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    expected = TraceStudy.from_trace(trace).replay
    (kept,) = replays(cache)
    kept.write_bytes(kept.read_bytes()[:100])
    again = TraceStudy.from_trace(trace)
    np.testing.assert_array_equal(again.replay.end_us, expected.end_us)
    assert kept.stat().st_size > 100  # written whole again
    changed = TraceStudy.from_trace(trace)
    changed.graph = changed.graph.copy()
    changed.graph.tasks["duration_us"] *= 2  # a study given another graph: the kept replay is not its
    assert changed.replay.end_us.max() > expected.end_us.max()


def _damaged(tmp_path):
    doc = json.loads(gzip.decompress(BUNDLED_TRACE.read_bytes()))
    for e in [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"][:3]:
        del e["dur"]
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_cached_trace_says_its_warnings_again_and_strict_still_stops(cache, tmp_path, capsys, monkeypatch):
    path = _damaged(tmp_path)
    assert main(["replay", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("whatif: warning:")]
    assert warnings and all(str(path) in line for line in warnings)
    assert len(entries(cache)) == 1
    not_read_again(monkeypatch)
    assert main(["replay", str(path), "--json"]) == 0
    again, err_again = capsys.readouterr()
    assert again == out
    assert [line for line in err_again.splitlines() if line.startswith("whatif: warning:")] == warnings
    assert main(["--strict", "replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(warnings[0].replace("warning", "error", 1))


def test_another_version_of_the_code_reads_the_trace_again(cache, tmp_path, monkeypatch):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    TraceStudy.from_trace(trace)
    stamp = graph_cache._code_stamp()
    monkeypatch.setattr(graph_cache, "_CODE_STAMP", stamp + [["sim/build.py", 1, 1]])  # a module edited
    TraceStudy.from_trace(trace)
    assert len(entries(cache)) == 2


def test_a_rewrite_of_the_same_size_and_time_is_told_by_its_content(tmp_path):
    trace = tmp_path / BUNDLED_TRACE.name
    shutil.copy(BUNDLED_TRACE, trace)
    before = graph_cache._stamp(trace)
    data = bytearray(trace.read_bytes())
    data[-5] ^= 0xFF  # the gzip trailer's length: what a rewrite of another trace would change
    trace.write_bytes(bytes(data))
    os.utime(trace, ns=(before[1], before[1]))
    after = graph_cache._stamp(trace)
    assert (after[0], after[1]) == (before[0], before[1]) and after[4] != before[4]
