# `make demo` and `make test` each set up .venv on their own. The install steps leave a stamp in
# .venv and are re-run only when pyproject.toml changes; the install is editable, so code edits
# need no reinstall.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRACE := data/convnet_cpu.pt.trace.json.gz

.PHONY: demo test clean

demo: $(VENV)/.installed-demo
	$(BIN)/whatif replay $(TRACE)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q tests

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
