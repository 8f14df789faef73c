"""A hostile user's corpus: real traces and scenarios damaged one way each, and the exact outcome.

Every case is made in ``tmp_path`` from a real trace (the bundled CPU trace in ``data/``, or the
small shared A100 AlexNet trace) and asserts the exit status and the whole of stderr: input the
tool can leave out is one warning line per class, with its count (exit 0, the prediction still
printed); input that would make the answer wrong, or that cannot be read, is one error line
(exit 2); ``--strict`` makes every warning an error. The classes are issue 29's: silent wrong
answers, tracebacks, unbounded work.
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import sys
import time

import pytest

from trace_corpus import BUNDLED_TRACE, SHARED_TRACES, NO_SHARED, REPO
from whatif.cli import main

ALEXNET = SHARED_TRACES / "hta-misc" / "a100_alexnet_small.json.gz"


def run_cli(capsys, argv):
    """Exit status, stdout and stderr; stderr without the ``whatif: note:`` lines, which are
    advice (the AlexNet trace has no ProfilerStep ranges, tests/test_cli.py holds that note),
    not a count of input the tool could not use."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("whatif: note:"))
    return status, out, err


@pytest.fixture(scope="module")
def alexnet_doc() -> dict:
    if not ALEXNET.is_file():
        pytest.skip(NO_SHARED)
    return json.loads(gzip.decompress(ALEXNET.read_bytes()))


@pytest.fixture(scope="module")
def convnet_doc() -> dict:
    return json.loads(gzip.decompress(BUNDLED_TRACE.read_bytes()))


def damaged(doc: dict, tmp_path, damage, name="damaged.json"):
    """A copy of ``doc`` with ``damage(events)`` applied, written to ``tmp_path``."""
    doc = copy.deepcopy(doc)
    damage(doc["traceEvents"])
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def first(events, count, cat):
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == cat][:count]


def set_all(events, cat, count, key, value):
    for e in first(events, count, cat):
        e[key] = value


# -- silent wrong answers: now a warning with counts, or an error --------------------------------

def _negative(ev):
    set_all(ev, "kernel", 7, "dur", -5)


def _no_duration(ev):
    for e in first(ev, 3, "cpu_op"):
        del e["dur"]


def _absurd_duration(ev):
    set_all(ev, "kernel", 1, "dur", 1e308)


def _absurd_timestamp(ev):
    set_all(ev, "kernel", 2, "ts", 1e308)


def _no_timestamp(ev):
    for e in first(ev, 4, "cuda_runtime"):
        del e["ts"]


def _dangling(ev):
    for i, e in enumerate(first(ev, 4, "kernel")):
        e["args"]["correlation"] = 10**12 + i


def _duplicated(ev):
    calls = [e for e in first(ev, 10**9, "cuda_runtime") if e["args"].get("correlation", -1) >= 0][:10]
    for a, b in zip(calls[0::2], calls[1::2]):
        b["args"]["correlation"] = a["args"]["correlation"]


def _kernels_share_a_launch(ev):
    kernels = first(ev, 10, "kernel")
    for a, b in zip(kernels[0::2], kernels[1::2]):
        b["args"]["correlation"] = a["args"]["correlation"]


def _launched_late(ev):
    calls = {e["args"]["correlation"]: e for e in first(ev, 10**9, "cuda_runtime") if "correlation" in e["args"]}
    for e in first(ev, 2, "kernel"):
        e["ts"] = calls[e["args"]["correlation"]]["ts"] - 100


def _swapped(ev):
    kernels = sorted(first(ev, 10**9, "kernel"), key=lambda e: e["ts"])
    a, b = [k for k in kernels if k["args"]["stream"] == kernels[0]["args"]["stream"]][3:5]
    a["args"]["correlation"], b["args"]["correlation"] = b["args"]["correlation"], a["args"]["correlation"]


DUPLICATE_LINES = [
    "5 runtime calls share a correlation id with an earlier call; their GPU tasks are taken as launched by the first",
    "3 GPU tasks have no launching call in the trace (correlation id missing or unknown); without a launch "
    "dependency, each starts when the trace says",
]


