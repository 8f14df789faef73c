"""Fixtures and parametrisation over the test traces (see ``trace_corpus``).

When the shared GPU traces are absent, every test that needs them is skipped with the reason,
and the tests on the bundled CPU trace still run. Tests that take the argument ``kineto_trace``
run once per shared Kineto trace; tests that take ``any_trace`` run for those and the bundled
trace.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from trace_corpus import BUNDLED, NO_SHARED, REPO, SHARED_TRACES, Traces, shared_kineto_traces
from whatif import TraceStudy
from whatif.sim.gradients import find_gradients
from whatif.sim.graph import TaskKind

WIDE_MLP = REPO / "data" / "wide_mlp_cpu.pt.trace.json.gz"

# Every test reads its traces afresh, the commands it runs included (they inherit this): the
# graph cache (whatif/graph_cache.py) would otherwise let a test pass on what an earlier run
# built; tests/test_graph_cache.py turns it on where it is what is tested.
os.environ["WHATIF_GRAPH_CACHE"] = "0"


def pytest_generate_tests(metafunc):
    shared = shared_kineto_traces()
    absent = [pytest.param(None, id="shared-traces-absent", marks=pytest.mark.skip(reason=NO_SHARED))]
    if "kineto_trace" in metafunc.fixturenames:
        metafunc.parametrize("kineto_trace", shared or absent)
    if "any_trace" in metafunc.fixturenames:
        metafunc.parametrize("any_trace", [BUNDLED] + shared)


@pytest.fixture(scope="session")
def traces() -> Traces:
    """Every test's access to the traces, loaded once per session."""
    return Traces(SHARED_TRACES)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The shared trace folder; skips the test when it is absent."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(NO_SHARED)
    return SHARED_TRACES


@pytest.fixture(scope="session")
def quick_sweep():
    """This machine's quick sweep (samples, device), once per session."""
    from whatif.sim.perfmodels.sweep import run_sweep

    return run_sweep(quick=True)


@pytest.fixture(scope="session")
def quick_models_file(quick_sweep, tmp_path_factory) -> Path:
    """Operator performance models fitted on this machine's quick sweep, once per session."""
    from whatif.sim.perfmodels.fit import fit_models

    samples, device = quick_sweep
    path = tmp_path_factory.mktemp("perfmodels") / "quick.json"
    fit_models(samples, device, ["sweep quick"]).save(path)
    return path


@pytest.fixture(scope="module")
def wide_mlp():
    """The wide MLP captured here (75.6 MB of gradients, backward overlapping their all-reduce):
    its study, its worker graph without communication, and its gradients."""
    study = TraceStudy.from_trace(WIDE_MLP)
    worker = study.graph.copy()
    worker.remove(worker.select(kinds=[TaskKind.COMM]))
    return study, worker, find_gradients(worker, study.iterations)


@pytest.fixture(scope="module")
def bench_script():
    """A loader of ``bench/NAME.py`` as a module, with ``bench/`` on the path (for the script's own
    imports) until the test module ends."""
    bench = REPO / "bench"
    sys.path.insert(0, str(bench))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    yield load
    sys.path.remove(str(bench))
