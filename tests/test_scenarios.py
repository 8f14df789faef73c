"""Scenario files (``Scenario.from_file``) and what the pipeline (``predict``) answers for them.

A scenario names a trace and a cluster, or a grid of them; every mistake in one is a single line
that names the file and the key, with exit status 2 from ``whatif predict``. Scenario files are
written into the test's folder, with absolute trace paths unless the test is about relative ones.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import whatif.pipeline
from trace_corpus import A100_DDP2, BUNDLED, BUNDLED_TRACE, RESNET50
from whatif.cli import main
from whatif.pipeline import predict
from whatif.report.iterations import steady_median
from whatif.scenario import Scenario, ScenarioError

CLUSTER = "cluster: {machines: 2, gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe}\n"


def write_scenario(folder: Path, text: str, name: str = "scenario.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture
def cached_loading(monkeypatch, traces):
    """``predict`` gets each trace's study from the session cache instead of parsing the
    file again (it reads nothing else from the trace file)."""
    bundled = BUNDLED_TRACE.resolve()

    class CachedStudies:
        @staticmethod
        def from_trace(path, iteration=None):
            assert iteration is None
            path = Path(path).resolve()
            name = BUNDLED if path == bundled else path.relative_to(traces.shared_root.resolve()).as_posix()
            return traces.study(name)

    monkeypatch.setattr(whatif.pipeline, "TraceStudy", CachedStudies)


# -- grids ---------------------------------------------------------------------------------------


def test_the_minimal_scenario_of_the_issue_is_a_grid_of_24_clusters(tmp_path):
    scenario = Scenario.from_file(write_scenario(tmp_path, (
        f"trace: {BUNDLED_TRACE}\n"
        "cluster:\n"
        "  machines: [1, 2, 3, 4]\n"
        "  gpus_per_machine: [1, 2]\n"
        "  intra_node: nvlink2\n"
        "  inter_node: {bandwidth: [10Gbps, 20Gbps, 40Gbps], latency: 5us}\n"
    )))
    points = {(p.cluster.machines, p.cluster.gpus_per_machine, p.inter_node_gbps) for p in scenario.points}
    assert len(scenario.points) == 24
    assert points == {(m, g, b) for m in (1, 2, 3, 4) for g in (1, 2) for b in (10.0, 20.0, 40.0)}
    assert {(p.framework, p.policy) for p in scenario.points} == {("horovod", "fifo")}, "the defaults"
    assert scenario.trace == BUNDLED_TRACE
    assert scenario.gradient_total is None and scenario.gradient_sizes is None, "gradients from the trace"


def test_frameworks_policies_and_link_presets_multiply_the_grid(tmp_path):
    scenario = Scenario.from_file(write_scenario(tmp_path, (
        f"trace: {BUNDLED_TRACE}\n"
        "cluster: {machines: [2, 4], gpus_per_machine: 8, intra_node: nvlink2, inter_node: [10gbe, 25gbe, 100gbe]}\n"
        "framework: [horovod, ddp, ps]\n"
        "policy: [fifo, p3]\n"
    )))
    assert len(scenario.points) == 2 * 3 * 3 * 2
    assert {round(p.inter_node_gbps) for p in scenario.points} == {10, 25, 100}
    assert {p.framework for p in scenario.points} == {"horovod", "ddp", "ps"}


def test_framework_options_take_units(tmp_path):
    scenario = Scenario.from_file(write_scenario(tmp_path, (
        f"trace: {BUNDLED_TRACE}\n{CLUSTER}"
        "framework_options: {cycle_time: 2ms, bucket_cap: 10MB, first_bucket: 1MiB, fusion_buffer: 32MB,"
        " partition: 2MB, slice: 512KB}\n"
        "stragglers: [{machine: 1, slowdown: 1.5}]\n"
        "gradients: {total: 80MB}\n"
    )))
    options = scenario.options
    assert options.cycle_time_us == 2000
    assert options.bucket_cap_bytes == 10e6 and options.first_bucket_bytes == 2**20
    assert options.fusion_buffer_bytes == 32e6 and options.partition_bytes == 2e6 and options.slice_bytes == 512e3
    assert [(s.machine, s.slowdown) for s in scenario.stragglers] == [(1, 1.5)]
    assert scenario.gradient_total == 80e6


def test_a_calibrated_links_file_brings_the_shared_memory_it_measured(tmp_path):
    (tmp_path / "lab.yaml").write_text(
        "intra_node: {bandwidth: 1GB/s, latency: 60us}\ninter_node: {bandwidth: 400Mbps, latency: 0us}\n"
        "shared_memory: {among: cluster, core_bandwidth: 42GB/s, total_bandwidth: 50GB/s, compute: 1.02}\n"
    )
    path = write_scenario(tmp_path, GOOD_TRACE + "cluster: {machines: [1, 2], gpus_per_machine: 1, links: lab.yaml}\n")
    points = Scenario.from_file(path).points
    assert [p.cluster.workers_sharing_memory for p in points] == [1, 2], "the lab's machines share one box"
    assert all(p.cluster.shared_memory.compute_slowdown == 1.02 for p in points)


def test_a_cluster_named_by_its_machine_keeps_the_machines_gpus_and_nccl(tmp_path):
    path = write_scenario(tmp_path, GOOD_TRACE + "cluster: {machine: dgx_h100, machines: [1, 2, 4], nccl: {protocol: simple}}\n")
    scenario = Scenario.from_file(path)
    assert [(p.cluster.machines, p.cluster.gpus_per_machine, p.cluster.backend) for p in scenario.points] == [
        (1, 8, "nccl"), (2, 8, "nccl"), (4, 8, "nccl")]
    assert all(p.cluster.fabric.nics_per_machine == 8 and p.cluster.fabric.calibration.protocol == "simple"
               for p in scenario.points)
    assert scenario.points[0].inter_node_gbps == pytest.approx(8 * 400), "the machine's NICs together"
    assert scenario.collective is None, "NCCL chooses"


def test_a_cluster_file_names_the_cluster_and_the_scenario_changes_what_it_gives(tmp_path):
    """``cluster: FILE`` (what ``whatif calibrate nccl-tests --out`` writes, or a scenario) or
    ``cluster: {file: FILE, ...}``: the file's cluster with the scenario's keys in place of its
    own, lists making a grid, a mapping changing only the keys it names."""
    (tmp_path / "calibrated.yaml").write_text("machine: hgx_h100\nmachines: 2\nnccl: {version: 2.25.1, protocol: simple}\n")
    (tmp_path / "other.yaml").write_text(GOOD_TRACE + "cluster: calibrated.yaml\n")
    as_is = Scenario.from_file(write_scenario(tmp_path, GOOD_TRACE + "cluster: calibrated.yaml\n"))
    assert [(p.cluster.machines, p.cluster.fabric.calibration.version) for p in as_is.points] == [(2, (2, 25, 1))]
    grid = Scenario.from_file(write_scenario(
        tmp_path, GOOD_TRACE + "cluster: {file: calibrated.yaml, machines: [8, 64], nccl: {algorithm: ring}}\n"))
    assert [p.cluster.machines for p in grid.points] == [8, 64]
    assert all(p.cluster.fabric.calibration.version == (2, 25, 1) and p.cluster.fabric.calibration.protocol == "simple"
               and p.cluster.fabric.calibration.algorithm == "ring" for p in grid.points)
    # a calibration's measured constants list the tables they were fitted on: data, not a grid
    (tmp_path / "fitted.yaml").write_text("machine: hgx_h100\nmachines: 1\nnccl:\n  measured:\n    p2p_efficiency: 0.5\n"
                                          "    fitted_on: [a.txt, b.txt, c.txt]\n")
    fitted = Scenario.from_file(write_scenario(tmp_path, GOOD_TRACE + "cluster: {file: fitted.yaml, machines: [2, 4]}\n"))
    assert [p.cluster.machines for p in fitted.points] == [2, 4]
    assert all(p.cluster.fabric.calibration.measured.fitted_on == ("a.txt", "b.txt", "c.txt") for p in fitted.points)
    (tmp_path / "fitted.yaml").write_text("machine: hgx_h100\nnccl: {measured: {fitted_on: a.txt}}\n")
    one = Scenario.from_file(write_scenario(tmp_path, GOOD_TRACE + "cluster: fitted.yaml\n"))
    assert one.points[0].cluster.fabric.calibration.measured.fitted_on == ("a.txt",), "one name, not its letters"
    for text, message in (("cluster: missing.yaml\n", "cluster: "), ("cluster: {file: missing.yaml}\n", "cluster.file: "),
                          ("cluster: {file: other.yaml}\n", "names another file"),
                          ("cluster: {file: [a.yaml, b.yaml]}\n", "cluster.file: expected the name of one cluster file")):
        with pytest.raises(ScenarioError) as err:
            Scenario.from_file(write_scenario(tmp_path, GOOD_TRACE + text))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_the_fabric_itself_makes_a_grid_and_rows_say_which_they_are(tmp_path):
    """``machine: [dgx_h100, dgx_b200]`` or ``nccl: {algorithm: [ring, tree]}`` vary the fabric:
    each filled from its own preset, the fabric's axes varying slowest; rows of one size and
    bandwidth are told apart by a column naming only what differs (``hardware``, ``nccl``),
    which the table prints and the plot's series take."""
    from whatif.report.plots import series_labels
    from whatif.report.tables import results_table

    path = write_scenario(tmp_path, GOOD_TRACE + "cluster: {machine: [dgx_h100, dgx_b200], machines: [2, 4]}\n"
                                                 "framework: ddp\n")
    points = Scenario.from_file(path).points
    assert [(p.cluster.fabric.gpu.name, p.cluster.machines) for p in points] == [
        ("h100", 2), ("h100", 4), ("b200", 2), ("b200", 4)]
    results = predict(Scenario.from_file(path).request()).results
    assert results["hardware"].tolist() == ["dgx_h100, h100", "dgx_h100, h100", "dgx_b200, b200", "dgx_b200, b200"]
    assert results.attrs["described"] == ["hardware"] and "intra_node" not in results, "the links follow the hardware"
    assert "dgx_b200, b200" in results_table(results).splitlines()[3]
    assert series_labels(results)[0] == ["dgx_h100, h100"] * 2 + ["dgx_b200, b200"] * 2
    forced = write_scenario(tmp_path, GOOD_TRACE + "cluster: {machine: dgx_h100, machines: 2, nccl: {algorithm: [ring, tree]}}\n"
                                                   "framework: ddp\n", "forced.yaml")
    results = predict(Scenario.from_file(forced).request()).results
    assert results["nccl"].tolist() == ["algorithm ring", "algorithm tree"]
    assert [c.split("/")[0] for c in results["collectives"]] == ["ring", "tree"]
    apart = write_scenario(tmp_path, GOOD_TRACE + "cluster: {machine: [dgx_v100, dgx_h100]}\nframework: ddp\n", "apart.yaml")
    results = predict(Scenario.from_file(apart).request()).results  # 400 and 3200 Gbps: named apart anyway
    assert results["hardware"].tolist() == ["dgx_v100, v100, 4 x ib_edr", "dgx_h100, h100, 8 x ib_ndr"]
    with pytest.raises(ScenarioError, match="cluster.machine: unknown machine 'dgx_h9000'; did you mean"):
        Scenario.from_file(write_scenario(tmp_path, GOOD_TRACE + "cluster: {machine: [dgx_h100, dgx_h9000]}\n"))


