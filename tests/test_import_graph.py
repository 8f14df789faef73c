"""The package's import graph (``bench/import_graph.py``): no cycles, and the lab outside it.

The simulator (``collectors``, ``sim``, ``topology``, ``report``) and the facade stand without
the lab, which holds predictions against real runs; only ``whatif.cli`` imports it, to register
its commands."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("import_graph", BENCH / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def graph(checker):
    return checker.import_graph()


def test_every_folder_of_the_package_is_in_the_graph(graph):
    tops = {".".join(name.split(".")[:2]) for name in graph}
    assert {"whatif.collectors", "whatif.sim", "whatif.topology", "whatif.report", "whatif.lab",
            "whatif.pipeline", "whatif.commands", "whatif.cli"} <= tops
    assert "whatif.sim.engine" in graph["whatif.pipeline"], "edges follow the imports"


def test_no_modules_import_each_other(checker, graph):
    assert checker.cycles(graph) == []


def test_the_simulator_never_imports_the_lab(checker, graph):
    """The lab holds predictions against real runs; the simulator stands without it."""
    assert checker.lab_importers(graph) == []
    assert "whatif.lab.cli" in graph["whatif.cli"], "the command line registers the lab's commands"


def test_a_cycle_is_found_and_named_in_import_order(checker):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(checker.cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]


def test_an_import_of_the_lab_from_the_simulator_is_found(checker):
    graph = {"whatif.sim.engine": {"whatif.lab.cluster"}, "whatif.cli": {"whatif.lab.cli"}, "whatif.lab.cli": set()}
    assert checker.lab_importers(graph) == ["whatif.sim.engine"]
