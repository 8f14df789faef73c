"""FSDP2 and ZeRO-1/2 on a real trace (``sim/parallel/fsdp.py``).

The bundled transformer (``data/transformer_cpu.bundle``: ``examples/transformer.py``'s
embeddings, four blocks, norm and head, captured under the capture API on one CPU core, four
profiled steps) carries the layers and parameters the units come from. The tests hold the pass
to its rules: how many collectives of which kind each unit gets per iteration, their bytes
against the bundle's parameter record, the waits and the one-unit prefetch FSDP2 imposes, and
the iteration time at the two ends of the link speed: with links infinitely fast the sharded
step is the single-process step less (d-1)/d of its optimizer, and on a slow link it grows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trace_corpus import NO_SHARED, REPO, SHARED_TRACES
from whatif import TraceStudy
from whatif.report.iterations import iteration_report
from whatif.sim.engine import simulate
from whatif.sim.graph import GPU_TASK_KINDS, EdgeKind, TaskKind
from whatif.sim.frameworks.copies import pass_rate_bytes_per_us
from whatif.sim.parallel import PASSES, Parallelism, ParallelismError
from whatif.sim.parallel.fsdp import ShardedDataParallel, apply_fsdp
from whatif.sim.parallel.units import TABLE_COLUMNS, PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, Units, find_units
from whatif.topology import Cluster, Link

BUNDLE = REPO / "data" / "transformer_cpu.bundle"
RANKS = (0, 1, 2, 3)
BLOCKS = 4  # examples/transformer.py's NUM_LAYERS
GPU_TRACE = SHARED_TRACES / "hta-ddp-resnet50" / "v100_1gpu_rank0.json.gz"  # ResNet-50 on one V100


@pytest.fixture(scope="module")
def study():
    return TraceStudy.from_trace(BUNDLE)


@pytest.fixture(scope="module")
def units(study):
    return find_units(study.graph)


def cluster(bytes_per_us: float) -> Cluster:
    """Four single-GPU machines (Gloo's ring collectives) on links of ``bytes_per_us``."""
    link = Link(bytes_per_us, 0.0)
    return Cluster(machines=len(RANKS), gpus_per_machine=1, intra_node=link, inter_node=link)


FAST = cluster(1e12)  # an exabyte per second, no latency: collectives take ~0
SLOW = cluster(125.0)  # 1 Gb/s


def sharded(study, units, zero: int, link: Cluster = FAST, reshard: bool = True):
    par = Parallelism(data=len(RANKS), zero=zero, reshard_after_forward=reshard)
    out = apply_fsdp(study.graph, units, par, link, {"data": RANKS})
    return out, out.last_note(ShardedDataParallel)


def predicted_ms(study, graph) -> np.ndarray:
    return iteration_report(simulate(graph), study.iterations)["predicted_ms"].to_numpy()


def bundle_bytes(study, prefix: str = "") -> float:
    p = study.graph.workload.parameters
    mine = p["name"].astype(str).str.startswith(prefix)
    return float((p.loc[mine, "numel"] * p.loc[mine, "element_size"]).sum())


def test_the_units_are_the_four_blocks_and_their_bytes_the_bundles(study, units):
    assert units.names == [f"blocks.{i}" for i in range(BLOCKS)]
    for i, nbytes in enumerate(units.table["param_bytes"]):
        assert nbytes == bundle_bytes(study, f"blocks.{i}.") > 0


def test_fsdp_gathers_each_unit_twice_and_scatters_its_gradients_once_per_iteration(study, units):
    _, note = sharded(study, units, 3)
    c = note.collectives
    iterations = len(study.iterations)
    assert sorted(c["iteration"].unique()) == list(range(iterations))
    for unit, nbytes in zip(units.table["unit"], units.table["param_bytes"]):
        mine = c[c["unit"] == unit]
        counts = mine.groupby(["iteration", "op", "phase"]).size()
        for it in range(iterations):
            assert counts[(it, "all_gather", "forward")] == 1
            assert counts[(it, "all_gather", "backward")] == 1
            assert counts[(it, "reduce_scatter", "backward")] == 1
        assert len(mine) == 3 * iterations
        assert (mine["nbytes"] == nbytes).all(), "all-gather and reduce-scatter sizes are the unit's parameter bytes"
    # the root (embeddings, norm, head) is gathered once, before the forward, and scattered once
    root = c[c["unit"] == -1]
    assert sorted(root["op"]) == sorted(["all_gather", "reduce_scatter"] * iterations)
    assert (root["nbytes"] == bundle_bytes(study) - units.table["param_bytes"].sum()).all()
    assert set(c["group"]) == {"data"}


def test_without_resharding_after_forward_each_unit_is_gathered_once(study, units):
    _, note = sharded(study, units, 3, reshard=False)
    c = note.collectives
    gathers = c[(c["op"] == "all_gather") & (c["unit"] >= 0)]
    assert set(gathers["phase"]) == {"forward"}
    assert len(gathers) == BLOCKS * len(study.iterations)


def test_on_a_cpu_trace_fsdp2s_collectives_are_comm_tasks_on_the_thread_that_waits_for_them(study, units):
    out, note = sharded(study, units, 3)
    tasks = out.tasks.iloc[note.collectives["task"].to_numpy()]
    assert (tasks["kind"] == int(TaskKind.COMM)).all()
    threads = set(study.graph.tasks["resource"].astype(str))
    assert set(tasks["resource"].astype(str)) <= threads  # on the trace's own threads, no queue
    assert tasks["name"].astype(str).str.contains("all_gather data|reduce_scatter data").all()


def gather_copies_ms(study, note) -> np.ndarray:
    """FSDP2's copies around each iteration's all-gathers on a CPU worker: the shard in, the
    unit out, at the rate the trace's optimizer updates memory."""
    rate = pass_rate_bytes_per_us(study.graph)
    gathers = note.collectives[note.collectives["op"] == "all_gather"]
    per = gathers.groupby("iteration")["nbytes"].sum().to_numpy()
    return per * (1 + 1 / len(RANKS)) / rate / 1e3


def test_with_infinitely_fast_links_the_step_loses_only_the_optimizers_shards(study, units):
    base = predicted_ms(study, study.graph)
    out, note = sharded(study, units, 3)
    optimizer = units.task_phase == PHASE_OPTIMIZER
    kind = study.graph.tasks["kind"].to_numpy()
    start = study.graph.tasks["measured_start_us"].to_numpy()
    duration = study.graph.tasks["duration_us"].to_numpy()
    d = len(RANKS)
    saved = []
    for it in study.iterations.itertuples():
        inside = optimizer & (kind != int(TaskKind.WAIT)) & (start >= it.start_us) & (start < it.end_us)
        saved.append(duration[inside].sum() * (d - 1) / d / 1e3)
    assert min(saved) > 0
    copies = gather_copies_ms(study, note)
    assert (copies > 0).all()
    np.testing.assert_allclose(predicted_ms(study, out), base - np.array(saved) + copies, rtol=1e-6, atol=1e-3)
    assert note.optimizer_scale == 1 / d
    assert note.host_us == pytest.approx(copies.sum() * 1e3)


def test_on_a_cpu_trace_fsdp2s_copies_follow_each_gather_and_the_unit_waits_for_them(study, units):
    out, note = sharded(study, units, 3, SLOW)
    rate = pass_rate_bytes_per_us(study.graph)
    tasks = out.tasks
    copies = np.flatnonzero(tasks["name"].astype(str).str.startswith("FSDP2 all-gather copies").to_numpy())
    gathers = note.collectives[note.collectives["op"] == "all_gather"]
    assert len(copies) == len(gathers) > 0
    assert (tasks["kind"].to_numpy()[copies] == int(TaskKind.CPU)).all()
    schedule = simulate(out)
    edges = out.edges
    for row in gathers.itertuples():
        after = edges.loc[edges["src"] == row.task, "dst"].to_numpy()
        copy = np.intersect1d(after, copies)
        assert len(copy) == 1, "one copy task follows each all-gather"
        copy = int(copy[0])
        assert tasks.at[copy, "duration_us"] == pytest.approx(row.nbytes * (1 + 1 / len(RANKS)) / rate)
        assert tasks.at[copy, "resource"] == tasks.at[row.task, "resource"]
        assert schedule.start_us[copy] >= schedule.end_us[row.task] - 1e-6
        if row.unit >= 0:  # the unit's own tasks of that phase start after its parameters are copied out
            phase = PHASE_FORWARD if row.phase == "forward" else PHASE_BACKWARD
            start = study.graph.tasks["measured_start_us"].to_numpy()
            it = study.iterations.iloc[row.iteration]
            own = np.flatnonzero((units.task_unit == row.unit) & (units.task_phase == phase)
                                 & (start >= it.start_us) & (start < it.end_us))
            assert schedule.start_us[own].min() >= schedule.end_us[copy] - 1e-6


def test_fsdp2s_host_time_per_unit_lengthens_each_step_by_its_units(study, units):
    """``fsdp_dispatch``: forward, backward and step time per unit (the blocks and the root) on
    the host; with infinitely fast links each steady step grows by their sum times five."""
    base_out, base_note = sharded(study, units, 3)
    per_unit = (2000.0, 4000.0, 1500.0)
    par = Parallelism(data=len(RANKS), zero=3, fsdp_dispatch=per_unit)
    out = apply_fsdp(study.graph, units, par, FAST, {"data": RANKS})
    note = out.last_note(ShardedDataParallel)
    grown = predicted_ms(study, out) - predicted_ms(study, base_out)
    steady = slice(1, -1)
    np.testing.assert_allclose(grown[steady], sum(per_unit) * (BLOCKS + 1) / 1e3, rtol=1e-6)
    assert note.host_us - base_note.host_us == pytest.approx(sum(per_unit) * (BLOCKS + 1) * len(study.iterations))
    assert "FSDP2's host time added" in note.describe()
    with pytest.raises(ParallelismError, match="fsdp_dispatch"):
        Parallelism(data=2, zero=2, fsdp_dispatch=per_unit)


def test_on_a_slow_link_the_step_grows_and_each_unit_waits_for_its_gather(study, units):
    fast = predicted_ms(study, sharded(study, units, 3)[0])
    out, note = sharded(study, units, 3, SLOW)
    slow = predicted_ms(study, out)
    assert (slow > fast * 1.2).all(), (slow, fast)
    # bounds: at least the all-gathers' queue, at most the step with every collective exposed
    c = note.collectives
    per_op_ms = c.pivot_table(index="iteration", columns="op", values="time_us", aggfunc="sum") / 1e3
    assert (slow >= per_op_ms["all_gather"].to_numpy()).all()
    assert (slow <= fast + per_op_ms.sum(axis=1).to_numpy() + 1e-6).all()
    schedule = simulate(out)
    for row in c[(c["op"] == "all_gather") & (c["unit"] >= 0)].itertuples():
        phase = PHASE_FORWARD if row.phase == "forward" else PHASE_BACKWARD
        own = np.flatnonzero((units.task_unit == row.unit) & (units.task_phase == phase))
        start = study.graph.tasks["measured_start_us"].to_numpy()
        inside = own[(start[own] >= study.iterations.iloc[row.iteration].start_us)
                     & (start[own] < study.iterations.iloc[row.iteration].end_us)]
        assert schedule.start_us[inside].min() >= schedule.end_us[row.task] - 1e-6


def test_on_a_cpu_trace_nothing_overlaps_fsdp2s_synchronous_collectives(study, units):
    """On CPU FSDP2 waits for every collective it issues: the step is the step on infinitely
    fast links plus the time of each of its collectives."""
    fast = predicted_ms(study, sharded(study, units, 3)[0])
    out, note = sharded(study, units, 3, SLOW)
    per_iteration_ms = note.collectives.groupby("iteration")["time_us"].sum().to_numpy() / 1e3
    steady = slice(1, -1)  # the first and last profiled steps are cut by the profiler's window
    np.testing.assert_allclose(predicted_ms(study, out)[steady], (fast + per_iteration_ms)[steady], rtol=2e-3)


def test_zero_2_reduce_scatters_then_gathers_the_updated_parameters_once(study, units):
    _, note = sharded(study, units, 2)
    c = note.collectives
    for it, rows in c.groupby("iteration"):
        scatters = rows[rows["op"] == "reduce_scatter"]
        assert sorted(scatters["unit"]) == [-1] + list(range(BLOCKS))
        gathers = rows[rows["op"] == "all_gather"]
        assert len(gathers) == 1 and gathers["nbytes"].iloc[0] == bundle_bytes(study)
        assert gathers["phase"].iloc[0] == "optimizer"
    assert "all_reduce" not in set(c["op"])


def test_zero_1_all_reduces_then_gathers_the_updated_parameters_once(study, units):
    base = predicted_ms(study, study.graph)
    out, note = sharded(study, units, 1, SLOW)
    c = note.collectives
    for it, rows in c.groupby("iteration"):
        assert sorted(rows.loc[rows["op"] == "all_reduce", "unit"]) == [-1] + list(range(BLOCKS))
        assert (rows["op"] == "all_gather").sum() == 1
    assert "reduce_scatter" not in set(c["op"])
    assert (predicted_ms(study, out) > base).all()


def test_under_tensor_parallelism_a_rank_gathers_its_tensor_shard_of_each_block(study, units):
    par = Parallelism(data=len(RANKS), tensor=2, zero=3)
    note = apply_fsdp(study.graph, units, par, FAST, {"data": RANKS}).last_note(ShardedDataParallel)
    c = note.collectives
    for unit, nbytes in zip(units.table["unit"], units.table["param_bytes"]):
        assert (c.loc[c["unit"] == unit, "nbytes"] == nbytes / 2).all()
    root = bundle_bytes(study) - units.table["param_bytes"].sum()
    assert (c.loc[c["unit"] == -1, "nbytes"] == root).all(), "the embeddings and head are replicated, not split"


@pytest.mark.parametrize("zero", [1, 3])
def test_the_units_follow_the_graph_the_pass_returns(study, units, zero):
    out, note = sharded(study, units, zero)
    after = note.units_after(units, out)
    n = len(study.graph.tasks)
    assert len(after.task_unit) == len(out.tasks) and len(after.task_phase) == len(out.tasks)
    assert (after.task_unit[:n] == units.task_unit).all() and (after.task_phase[:n] == units.task_phase).all()
    c = note.collectives
    forward = c.loc[c["phase"] == "forward", "task"].to_numpy()
    assert (after.task_phase[forward] == PHASE_FORWARD).all()
    assert (after.task_unit[c["task"].to_numpy()] == c["unit"].to_numpy()).all()
    if zero == 1:  # optimizer.step() waits for the gather: its wait is in the optimizer phase
        assert len(note.waits) == len(study.iterations)
        assert (after.task_phase[list(note.waits)] == PHASE_OPTIMIZER).all()


@pytest.mark.parametrize("zero", [1, 3])
def test_the_units_found_after_the_pass_time_the_blocks_as_before(study, units, zero):
    """The collectives the pass puts on a CPU trace's thread are not the blocks' own work: the
    units found again on its graph (as ``parallelize`` finds them for the passes after it) keep
    the traced blocks' forward and backward times."""
    out, _ = sharded(study, units, zero)
    again = find_units(out)
    assert (units.table["forward_us"] > 0).all() and (units.table["backward_us"] > 0).all()
    pd.testing.assert_frame_equal(again.table, units.table)


def test_a_unit_without_backward_tasks_has_its_gradients_reduced_with_the_roots(study, units):
    """As a plain trace gives them: module names on the forward only."""
    unit = units.task_unit.copy()
    unit[(unit == BLOCKS - 1) & (units.task_phase == PHASE_BACKWARD)] = -1
    forward_only = Units(units.pattern, unit, units.task_phase, units.table)
    _, note = sharded(study, forward_only, 3)
    c = note.collectives[note.collectives["op"] == "reduce_scatter"]
    for it, rows in c.groupby("iteration"):
        assert sorted(rows["unit"]) == [-1] + list(range(BLOCKS - 1))
        assert rows["nbytes"].sum() == bundle_bytes(study)


def test_the_pass_is_registered_for_the_fsdp_family():
    assert PASSES["fsdp"] is apply_fsdp


def test_without_sharding_the_graph_is_untouched(study, units):
    par = Parallelism(data=len(RANKS), zero=0)
    assert apply_fsdp(study.graph, units, par, FAST, {"data": RANKS}) is study.graph


def test_ddp_beside_tensor_parallelism_all_reduces_each_units_shard_and_keeps_the_optimizer(study, units):
    par = Parallelism(data=len(RANKS), tensor=2, zero=0)
    assert "fsdp" in par.families(), "the data-parallel pass runs beside a model-parallel family"
    fast = apply_fsdp(study.graph, units, par, FAST, {"data": RANKS})
    note = fast.last_note(ShardedDataParallel)
    c = note.collectives
    for it, rows in c.groupby("iteration"):
        assert sorted(rows["unit"]) == [-1] + list(range(BLOCKS))
    assert set(c["op"]) == {"all_reduce"} and note.optimizer_scale == 1.0
    for unit, nbytes in zip(units.table["unit"], units.table["param_bytes"]):
        assert (c.loc[c["unit"] == unit, "nbytes"] == nbytes / 2).all(), "a rank reduces its tensor shard"
    np.testing.assert_allclose(predicted_ms(study, fast), predicted_ms(study, study.graph), rtol=1e-6)
    slow = apply_fsdp(study.graph, units, par, SLOW, {"data": RANKS})
    assert (predicted_ms(study, slow) > predicted_ms(study, study.graph)).all()


# -- a GPU trace -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_study():
    if not GPU_TRACE.exists():
        pytest.skip(NO_SHARED)
    return TraceStudy.from_trace(GPU_TRACE)


def cut_units(study, count: int = 4, unit_bytes: float = 25e6) -> Units:
    """Units for a trace that records no modules (HTA's ResNet-50 has none): each iteration's
    forward operators on the training thread (those before its first autograd function) cut
    into ``count`` runs of equal length, its backward operators (on autograd's thread) into as
    many in reverse, the first and last tenth of each left to the root; the optimizer step is
    phase 3; GPU tasks take their launch's unit and phase, as ``find_units`` gives them."""
    graph = study.graph
    start = graph.tasks["measured_start_us"].to_numpy()
    resource = graph.tasks["resource"].astype(str).to_numpy().astype(str)
    thread = resource == f"cpu {study.iterations['thread'].iloc[0]}"
    on_cpu = np.char.startswith(resource, "cpu ")
    backward, optimizer = graph.match(r"autograd::engine::evaluate_function"), graph.match(r"Optimizer\.step#")
    unit = np.full(len(start), -1, dtype=np.int64)
    phase = np.zeros(len(start), dtype=np.int8)
    for it in study.iterations.itertuples():
        inside = on_cpu & (start >= it.start_us) & (start < it.end_us)
        first_backward = start[inside & backward].min()
        forward_ids = np.flatnonzero(inside & thread & (start < first_backward) & ~optimizer)
        backward_ids = np.flatnonzero(inside & ~thread & (start >= first_backward))
        phase[forward_ids], phase[backward_ids], phase[inside & optimizer] = 1, 2, 3
        forward_ids = forward_ids[np.argsort(start[forward_ids])]
        backward_ids = backward_ids[np.argsort(start[backward_ids])]
        for k, run in enumerate(np.array_split(forward_ids[len(forward_ids) // 10:], count)):
            unit[run] = k
        for k, run in enumerate(np.array_split(backward_ids[: len(backward_ids) * 9 // 10], count)):
            unit[run] = count - 1 - k
    launch = graph.edges[graph.edges["kind"] == int(EdgeKind.LAUNCH)]
    unit[launch["dst"].to_numpy()] = unit[launch["src"].to_numpy()]
    phase[launch["dst"].to_numpy()] = phase[launch["src"].to_numpy()]
    table = pd.DataFrame({"unit": range(count), "name": [f"part {k}" for k in range(count)], "param_bytes": unit_bytes,
                          "activation_bytes": 0.0, "forward_us": 0.0, "backward_us": 0.0})[TABLE_COLUMNS]
    return Units("cut by hand", unit, phase, table)


def test_on_a_gpu_trace_the_gpu_streams_wait_for_the_gathers_not_the_cpu(gpu_study):
    units = cut_units(gpu_study)
    par = Parallelism(data=len(RANKS), zero=3)
    base = predicted_ms(gpu_study, gpu_study.graph)
    fast = apply_fsdp(gpu_study.graph, units, par, FAST, {"data": RANKS})
    assert (predicted_ms(gpu_study, fast) <= base + 1e-6).all()
    out = apply_fsdp(gpu_study.graph, units, par, cluster(1250.0), {"data": RANKS})  # 10 Gb/s
    note = out.last_note(ShardedDataParallel)
    c = note.collectives
    assert len(c) == len(gpu_study.iterations) * 3 * 4  # no parameter record: the root holds none, sends none
    gpu_kinds = [int(k) for k in GPU_TASK_KINDS]
    gathers = c.loc[c["op"] == "all_gather", "task"].to_numpy()
    waiters = out.edges.loc[out.edges["src"].isin(gathers), "dst"].to_numpy()
    assert len(waiters) and out.tasks["kind"].iloc[waiters].isin(gpu_kinds).all()
    schedule = simulate(out)
    edges = out.edges
    for row in c[c["op"] == "all_gather"].itertuples():
        waiters = edges.loc[edges["src"] == row.task, "dst"].to_numpy()
        phase = PHASE_FORWARD if row.phase == "forward" else PHASE_BACKWARD
        assert len(waiters), f"nothing waits for {row}"
        assert (units.task_unit[waiters] == row.unit).all() and (units.task_phase[waiters] == phase).all()
        assert (schedule.start_us[waiters] >= schedule.end_us[row.task] - 1e-6).all()
    # the optimizer's first kernel waits for the iteration's last reduce-scatter
    optimizer = np.flatnonzero(units.task_phase == PHASE_OPTIMIZER)
    for it, rows in c[c["op"] == "reduce_scatter"].groupby("iteration"):
        waiters = edges.loc[edges["src"] == rows["task"].iloc[-1], "dst"].to_numpy()
        assert len(waiters) and np.isin(waiters, optimizer).all()
        assert out.tasks["kind"].iloc[waiters].isin(gpu_kinds).all()
    steady = slice(1, None)  # the first profiled step is short: the profiler starts mid-step
    assert (predicted_ms(gpu_study, out)[steady] > base[steady] * 1.2).all()


def test_data_groups_crossing_one_nic_at_once_each_get_their_share_of_it(study, units):
    """On 2 machines x 2 GPUs with tensor 2 (the lab's FSDP+TP), rank 0's data group (0, 2) and
    the other one (1, 3) cross each machine's NIC at the same time: every collective takes what
    it takes on half the NIC (twice as long, with no latency); with data 4, one group fills the
    machines and has the NIC to itself."""
    from whatif.sim.parallel.placement import nic_sharing, with_nic_shared
    from whatif.topology import collective_cost

    nic = Cluster(machines=2, gpus_per_machine=2, intra_node=Link(1e12, 0.0), inter_node=Link(125.0, 0.0))
    assert nic_sharing(nic, (0, 2)) == 2 and nic_sharing(nic, RANKS) == 1 and nic_sharing(nic, (0, 1)) == 1
    par = Parallelism(data=2, tensor=2, zero=3)
    out = apply_fsdp(study.graph, units, par, nic, {"data": (0, 2)})
    c = out.last_note(ShardedDataParallel).collectives
    durations = out.tasks["duration_us"].to_numpy()[c["task"].to_numpy()]
    alone = np.array([collective_cost(nic, op, n, ranks=(0, 2)).time_us for op, n in zip(c["op"], c["nbytes"])])
    shared = np.array([collective_cost(with_nic_shared(nic, 2), op, n, ranks=(0, 2)).time_us
                       for op, n in zip(c["op"], c["nbytes"])])
    assert len(c) and np.allclose(durations, shared) and np.allclose(durations, 2 * alone)
    whole = apply_fsdp(study.graph, units, Parallelism(data=4, zero=3), nic, {"data": RANKS})
    c4 = whole.last_note(ShardedDataParallel).collectives
    assert np.allclose(whole.tasks["duration_us"].to_numpy()[c4["task"].to_numpy()],
                       [collective_cost(nic, op, n, ranks=RANKS).time_us for op, n in zip(c4["op"], c4["nbytes"])])