@pytest.mark.parametrize(
    "damage, lines",
    [
        (_negative, ["dropped 7 kernels with negative duration (dur)"]),
        (_no_duration, ["dropped 3 CPU operators with no duration (dur)"]),
        (_absurd_duration, ["dropped 1 kernel with an absurd duration (dur over 24 h)"]),
        (_absurd_timestamp, ["dropped 2 kernels with an absurd timestamp (ts over 24 h from the trace's median)"]),
        (_no_timestamp, ["dropped 4 runtime calls with no timestamp (ts)",  # and what they launched is left
                         DUPLICATE_LINES[1].replace("3 GPU tasks have", "1 GPU task has")]),
        (_dangling, [DUPLICATE_LINES[1].replace("3 GPU tasks", "4 GPU tasks")]),
        (_duplicated, DUPLICATE_LINES),
        (_kernels_share_a_launch, ["5 GPU tasks share a launching call with another (correlation ids duplicated; a call "
                                   "launches one task, a graph launch several); each is taken as launched by it"]),
        (_launched_late, ["2 GPU tasks start before the call that launched them (correlation ids out of order or "
                          "clocks skewed); the replay starts each after its call"]),
        (_swapped, ["1 GPU task runs on its stream after a task launched later (correlation ids out of order); a "
                    "synchronisation waits for the latest launch before it"]),
    ],
    ids=["negative dur", "missing dur", "absurd dur", "absurd ts", "missing ts", "dangling correlation",
         "duplicated correlation", "kernels sharing a correlation", "kernel before its launch", "correlation ids out of order on a stream"],
)
def test_events_the_tool_cannot_use_are_counted_in_one_warning_per_class(alexnet_doc, tmp_path, capsys, damage, lines):
    path = damaged(alexnet_doc, tmp_path, damage)
    status, out, err = run_cli(capsys, ["replay", path])
    assert status == 0
    assert err.splitlines() == [f"whatif: warning: {path}: {line}" for line in lines]
    assert "whole trace" in out
    status, out, err = run_cli(capsys, ["--strict", "replay", path])
    assert (status, out) == (2, "")
    assert err == f"whatif: error: {path}: {lines[0]}; --strict makes this an error\n"