def test_gpu_variation_draws_each_gpus_own_slowdown_the_same_way_every_time(tmp_path):
    text = f"trace: {BUNDLED_TRACE}\ncluster: {{machines: [2, 4], gpus_per_machine: 2, intra_node: nvlink2, inter_node: 10gbe}}\ngpu_variation: {{sigma: 0.1, seed: 3}}\n"
    configs = Scenario.from_file(write_scenario(tmp_path, text)).request().clusters
    again = Scenario.from_file(write_scenario(tmp_path, text)).request().clusters
    assert [len(c.gpu_slowdowns) for c in configs] == [4, 8]
    assert configs[1].gpu_slowdowns == again[1].gpu_slowdowns
    assert configs[1].gpu_slowdowns[:4] == configs[0].gpu_slowdowns, "drawn in GPU order from the seed"
    assert len(set(configs[1].gpu_slowdowns)) == 8 and all(0.5 < f < 2 for f in configs[1].gpu_slowdowns)


def test_a_relative_trace_path_is_relative_to_the_scenario_file(tmp_path, monkeypatch):
    (tmp_path / "traces").mkdir()
    (tmp_path / "scenarios").mkdir()
    trace = tmp_path / "traces" / "convnet.pt.trace.json.gz"
    shutil.copyfile(BUNDLED_TRACE, trace)
    path = write_scenario(tmp_path / "scenarios", f"trace: ../traces/{trace.name}\n{CLUSTER}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    scenario = Scenario.from_file(path)
    assert scenario.trace.resolve() == trace.resolve()


def test_a_scenario_given_as_a_mapping_is_the_scenario_its_yaml_would_be(tmp_path):
    text = (f"trace: {BUNDLED_TRACE.name}\n"
            "cluster: {machines: [1, 2], gpus_per_machine: 1, intra_node: nvlink2, inter_node: [10gbe, 40gbe]}\n"
            "framework: [horovod, ddp]\n")
    shutil.copyfile(BUNDLED_TRACE, tmp_path / BUNDLED_TRACE.name)
    from_file = Scenario.from_file(write_scenario(tmp_path, text))
    from_dict = Scenario.from_dict(yaml.safe_load(text), base_dir=tmp_path, name="the grid")
    assert from_dict.trace == from_file.trace == tmp_path / BUNDLED_TRACE.name, "relative to base_dir"
    assert from_dict.points == from_file.points
    with pytest.raises(ScenarioError, match="^the grid: framework: "):
        Scenario.from_dict({**yaml.safe_load(text), "framework": "mpi"}, base_dir=tmp_path, name="the grid")


def test_any_list_in_the_cluster_is_a_grid_axis(tmp_path):
    scenario = Scenario.from_file(write_scenario(tmp_path, (
        f"{GOOD_TRACE}cluster: {{machines: 2, gpus_per_machine: [1, 2], intra_node: nvlink2,"
        " inter_node: {bandwidth: 10Gbps, latency: [5us, 50us]}}\n"
    )))
    assert [(p.cluster.gpus_per_machine, p.cluster.inter_node.latency_us) for p in scenario.points] == [
        (1, 5.0), (1, 50.0), (2, 5.0), (2, 50.0)]


def test_the_grid_varies_machines_then_gpus_whatever_order_the_file_writes_them(tmp_path):
    scenario = Scenario.from_file(write_scenario(tmp_path, (
        f"{GOOD_TRACE}cluster: {{inter_node: [10gbe, 40gbe], gpus_per_machine: [1, 2], machines: [1, 2], intra_node: nvlink2}}\n"
    )))
    order = [(p.cluster.machines, p.cluster.gpus_per_machine, round(p.inter_node_gbps)) for p in scenario.points]
    assert order == [(m, g, b) for m in (1, 2) for g in (1, 2) for b in (10, 40)]


def test_configurations_that_differ_only_beyond_the_table_get_a_column_and_a_name_each(tmp_path, cached_loading):
    path = write_scenario(tmp_path, (
        f"{GOOD_TRACE}cluster: {{machines: 1, gpus_per_machine: 2, intra_node: [nvlink2, pcie3], inter_node: 10gbe}}\n"
    ))
    outcome = predict(Scenario.from_file(path).request())
    assert len(outcome.runs) == len(outcome.results) == 2
    assert outcome.results["intra_node"].str.startswith(("nvlink2", "pcie3")).all()
    assert all("intra_node=" in label for label in outcome.runs)


def test_a_cluster_takes_every_key_the_topology_knows(tmp_path):
    (point,) = Scenario.from_file(write_scenario(tmp_path, (
        f"{GOOD_TRACE}cluster: {{machines: 1, gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe,"
        " note: measured in May, server_machines: 1}\n"
    ))).points
    assert point.cluster.server_machines == 1


# -- mistakes ------------------------------------------------------------------------------------

GOOD_TRACE = f"trace: {BUNDLED_TRACE}\n"

BAD_SCENARIOS = {
    # case: (text, the key named, more the message says)
    "typo in a top-level key": (GOOD_TRACE + CLUSTER + "framwork: ddp\n", "framwork", "'framework'"),
    "unknown cluster key": (
        GOOD_TRACE + "cluster: {machines: 2, gpus: 2, gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe}\n",
        "cluster.gpus", "gpus_per_machine",
    ),
    "typo in a preset": (
        GOOD_TRACE + "cluster: {machines: 2, gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbee}\n",
        "cluster.inter_node", "10gbe",
    ),
    "zero GPUs": (
        GOOD_TRACE + "cluster: {machines: 2, gpus_per_machine: 0, intra_node: nvlink2, inter_node: 10gbe}\n",
        "cluster.gpus_per_machine", "positive",
    ),
    "zero GPUs in a grid": (
        GOOD_TRACE + "cluster: {machines: 2, gpus_per_machine: [1, 0], intra_node: nvlink2, inter_node: 10gbe}\n",
        "cluster.gpus_per_machine", "positive",
    ),
    "negative bandwidth": (
        GOOD_TRACE + "cluster: {machines: 2, gpus_per_machine: 1, intra_node: nvlink2,"
        " inter_node: {bandwidth: [10Gbps, -40Gbps], latency: 5us}}\n",
        "cluster.inter_node.bandwidth", "-40Gbps",
    ),
    "bandwidth without a unit": (
        GOOD_TRACE + "cluster: {machines: 2, gpus_per_machine: 1, intra_node: nvlink2,"
        " inter_node: {bandwidth: '10', latency: 5us}}\n",
        "cluster.inter_node.bandwidth", "unit",
    ),
    "a negative memory bandwidth": (
        GOOD_TRACE + "cluster: {machines: 1, gpus_per_machine: 2, intra_node: nvlink2, inter_node: 10gbe,"
        " shared_memory: {among: machine, core_bandwidth: 40GB/s, total_bandwidth: -48GB/s}}\n",
        "cluster.shared_memory.total_bandwidth", "-48GB/s",
    ),
    "a trace that is not there": ("trace: no_such_trace.json.gz\n" + CLUSTER, "trace", "no_such_trace.json.gz"),
    "unknown policy": (GOOD_TRACE + CLUSTER + "policy: [fifo, lifo]\n", "policy", "lifo"),
    "unknown framework": (GOOD_TRACE + CLUSTER + "framework: mpi\n", "framework", "mpi"),
    "a straggler without a machine": (GOOD_TRACE + CLUSTER + "stragglers: [{slowdown: 2}]\n", "stragglers[0].machine", "missing"),
    "no cluster": (GOOD_TRACE, "cluster", "missing"),
    "a negative gpu variation": (GOOD_TRACE + CLUSTER + "gpu_variation: {sigma: -0.1}\n", "gpu_variation.sigma", "-0.1"),
    "a size without a known unit": (GOOD_TRACE + CLUSTER + "gradients: {total: 50 MBs}\n", "gradients.total", "MBs"),
    "a list where one value goes": (GOOD_TRACE + CLUSTER + "collective: [hierarchical]\n", "collective", "not a grid axis"),
    "a typo in a framework option": (GOOD_TRACE + CLUSTER + "framework_options: {fusion: 32MB}\n",
                                     "framework_options.fusion", "'fusion_buffer'"),
    "an optimization's bad value": (GOOD_TRACE + CLUSTER + "optimizations: [faster-gpu=twice]\n", "optimizations", "twice"),
    "a collective the link models do not run": (GOOD_TRACE + CLUSTER + "collective: tree\n", "collective", "hierarchical"),
    "a collective NCCL does not run": (
        GOOD_TRACE + "cluster: {machine: dgx_h100, machines: 2}\ncollective: hierarchical\n", "collective", "nvls_tree",
    ),
    "a typo in NCCL_ALGO": (
        GOOD_TRACE + "cluster: {machine: dgx_h100, machines: [1, 2], nccl: {algorithm: rign}}\n",
        "cluster.nccl.algorithm", "'ring'",
    ),
    "an unknown machine": (GOOD_TRACE + "cluster: {machine: dgx_h900, machines: 2}\n", "cluster.machine", "dgx_h100"),
}

NOT_A_SCENARIO = {
    "invalid YAML": ("trace: [unclosed\ncluster: {\n", "YAML"),
    "a list": (f"- {GOOD_TRACE}- {CLUSTER}", "mapping"),
    "empty": ("", "mapping"),
}


def run_predict(capsys, *argv):
    status = main(["predict", *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: int, err: str, *mentions: str):
    assert status == 2
    assert "Traceback" not in err
    assert err.startswith("whatif: error: ") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    for text in mentions:
        assert text in err, f"{text!r} not in {err!r}"


@pytest.mark.parametrize("case", list(BAD_SCENARIOS))
def test_a_mistake_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, case):
    text, key, hint = BAD_SCENARIOS[case]
    path = write_scenario(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        Scenario.from_file(path)
    assert info.value.key == key
    status, out, err = run_predict(capsys, path)
    assert_one_line_error(status, err, f"{path}: {key}: ", hint)
    assert out == ""
    assert path.read_text() == text


@pytest.mark.parametrize("case", list(NOT_A_SCENARIO))
def test_a_file_that_is_not_a_scenario_is_one_line_naming_it(tmp_path, capsys, case):
    text, says = NOT_A_SCENARIO[case]
    path = write_scenario(tmp_path, text)
    status, _, err = run_predict(capsys, path)
    assert_one_line_error(status, err, str(path), says)


def test_a_missing_scenario_is_one_line_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    status, _, err = run_predict(capsys, missing)
    assert_one_line_error(status, err, str(missing))


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]",
        "!!python/object/new:type ['Evil', !!python/tuple [], {{}}]",
    ],
)
def test_yaml_is_loaded_safely(tmp_path, capsys, tag):
    """A tag that would construct Python objects is refused, not executed."""
    marker = tmp_path / "executed"
    path = write_scenario(tmp_path, f"{GOOD_TRACE}{CLUSTER}name: {tag.format(marker=marker)}\n")
    status, _, err = run_predict(capsys, path)
    assert_one_line_error(status, err, str(path))
    assert not marker.exists()


