"""``whatif simulate --batch-size``: the traced iteration rebuilt at another batch size, operator
compute rescaled by the performance models and everything between operators kept."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from trace_corpus import BUNDLED_TRACE
from whatif.cli import main
from whatif.collectors.load import load_trace
from whatif.pipeline import Request, predict
from whatif.sim.build import build_graph
from whatif.sim.graph import TaskKind
from whatif.sim.passes.batch_size import BatchSizeChange, change_batch_size, infer_batch_size, parameter_shapes, rescale_dims
from whatif.sim.perfmodels.models import load_models
from whatif.sim.perfmodels.shapes import operator_units
from whatif.study import TraceStudy

BUNDLE = BUNDLED_TRACE.parent / "convnet_cpu.bundle"
WIDE_MLP = BUNDLED_TRACE.parent / "wide_mlp_cpu.pt.trace.json.gz"


def test_the_batch_dimension_is_rescaled_in_activations_not_weights():
    weights = {(32, 3, 3, 3), (10, 128), (128, 10), (768, 256), (256, 768)}
    conv = [[32, 3, 32, 32], [32, 3, 3, 3], [], [], [], [], []]
    assert rescale_dims("aten::conv2d", conv, 32, 64, weights)[:2] == [[64, 3, 32, 32], [32, 3, 3, 3]]
    # the weight gradient of a linear layer: the batch is the inner dimension
    assert rescale_dims("aten::mm", [[10, 32], [32, 128]], 32, 64, weights) == [[10, 64], [64, 128]]
    # its input gradient: the batch is the rows
    assert rescale_dims("aten::mm", [[32, 10], [10, 128]], 32, 64, weights) == [[64, 10], [10, 128]]
    # flattened tokens of a transformer (batch 8 x 64 tokens), the weight transposed
    addmm = [[768], [512, 256], [256, 768], [], []]
    assert rescale_dims("aten::addmm", addmm, 8, 16, weights)[:3] == [[768], [1024, 256], [256, 768]]


def test_the_traced_batch_size_comes_from_the_bundle_or_the_first_layer():
    bundle = build_graph(load_trace(BUNDLE))
    assert infer_batch_size(bundle, parameter_shapes(bundle)) == (32, "the bundle's environment")
    for path, batch, first_op in ((BUNDLED_TRACE, 32, "aten::conv2d"), (WIDE_MLP, 64, "aten::linear")):
        graph = build_graph(load_trace(path))
        found, source = infer_batch_size(graph, parameter_shapes(graph))
        assert found == batch and first_op in source


def test_a_factorys_empty_output_is_not_taken_for_the_batch(tmp_path):
    """A transformer numbers its positions first (``torch.arange``, whose ``out=`` tensor is
    recorded with shape ``[0]``); the batch is its tokens' leading dimension."""
    torch = pytest.importorskip("torch", reason="captures a trace: pip install -e '.[test]'")

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.token, self.position, self.head = torch.nn.Embedding(100, 16), torch.nn.Embedding(10, 16), torch.nn.Linear(16, 4)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1])
            return self.head(self.token(tokens) + self.position(positions)).mean(1)

    model, tokens, path = Tokens(), torch.randint(0, 100, (6, 10)), tmp_path / "tokens.pt.trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        model(tokens).sum().backward()
    profiler.export_chrome_trace(str(path))
    graph = build_graph(load_trace(path))
    assert infer_batch_size(graph, parameter_shapes(graph)) == (6, "the first input of the first layer, aten::embedding [6, 10]")


@pytest.fixture(scope="module")
def models(quick_models_file):
    return load_models(quick_models_file)


def test_doubling_the_batch_of_the_convnet_takes_longer_but_less_than_2_2_times(models):
    traced = TraceStudy.from_trace(BUNDLE).replay_report()["measured_ms"].to_numpy()
    steady = float(np.median(traced[1:-1]))
    doubled = predict(Request(BUNDLE, batch_size=64, perfmodel=models)).iteration_ms
    halved = predict(Request(BUNDLE, batch_size=16, perfmodel=models)).iteration_ms
    assert steady < doubled < 2.2 * steady
    assert steady / 2.2 < halved < steady


def test_only_batch_carrying_operators_and_data_loading_change(models):
    trace = load_trace(BUNDLE)
    graph = build_graph(trace)
    before = graph.tasks["duration_us"].to_numpy().copy()
    graph = change_batch_size(graph, models, 64)
    change = graph.last_note(BatchSizeChange)
    after = graph.tasks["duration_us"].to_numpy()
    assert change.from_batch == 32 and change.scaled_units > 0 and not change.unmodelled
    changed = after != before
    names = graph.tasks["name"].astype(str)
    context = graph.tasks["context"].astype(str)
    optimizer = context.str.contains("Optimizer.step").to_numpy()
    assert not changed[optimizer].any(), "the optimizer's per-parameter work does not see the batch"
    between = (graph.tasks["kind"] == int(TaskKind.GAP)).to_numpy() & ~context.str.contains("DataLoader|aten::").to_numpy()
    assert not changed[between].any(), "time between operators is kept as measured"
    assert changed[(names == "aten::mkldnn_convolution").to_numpy()].all()
    loading = context.str.contains("DataLoader").to_numpy()
    np.testing.assert_allclose(after[loading], 2 * before[loading])


