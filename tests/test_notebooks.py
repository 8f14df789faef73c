"""The notebooks in ``notebooks/`` run from top to bottom, and are committed without outputs.

They run in a Jupyter kernel of this very interpreter: a kernel spec named ``python3`` written
to a temporary folder that ``JUPYTER_PATH`` puts before any other, so a ``python3`` kernel
installed elsewhere on the machine cannot stand in for the virtual environment under test.
The notebooks read the shared GPU traces; without them every notebook is skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from trace_corpus import NO_SHARED, SHARED_TRACES

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch) -> str:
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    return "python3"


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "clear the outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_runs_from_top_to_bottom(path, this_python_kernel):
    if not SHARED_TRACES.is_dir():
        pytest.skip(NO_SHARED)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=this_python_kernel,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, when one fails
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "a worked example shows its plot"
