# make install: a virtual environment in .venv; make run: the main job locally;
# make test: install if needed, then every test (SLURM tests run when root can start SLURM;
# GPU tests when there is a GPU). make test-oldest: every test again with the oldest torch that
# requirements.txt allows. make test-gpu: the GPU tests and benchmark.py alone.
# make lint: ruff (lint and format check) and shellcheck, installed from requirements-dev.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed
SHELL_SCRIPTS := $(wildcard *.sh) .ci/run $(wildcard .ci/*.sh .ci/slurm/*.sh tests/fake-bin/*) \
	docs/gpu-runs/next_run.sh

.PHONY: install run test test-fast test-oldest test-gpu lint format clean exercise check

install: $(STAMP)

# A torchvision built for another torch (from another package index) installs without a word
# and fails at import: the install ends by checking that a ResNet (torchvision's) builds.
INSTALL_CHECK := main.py --check --device cpu --dataset synthetic --model resnet18 >/dev/null

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	$(PY) $(INSTALL_CHECK)
	touch $(STAMP)

run: $(STAMP)
	bash run.sh $(ARGS)

# Two workers: the suite alone leaves a core idle much of the time (its runs wait on timeouts,
# SLURM and process start-up). Which test goes where: tests/conftest.py's scheduler. Serial,
# e.g. to read one test's output: PYTEST_ARGS="-n 0".
WORKERS := -n 2

test: $(STAMP)
	$(PY) -m pytest tests $(WORKERS) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -m fast $(WORKERS) $(PYTEST_ARGS)

# The range's other end: requirements.txt's floor (torch>=X.Y) at its newest patch release, in a
# virtual environment of its own. The tests' own Python runs run.sh and the SLURM jobs too.
# Without pip's cache: PyPI's torch for x86-64 Linux is a CUDA build, whose wheels (about 4 GB)
# would otherwise stay on disk beside the 7 GB they unpack to.
OLDEST_VENV := .venv-oldest
OLDEST_TORCH := $(shell sed -n 's/^torch>=\([0-9.]*\),.*/\1/p' requirements.txt)

$(OLDEST_VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --no-cache-dir -r requirements.txt "torch==$(OLDEST_TORCH).*"
	$(OLDEST_VENV)/bin/python $(INSTALL_CHECK)
	touch $@

# The planted mistakes (about a minute) grade what the checks say, which the torch version does not
# change; the oldest torch runs the checks themselves on the solved and unsolved copies.
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest tests $(WORKERS) -m "not planted" $(PYTEST_ARGS)

# On a machine with a GPU: the CUDA/NCCL tests (skipped elsewhere), then the benchmark. Eight
# workers share the one GPU (2 minutes against about 7 one after another, H200); no GPU test
# needs the GPU to itself: those that time it take their reference in their own process.
GPU_WORKERS ?= 8

test-gpu: $(STAMP)
	$(PY) -m pytest tests -m gpu -rs -n $(GPU_WORKERS) $(PYTEST_ARGS)
	$(PY) benchmark.py

$(LINT_STAMP): requirements-dev.txt $(STAMP)
	$(PY) -m pip install -r requirements-dev.txt
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)

# Rewrites the Python files as make lint wants them (import order, then layout).
format: $(LINT_STAMP)
	$(VENV)/bin/ruff check --select I --fix .
	$(VENV)/bin/ruff format .

# The student's copy (make_exercise.py, docs/exercise.md): DIR=path, default exercise/ here;
# KEY=1 keeps the instructors' key (docs/concepts.md), which the copy otherwise leaves out.
DIR ?= exercise

exercise:
	$(PYTHON) make_exercise.py $(DIR) $(if $(KEY),--key)

# The checks of EXERCISES.md's parts to complete: EX=2.1 for one, all without. The module is
# also the plugin that says each failure in one line (-p), in place of pytest's report.
# PYTEST_ARGS='-k "test_ex6_1_..."' picks checks by name (tests/test_exercise.py does).
check: $(STAMP)
	PYTHONPATH=.:tests $(PY) -m pytest tests/exercise_checks.py -p exercise_checks \
		-p no:cacheprovider -q --no-header --tb=no -rN $(if $(EX),-k "ex$(subst .,_,$(EX))_") \
		$(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .pytest_cache __pycache__ tests/__pycache__
