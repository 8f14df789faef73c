"""A scenario at another batch size (``batch_size:``): the worker's iteration is rebuilt with the
operator models (``sim/passes/batch_size.py``) before the cluster is simulated, so a cluster what-if
and a batch-size what-if combine. On the bundled convnet bundle, captured at batch 32, with the
operator models fitted on this machine's quick sweep (``quick_models_file``)."""

from __future__ import annotations

import pytest

from trace_corpus import REPO
from whatif.pipeline import predict
from whatif.scenario import Scenario, ScenarioError
from whatif.sim.perfmodels.models import PerfModelError

pytest.importorskip("torch", reason="the operator models are fitted with torch: pip install -e '.[test]'")

BUNDLE = REPO / "data" / "convnet_cpu.bundle"


def scenario(tmp_path, models=None, **extra):
    doc = {"trace": str(BUNDLE), "cluster": {"machines": [1, 2], "gpus_per_machine": 1, "intra_node": "pcie3",
                                            "inter_node": "10gbe"}, "framework": "ddp", **extra}
    if models is not None:
        doc["perfmodel"] = str(models)
    return Scenario.from_dict(doc, base_dir=tmp_path)


@pytest.fixture(scope="module")
def at_32(tmp_path_factory):
    return predict(scenario(tmp_path_factory.mktemp("b32")).request())


def test_a_larger_batch_predicts_a_longer_iteration_but_not_more_than_proportionally(at_32, quick_models_file, tmp_path):
    at_64 = predict(scenario(tmp_path, quick_models_file, batch_size=64).request())
    assert at_32.iteration_ms < at_64.iteration_ms < 2.2 * at_32.iteration_ms
    assert (at_64.results["iteration_ms"].to_numpy() > at_32.results["iteration_ms"].to_numpy()).all()


def test_the_traced_batch_size_comes_from_the_bundle_or_from_the_scenario(at_32, quick_models_file, tmp_path):
    implicit = predict(scenario(tmp_path, quick_models_file, batch_size=16).request())
    explicit = predict(scenario(tmp_path, quick_models_file, batch_size={"from": 32, "to": 16}).request())
    assert implicit.iteration_ms == pytest.approx(explicit.iteration_ms, rel=1e-9)
    assert implicit.iteration_ms < at_32.iteration_ms
    same = predict(scenario(tmp_path, quick_models_file, batch_size=32).request())
    assert same.iteration_ms == pytest.approx(at_32.iteration_ms, rel=1e-9)


def test_a_batch_size_without_operator_models_names_the_command_that_fits_them(tmp_path, monkeypatch):
    monkeypatch.setenv("WHATIF_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(PerfModelError, match="whatif perfmodel fit --quick --cache"):
        predict(scenario(tmp_path, batch_size=64).request())


@pytest.mark.parametrize("value, key", [(0, "batch_size"), ({"from": 32}, "batch_size.to"), ({"to": 8, "form": 32}, "batch_size.form"),
                                        ({"to": 8, "from": -1}, "batch_size.from"), ("big", "batch_size")])
def test_a_bad_batch_size_names_the_key(value, key, tmp_path):
    with pytest.raises(ScenarioError) as error:
        scenario(tmp_path, batch_size=value)
    assert f": {key}:" in str(error.value)
