"""``whatif predict SCENARIO``: the table, ``--json``, ``--csv``, ``--plot`` and ``--timeline``, and
that no output ever lands on an input.

The scenarios run on the bundled CPU trace (it predicts in about a second) except where a GPU
trace is the point.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import stat

import pytest

from trace_corpus import BUNDLED_TRACE, RESNET50
from whatif.cli import main

RESULT_KEYS = {
    "machines", "gpus_per_machine", "inter_node_gbps", "framework", "policy",
    "iteration_ms", "speedup", "scaling_efficiency", "exposed_comm_ms",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GZIP_MAGIC = b"\x1f\x8b"
BUNDLED_ITERATIONS = 5


@pytest.fixture
def trace(tmp_path):
    """A copy of the bundled trace, so a misbehaving command can only damage the copy."""
    path = tmp_path / "convnet.pt.trace.json.gz"
    shutil.copyfile(BUNDLED_TRACE, path)
    return path


def scenario_file(folder, trace, machines="[1, 2]", gbps="[10Gbps, 40Gbps]", extra=""):
    path = folder / "scenario.yaml"
    path.write_text(
        f"trace: {trace}\n"
        f"cluster: {{machines: {machines}, gpus_per_machine: 1, intra_node: nvlink2,"
        f" inter_node: {{bandwidth: {gbps}, latency: 5us}}}}\n" + extra
    )
    return path


def predict(capsys, *argv) -> str:
    status = main(["predict", *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert err == ""
    return out


def predict_json(capsys, *argv) -> dict:
    out = predict(capsys, *argv, "--json")
    assert out.endswith("\n") and out.count("\n") == 1, "one JSON object on one line"
    return json.loads(out)


def refused(capsys, *argv) -> str:
    status = main(["predict", *[str(a) for a in argv]])
    _, err = capsys.readouterr()
    assert status == 2
    assert err.startswith("whatif: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.fixture
def grid_json(capsys, tmp_path, trace):
    """machines 1 and 2 at 10 and 40 Gbps, Horovod and DDP: 8 configurations, as JSON."""
    return predict_json(capsys, scenario_file(tmp_path, trace, extra="framework: [horovod, ddp]\n"))


def test_json_has_a_result_per_configuration_with_the_documented_keys(grid_json, trace):
    results = grid_json["results"]
    assert len(results) == 2 * 2 * 2
    for row in results:
        assert RESULT_KEYS <= set(row)
    assert {(r["machines"], r["inter_node_gbps"], r["framework"]) for r in results} == {
        (m, g, f) for m in (1, 2) for g in (10.0, 40.0) for f in ("horovod", "ddp")
    }
    assert grid_json["trace"] == str(trace)
    assert "AccumulateGrad" in grid_json["gradients"]["source"]


def test_json_speed_up_is_against_one_worker(grid_json):
    baseline = grid_json["baseline_1x1_ms"]
    for row in grid_json["results"]:
        workers = row["machines"] * row["gpus_per_machine"]
        if workers == 1:
            assert row["speedup"] == 1.0 and row["scaling_efficiency"] == 1.0
            assert row["iteration_ms"] == baseline and row["exposed_comm_ms"] == 0
        else:
            assert row["speedup"] == pytest.approx(workers * baseline / row["iteration_ms"], rel=1e-12)
            assert row["scaling_efficiency"] == pytest.approx(row["speedup"] / workers, rel=1e-12)
            assert 0 < row["speedup"] <= workers
            assert 0 <= row["exposed_comm_ms"] <= row["iteration_ms"]


@pytest.mark.parametrize("which", ["bundled", "resnet50"])
def test_one_worker_predicts_what_replay_says(capsys, tmp_path, traces, which):
    path = BUNDLED_TRACE if which == "bundled" else traces.path(RESNET50)
    replay = json.loads(predict_replay(capsys, path))["summary"]["steady_predicted_ms"]
    doc = predict_json(capsys, scenario_file(tmp_path, path, machines=1, gbps="10Gbps"))
    (row,) = doc["results"]
    assert row["iteration_ms"] == pytest.approx(replay, rel=5e-3)
    assert row["iteration_ms"] == pytest.approx(replay, rel=1e-12), "exactly: it is the same simulation"


def predict_replay(capsys, path) -> str:
    status = main(["replay", str(path), "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def test_the_table_has_a_row_per_configuration(capsys, tmp_path, trace):
    out = predict(capsys, scenario_file(tmp_path, trace))
    lines = out.splitlines()
    assert lines[0].startswith(f"{trace}: 1x1 iteration ")
    assert "MB per iteration" in lines[0]
    assert lines[1].split()[:3] == ["machines", "GPUs/machine", "Gbps"]
    assert len(lines) == 2 + 4


def test_csv_has_a_row_per_configuration(capsys, tmp_path, trace):
    out_csv = tmp_path / "results.csv"
    doc = predict_json(capsys, scenario_file(tmp_path, trace, extra="policy: [fifo, p3]\n"), "--csv", out_csv)
    with out_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(doc["results"]) == 2 * 2 * 2
    assert RESULT_KEYS <= set(rows[0])
    for row, result in zip(rows, doc["results"]):
        assert int(row["machines"]) == result["machines"] and row["policy"] == result["policy"]
        assert float(row["iteration_ms"]) == pytest.approx(result["iteration_ms"], rel=1e-9)


def test_the_table_says_where_the_csv_went(capsys, tmp_path, trace):
    out_csv = tmp_path / "results.csv"
    out = predict(capsys, scenario_file(tmp_path, trace), "--csv", out_csv)
    assert f"CSV written to {out_csv}" in out
    assert out_csv.read_text().count("\n") == 1 + 4


def test_plot_writes_a_png(capsys, tmp_path, trace):
    out_png = tmp_path / "scaling.png"
    predict(capsys, scenario_file(tmp_path, trace, extra="framework: [horovod, ps]\n"), "--plot", out_png)
    data = out_png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000, "two panels of curves and bars, not an empty canvas"
    assert not list(tmp_path.glob(".scaling.png*")), "no temporary file left behind"


def test_neither_legend_covers_its_panel(capsys, tmp_path, trace, monkeypatch):
    """Issue 29: the legend covered the bars. Both legends sit below their panels' axes."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    predict(capsys, scenario_file(tmp_path, trace, extra="framework: [horovod, ps]\n"), "--plot", tmp_path / "s.png")
    (fig,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # closing the figure detached its own
    canvas.draw()
    renderer = canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels) == 2
    for ax in panels:
        assert not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), ax.get_title()


