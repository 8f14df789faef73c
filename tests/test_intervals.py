"""Prediction intervals (``report/intervals.py``): the method, and how the commands report it."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from whatif.cli import main
from whatif.pipeline import Request, predict
from whatif.report.intervals import LEVEL, describe, prediction_interval, student_t_two_sided
from whatif.report.iterations import IntervalUnion, steady_median, steady_values

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"
RESNET = SHARED / "kineto-resnet50-v100" / "resnet50_bs32_workers0.pt.trace.json.gz"
ONE_ITERATION = SHARED / "triosim-vgg13-h100" / "vgg13_bs512_iter41.json.gz"


def whatif(capsys, *argv) -> str:
    """stdout of ``whatif ARGV``, which must succeed."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} is not here")


@pytest.mark.parametrize("dof, published", [(1, 6.3138), (2, 2.9200), (5, 2.0150), (10, 1.8125), (30, 1.6973)])
def test_students_quantile_is_the_published_one(dof, published):
    # two-sided 90 %: the 95th percentile of Student's t (any statistics table)
    assert student_t_two_sided(0.90, dof) == pytest.approx(published, abs=1e-4)


def test_students_quantile_agrees_with_scipy_at_other_levels():
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 4, 7, 25):
        for level in (0.5, 0.8, 0.99):
            assert student_t_two_sided(level, dof) == pytest.approx(stats.t.ppf((1 + level) / 2, dof), rel=1e-8)


def test_the_interval_is_centred_on_the_central_value_in_logarithm():
    low, high = prediction_interval([95.0, 100.0, 104.0, 101.0], 100.0)
    assert low < 100.0 < high
    assert math.log(100.0 / low) == pytest.approx(math.log(high / 100.0))


def test_two_steady_iterations_give_no_interval():
    """With two, t is 6.3 at 90 %: the interval would say little but how few they are."""
    assert all(math.isnan(x) for x in prediction_interval([96.0, 104.0], 100.0))
    assert all(math.isfinite(x) for x in prediction_interval([96.0, 104.0, 100.0], 100.0))


def test_few_iterations_of_the_same_spread_give_a_wider_interval():
    times = [96.0, 104.0, 100.0]
    few = prediction_interval(times, 100.0)
    many = prediction_interval(times * 10, 100.0)
    assert few[1] - few[0] > 2 * (many[1] - many[0])


def test_one_iteration_gives_no_interval_and_says_so():
    low, high = prediction_interval([100.0], 100.0)
    assert math.isnan(low) and math.isnan(high)
    assert describe(100.0, low, high) == "100.0 ms (no interval: fewer than 3 steady iterations)"
    assert describe(193.24, 181.01, 207.5) == "193.2 ms (90 % interval 181.0-207.5)"


@needs(RESNET)
def test_a_traces_interval_comes_from_its_steady_iterations():
    prediction = predict(Request(RESNET))
    times = prediction.report["predicted_ms"]
    low, high = prediction.iteration_interval
    assert (low, high) == prediction_interval(steady_values(times), steady_median(times))
    assert low < prediction.iteration_ms < high
    # the first (slow, warming up) iteration is not part of the spread
    assert (low, high) != prediction_interval(times, steady_median(times))


@needs(RESNET)
def test_each_steady_iteration_held_out_of_a_steady_trace_is_inside_the_others_interval():
    times = predict(Request(RESNET, remove_profiler_overhead=False)).report["predicted_ms"]
    for k in range(1, len(times) - 1):
        rest = times.drop(index=times.index[k])
        low, high = prediction_interval(steady_values(rest), steady_median(rest))
        assert low <= times.iloc[k] <= high


def test_every_configuration_of_predict_has_its_interval_in_the_table_and_the_json(capsys):
    scenario = REPO / "scenarios" / "p3_vs_fifo.yaml"
    table = whatif(capsys, "predict", scenario).splitlines()
    assert f"{100 * LEVEL:g} % interval" in table[1]
    assert f"1x1 iteration 196.3 ms ({100 * LEVEL:g} % interval " in table[0]
    out = json.loads(whatif(capsys, "predict", scenario, "--json"))
    assert out["interval_level"] == LEVEL
    assert out["baseline_1x1_ms_low"] < out["baseline_1x1_ms"] < out["baseline_1x1_ms_high"]
    for row in out["results"]:
        assert row["iteration_ms_low"] < row["iteration_ms"] < row["iteration_ms_high"]