def test_overlapping_profiler_steps_are_an_error_naming_the_steps(convnet_doc, tmp_path, capsys):
    def overlap(ev):
        steps = sorted((e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
        steps[1]["dur"] += 5000.0

    path = damaged(convnet_doc, tmp_path, overlap)
    status, out, err = run_cli(capsys, ["replay", path])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {path}: ts/dur: iteration 'ProfilerStep#3' starts 4953.1 us before "
                   "'ProfilerStep#2' ends; overlapping iterations cannot be replayed as measured (name other ranges "
                   "with --iteration NAME)\n")


def test_a_trace_without_operators_is_refused_by_overheads_and_replayed_with_a_warning(convnet_doc, tmp_path, capsys):
    """A profiler window that ran no operator (its schedule's trace never exported, or only the
    step annotations kept) has nothing to measure: pandas' "Empty DataFrame" was printed."""
    path = damaged(convnet_doc, tmp_path, lambda ev: ev.__setitem__(
        slice(None), [e for e in ev if e.get("cat") != "cpu_op"]))
    status, out, err = run_cli(capsys, ["overheads", path])
    assert (status, out) == (2, "")
    assert err.startswith(f"whatif: error: {path}: no top-level operators (cpu_op events) to measure the overheads "
                          "around;") and err.count("\n") == 1
    status, out, err = run_cli(capsys, ["replay", path])  # replays, as the steps' spans, and says so
    assert status == 0 and "ProfilerStep#2" in out
    assert err == (f"whatif: warning: {path}: has no operator, runtime call or GPU task, only annotations: its steps "
                   "replay as their spans and no what-if changes them (was the profiler's window empty?)\n")


@pytest.mark.parametrize("option", ["--scale", "--remove"])
def test_a_pattern_that_matches_nothing_warns_and_strict_refuses(tmp_path, capsys, option):
    value = "no_such_operator=0.5" if option == "--scale" else "no_such_operator"
    status, out, err = run_cli(capsys, ["simulate", BUNDLED_TRACE, option, value])
    assert status == 0 and "ProfilerStep#" in out
    assert err == f"whatif: warning: {option} {value!r}: matches no task, so it changes nothing\n"
    status, out, err = run_cli(capsys, ["simulate", BUNDLED_TRACE, option, value, "--strict"])
    assert (status, out) == (2, "")
    assert err == f"whatif: error: {option} {value!r}: matches no task, so it changes nothing; --strict makes this an error\n"


def test_an_optimization_that_changes_no_task_warns_and_strict_refuses(capsys):
    """amp on the CPU trace: no kernel to speed up (the note after it says what bounds the step)."""
    line = "optimization 'amp': changes no task of this trace, so it changes nothing"
    status, out, err = run_cli(capsys, ["simulate", BUNDLED_TRACE, "--optimization", "amp"])
    assert status == 0 and "ProfilerStep#" in out
    assert err == f"whatif: warning: {line}\n"
    status, out, err = run_cli(capsys, ["--strict", "simulate", BUNDLED_TRACE, "--optimization", "amp"])
    assert (status, out, err) == (2, "", f"whatif: error: {line}; --strict makes this an error\n")


def test_a_clean_real_trace_warns_of_nothing(capsys):
    status, _, err = run_cli(capsys, ["--strict", "replay", BUNDLED_TRACE])
    assert (status, err) == (0, "")


# -- a capture's warm-up too short to time a step without the profiler ---------------------------

SHORT_WARMUP = ("a warm-up of 2 steps times no step without the profiler (steps 2 to warm-up - 1 are), so predictions "
                "from this bundle cannot remove the profiler's overhead and will be slower than the plain run; use "
                "--warmup 3 or more")


def test_a_bundle_captured_with_a_warmup_below_three_warns_that_its_overhead_stays(tmp_path, capsys):
    bundle = tmp_path / "short_warmup.bundle"
    shutil.copytree(REPO / "data" / "convnet_cpu.bundle", bundle)
    manifest = json.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(json.dumps(dict(manifest, warmup_steps=2)))
    status, out, err = run_cli(capsys, ["simulate", bundle, "--optimization", "no-dataloader"])
    assert status == 0 and "ProfilerStep#" in out
    assert err == f"whatif: warning: {bundle}: {SHORT_WARMUP}\n"
    status, out, err = run_cli(capsys, ["--strict", "simulate", bundle])
    assert (status, out, err) == (2, "", f"whatif: error: {bundle}: {SHORT_WARMUP}; --strict makes this an error\n")


def test_collect_with_a_warmup_below_three_warns_first_and_strict_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    status, out, err = run_cli(capsys, ["--strict", "collect", "--out", tmp_path / "x.bundle", "--warmup", "2", *script])
    assert (status, out, err) == (2, "", f"whatif: error: --warmup 2: {SHORT_WARMUP}; --strict makes this an error\n")
    assert not marker.exists()
    status, out, err = run_cli(capsys, ["collect", "--out", tmp_path / "x.bundle", "--warmup", "2", *script])
    assert status == 2 and marker.exists()
    assert err.splitlines()[0] == f"whatif: warning: --warmup 2: {SHORT_WARMUP}"


# -- scenario values that make no sense ----------------------------------------------------------

CLUSTER = "intra_node: nvlink2, inter_node: 10gbe"


@pytest.mark.parametrize(
    "body, line",
    [
        (f"cluster: {{machines: 2, {CLUSTER}}}\nstragglers: [{{machine: 1, slowdown: .nan}}]\n",
         "stragglers[0].slowdown: must be a positive finite number, got nan"),
        (f"cluster: {{machines: 2, {CLUSTER}}}\nstragglers: [{{machine: 1, gpu_slowdown: .inf}}]\n",
         "stragglers[0].gpu_slowdown: must be a positive finite number, got inf"),
        (f"cluster: {{machines: 2, {CLUSTER}}}\nstragglers: [{{machine: 1, slowdown: -2}}]\n",
         "stragglers[0].slowdown: must be a positive finite number, got -2"),
        (f"cluster: {{machines: [2, 4], {CLUSTER}}}\nstragglers: [{{machine: 4, slowdown: 2}}]\n",
         "stragglers[0].machine: machine 4 does not exist: the largest cluster has 4 (machines are numbered from 0)"),
        (f"cluster: {{machines: 2, {CLUSTER}}}\nstragglers: [{{machine: true, slowdown: 2}}]\n",
         "stragglers[0].machine: must be a machine index >= 0, got True"),
        (f"cluster: {{machines: 2, {CLUSTER}}}\nstragglers: [{{machine: 1}}]\n",
         "stragglers[0]: gives neither slowdown nor gpu_slowdown, so it slows nothing"),
        (f"cluster: {{machines: 2, gpus_per_machine: 1000000000, {CLUSTER}}}\n",
         "cluster.gpus_per_machine: 1000000000 GPUs in one machine: no machine has more than 72 (GB200 NVL72); "
         "a machine preset has 8"),
        (f"cluster: {{machines: 1000000000000, {CLUSTER}}}\n",
         "cluster.machines: 1000000000000 GPUs: more than 1000000, beyond any cluster built (the largest have "
         "about 100,000)"),
        (f"cluster: {{machines: 2, {CLUSTER}}}\noptimizations: [faster-gpu=inf]\n",
         "optimizations: optimization 'faster-gpu=inf': the speed-up must be a positive finite number"),
    ],
    ids=["nan slowdown", "inf gpu slowdown", "negative slowdown", "no such machine", "machine: true", "no slowdown",
         "a billion GPUs per machine", "a trillion machines", "faster-gpu=inf"],
)
def test_a_scenario_value_that_makes_no_sense_is_one_line(tmp_path, capsys, body, line):
    path = tmp_path / "scenario.yaml"
    path.write_text(f"trace: {BUNDLED_TRACE}\n{body}")
    status, out, err = run_cli(capsys, ["predict", path])
    assert (status, out) == (2, "")
    assert err == f"whatif: error: {path}: {line}\n"


def _shipped_straggler(tmp_path, replace: dict):
    """scenarios/straggler.yaml (machine 1 of 2 or 4 runs 1.5 times slower), its trace named by
    absolute path, with ``replace``'s texts replaced."""
    text = (REPO / "scenarios" / "straggler.yaml").read_text().replace("../data/", f"{REPO / 'data'}/")
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "straggler.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "replace, line",
    [
        ({"machine: 1,": "machine: 3,"},
         "{scenario}: stragglers[0].machine: machine 3 is not in 1 configuration of fewer machines, which run without it"),
        ({"slowdown: 1.5": "gpu_slowdown: 1.5"},
         "{trace}: has no GPU task, so the GPU slowdown of 2 configurations (gpu_slowdown, gpu_variation) changes "
         "nothing"),
    ],
    ids=["straggler beyond some configurations", "gpu_slowdown on a CPU trace"],
)
def test_a_scenario_value_some_or_all_configurations_cannot_use_is_a_warning(tmp_path, capsys, replace, line):
    path = _shipped_straggler(tmp_path, replace)
    line = line.format(scenario=path, trace=REPO / "data" / "convnet_cpu.pt.trace.json.gz")
    status, out, err = run_cli(capsys, ["--strict", "predict", path])
    assert (status, out, err) == (2, "", f"whatif: error: {line}; --strict makes this an error\n")