def test_the_plot_orders_setups_by_machines_then_gpus_per_machine():
    """By worker count 1x2 came before 2x1 and the curve rose and fell; by machines it does not."""
    import pandas as pd

    from whatif.report.plots import configuration_order

    shapes = [(2, 1), (1, 2), (4, 1), (1, 1), (2, 2), (3, 1), (2, 1)]
    frame = pd.DataFrame({"machines": [m for m, _ in shapes], "gpus_per_machine": [g for _, g in shapes]})
    assert configuration_order(frame) == ["1x1", "1x2", "2x1", "2x2", "3x1", "4x1"]


def test_identical_lines_are_named_as_the_same():
    import pandas as pd

    from whatif.report.plots import same_as

    frame = pd.DataFrame({"series": ["a", "a", "b", "b", "c", "c"], "configuration": ["1x1", "2x1"] * 3,
                          "speedup": [1.0, 1.9, 1.0, 1.9000001, 1.0, 1.5]})
    assert same_as(frame, ["a", "b", "c"]) == {"b": "a"}


def test_the_plot_title_is_the_scenarios_name_and_description_not_its_file_name(tmp_path, trace):
    from whatif.commands.predict import plot_titles
    from whatif.scenario import Scenario

    path = scenario_file(tmp_path, trace, extra='name: "10 or 40 Gbps?"\ndescription: >-\n  The small CNN,\n  Horovod.\n')
    assert plot_titles(path, Scenario.from_file(path)) == ("10 or 40 Gbps?", "The small CNN, Horovod.")
    bare = scenario_file(tmp_path, trace)
    title, subtitle = plot_titles(bare, Scenario.from_file(bare))
    assert (title, subtitle) == (f"Predicted scaling of {trace.name}", "")
    assert "scenario.yaml" not in title


