"""Gloo's collectives as the lab calibrates them (``topology/collectives.py``, ``lab/calibrate.py``).

A reduce-scatter on Gloo is an all-reduce of the whole tensor (``ProcessGroupGloo`` clones the
input, all-reduces it and copies its chunk out), so it costs what the all-reduce costs. Each op
may carry figures of its own on a link (``collectives:`` in the links YAML), which price that op
and nothing else; a links YAML without them means what it meant. The calibration's fit reads
probe times through each op's own closed form, so the topology gives back the times measured.
"""

from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import numpy as np
import pytest

from whatif.lab.calibrate import combine_runs, fit_collectives, fit_floor, op_shape, runs_apart
from whatif.topology import Cluster, Link, TopologyError, collective_cost, collective_plan
from whatif.topology.cluster import CALIBRATED_OPS
from whatif.topology.collectives import allreduce_time_us
from whatif.topology.yamlfile import read_yaml
from whatif.sim.parallel.pipeline import one_way

NIC = {"bandwidth": "200Mbps", "latency": "70us", "efficiency": 0.94}
LOOPBACK = {"bandwidth": "1300MB/s", "latency": "2000us", "efficiency": 1.0}


def lab(machines: int, gpus: int, nic: dict = NIC, loopback: dict = LOOPBACK) -> Cluster:
    return Cluster(machines, gpus, Link.from_config(loopback, "intra_node"), Link.from_config(nic, "inter_node"))