@needs(ONE_ITERATION)
def test_a_trace_of_one_iteration_predicts_without_an_interval(capsys, tmp_path):
    doc = {"trace": str(ONE_ITERATION), "cluster": {"machines": 2, "gpus_per_machine": 1, "intra_node": "nvlink3",
                                                      "inter_node": "100gbe"}}
    scenario = tmp_path / "one.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    out = json.loads(whatif(capsys, "predict", scenario, "--json"))
    assert out["baseline_1x1_ms_low"] is None and out["results"][0]["iteration_ms_high"] is None


def test_simulate_reports_the_steady_iteration_with_its_interval(capsys):
    trace = REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz"
    last = whatif(capsys, "simulate", trace, "--optimization", "faster-gpu=2").splitlines()[-1]
    assert last.startswith(f"steady iteration: 196.3 ms ({100 * LEVEL:g} % interval ")
    summary = json.loads(whatif(capsys, "simulate", trace, "--json", "--optimization", "faster-gpu=2"))["summary"]
    assert summary["steady_predicted_ms_low"] < summary["steady_predicted_ms"] < summary["steady_predicted_ms_high"]


def test_the_results_table_shows_a_dash_where_a_configuration_has_no_interval():
    from whatif.report.tables import results_table

    rows = pd.DataFrame([{"machines": 2, "gpus_per_machine": 1, "iteration_ms": 10.0, "iteration_ms_low": np.nan,
                          "iteration_ms_high": np.nan}])
    assert results_table(rows).splitlines()[1].split()[-1] == "-"


# -- the calibration's spread ---------------------------------------------------------------------

FRESH_LINKS = REPO / "docs" / "validation" / "fresh" / "links_400mbps.yaml"


def kept_calibration(tmp_path: Path, slower: float = 1.3) -> Path:
    """A calibration folder as ``lab/calibrate.py`` keeps it, of two runs: the kept 400 Mbps
    calibration's figures, and the same with loopback all-reduces ``slower`` times slower."""
    measured = yaml.safe_load(FRESH_LINKS.read_text())["measured"]
    for run, factor in (("run0", 1.0), ("run1", slower)):
        for where, folder in (("across_machines", "across"), ("inside_a_machine", "inside")):
            probe = dict(measured[where])
            loop = probe.pop("horovod_loop")
            if where == "inside_a_machine":
                probe["seconds"] = [s * factor for s in probe["seconds"]]
            (tmp_path / folder / run).mkdir(parents=True)
            (tmp_path / folder / run / "allreduce.json").write_text(json.dumps(probe))
            (tmp_path / f"horovod_loop_{where}" / run).mkdir(parents=True)
            (tmp_path / f"horovod_loop_{where}" / run / "horovod_loop.json").write_text(json.dumps(loop))
        (tmp_path / "shared_memory" / run).mkdir(parents=True)
        (tmp_path / "shared_memory" / run / "shared_memory.json").write_text(json.dumps(measured["shared_memory"]))
    return tmp_path


def test_the_links_fitted_from_a_calibrations_figures_are_the_ones_it_wrote():
    from whatif.lab.calibrate import fit_links

    kept = yaml.safe_load(FRESH_LINKS.read_text())
    measured = dict(kept["measured"])
    fitted = fit_links(400.0, measured, measured.pop("shared_memory"))
    for key in ("intra_node", "inter_node", "shared_memory"):
        assert fitted[key] == kept[key]


def test_each_kept_run_of_a_calibration_gives_its_own_links(tmp_path):
    from whatif.lab.calibrate import calibrations_of_runs

    runs = calibrations_of_runs(kept_calibration(tmp_path), 400.0)
    assert len(runs) == 2
    first, second = (float(r["intra_node"]["bandwidth"].removesuffix("MB/s")) for r in runs)
    assert second == pytest.approx(first / 1.3, rel=0.01)
    assert runs[0]["inter_node"] == runs[1]["inter_node"]
    assert calibrations_of_runs(tmp_path / "nothing", 400.0) == []