def test_every_shipped_scenario_with_a_plot_has_a_title():
    import yaml

    from trace_corpus import REPO

    for path in sorted((REPO / "scenarios").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert doc.get("name") and doc.get("description"), path


def network_events(timeline: dict) -> list:
    events = timeline["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    return [e for e in events if e["ph"] == "X" and tracks[(e["pid"], e["tid"])] == "network"]


def test_timeline_of_one_configuration_shows_the_network(capsys, tmp_path, trace):
    out_json = tmp_path / "timeline.json.gz"
    doc = predict_json(capsys, scenario_file(tmp_path, trace, machines=2, gbps="10Gbps"), "--timeline", out_json)
    (row,) = doc["results"]
    assert doc["timelines"] == [str(out_json)]
    timeline = json.load(gzip.open(out_json))
    on_network = network_events(timeline)
    assert len(on_network) == row["messages_per_iteration"] * BUNDLED_ITERATIONS
    assert all(e["name"].startswith("all-reduce ") and e["dur"] > 0 for e in on_network)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("timeline")] == ["timeline.json.gz"]


def test_timelines_of_a_grid_are_one_file_per_configuration(capsys, tmp_path, trace):
    out_json = tmp_path / "timeline.json.gz"
    doc = predict_json(capsys, scenario_file(tmp_path, trace), "--timeline", out_json)
    written = sorted(tmp_path.glob("timeline.*.json.gz"))
    assert len(written) == len(doc["results"]) == 4
    assert sorted(doc["timelines"]) == [str(p) for p in written]
    assert not out_json.exists()
    for path in written:
        assert path.read_bytes()[:2] == GZIP_MAGIC, "Perfetto recognises a gzip file by its first bytes"
        assert json.load(gzip.open(path))["traceEvents"]


def test_a_timeline_never_replaces_a_file_and_writes_none_of_the_grid(capsys, tmp_path, trace):
    scenario = scenario_file(tmp_path, trace)
    kept = tmp_path / "timeline.1x1_40Gbps_horovod_fifo.json.gz"
    kept.write_bytes(b"the user's own file")
    err = refused(capsys, scenario, "--timeline", tmp_path / "timeline.json.gz")
    assert str(kept) in err and "already exists" in err
    assert kept.read_bytes() == b"the user's own file"
    assert [p.name for p in tmp_path.glob("timeline*")] == [kept.name]


def test_a_timeline_not_named_json_gz_is_refused_before_the_prediction(capsys, tmp_path, trace):
    err = refused(capsys, scenario_file(tmp_path, trace), "--timeline", tmp_path / "timeline.json")
    assert "timeline.json" in err and ".json.gz" in err
    assert not list(tmp_path.glob("timeline*"))


def test_csv_over_the_scenario_is_refused_and_leaves_it_alone(capsys, tmp_path, trace):
    scenario = scenario_file(tmp_path, trace)
    before = scenario.read_bytes()
    err = refused(capsys, scenario, "--csv", scenario)
    assert str(scenario) in err
    assert scenario.read_bytes() == before


@pytest.mark.parametrize("option", ["--csv", "--plot", "--timeline"])
def test_no_output_overwrites_the_trace(capsys, tmp_path, trace, option):
    scenario = scenario_file(tmp_path, trace, machines=2, gbps="10Gbps")
    before = trace.read_bytes()
    err = refused(capsys, scenario, option, trace)
    assert str(trace) in err
    assert trace.read_bytes() == before


def test_outputs_over_an_input_by_another_spelling_are_refused(capsys, tmp_path, trace, monkeypatch):
    scenario = scenario_file(tmp_path, trace)
    before = scenario.read_bytes()
    monkeypatch.chdir(tmp_path)
    refused(capsys, scenario, "--plot", f"./{scenario.name}")
    assert scenario.read_bytes() == before


def test_outputs_get_the_permissions_of_any_new_file(capsys, tmp_path, trace):
    old = os.umask(0o022)
    try:
        predict(capsys, scenario_file(tmp_path, trace, machines=2, gbps="10Gbps"),
                "--csv", tmp_path / "r.csv", "--plot", tmp_path / "r.png", "--timeline", tmp_path / "r.json.gz")
    finally:
        os.umask(old)
    for name in ("r.csv", "r.png", "r.json.gz"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_the_plot_names_each_series_by_what_varies_and_a_layout_by_its_split(capsys, tmp_path):
    """A parallelism grid on two cluster sizes: one series per layout (its data-parallel degree
    follows the cluster), named by what varies across the grid, the rest said once above the
    panels; the figure stays a figure, not one line of every label (it was 4186 pixels wide)."""
    import pandas as pd
    from PIL import Image

    from trace_corpus import REPO
    from whatif.report.plots import series_labels

    doc = (REPO / "scenarios" / "parallelism_transformer.yaml").read_text().replace("../data/", f"{REPO}/data/")
    doc = doc.replace("machines: 2\n", "machines: [2, 4]\n").replace("bandwidth: [1Gbps, 10Gbps]", "bandwidth: 10Gbps")
    path = tmp_path / "grid.yaml"
    path.write_text(doc)
    out_csv, out_png = tmp_path / "grid.csv", tmp_path / "grid.png"
    predict(capsys, path, "--csv", out_csv, "--plot", out_png)
    results = pd.read_csv(out_csv)
    assert sorted(set(results["parallelism"])) == ["dp2 tp2", "dp2 tp2 fsdp", "dp4", "dp4 fsdp", "dp4 tp2", "dp4 tp2 fsdp",
                                                  "dp8", "dp8 fsdp"]
    labels, shared = series_labels(results)
    assert sorted(set(labels)) == ["data parallel", "fsdp", "tp2", "tp2 fsdp"]
    assert shared == "10 Gbps per machine, framework ddp, policy fifo"
    width, height = Image.open(out_png).size
    assert width < 2.5 * height, (width, height)


def test_a_cluster_of_other_gpus_than_the_traced_one_is_noted(tmp_path, capsys, traces):
    """The H100 trace on DGX H100 and B200 machines: the B200 rows keep the traced kernel times,
    which the command says in a note (advice, not input it could not use: no warning); none
    where faster-gpu says how much faster the GPUs compute, or where they are the traced ones."""
    trace = traces.path("triosim-vgg13-h100/vgg13_bs512_iter41.json.gz")
    notes = {}
    for name, text in (("both", "machine: [dgx_h100, dgx_b200]"), ("h100", "machine: dgx_h100"),
                       ("faster", "machine: dgx_b200")):
        path = tmp_path / f"{name}.yaml"
        extra = "optimizations: [faster-gpu=2]\n" if name == "faster" else ""
        path.write_text(f"trace: {trace}\ncluster: {{{text}, machines: 2}}\nframework: ddp\n{extra}")
        assert main(["predict", str(path)]) == 0
        notes[name] = [line for line in capsys.readouterr().err.splitlines() if "keep their traced times" in line]
    assert len(notes["both"]) == 1 and "NVIDIA H100 80GB HBM3" in notes["both"][0] and "b200 GPUs" in notes["both"][0]
    assert notes["h100"] == [] and notes["faster"] == []


def test_a_parallelism_the_trace_cannot_take_is_one_line_naming_the_scenario(tmp_path, capsys):
    """Found while the job is built (expert parallelism over four ranks of a model with two
    embedding tables and no experts): one line naming the scenario file and the key, status 2."""
    path = tmp_path / "ep.yaml"
    path.write_text(f"trace: {BUNDLED_TRACE.parent / 'transformer_cpu.bundle'}\ncluster: {{machines: 1, gpus_per_machine: 4, intra_node: nvlink2, "
                    f"inter_node: 10gbe}}\nframework: ddp\nparallelism: {{expert: 4}}\n")
    assert main(["predict", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"whatif: error: {path}: parallelism.expert: ") and "fewer tables than the 4 ranks" in err[-1]
    assert not any("Traceback" in line for line in err)
