"""The validation grid's bookkeeping: which points it runs, how repeated runs are reported.

The real runs need root and minutes of quiet machine, so the grid itself is a script
(``bench/validation_grid.py``); these tests hold its tables and refusals to their word."""

import os
from pathlib import Path

import pytest

from whatif.lab.cluster import LabError
from whatif.lab.validate import validate



@pytest.fixture(scope="module")
def grid_script(bench_script):
    return bench_script("validation_grid")


def measured_row(runs_ms, predicted_ms=100.0):
    runs = sorted(runs_ms)
    measured = runs[len(runs) // 2]
    return {
        "model": "vgg", "machines": "1", "gpus_per_machine": "2", "bandwidth_mbps": "", "framework": "ddp",
        "status": "ok", "measured_ms": str(measured), "predicted_ms": str(predicted_ms),
        "error_pct": str(100 * (predicted_ms - measured) / measured), "runs_ms": ";".join(map(str, runs_ms)),
        "predicted_with_profiler_ms": str(measured * 1.03),
    }


def test_one_machine_configurations_run_once_per_framework_and_one_worker_once_per_model(grid_script):
    points = list(grid_script.grid(["vgg"], [(1, 1), (1, 2), (2, 1)], [100.0, 200.0], ["horovod", "ddp"]))
    assert points == [
        ("vgg", 1, 1, None, "single"),
        ("vgg", 1, 2, None, "horovod"), ("vgg", 1, 2, None, "ddp"),
        ("vgg", 2, 1, 100.0, "horovod"), ("vgg", 2, 1, 200.0, "horovod"),
        ("vgg", 2, 1, 100.0, "ddp"), ("vgg", 2, 1, 200.0, "ddp"),
    ]


def test_more_workers_than_cores_is_reported_not_run_never_passed(grid_script, tmp_path):
    workers = (os.cpu_count() or 1) + 1
    row = grid_script.run_point("vgg", workers, 1, 100.0, "ddp", tmp_path, steps=20, repeats=3, default_mbps=200.0)
    assert row["status"].startswith("not run:") and "measured_ms" not in row
    assert not any(tmp_path.iterdir()), "nothing was captured or run for a point that cannot run"


def test_the_table_names_the_code_measured_and_every_points_range_of_runs(grid_script):
    table = grid_script.markdown_table([measured_row([95.0, 104.0, 99.0])], "abc1234")
    assert "abc1234" in table
    assert "| vgg | 1x2 (loopback) | ddp | 99.0 | 95.0–104.0 | 100.0 | +1.0 | +3.0 |" in table


def test_a_table_predicted_again_says_its_code_predicted_rather_than_measured(grid_script):
    table = grid_script.markdown_table([measured_row([99.0])], "abc1234", repredicted=True)
    assert table.startswith("Predicted again with the code of abc1234")


def test_the_profiler_correction_is_judged_by_the_same_mean_absolute_error(grid_script):
    rows = [measured_row([100.0], predicted_ms=98.0), measured_row([200.0], predicted_ms=204.0)]
    assert grid_script.mean_abs_error_pct(rows, "predicted_ms") == pytest.approx(2.0)
    assert grid_script.mean_abs_error_pct(rows, "predicted_with_profiler_ms") == pytest.approx(3.0)


def test_repredicting_without_the_kept_capture_says_which_file_is_missing(grid_script, tmp_path):
    with pytest.raises(SystemExit, match="vgg_1x1.bundle is missing"):
        grid_script.repredict([measured_row([99.0])], tmp_path / "work", 200.0)


def test_a_point_is_predicted_again_from_the_calibration_it_was_run_with(grid_script, tmp_path, monkeypatch):
    """A grid run over several sessions calibrates in each; its loopback points were run in
    the first, and the box's speed drifts between sessions."""
    work = tmp_path / "work"
    for path in (grid_script.capture_path("vgg", work), grid_script.links_path(400, work), grid_script.links_path(200, work)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    used = []
    monkeypatch.setattr(grid_script, "predict", lambda bundle, links, *args, **kwargs: (used.append(links.name) or 99.0, None, None))
    from_its_session = {**measured_row([99.0]), "calibrated_at_mbps": "400.0"}
    from_before_it_was_recorded = measured_row([99.0])
    grid_script.repredict([from_its_session, from_before_it_was_recorded], work, default_mbps=200.0)
    assert used == ["links_400mbps.yaml"] * 2 + ["links_200mbps.yaml"] * 2  # with and without the profiler


def test_a_point_records_the_calibration_it_is_run_with(grid_script, tmp_path, monkeypatch):
    monkeypatch.setattr(grid_script, "validate", lambda *args, **kwargs: (_ for _ in ()).throw(LabError("no lab here")))
    loopback = grid_script.run_point("vgg", 1, 2, None, "ddp", tmp_path, steps=20, repeats=3, default_mbps=200.0)
    across = grid_script.run_point("vgg", 2, 1, 100.0, "ddp", tmp_path, steps=20, repeats=3, default_mbps=200.0)
    assert (loopback["calibrated_at_mbps"], across["calibrated_at_mbps"]) == (200.0, 100.0)


def test_a_csv_written_before_repeats_existed_still_reads_as_one_run(grid_script):
    row = measured_row([99.0])
    del row["runs_ms"]
    assert grid_script.run_medians(row) == [99.0]


def test_the_plot_draws_repeated_runs_as_ranges(grid_script, tmp_path):
    grid_script.plot([measured_row([95.0, 104.0, 99.0]), measured_row([180.0], 170.0)], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_validation_needs_at_least_one_real_run(tmp_path):
    with pytest.raises(LabError, match="--repeats"):
        validate("vgg", 1, 2, 200.0, "ddp", tmp_path, repeats=0)
    assert not any(tmp_path.iterdir())


def test_repredicting_runs_nothing_and_keeps_every_row(grid_script, tmp_path):
    failed = {**measured_row([100.0]), "model": "vgg", "machines": "1", "gpus_per_machine": "1", "framework": "single",
              "status": "failed: the real run failed"}
    grid_script.write_rows(tmp_path / "validation.csv", [failed])
    assert grid_script.main(["--repredict", "--out", str(tmp_path), "--models", "vgg", "--configs", "1x1"]) == 1
    rows = grid_script.read_rows(tmp_path / "validation.csv")
    assert [r["status"] for r in rows] == [failed["status"]]
    assert not (tmp_path / "work").exists(), "nothing was captured, calibrated or run"


UNSTEADY_MS = [113.2, 106.3, 105.9, 105.2, 132.2, 129.9, 124.3, 150.5]  # the wide MLP's capture on a busy box
STEADY_MS = [144.3, 143.3, 145.6, 143.4, 143.3, 143.2, 141.8, 144.0]


@pytest.fixture
def captures_timing(monkeypatch):
    """Stand in for ``whatif collect``: each capture is the bundled convnet capture with its plain
    steps timed as the next entry of the list this fixture returns."""
    import json
    import shutil

    import whatif.lab.validate as validation

    timings = []

    def collect(command, out, steps, warmup, env):
        shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "convnet_cpu.bundle", out)
        manifest = json.loads((out / "bundle.json").read_text())
        manifest["step_wall_ms"] = {"unprofiled": timings.pop(0), "profiled": []}
        (out / "bundle.json").write_text(json.dumps(manifest))

    monkeypatch.setattr(validation, "collect", collect)
    return timings


def test_the_capture_process_of_median_speed_is_kept(captures_timing, tmp_path):
    import json
    import statistics

    from whatif.collectors.bundle import read_bundle
    from whatif.lab.validate import capture, captures_record

    slow, fast, middle = ([ms * factor for ms in STEADY_MS] for factor in (1.3, 0.75, 1.0))
    captures_timing += [slow, fast, middle]
    bundle = capture("vgg", tmp_path)
    assert read_bundle(bundle).unprofiled_step_ms == middle
    assert not captures_timing, "every process is captured, a steady one does not end them"
    assert json.loads(captures_record(bundle).read_text()) == pytest.approx([statistics.median(t) for t in (slow, fast, middle)])
    assert sorted(p.name for p in bundle.parent.iterdir()) == sorted([bundle.name, captures_record(bundle).name]), \
        "no other process's bundle is left behind"


def test_each_capture_process_says_on_stderr_that_it_starts(captures_timing, tmp_path, capsys):
    """Issue 29: captures and calibration ran for minutes with only the profiler's lines."""
    import re

    from whatif.lab.validate import capture

    captures_timing += [STEADY_MS, STEADY_MS, STEADY_MS]
    capture("vgg", tmp_path)
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r"^\[\d\d:\d\d:\d\d\] ", "[time] ", line) for line in lines] == [
        f"[time] lab: capturing vgg on one worker, process {n} of 3" for n in (1, 2, 3)]