def test_a_gpu_slowdown_on_a_cpu_trace_predicts_with_the_warning(tmp_path, capsys):
    path = _shipped_straggler(tmp_path, {"slowdown: 1.5": "gpu_slowdown: 1.5", "machines: [2, 4]": "machines: 2"})
    status, out, err = run_cli(capsys, ["predict", path])
    assert status == 0 and "horovod" in out
    assert err == (f"whatif: warning: {REPO / 'data' / 'convnet_cpu.pt.trace.json.gz'}: has no GPU task, so the GPU "
                   "slowdown of 1 configuration (gpu_slowdown, gpu_variation) changes nothing\n")


@pytest.mark.parametrize("option", ["faster-gpu=inf", "faster-gpu=nan", "faster-gpu=-1"])
def test_faster_gpu_must_be_finite_and_positive(capsys, option):
    status, out, err = run_cli(capsys, ["simulate", BUNDLED_TRACE, "--optimization", option])
    assert (status, out) == (2, "")
    assert err == f"whatif: error: optimization {option!r}: the speed-up must be a positive finite number\n"


# -- tracebacks: now one line, exit 2 -------------------------------------------------------------

def _not_utf8(doc, tmp_path):
    path = tmp_path / "latin1.json"
    text = json.dumps(doc).replace('"aten::empty"', '"aten::\\u00e9mpty"', 1).replace("\\u00e9", "\u00e9")
    path.write_bytes(text.encode("latin-1", errors="replace"))
    return path


def _deep(doc, tmp_path):
    path = tmp_path / "deep.json"
    text = json.dumps(doc)
    path.write_text(text.replace('"traceEvents":', '"deep": ' + "[" * 100_000 + "]" * 100_000 + ', "traceEvents":', 1))
    return path


