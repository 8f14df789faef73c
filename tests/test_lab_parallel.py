"""The lab's parallel runs: FSDP2, tensor, pipeline and expert parallelism really happen.

The specification of a real run of a parallel family is that it computes what one worker
computes for the same data, with its work split as the family splits it: every family runs 1
warm-up and 2 timed steps on the emulated cluster (on loopback where the lab cannot run) and its
losses must equal one worker's on the same batches to float rounding, its ranks must hold the
shares of the model the family gives them, and its report must carry the fields the harness
reads. The harness's settings (``lab/parallel.py``) are checked against what the runs report.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest

from trace_corpus import REPO
from whatif.lab.cluster import LabSpec, pin
from whatif.lab.parallel import (
    VARIANTS, ParallelPoint, ParallelSetting, as_record, csv_row, default_settings, point_of_record, predict_point, run_name,
    write_campaign,
)

EXAMPLES = REPO / "examples"
STEPS, WARMUP = 2, 1
LAB = os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="real runs need torch (pip install torch==2.13.0)"
)


# -- the harness's settings ---------------------------------------------------------------------


def test_each_setting_says_its_parallelism_in_the_scenarios_vocabulary():
    assert ParallelSetting("fsdp", "transformer", 2, 1, 200.0).parallelism() == {
        "data": 2, "fsdp": True, "placement": ["tensor", "data", "pipeline"], "units": r"blocks\.\d+"}
    pipeline = ParallelSetting("pp", "transformer", 2, 1, 200.0, microbatches=4, schedule="gpipe")
    assert pipeline.parallelism()["pipeline"] == {"stages": 2, "microbatches": 4, "schedule": "gpipe"}
    assert pipeline.options() == ["--microbatches", "4", "--schedule", "gpipe"]
    assert pipeline.capture_batches() == {"step": 8, "microbatch": 2}
    two_d = ParallelSetting("fsdp+tp", "transformer", 2, 2, 200.0, sequence_parallel=True)
    assert two_d.degrees() == {"data": 2, "tensor": 2, "pipeline": 1, "expert": 1}
    assert two_d.options() == ["--sequence-parallel", "--tensor", "2"]
    assert two_d.parallelism()["sequence_parallel_grads"] == "per_parameter", "DTensor reduces each norm's gradient"
    assert "sequence_parallel_grads" not in ParallelSetting("tp", "transformer", 2, 1, 200.0).parallelism()
    assert ParallelSetting("ep", "moe", 1, 2, None).degrees() == {"data": 2, "tensor": 1, "pipeline": 1, "expert": 2}


def test_the_campaign_runs_every_variant_at_every_bandwidth_and_on_loopback():
    settings = default_settings(bandwidths=(200.0, 1000.0))
    assert {s.variant for s in settings} == set(VARIANTS)
    assert len({run_name(s) for s in settings}) == len(settings)
    two_rank = [s for s in settings if s.variant != "fsdp+tp"]
    assert len(two_rank) == 3 * (len(VARIANTS) - 1)  # 2x1 at two bandwidths, 1x2 on loopback
    assert [(s.machines, s.gpus_per_machine) for s in settings if s.variant == "fsdp+tp"] == [(2, 2), (2, 2)]


def test_a_setting_the_runs_cannot_do_is_refused():
    from whatif.lab.cluster import LabError

    with pytest.raises(LabError, match="microbatches"):
        ParallelSetting("pp", "transformer", 2, 1, 200.0, batch_size=6, microbatches=4)
    with pytest.raises(LabError, match="unknown family"):
        ParallelSetting("zero", "transformer", 2, 1, 200.0)


def test_workers_beyond_the_cores_share_their_own_machines_cores():
    """A core per worker where there are enough; else each machine's workers on its own cores."""
    assert [pin(LabSpec(2, 1, 100.0), r, 2) for r in range(2)] == [[0], [1]]
    assert [pin(LabSpec(1, 2, 100.0), r, 2) for r in range(2)] == [[0], [1]]
    assert [pin(LabSpec(2, 2, 100.0), r, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert [pin(LabSpec(2, 2, 100.0), r, 4) for r in range(4)] == [[0], [1], [2], [3]]
    assert [pin(LabSpec(2, 4, 100.0), r, 4) for r in range(8)] == [[0, 1]] * 4 + [[2, 3]] * 4


def test_a_failed_setting_is_a_row_with_its_reason_and_no_numbers():
    point = ParallelPoint(ParallelSetting("tp", "transformer", 2, 1, 200.0), "failed: workers [1] failed")
    row = csv_row(point)
    assert row["status"] == "failed: workers [1] failed" and row["measured_ms"] == "" and row["predicted_ms"] == ""
    assert as_record(point)["parallelism"]["tensor"] == 2


def test_a_predictor_fills_the_prediction_and_what_it_raises_is_kept(tmp_path):
    setting = ParallelSetting("pp", "transformer", 2, 1, 200.0)
    point = ParallelPoint(setting, "ok", measured_ms=200.0, runs_ms=[200.0], spread_pct=0.0, iteration_iqr_pct=1.0,
                          captures={"step": "a", "microbatch": "b"})
    predict_point(point, lambda s, captures, work: 210.0 if set(captures) == {"step", "microbatch"} else 0.0, tmp_path)
    assert (point.predicted_ms, point.error_pct) == (210.0, pytest.approx(5.0))

    def unfinished(setting, captures, work):
        raise NotImplementedError("pipeline schedules")

    predict_point(point, unfinished, tmp_path)
    assert point.predicted_ms is None and point.error_pct is None and point.prediction_error.startswith("NotImplementedError: pipeline schedules")
    write_campaign(tmp_path, [as_record(point)])
    (back,) = json.loads((tmp_path / "parallel_validation.json").read_text())["points"]
    assert csv_row(point_of_record(back)) == csv_row(point)


def test_with_anchor_runs_the_point_is_predicted_again_at_the_boxs_speed_then(tmp_path):
    """The capture ran its plain step at 213 ms; the anchors after the runs at 190, 200 and 180:
    the box ran 213 / 190 times faster, and the predictor is asked for that host speed too."""
    setting = ParallelSetting("tp", "transformer", 2, 1, 200.0)
    point = ParallelPoint(setting, "ok", measured_ms=200.0, runs_ms=[200.0], spread_pct=0.0, iteration_iqr_pct=1.0,
                          captures={"step": "a"}, capture_plain_ms={"step": 213.0}, anchor_ms=[190.0, 200.0, 180.0])
    asked = []

    def predictor(s, captures, work, cpu_speed=1.0):
        asked.append(cpu_speed)
        return 220.0 / cpu_speed

    predict_point(point, predictor, tmp_path)
    assert asked == [1.0, pytest.approx(213.0 / 190.0)]
    assert (point.predicted_ms, point.error_pct) == (220.0, pytest.approx(10.0))
    assert point.anchored_ms == pytest.approx(220.0 * 190.0 / 213.0)
    assert point.anchored_error_pct == pytest.approx(100 * (220.0 * 190.0 / 213.0 - 200.0) / 200.0)
    row = csv_row(point)
    assert row["anchor_ms"] == "190.00;200.00;180.00" and row["anchored_ms"] == point.anchored_ms
    write_campaign(tmp_path, [as_record(point)])
    (back,) = json.loads((tmp_path / "parallel_validation.json").read_text())["points"]
    assert csv_row(point_of_record(back)) == row
    # a record from before the anchors: predicted as it was, nothing anchored
    older = ParallelPoint(setting, "ok", measured_ms=200.0, captures={"step": "a"}, capture_plain_ms={"step": 213.0})
    predict_point(older, predictor, tmp_path)
    assert older.anchored_ms is None and older.predicted_ms == 220.0


def test_the_tensor_dispatch_is_the_median_phase_difference_over_the_plans_pairs(tmp_path, monkeypatch):
    """Plain and one-rank tensor-parallel runs alternate; each phase's median difference over
    the pairs the run reports is the host time per pair, never below 0, measured once."""
    from whatif.lab import parallel

    plain = [{"forward": 60.0, "backward": 120.0, "step": 10.0}, {"forward": 55.0, "backward": 110.0, "step": 9.0},
             {"forward": 58.0, "backward": 115.0, "step": 11.0}]
    tensor = [{"forward": 84.0, "backward": 158.0, "step": 9.0}, {"forward": 77.0, "backward": 150.0, "step": 8.0},
              {"forward": 90.0, "backward": 157.0, "step": 10.5}]
    runs = fake_dispatch_runs(monkeypatch, parallel, {"single": plain, "tp": tensor}, {"tp": {"tensor_pairs": 8}})
    probe = {2: {"dist": 0.2, "dtensor": 0.8, "dtensor_gather": 0.9, "dtensor_scatter": 1.2},
             1: {"dtensor": 0.3, "dtensor_gather": 0.3, "dtensor_scatter": 0.4}}
    monkeypatch.setattr(parallel, "_probe_collectives", lambda world: probe[world])
    path = parallel.measure_tensor_dispatch("transformer", 8, True, tmp_path)
    measured = json.loads(path.read_text())
    assert [r[0] for r in runs] == ["single", "tp"] * 3 and {r[1] for r in runs} == {1}
    assert [r[3] for r in runs if r[0] == "tp"] == [True] * 3  # the plan of the setting's family
    assert measured["forward_us"] == pytest.approx(24e3 / 8)  # medians of 24, 22, 32 ms
    assert measured["backward_us"] == pytest.approx(40e3 / 8)  # of 38, 40, 42
    assert measured["step_us"] == 0.0  # -1, -1, -0.5: the library made the step no slower
    # each way's thread time on two ranks less a mesh of one's and a plain all-reduce's: 0.3, 0.4, 0.6 ms
    assert measured["collective_us"] == pytest.approx(1300.0 / 3)
    assert parallel.dispatch_block(path) == {"forward": "3000.0us", "backward": "5000.0us", "step": "0.0us",
                                             "collective": "433.3us"}
    assert parallel.measure_collective_issue(False)["collective_us"] == pytest.approx(300.0)  # the all-reduce alone

    def failing(world):
        raise parallel.LabError("the collectives probe on 2 ranks failed")

    monkeypatch.setattr(parallel, "_probe_collectives", failing)
    with pytest.raises(parallel.LabError):
        parallel.measure_tensor_dispatch("transformer", 8, False, tmp_path)
    assert not parallel.tensor_dispatch_path("transformer", 8, False, tmp_path).exists()  # no file kept without it
    assert parallel.measure_tensor_dispatch("transformer", 8, True, tmp_path) == path and len(runs) == 6  # kept


def fake_dispatch_runs(monkeypatch, parallel, phases: dict, parallelism: dict) -> list:
    """``parallel.run_job`` replaced by runs that report ``phases[framework]`` in turn (and
    ``parallelism[framework]``, where given); returns the runs made: (the run's ``--framework``,
    its workers, the job's framework, whether it asked for sequence parallelism)."""
    runs = []

    def fake_job(spec, framework, argv, out, timeout_s):
        which = argv[argv.index("--framework") + 1]
        runs.append((which, spec.workers, framework, "--sequence-parallel" in argv))
        report = {"workers": [{"phase_wall_ms": phases[which][sum(1 for r in runs if r[0] == which) - 1]}]}
        if which in parallelism:
            report["parallelism"] = parallelism[which]
        (out / "report.json").write_text(json.dumps(report))
        return parallel_job_result()

    monkeypatch.setattr(parallel, "run_job", fake_job)
    return runs


def parallel_job_result():
    from pathlib import Path

    from whatif.lab.cluster import JobResult

    return JobResult(exit_codes=[0], logs=[], out_dir=Path("."))


def test_the_moe_capture_records_its_blocks_router_experts_and_exchanges(tmp_path):
    """What the expert-parallel prediction reads from the one-worker bundle: the units and the
    experts by name, the experts' GEMMs at capacity x d_model, and where the all-to-alls go."""
    from whatif.collectors.bundle import read_bundled_trace

    bundle = tmp_path / "moe.bundle"
    completed = subprocess.run(
        [sys.executable, "-m", "whatif.cli", "collect", "--out", str(bundle), "--steps", "1", "--warmup", "3", "--",
         sys.executable, str(EXAMPLES / "moe.py")], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    trace = read_bundled_trace(bundle)
    layers = set(trace.bundle.layers["name"])
    assert {"blocks.0.moe.router", "blocks.3.moe.experts.3.fc2", "blocks.2.attention.qkv"} <= layers
    parameters = trace.bundle.parameters.set_index("name")
    assert list(parameters.loc["blocks.1.moe.experts.2.fc1.weight", "shape"]) == [512, 256]
    names = trace.events["name"].astype(str)
    assert (names == "moe.dispatch").sum() == (names == "moe.combine").sum() == 4, "one of each per block"
    capacity = math.ceil(1.25 * 2 * 8 * 64 / 4)
    gemm_inputs = [json.loads(bytes(trace.input_dims[row]))[1] for row in names.index[names == "aten::addmm"]
                   if row in trace.input_dims]
    assert gemm_inputs.count([capacity, 256]) == 4 * 4, "each expert's first layer on its capacity of tokens"


# -- real runs ------------------------------------------------------------------------------


def run_report(setting: ParallelSetting, tmp_path) -> dict:
    """The run's report: on the emulated cluster where the lab can run, else as local processes."""
    if LAB:
        from whatif.lab.validate import measure

        return measure(setting.model, setting.spec(), setting.family, tmp_path / "run", steps=STEPS, warmup=WARMUP,
                       batch_size=setting.batch_size, options=setting.options())
    report = tmp_path / "report.json"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, str(EXAMPLES / "run_distributed.py"), "--model", setting.model, "--framework",
               setting.family, "--steps", str(STEPS), "--warmup", str(WARMUP), "--batch-size", str(setting.batch_size),
               *setting.options()]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(setting.world),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen(command + (["--json", str(report)] if rank == 0 else []), env={**env, "RANK": str(rank)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in range(setting.world)]
    try:
        outputs = [w.communicate(timeout=300)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, output in zip(workers, outputs):
        assert w.returncode == 0, output[-4000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def examples():
    """The example modules, imported as the runner imports them."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield {name: importlib.import_module(name) for name in ("parallel", "transformer", "moe", "profiled_training")}
    finally:
        sys.path.remove(str(EXAMPLES))


def test_fsdp2s_dispatch_is_the_median_phase_difference_over_its_units(tmp_path, monkeypatch):
    """Plain runs and FSDP2 in a world of one alternate, five each; each phase's median
    difference over the units the run reports is FSDP2's host time per unit, measured once."""
    from whatif.lab import parallel

    plain = [{"forward": 60.0, "backward": 120.0, "step": 10.0}, {"forward": 70.0, "backward": 135.0, "step": 13.0},
             {"forward": 62.0, "backward": 122.0, "step": 10.0}, {"forward": 67.0, "backward": 126.0, "step": 11.0},
             {"forward": 63.0, "backward": 119.0, "step": 10.0}]
    sharded = [{"forward": 80.0, "backward": 166.0, "step": 19.0}, {"forward": 67.0, "backward": 141.0, "step": 17.0},
               {"forward": 79.0, "backward": 162.0, "step": 18.0}, {"forward": 70.0, "backward": 145.0, "step": 17.0},
               {"forward": 63.0, "backward": 140.0, "step": 15.0}]
    runs = fake_dispatch_runs(monkeypatch, parallel, {"single": plain, "fsdp": sharded}, {"fsdp": {"fsdp_units": 5}})
    path = parallel.measure_fsdp_dispatch("transformer", 8, tmp_path)
    measured = json.loads(path.read_text())
    assert [r[0] for r in runs] == ["single", "fsdp"] * 5 and {r[1] for r in runs} == {1}
    assert [r[2] for r in runs if r[0] == "fsdp"] == ["fsdp"] * 5  # FSDP2's own rendezvous
    assert measured["forward_us"] == pytest.approx(3e3 / 5)  # median of 20, -3, 17, 3, 0 ms
    assert measured["backward_us"] == pytest.approx(21e3 / 5)  # of 46, 6, 40, 19, 21
    assert measured["step_us"] == pytest.approx(6e3 / 5)  # of 9, 4, 8, 6, 5
    assert parallel.dispatch_block(path) == {"forward": "600.0us", "backward": "4200.0us", "step": "1200.0us"}
    assert parallel.measure_fsdp_dispatch("transformer", 8, tmp_path) == path and len(runs) == 10  # kept


def whole_model_bytes(examples, model: str, experts_only: bool = False) -> int:
    import torch

    torch.manual_seed(0)
    built, _ = examples[model].build()
    return sum(p.numel() * p.element_size() for name, p in built.named_parameters()
               if not experts_only or ".experts." in name)


SETTINGS = {
    "fsdp": ParallelSetting("fsdp", "transformer", 2, 1, 1000.0),
    "tp+sp": ParallelSetting("tp", "transformer", 2, 1, 1000.0, sequence_parallel=True),
    "pp-gpipe": ParallelSetting("pp", "transformer", 2, 1, 1000.0, schedule="gpipe"),
    "pp-1f1b": ParallelSetting("pp", "transformer", 1, 2, None, schedule="1f1b"),
    "ep": ParallelSetting("ep", "moe", 2, 1, 1000.0),
    "fsdp+tp": ParallelSetting("fsdp+tp", "transformer", 2, 2, 1000.0),
}


@needs_torch
@pytest.mark.parametrize("variant", list(SETTINGS))
def test_a_parallel_run_computes_what_one_worker_computes(variant, examples, tmp_path):
    setting = SETTINGS[variant]
    report = run_report(setting, tmp_path)
    parallel = examples["parallel"]
    # the report: the fields the harness and the predictions read
    assert (report["model"], report["framework"], report["world_size"]) == (setting.model, setting.family, setting.world)
    assert {k: report["parallelism"][k] for k in ("data", "tensor", "pipeline", "expert")} == setting.degrees()
    workers = report["workers"]
    assert [w["rank"] for w in workers] == list(range(setting.world))
    phases = {"schedule", "step"} if setting.family == "pp" else {"forward", "backward", "step"}
    for w in workers:
        assert len(w["iteration_ms"]) == STEPS and all(ms > 0 for ms in w["iteration_ms"])
        assert set(w["phase_wall_ms"]) == phases
        assert len(w["losses"]) == WARMUP + STEPS
    # the same losses as one worker on the same batches: the parallelism is real and exact
    expected = parallel.reference_losses(examples[setting.model].build, setting.degrees()["data"], WARMUP + STEPS,
                                         setting.batch_size)
    assert parallel.data_parallel_losses(report) == pytest.approx(expected, rel=1e-5)
    # and each rank holds its share of the model
    held = [w["parameter_bytes"] for w in workers]
    whole = whole_model_bytes(examples, setting.model)
    if setting.family in ("fsdp", "pp"):
        assert sum(held) == whole, "FSDP shards, and pipeline stages split, the parameters without overlap"
    elif setting.family == "ep":
        experts = whole_model_bytes(examples, "moe", experts_only=True)
        assert held == [whole - experts + experts // setting.world] * setting.world
    else:  # tensor parallel blocks: every rank holds less than the whole, and FSDP+TP less again
        assert all(h < whole for h in held) and len(set(held)) == 1
    if setting.family == "fsdp":  # what measure_fsdp_dispatch divides by: the blocks, then the root
        built, _ = examples[setting.model].build()
        assert report["parallelism"]["fsdp_units"] == len(parallel.blocks_of(built)) + 1
    if setting.family == "pp":
        last = workers[-1]["losses"]
        assert all(math.isnan(x) for x in workers[0]["losses"]) and not any(math.isnan(x) for x in last)
