# `make demo` and `make test` each set up .venv on their own. The install steps leave a stamp in
# .venv and are re-run only when pyproject.toml changes; the install is editable, so code edits
# need no reinstall.
#
# `make horovod` installs what the real multi-worker runs need (the `lab` extra: torch) and builds
# Horovod 0.28.1 with PyTorch and Gloo into .venv (lab/horovod_build.sh): about 5 minutes
# on two cores the first time, then seconds, from the wheel it caches in ~/.cache/whatif-wheels.
# Only the lab and its tests need it (`make test` runs it); the simulator never does.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRACE := data/convnet_cpu.pt.trace.json.gz

.PHONY: demo test horovod clean

demo: $(VENV)/.installed-demo
	$(BIN)/whatif replay $(TRACE)

# the tests hold predictions against real Horovod and DDP runs, so they install the lab first
test: $(VENV)/.installed-test horovod
	$(BIN)/python -m pytest -q tests

horovod: $(VENV)/.installed-lab
	lab/horovod_build.sh $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[test]'
	touch $@

$(VENV)/.installed-lab: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[lab]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