def _nan_duration(doc, tmp_path):
    return damaged(doc, tmp_path, lambda ev: first(ev, 1, "kernel")[0].update(dur=float("nan")))


def _huge_id(doc, tmp_path):
    return damaged(doc, tmp_path, lambda ev: first(ev, 1, "kernel")[0]["args"].update(correlation=2**64 - 1))


def _no_stream(doc, tmp_path):
    def damage(ev):
        kernel = first(ev, 1, "kernel")[0]
        del kernel["args"]["stream"]
        kernel["tid"] = None

    return damaged(doc, tmp_path, damage)


def _word_for_stream(doc, tmp_path):
    def damage(ev):
        kernel = first(ev, 1, "kernel")[0]
        del kernel["args"]["stream"]
        kernel["tid"] = "the fast one"

    return damaged(doc, tmp_path, damage)


def _null_tid(doc, tmp_path):
    return damaged(doc, tmp_path, lambda ev: first(ev, 1, "cpu_op")[0].update(tid=None))


def _float_tid(doc, tmp_path):
    return damaged(doc, tmp_path, lambda ev: first(ev, 1, "cpu_op")[0].update(tid=1.5))


@pytest.mark.parametrize(
    "make, problem",
    [
        (_not_utf8, "is not UTF-8 text (a string holds the byte 0xe9)"),
        (_deep, "JSON nested deeper than Python's recursion limit: no trace nests so deep"),
        (_nan_duration, "holds NaN at byte {nan_at}, which JSON has no number for (a duration or timestamp that is "
                        "not a number?)"),
        (_huge_id, "args['correlation']: 18446744073709551615 does not fit in 64 bits"),
        (_no_stream, "a kernel ({name!r} at ts {ts}) has no stream (args.stream) nor tid"),
        (_word_for_stream, "a kernel ({name!r} at ts {ts}) has no stream (args.stream) and its tid 'the fast one' "
                           "is not a stream number"),
        (_null_tid, "a CPU operator ({cpu!r} at ts {cpu_ts}) has no tid"),
        (_float_tid, "JSON is not a Chrome trace (Expected `int | str | null`, got `float` - at `$.traceEvents[{i}].tid`)"),
    ],
    ids=["not UTF-8", "nested too deep", "NaN duration", "id beyond 64 bits", "GPU event without a stream",
         "GPU event with a word for a stream", "null tid", "non-numeric tid"],
)
def test_a_trace_that_used_to_raise_a_traceback_is_one_line(alexnet_doc, tmp_path, capsys, make, problem):
    kernel = first(alexnet_doc["traceEvents"], 1, "kernel")[0]
    cpu = first(alexnet_doc["traceEvents"], 1, "cpu_op")[0]
    path = make(alexnet_doc, tmp_path)
    status, out, err = run_cli(capsys, ["replay", path])
    assert (status, out) == (2, "")
    expected = problem.format(name=kernel["name"], ts=float(kernel["ts"]), cpu=cpu["name"], cpu_ts=float(cpu["ts"]),
                              i=alexnet_doc["traceEvents"].index(cpu), nan_at=path.read_bytes().find(b"NaN"))
    assert err == f"whatif: error: {path}: {expected}\n"


@pytest.mark.parametrize("command", [["predict"], ["collective", "--op", "all_reduce"]])
def test_a_trace_given_as_a_scenario_or_cluster_is_one_line(capsys, command):
    status, out, err = run_cli(capsys, [command[0], BUNDLED_TRACE, *command[1:]])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {BUNDLED_TRACE}: is gzip data, not YAML (a trace? name it in a scenario's "
                   "trace: key)\n")


@pytest.mark.parametrize("command", [["predict", "{path}"], ["collective", "{path}", "--op", "all_reduce"],
                                     ["advise", BUNDLED_TRACE, "{path}"]], ids=["predict", "collective", "advise"])
def test_a_plain_json_trace_given_as_a_scenario_or_cluster_is_one_line(alexnet_doc, tmp_path, capsys, command):
    """JSON is YAML: the plain AlexNet trace loaded, and was refused as 'schemaVersion: unknown key'."""
    path = tmp_path / "alexnet.json"
    path.write_text(json.dumps(alexnet_doc))
    status, out, err = run_cli(capsys, [str(a).format(path=path) for a in command])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {path}: is a profiler trace (Chrome trace events), not YAML of whatif's (name it "
                   "in a scenario's trace: key)\n")