def calibrated_scenario(tmp_path: Path, runs: list) -> Path:
    links = yaml.safe_load(FRESH_LINKS.read_text())
    links["runs"] = runs
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "links.yaml").write_text(yaml.safe_dump(links))
    doc = {"trace": str(REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz"),
           "cluster": {"machines": 1, "gpus_per_machine": 2, "links": "links.yaml"}, "framework": "horovod"}
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "scenario.yaml"


def test_an_interval_on_calibrated_links_holds_every_runs_prediction_and_keeps_its_centre(tmp_path):
    from whatif.lab.calibrate import calibrations_of_runs
    from whatif.scenario import Scenario

    runs = [{k: v for k, v in r.items() if k != "measured"}
            for r in calibrations_of_runs(kept_calibration(tmp_path / "calibration"), 400.0)]
    with_runs = Scenario.from_file(calibrated_scenario(tmp_path, runs))
    assert len(with_runs.points[0].calibrations) == 2
    row = predict(with_runs.request()).results.iloc[0]
    without = predict(Scenario.from_file(calibrated_scenario(tmp_path / "none", [])).request()).results.iloc[0]
    assert row["iteration_ms"] == without["iteration_ms"]
    assert row["iteration_ms_low"] <= without["iteration_ms_low"] and row["iteration_ms_high"] >= without["iteration_ms_high"]
    assert row["iteration_ms_high"] > without["iteration_ms_high"]  # the run of slower loopback predicts slower


def captured_in_processes(tmp_path: Path, factors) -> Path:
    """The bundled transformer's capture, noted as one of several processes whose plain steps
    were ``factors`` times its own (as the lab's capture notes its three)."""
    import shutil

    from whatif.collectors.bundle import read_bundle, record_processes

    bundle = tmp_path / "transformer.bundle"
    shutil.copytree(REPO / "data" / "transformer_cpu.bundle", bundle)
    own = float(np.median(read_bundle(bundle).unprofiled_step_ms))
    record_processes(bundle, [own * f for f in factors])
    return bundle


def test_other_capture_processes_widen_the_interval_to_their_predictions_and_keep_its_centre(tmp_path):
    alone = predict(Request(REPO / "data" / "transformer_cpu.bundle"))
    several = predict(Request(captured_in_processes(tmp_path, [0.8, 1.0, 1.25])))
    assert several.iteration_ms == pytest.approx(alone.iteration_ms, rel=1e-12)
    assert len(several.processes) == 2  # its own process is not predicted twice
    slow, fast = sorted(p.iteration_ms for p in several.processes)[::-1]
    assert slow > 1.15 * alone.iteration_ms and fast < 0.85 * alone.iteration_ms
    low, high = several.iteration_interval
    assert low <= fast and high >= slow
    assert (low, high) != alone.iteration_interval


def test_a_cluster_rows_interval_holds_the_other_processes_predictions(tmp_path):
    from whatif.scenario import Scenario

    def row(trace):
        doc = {"trace": str(trace), "cluster": {"machines": 2, "gpus_per_machine": 1, "intra_node": "nvlink2", "inter_node": "10gbe"},
               "framework": "ddp"}
        return predict(Scenario.from_dict(doc, base_dir=tmp_path).request()).results.iloc[0]

    alone = row(REPO / "data" / "transformer_cpu.bundle")
    several = row(captured_in_processes(tmp_path, [1.0, 1.3]))
    assert several["iteration_ms"] == pytest.approx(alone["iteration_ms"], rel=1e-12)
    # the bundled transformer has two steady steps, so no interval of its own: its central value
    # counts as one (report/intervals.py, widened), and the slower process's prediction the other
    own_low = alone["iteration_ms_low"] if math.isfinite(alone["iteration_ms_low"]) else alone["iteration_ms"]
    own_high = alone["iteration_ms_high"] if math.isfinite(alone["iteration_ms_high"]) else alone["iteration_ms"]
    assert several["iteration_ms_low"] == pytest.approx(own_low, rel=1e-12)
    assert several["iteration_ms_high"] > 1.1 * own_high


def test_a_links_file_whose_runs_are_not_links_is_refused_with_one_line(tmp_path):
    from whatif.scenario import Scenario, ScenarioError

    with pytest.raises(ScenarioError, match=r"cluster\.links: .*runs: expected a list of links"):
        Scenario.from_file(calibrated_scenario(tmp_path, [{"bandwidth": "1GB/s"}]))


def test_a_pipelines_rebuilt_step_takes_the_traced_iterations_relative_interval(tmp_path):
    from whatif.scenario import Scenario

    doc = {"trace": str(REPO / "data" / "transformer_cpu.bundle"),
           "cluster": {"machines": 1, "gpus_per_machine": 2, "intra_node": {"bandwidth": "40Gbps", "latency": "20us"},
                       "inter_node": {"bandwidth": "10Gbps", "latency": "50us"}},
           "framework": "ddp",
           "parallelism": {"data": 1, "pipeline": {"stages": 2, "microbatches": 4}, "units": r"blocks\.\d+"}}
    prediction = predict(Scenario.from_dict(doc, name="pipeline").request())
    row = prediction.results.iloc[0]
    low, high = prediction.iteration_interval
    # the bundle has two steady steps: no interval for the traced worker, and none borrowed
    assert math.isnan(low) and math.isnan(high)
    assert math.isnan(row["iteration_ms_low"]) and math.isnan(row["iteration_ms_high"])


def test_a_rebuilt_step_borrows_the_reference_interval_relative_to_its_central_value():
    from whatif.report.intervals import relative_interval

    assert relative_interval(300.0, 100.0, (90.0, 120.0)) == pytest.approx((270.0, 360.0))
    assert all(math.isnan(x) for x in relative_interval(300.0, 100.0, (math.nan, math.nan)))


# -- bench/interval_coverage.py ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def coverage_bench(bench_script):
    return bench_script("interval_coverage")


def test_the_bench_reads_a_validation_grid_and_reports_points_it_cannot_predict_again(coverage_bench, tmp_path):
    grid = REPO / "docs" / "validation" / "fresh" / "validation.csv"
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "validation.csv").write_text(grid.read_text())
    points = coverage_bench.campaign_points(tmp_path / "grid")
    assert len(points) == 27 and points[0]["label"] == "vgg 1x1 (one machine) single"
    assert points[0]["runs_ms"] == [142.08, 144.96, 145.91]
    rows = coverage_bench.check_campaigns([tmp_path / "grid"], tmp_path / "out")
    assert len(rows) == 27 and rows["status"].str.startswith("not predicted: FileNotFoundError").all()


