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

# the tests hold predictions against real Horovod and DDP runs, so they install the lab first;
# the run says how many tests there are and what to expect first, and what it took at the end
test: $(VENV)/.installed-test horovod
	@echo "make test: $$($(BIN)/python -m pytest -q --collect-only tests | tail -n 1 | sed 's/ in .*//');" \
	  "about 25-40 minutes on 2 cores (the lab's real runs are most of it)"
	@start=$$(date +%s); $(BIN)/python -m pytest -q tests; status=$$?; took=$$(( $$(date +%s) - start )); \
	  echo "make test: took $$(( took / 60 )) min $$(( took % 60 )) s (exit status $$status)"; exit $$status

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