def test_a_scenario_that_is_not_utf8_is_one_line(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(f"trace: {BUNDLED_TRACE}\nname: caf\xe9\n".encode("latin-1"))
    status, out, err = run_cli(capsys, ["predict", path])
    assert (status, out, err) == (2, "", f"whatif: error: {path}: is not UTF-8 text, so not YAML\n")


def _nested_too_deep(text: str) -> str:
    """``text`` with a value nested 100,000 lists deep before its first line."""
    return "deep: " + "[" * 100_000 + "]" * 100_000 + "\n" + text


@pytest.mark.parametrize(
    "command, make, problem",
    [
        (["predict"], lambda p: p.write_text(_nested_too_deep((REPO / "scenarios" / "straggler.yaml").read_text())),
         "YAML nested deeper than Python's recursion limit: no scenario or cluster nests so deep"),
        (["perfmodel", "report"], lambda p: p.write_text('{"format": "whatif-perfmodels", "deep": '
                                                         + "[" * 100_000 + "]" * 100_000 + "}"),
         "JSON nested deeper than Python's recursion limit: no models file nests so deep"),
        (["lab", "calibrate", "--shared-memory-into"], lambda p: p.write_bytes(BUNDLED_TRACE.read_bytes()),
         "cannot read it as a topology YAML (is gzip data, not YAML (a trace? name it in a scenario's trace: key))"),
        (["lab", "calibrate", "--shared-memory-into"],
         lambda p: p.write_bytes((REPO / "scenarios" / "straggler.yaml").read_text().replace("slower", "sl\xf6wer").encode("latin-1")),
         "cannot read it as a topology YAML (is not UTF-8 text, so not YAML)"),
    ],
    ids=["scenario nested too deep", "models file nested too deep", "trace as a links file", "links file not UTF-8"],
)
def test_a_file_of_our_own_formats_that_used_to_raise_a_traceback_is_one_line(tmp_path, capsys, command, make, problem):
    path = tmp_path / "input"
    make(path)
    status, out, err = run_cli(capsys, [*command, path])
    assert (status, out, err) == (2, "", f"whatif: error: {path}: {problem}\n")


# -- unbounded work: refused before it starts, with the limit and how to raise it ----------------

def test_a_bad_batch_size_fails_before_the_trace_is_read(tmp_path, capsys):
    started = time.perf_counter()
    status, out, err = run_cli(capsys, ["simulate", tmp_path / "never_read.json", "--batch-size", "0"])
    assert (status, out, err) == (2, "", "whatif: error: --batch-size 0: expected a positive whole number\n")
    assert time.perf_counter() - started < 1.0


def test_a_gzip_bomb_is_refused_before_it_takes_the_memory(tmp_path, capsys):
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 100_000_000 + b"]}", compresslevel=9))
    status, out, err = run_cli(capsys, ["replay", path])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {path}: gzip data expands to more than 200 times its 0.1 MB "
                   "(WHATIF_MAX_GZIP_RATIO raises the limit); refusing to read it\n")


def test_the_decompressed_size_limit_names_its_variable(capsys, monkeypatch):
    monkeypatch.setenv("WHATIF_MAX_TRACE_MB", "0.5")
    status, out, err = run_cli(capsys, ["replay", BUNDLED_TRACE])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {BUNDLED_TRACE}: gzip data expands to more than 0.5 MB (WHATIF_MAX_TRACE_MB "
                   "raises the limit); refusing to read it\n")


def test_a_yaml_alias_bomb_is_refused(tmp_path, capsys):
    path = tmp_path / "laughs.yaml"
    lols = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lols.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    path.write_text("\n".join(lols) + "\n")
    status, out, err = run_cli(capsys, ["predict", path])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {path}: more than 16 YAML aliases (*name); refusing a document that may expand "
                   "beyond bounds (write the values out)\n")


@pytest.mark.parametrize("command", [["predict"], ["advise", BUNDLED_TRACE]])
def test_a_grid_that_simulates_thousands_of_workers_asks_for_yes(tmp_path, capsys, command):
    path = tmp_path / "huge.yaml"
    path.write_text(f"trace: {BUNDLED_TRACE}\nreplicate: true\ncluster: {{machines: [1000, 10000], {CLUSTER}}}\n")
    status, out, err = run_cli(capsys, [*command, path])
    assert (status, out) == (2, "")
    assert err == (f"whatif: error: {path}: the grid simulates 11000 workers' graphs (11000 GPUs) over 2 configurations, "
                   "more than 2048 (minutes to hours); pass --yes to run it anyway\n")