def test_a_modelled_operator_takes_its_models_ratio_of_its_whole_traced_time_its_fixed_helpers_included(models):
    """A ``linear`` of the wide MLP transposes its weight (``aten::t``, no batch in it) before
    its GEMM: the transpose keeps its time and the GEMM makes up the rest, so that the call as a
    whole changes by the model's ratio, as the microbenchmark that fitted the model timed it."""
    trace = load_trace(WIDE_MLP)
    graph = build_graph(trace)
    units = operator_units(graph.ops)
    linear = units[(units["op"] == "aten::linear") & (units["unit"] == units["row"])]
    weights = parameter_shapes(graph)
    new_dims = [rescale_dims("aten::linear", d, 64, 32, weights) for d in linear["dims"]]
    ratio = models.predict_us(["aten::linear"] * len(linear), new_dims, linear["types"].tolist(), learned=False) / models.predict_us(
        ["aten::linear"] * len(linear), linear["dims"].tolist(), linear["types"].tolist(), learned=False)
    unit_of_event = units.set_index("row")["unit"]
    op_of_event = units.set_index("row")["op"]
    events = graph.tasks["event"].to_numpy()
    in_unit = unit_of_event.reindex(events).fillna(-1).to_numpy()
    transposes = (op_of_event.reindex(events) == "aten::t").to_numpy() & np.isin(in_unit, linear["row"].to_numpy())
    assert transposes.any()
    before = graph.tasks["duration_us"].to_numpy().copy()
    after = change_batch_size(graph, models, 32).tasks["duration_us"].to_numpy()
    np.testing.assert_array_equal(after[transposes], before[transposes])
    for row, r in zip(linear["row"].to_numpy(), ratio):
        mine = in_unit == row
        assert after[mine].sum() == pytest.approx(r * before[mine].sum(), rel=1e-9)


def with_trees(models, trees):
    """``models`` with every family's learned correction replaced by ``trees`` (None: roofline only)."""
    changed = copy.deepcopy(models)
    for family in changed.families.values():
        family.trees, family._booster = trees, None
    return changed


def test_a_call_moves_by_its_rooflines_ratio_whatever_the_learned_correction_says(models):
    """The traced call has measured what the roofline misses at its own shape; a tree
    ensemble's correction jumps from leaf to leaf between two shapes where the roofline is
    smooth, and its ratios were the further from the traces at other batch sizes
    (``bench/batch_size_ratios.py``)."""
    lightgbm = pytest.importorskip("lightgbm")
    features = np.random.default_rng(0).uniform(0, 30, size=(400, 14))
    booster = lightgbm.train({"objective": "regression", "verbose": -1, "min_data_in_leaf": 5},
                             lightgbm.Dataset(features, features[:, 1] / 5), num_boost_round=20)
    roofline, learned = with_trees(models, None), with_trees(models, booster.model_to_string())
    trace = load_trace(WIDE_MLP)
    traced = build_graph(trace)
    linear = operator_units(traced.ops).query("op == 'aten::linear' and unit == row")
    new_dims = [rescale_dims("aten::linear", d, 64, 32, parameter_shapes(traced)) for d in linear["dims"]]
    calls = (["aten::linear"] * len(linear), linear["types"].tolist())
    ratios = [m.predict_us(calls[0], new_dims, calls[1]) / m.predict_us(calls[0], linear["dims"].tolist(), calls[1])
              for m in (roofline, learned)]
    assert not np.allclose(*ratios), "the learned correction must move the model's ratio for the test to tell"
    rescaled = []
    for m in (roofline, learned):
        rescaled.append(change_batch_size(build_graph(trace), m, 32).tasks["duration_us"].to_numpy())
    np.testing.assert_array_equal(*rescaled)


def test_the_same_batch_size_changes_nothing(models):
    trace = load_trace(BUNDLE)
    graph = build_graph(trace)
    before = graph.tasks["duration_us"].to_numpy().copy()
    np.testing.assert_array_equal(change_batch_size(graph, models, 32).tasks["duration_us"].to_numpy(), before)


def test_without_operator_models_a_batch_size_is_a_one_line_error_naming_the_command_that_fits_them(
        tmp_path, monkeypatch, capsys):
    """Nothing is fitted behind the user's back: no sweep runs, nothing is cached."""
    monkeypatch.setenv("WHATIF_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["simulate", str(BUNDLED_TRACE), "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("whatif: error: no operator models for this device (")
    assert "`whatif perfmodel fit --quick --out models.json`" in err and "--perfmodel models.json" in err
    assert "`whatif perfmodel fit --quick --cache`" in err
    assert not (tmp_path / "cache").exists()


def test_simulate_batch_size_on_the_command_line(quick_models_file, capsys):
    argv = ["simulate", str(BUNDLED_TRACE), "--batch-size", "16", "--perfmodel", str(quick_models_file), "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["batch_size"]["from"] == 32 and doc["batch_size"]["to"] == 16
    assert doc["batch_size"]["from_source"].startswith("the first input of the first layer")
    assert doc["summary"]["steady_predicted_ms"] < doc["summary"]["steady_measured_ms"]
    argv = ["simulate", str(BUNDLED_TRACE), "--batch-size", "64", "--from-batch-size", "0", "--perfmodel", str(quick_models_file)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err == "whatif: error: --from-batch-size 0: expected a positive whole number\n"