def test_the_width_one_interval_for_all_needs_covers_that_share_of_points(coverage_bench):
    central = np.full(20, 100.0)
    measured = 100.0 * np.exp(np.linspace(-0.1, 0.1, 20))
    width = coverage_bench.needed_width_pct(central, measured, 0.85)
    h = math.asinh(width / 200.0)  # width = 100 (e^h - e^-h) = 200 sinh(h)
    inside = np.abs(np.log(measured / central)) <= h + 1e-12
    assert inside.mean() >= 0.85 and (np.abs(np.log(measured / central)) < h - 1e-3).mean() < 0.85


def test_the_union_of_merged_blocks_and_more_intervals_is_the_union_of_all():
    """cluster_breakdown merges the worker's busy intervals once and adds the network's to their
    blocks: the same blocks, to the bit, as merging every interval at once (touching intervals,
    of zero length and repeated ends included)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        starts = np.round(rng.uniform(0, 100, 300), 1)
        ends = starts + np.round(rng.exponential(2.0, 300), 1) * (rng.random(300) > 0.1)
        some = rng.random(300) < 0.7
        first = IntervalUnion(starts[some], ends[some])
        over_blocks = IntervalUnion(np.r_[first.start, starts[~some]], np.r_[first.end, ends[~some]])
        at_once = IntervalUnion(np.r_[starts[some], starts[~some]], np.r_[ends[some], ends[~some]])
        np.testing.assert_array_equal(over_blocks.start, at_once.start)
        np.testing.assert_array_equal(over_blocks.end, at_once.end)
        lo, hi = sorted(rng.uniform(0, 110, 2))
        assert over_blocks.within(lo, hi) == at_once.within(lo, hi)