@pytest.mark.parametrize(
    "cluster",
    [
        "{machines: [], gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe}",
        "{machines: 2, gpus_per_machine: 1, intra_node: nvlink2, inter_node: {bandwidth: [], latency: 5us}}",
    ],
    ids=["no machines", "no bandwidths"],
)
def test_an_empty_list_in_the_grid_is_a_mistake(tmp_path, capsys, cluster):
    path = write_scenario(tmp_path, f"{GOOD_TRACE}cluster: {cluster}\n")
    status, _, err = run_predict(capsys, path)
    assert_one_line_error(status, err, str(path), "cluster.")


def test_no_gradients_at_all_is_a_mistake(tmp_path):
    path = write_scenario(tmp_path, f"{GOOD_TRACE}{CLUSTER}gradients: {{total: 0MB}}\n")
    with pytest.raises(ScenarioError) as info:
        Scenario.from_file(path)
    assert info.value.key.startswith("gradients")


def test_the_command_fails_in_one_line_without_a_traceback(tmp_path):
    path = write_scenario(tmp_path, GOOD_TRACE + CLUSTER + "framwork: ddp\n")
    result = subprocess.run(
        [sys.executable, "-m", "whatif.cli", "predict", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"whatif: error: {path}: framwork: ")


# -- predicting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [RESNET50, A100_DDP2, BUNDLED])
def test_one_worker_predicts_the_replay(traces, tmp_path, cached_loading, name):
    """1x1 is the trace itself: every iteration as the replay predicts it (exactly: the same graph
    simulated the same way), so the same steady-state iteration, a speed-up of 1, no network."""
    path = write_scenario(tmp_path, (
        f"trace: {traces.path(name)}\n"
        "cluster: {machines: 1, gpus_per_machine: 1, intra_node: nvlink2, inter_node: 10gbe}\n"
        "framework: [horovod, ddp, ps]\npolicy: [fifo, p3]\n"
    ))
    outcome = predict(Scenario.from_file(path).request())
    replay = traces.study(name).replay_report()["predicted_ms"]
    assert outcome.iteration_ms == pytest.approx(steady_median(replay), rel=1e-12)
    results = outcome.results
    assert len(results) == 6
    for label, run in outcome.runs.items():
        assert len(run.comm_tasks) == 0, label
    assert np.allclose(results["iteration_ms"], steady_median(replay), rtol=1e-12, atol=0)
    assert (results["speedup"] == 1.0).all()
    assert (results["comm_ms"] == 0).all() and (results["exposed_comm_ms"] == 0).all()


def test_every_kineto_trace_is_usable_with_a_gradient_total(traces, tmp_path, cached_loading, kineto_trace):
    path = write_scenario(tmp_path, f"trace: {traces.path(kineto_trace)}\n{CLUSTER}gradients: {{total: 50MB}}\n")
    outcome = predict(Scenario.from_file(path).request())
    (row,) = outcome.results.itertuples()
    assert np.isfinite(row.iteration_ms) and row.iteration_ms > 0
    assert np.isfinite(outcome.iteration_ms) and outcome.iteration_ms > 0
    assert row.messages_per_iteration > 0 and row.comm_mb_per_iteration > 0
    assert row.speedup <= 2 * (1 + 1e-9), "two workers are at most twice as fast as one"


@pytest.mark.parametrize("name", [RESNET50, A100_DDP2])
def test_a_gradient_total_in_the_scenario_is_what_is_communicated(traces, tmp_path, cached_loading, name):
    """The scenario format documents ``gradients: {total: 100MB}`` as the alternative to the
    default "from the trace": asking what 50 MB of gradients would cost gets 50 MB."""
    path = write_scenario(tmp_path, f"trace: {traces.path(name)}\n{CLUSTER}gradients: {{total: 50MB}}\n")
    outcome = predict(Scenario.from_file(path).request())
    assert outcome.bytes_per_iteration == pytest.approx(50e6)
    assert outcome.results["comm_mb_per_iteration"].tolist() == pytest.approx([50.0])