@pytest.mark.parametrize("machines, gpus", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_a_gloo_reduce_scatter_costs_the_all_reduce_of_the_whole_tensor(machines, gpus):
    cluster = lab(machines, gpus)
    for size in (0.0, 1e6, 16e6):
        cost = collective_cost(cluster, "reduce_scatter", size)
        assert cost.algorithm == "ring_allreduce"
        assert cost.time_us == pytest.approx(allreduce_time_us(cluster, size))
        scatter, reduce = collective_plan(cluster, "reduce_scatter", size), collective_plan(cluster, "all_reduce", size)
        assert len(scatter.steps) == len(reduce.steps)
        for a, b in zip(scatter.steps, reduce.steps):
            for field in ("src", "dst", "nbytes"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_the_all_gather_is_half_the_ring_all_reduce():
    # two machines: one step of S/2 over the NIC, L + S / (2 e B)
    s = 8e6
    expected = 70.0 + s / 2 / (200e6 / 8 / 1e6 * 0.94)
    assert collective_cost(lab(2, 1), "all_gather", s).time_us == pytest.approx(expected)


def test_an_ops_own_figures_price_that_op_alone():
    nic = dict(NIC, collectives={"all_gather": {"latency": "500us", "efficiency": 0.5},
                                 "send_recv": {"bandwidth": "100Mbps"}})
    plain, calibrated = lab(2, 1), lab(2, 1, nic)
    s = 4e6
    assert collective_cost(calibrated, "all_gather", s).time_us == pytest.approx(500.0 + s / 2 / (25.0 * 0.5))
    # send/recv keeps the link's latency and efficiency, with its own bandwidth
    assert collective_cost(calibrated, "send_recv", s).time_us == pytest.approx(70.0 + s / (12.5 * 0.94))
    for op in ("all_reduce", "reduce_scatter", "all_to_all"):
        assert collective_cost(calibrated, op, s).time_us == collective_cost(plain, op, s).time_us


def test_a_links_yaml_without_op_figures_means_what_it_meant():
    link = Link.from_config(NIC, "inter_node")
    assert link.collectives == ()
    for op in CALIBRATED_OPS:
        assert link.for_op(op) is link


@pytest.mark.parametrize("entry, field", [
    ({"allgather": {"latency": "1us"}}, "collectives.allgather"),
    ({"all_gather": {"latency": "1us", "speed": 2}}, "collectives.all_gather.speed"),
    ({"all_gather": {"efficiency": 1.5}}, "collectives.all_gather.efficiency"),
    ({"all_gather": 3}, "collectives.all_gather"),
])
def test_a_bad_op_entry_is_refused_naming_its_field(entry, field):
    with pytest.raises(TopologyError) as err:
        Link.from_config(dict(NIC, collectives=entry), "inter_node")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_op_shape_reads_the_closed_forms():
    assert op_shape("all_gather", 2, 1) == pytest.approx((1.0, 0.5))
    assert op_shape("reduce_scatter", 2, 1) == pytest.approx((2.0, 1.0))  # Gloo's all-reduce
    assert op_shape("all_to_all", 1, 2) == pytest.approx((1.0, 0.5))
    assert op_shape("send_recv", 2, 1) == pytest.approx((1.0, 1.0))


@pytest.mark.parametrize("machines, gpus, nominal", [(2, 1, 200e6 / 8), (1, 2, None)])
def test_the_fit_gives_back_the_times_it_was_fitted_to(machines, gpus, nominal):
    """Times made by each op's closed form at a known latency and rate (different per op, as a
    real probe finds them) are fitted, written as the links YAML's entries, and priced again."""
    sizes = [64e3, 256e3, 1e6, 4e6, 16e6]
    rates = {"all_gather": 20e6, "reduce_scatter": 22e6, "all_to_all": 18e6, "send_recv": 23e6, "send": 24e6}  # bytes/s
    latency_s = {"all_gather": 3e-4, "reduce_scatter": 2e-4, "all_to_all": 5e-4, "send_recv": 1e-4, "send": 2e-5}
    measured = {"sizes_bytes": sizes}
    for op in CALIBRATED_OPS:
        steps, per_byte = op_shape(op, machines, gpus)
        measured[op] = [steps * latency_s[op] + per_byte * s / rates[op] for s in sizes]
    fitted = fit_collectives(measured, machines, gpus, nominal)
    base = NIC if nominal else LOOPBACK
    link = dict(base, collectives=fitted)
    cluster = lab(machines, gpus, nic=link) if nominal else lab(machines, gpus, loopback=link)
    for op in CALIBRATED_OPS:
        # a one-way send prices a pipeline's send_recv (sim/parallel/pipeline.py's one_way)
        priced, as_op = (one_way(cluster), "send_recv") if op == "send" else (cluster, op)
        for size, seconds in zip(sizes, measured[op]):
            assert collective_cost(priced, as_op, size).time_us == pytest.approx(seconds * 1e6, rel=2e-3)


def test_a_probe_record_from_before_the_one_way_send_fits_without_it():
    sizes = [64e3, 256e3, 1e6, 4e6, 16e6]
    measured = {"sizes_bytes": sizes, **{op: [1e-3 + s / 20e6 for s in sizes] for op in CALIBRATED_OPS if op != "send"}}
    fitted = fit_collectives(measured, 2, 1, 200e6 / 8)
    assert "send" not in fitted and set(fitted) == set(CALIBRATED_OPS) - {"send"}
    cluster = lab(2, 1, nic=dict(NIC, collectives=fitted))
    assert one_way(cluster) is cluster  # its send_recv prices a pipeline's transfers, as it did


def test_a_pipeline_prices_its_one_way_transfers_where_the_links_time_them():
    exchange = {"send_recv": {"latency": "3500us", "efficiency": 1.0}}
    cluster = lab(1, 2, loopback=dict(LOOPBACK, collectives=exchange))
    both = lab(1, 2, loopback=dict(LOOPBACK, collectives={**exchange, "send": {"latency": "300us"}}))
    size = 131e3
    assert collective_cost(one_way(cluster), "send_recv", size).time_us == collective_cost(cluster, "send_recv", size).time_us
    one = collective_cost(one_way(both), "send_recv", size).time_us
    assert one == pytest.approx(300 + size / 1300.0) and one < collective_cost(both, "send_recv", size).time_us
    assert collective_cost(both, "send_recv", size).time_us == pytest.approx(3500 + size / 1300.0)  # the link's own


def test_a_probe_run_several_times_gives_the_median_of_every_figure():
    """Lists by position (each size's median), single figures alike; what names the run (its
    sizes, its world) is kept."""
    runs = [
        {"sizes_bytes": [1, 2], "seconds": [0.1, 1.0], "compute_rate_alone": 900.0, "world_size": 2,
         "all_gather": [1.0, 5.0]},
        {"sizes_bytes": [1, 2], "seconds": [0.3, 2.0], "compute_rate_alone": 3000.0, "world_size": 2,
         "all_gather": [3.0, 4.0]},
        {"sizes_bytes": [1, 2], "seconds": [0.2, 1.5], "compute_rate_alone": 1000.0, "world_size": 2,
         "all_gather": [2.0, 9.0]},
    ]
    combined = combine_runs(runs)
    assert combined == {"sizes_bytes": [1, 2], "seconds": [0.2, 1.5], "compute_rate_alone": 1000.0,
                        "world_size": 2, "all_gather": [2.0, 5.0]}
    assert np.isfinite(combined["all_gather"]).all()


def test_the_collectives_probe_prices_a_two_mode_op_at_its_mean():
    """Campaign G's 16 MB all-to-all across machines at 1000 Mbps, three runs in Gloo's two modes
    (107.8, 106.0, 69.4 ms): the median takes the slow mode, the mean the op's expected time."""
    runs = [{"sizes_bytes": [16000000], "world_size": 2, "all_to_all": [t]} for t in (0.1078, 0.1060, 0.0694)]
    assert combine_runs(runs)["all_to_all"] == [pytest.approx(0.1060)]
    assert combine_runs(runs, np.mean)["all_to_all"] == [pytest.approx(0.0944)]


def test_the_calibration_takes_the_collectives_probes_mean_and_the_others_median(monkeypatch, tmp_path):
    from whatif.lab import calibrate
    from whatif.lab.cluster import LabSpec
    asked = {}
    monkeypatch.setattr(calibrate, "run_probe", lambda *a, **kw: asked.setdefault(a[6], kw.get("combine", np.median)))
    calibrate.measure_collectives(LabSpec(2, 1, 200), tmp_path)
    calibrate.measure(LabSpec(2, 1, 200), tmp_path)
    calibrate.measure_floor(LabSpec(2, 1, 200), tmp_path)
    assert asked == {"the collectives probe": np.mean, "calibration workers": np.median,
                     "the small all-reduce probe": np.median}


def test_a_probe_whose_runs_lie_far_apart_says_how_its_links_combine_them(monkeypatch, tmp_path):
    """The warning names the figure the links took, the mean for the collectives probe."""
    from types import SimpleNamespace

    from whatif.lab import calibrate
    from whatif.lab.cluster import LabSpec
    seconds = iter((0.1078, 0.1060, 0.0694))

    def fake_job(spec, framework, argv, run_dir, timeout_s, env):
        run_dir.mkdir(parents=True)
        record = {"sizes_bytes": [16000000], "world_size": 2, "all_to_all": [next(seconds)]}
        (run_dir / "collectives.json").write_text(json.dumps(record))
        return SimpleNamespace(exit_codes=[0, 0])

    said = []
    monkeypatch.setattr(calibrate, "run_job", fake_job)
    monkeypatch.setattr(calibrate, "progress", said.append)
    combined = calibrate.measure_collectives(LabSpec(2, 1, 1000), tmp_path)
    assert combined["all_to_all"] == [pytest.approx(0.0944)]
    warning = [line for line in said if line.startswith("warning:")]
    assert len(warning) == 1 and "all_to_all at 16 MB" in warning[0]
    assert "the links take each size's mean," in warning[0]


def test_probe_runs_far_apart_are_named_by_op_and_size():
    """Campaign G's calibration at 1000 Mbps (2026-12-03, docs/validation/parallel.md): the
    collectives probe across machines, seconds of three runs; the 16 MB all-to-all fell into
    Gloo's two modes and its median priced the op at 0.60 of the link."""
    sizes = [64000, 256000, 1000000, 4000000, 16000000]
    runs = [{"sizes_bytes": sizes, "world_size": 2, "all_to_all": a2a, "all_reduce": ar}
            for a2a, ar in (([0.00017, 0.00059, 0.00601, 0.01969, 0.10779], [0.00428, 0.00206, 0.00797, 0.03319, 0.13361]),
                            ([0.00013, 0.00042, 0.00404, 0.01986, 0.10602], [0.00030, 0.00190, 0.00810, 0.03290, 0.13420]),
                            ([0.00023, 0.00027, 0.00778, 0.02028, 0.06935], [0.00025, 0.00200, 0.00820, 0.03310, 0.13360]))]
    assert runs_apart(runs) == ["all_to_all at 16 MB: 69 to 108 ms"]  # 1 MB's spread is the host's: not named
    assert runs_apart(runs, from_bytes=1e6) == ["all_to_all at 1 MB: 4 to 8 ms", "all_to_all at 16 MB: 69 to 108 ms"]
    assert runs_apart(runs[:2]) == []


# -- the all-reduce's floor (``Link.floors_us``) -------------------------------------------------

FLOOR_RECORD = Path(__file__).resolve().parents[1] / "docs" / "validation" / "parallel" / "2026-11-28_floor"


def test_a_links_floor_holds_small_all_reduces_up_and_leaves_large_ones_to_the_line():
    floored = lab(2, 1, nic=dict(NIC, floor="2.5ms"))
    plain = lab(2, 1)
    for size in (1e3, 16e3):
        assert plain.inter_node.floor_us("all_reduce") == 0.0 and collective_cost(plain, "all_reduce", size).time_us < 2500
        assert collective_cost(floored, "all_reduce", size).time_us == pytest.approx(2500.0)
    large = 16e6
    assert collective_cost(floored, "all_reduce", large).time_us == collective_cost(plain, "all_reduce", large).time_us > 2500
    # the floor is the all-reduce's: the other ops, the reduce-scatter (Gloo's all-reduce inside) too, keep theirs
    for op in ("all_gather", "send_recv", "all_to_all", "reduce_scatter"):
        assert collective_cost(floored, op, 1e3).time_us == collective_cost(plain, op, 1e3).time_us
    # one worker sends nothing, floor or not
    assert collective_cost(lab(1, 1, nic=dict(NIC, floor="2.5ms")), "all_reduce", 1e3).time_us == 0.0


def test_an_ops_floor_is_its_own_and_a_one_way_send_brings_its_floor_to_the_pipeline():
    nic = dict(NIC, floor="2.5ms", collectives={"all_gather": {"floor": "1ms"}, "send": {"latency": "20us", "floor": "300us"}})
    cluster = lab(2, 1, nic=nic)
    assert collective_cost(cluster, "all_gather", 1e3).time_us == pytest.approx(1000.0)
    assert collective_cost(cluster, "send_recv", 1e3).time_us < 300  # the exchange has no floor of its own
    assert collective_cost(one_way(cluster), "send_recv", 1e3).time_us == pytest.approx(300.0)
    assert collective_cost(one_way(cluster), "all_reduce", 1e3).time_us == pytest.approx(2500.0)


@pytest.mark.parametrize("where, value", [("floor", "-1ms"), ("floor", "soon"), ("collectives.all_gather.floor", "-2us")])
def test_a_bad_floor_is_refused_naming_its_key(where, value):
    nic = dict(NIC, floor=value) if where == "floor" else dict(NIC, collectives={"all_gather": {"floor": value}})
    with pytest.raises(TopologyError) as err:
        Link.from_config(nic, "inter_node")
    assert err.value.key == f"inter_node.{where}"


@pytest.mark.parametrize("links", ["links_1000mbps.yaml", "links_200mbps.yaml"])
def test_the_floor_fitted_to_a_real_probe_gives_back_its_small_and_large_all_reduces(links):
    """The small all-reduce probe's record of a real calibration (the lab's box, 2026-11-28):
    across machines, the links it was written into price a 1 kB all-reduce inside the probe's
    quartiles for 1 kB in a burst, where the line alone falls below them, and a 1 MB one within
    15 % of the probe's. On loopback the line's own price of 1 kB lies above the floor, which
    then changes nothing."""
    doc = read_yaml(FLOOR_RECORD / links)
    for where, kind in (("across_machines", "inter_node"), ("inside_a_machine", "intra_node")):
        assert doc[kind]["floor"] == fit_floor(doc["measured"][where]["small_allreduce"])
    record = doc["measured"]["across_machines"]["small_allreduce"]
    nic, loopback = Link.from_config(doc["inter_node"], "inter_node"), Link.from_config(doc["intra_node"], "intra_node")
    across, inside = Cluster(2, 1, loopback, nic), Cluster(1, 2, loopback, nic)
    q1, q3 = record["burst_q1"][0] * 1e6, record["burst_q3"][0] * 1e6
    smallest, largest = record["sizes_bytes"][0], record["sizes_bytes"][-1]
    assert q1 <= collective_cost(across, "all_reduce", smallest).time_us <= q3
    unfloored = Cluster(2, 1, loopback, replace(nic, floors_us=()))
    assert collective_cost(unfloored, "all_reduce", smallest).time_us < q1
    assert collective_cost(across, "all_reduce", largest).time_us == pytest.approx(record["burst"][-1] * 1e6, rel=0.15)
    line = Cluster(1, 2, replace(loopback, floors_us=()), nic)
    assert collective_cost(inside, "all_reduce", smallest).time_us == collective_cost(line, "all_reduce", smallest).time_us


def test_a_calibration_with_the_small_all_reduce_probe_writes_each_links_floor():
    from whatif.lab.calibrate import fit_links

    doc = read_yaml(FLOOR_RECORD / "links_1000mbps.yaml")
    measured = dict(doc["measured"])
    shared, ops = measured.pop("shared_memory"), measured.pop("collectives")
    fitted = fit_links(1000.0, measured, shared, ops)
    assert fitted["inter_node"] == doc["inter_node"] and fitted["intra_node"] == doc["intra_node"]
    assert fitted["inter_node"]["floor"] == doc["inter_node"]["floor"] == "3000.5us"
    assert fitted["intra_node"]["floor"] == doc["intra_node"]["floor"]
    without = {where: {k: v for k, v in probe.items() if k != "small_allreduce"} for where, probe in measured.items()}
    assert "floor" not in fit_links(1000.0, without, shared, ops)["inter_node"]