def test_an_unsteady_capture_is_passed_over_while_a_steady_one_exists(captures_timing, tmp_path):
    from whatif.collectors.bundle import read_bundle
    from whatif.lab.validate import capture

    captures_timing += [UNSTEADY_MS, STEADY_MS, UNSTEADY_MS]
    bundle = capture("vgg", tmp_path)
    assert read_bundle(bundle).unprofiled_step_ms == STEADY_MS


def test_when_every_capture_is_unsteady_the_one_of_median_speed_is_kept(captures_timing, tmp_path):
    from whatif.collectors.bundle import read_bundle
    from whatif.lab.validate import capture, plain_step_spread

    wilder = [ms * (1 + 0.2 * (i % 2)) for i, ms in enumerate(UNSTEADY_MS)]
    slower = [ms * 1.5 for ms in UNSTEADY_MS]
    captures_timing += [slower, wilder, UNSTEADY_MS]
    bundle = capture("vgg", tmp_path)
    assert read_bundle(bundle).unprofiled_step_ms == wilder
    assert plain_step_spread(read_bundle(bundle).unprofiled_step_ms) > 0.05 and not captures_timing


def test_a_validation_point_is_predicted_by_the_pipeline_on_calibrated_links():
    from whatif.lab.validate import predict

    repo = Path(__file__).resolve().parents[1]
    predicted_ms, (low_ms, high_ms), _ = predict(repo / "data" / "convnet_cpu.bundle",
                                                 repo / "docs" / "validation" / "fresh" / "links_400mbps.yaml", 2, 1,
                                                 400.0, "horovod")
    assert 0 < low_ms < predicted_ms < high_ms, "with its interval"