def test_a_grid_of_thousands_of_identical_gpus_runs_without_yes(tmp_path, capsys):
    """Identical workers are simulated once: 3000 GPUs over two configurations are two workers'
    graphs, seconds of work, and not refused as thousands of GPUs would be."""
    path = tmp_path / "large.yaml"
    path.write_text(f"trace: {BUNDLED_TRACE}\ncluster: {{machines: [1000, 2000], {CLUSTER}}}\n")
    status, out, err = run_cli(capsys, ["predict", path, "--json", "--jobs", "1"])
    assert status == 0, err
    assert [row["workers"] for row in json.loads(out)["results"]] == [1000, 2000]


def test_perfmodel_fit_checks_its_arguments_before_the_sweep(tmp_path, capsys):
    missing = tmp_path / "no_such_trace.json"
    for argv, line in [
        (["--threads", "0"], "perfmodel fit --threads 0: expected a positive whole number"),
        (["--from-trace", missing], f"perfmodel fit --from-trace {missing}: no such file or bundle"),
    ]:
        status, out, err = run_cli(capsys, ["perfmodel", "fit", "--out", tmp_path / "m.json", *argv])
        assert (status, out, err) == (2, "", f"whatif: error: {line}\n")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["validate", "--model", "convnet", "--steps", "0"], "--steps must be at least 1, not 0"),
        (["validate", "--model", "convnet", "--batch-size", "0"], "--batch-size must be at least 1, not 0"),
        (["validate", "--model", "convnet", "--batch-size", "8", "--predict-from", "0"],
         "--predict-from must be at least 1, not 0"),
        (["lab", "run", "--threads", "0", "--", "true"], "--threads 0: a worker needs at least 1 thread"),
        (["lab", "run", "--timeout", "0", "--", "true"], "--timeout 0: the workers need some seconds to run"),
    ],
    ids=["validate --steps 0", "validate --batch-size 0", "validate --predict-from 0", "lab run --threads 0",
         "lab run --timeout 0"],
)
def test_the_labs_arguments_are_checked_before_any_capture_or_namespace(tmp_path, capsys, argv, line):
    """``validate --steps 0`` used to start minutes of captures before anything looked at it."""
    command = 1 if argv[0] == "validate" else 2
    where = ["--work", tmp_path / "work"] if argv[0] == "validate" else ["--out", tmp_path / "out"]
    started = time.perf_counter()
    status, out, err = run_cli(capsys, [*argv[:command], *where, *argv[command:]])
    assert (status, out, err) == (2, "", f"whatif: error: {line}\n")
    assert time.perf_counter() - started < 5.0
    assert not (tmp_path / "work").exists()


def test_the_python_api_collects_the_same_warnings_or_raises_under_strict(alexnet_doc, tmp_path):
    from whatif import Diagnostics, InputWarning, StrictError, TraceStudy, collecting

    path = damaged(alexnet_doc, tmp_path, _negative)
    line = f"{path}: dropped 7 kernels with negative duration (dur)"
    with collecting(Diagnostics()) as diagnostics:
        TraceStudy.from_trace(path)
    assert diagnostics.messages == [line]
    with pytest.warns(InputWarning, match="dropped 7 kernels"):
        TraceStudy.from_trace(path)
    with pytest.raises(StrictError, match="--strict makes this an error"), collecting(Diagnostics(strict=True)):
        TraceStudy.from_trace(path)


def test_a_collective_table_of_a_third_of_a_million_sizes_is_refused(tmp_path, capsys):
    cluster = tmp_path / "h100.yaml"
    cluster.write_text("machine: dgx_h100\nmachines: 4\n")
    status, out, err = run_cli(capsys, ["collective", cluster, "--op", "all_reduce", "--min-bytes", "1",
                                        "--max-bytes", "1000TB", "--step-factor", "1.0001"])
    assert (status, out) == (2, "")
    assert err == ("whatif: error: --step-factor: 1.0001 from 1 to 1000TB makes 345406 sizes (more than 10000); "
                   "take a larger step\n")
