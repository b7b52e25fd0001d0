# make install: a virtual environment in .venv; make run: the main job locally;
# make test: install if needed, then every test (SLURM tests run when root can start SLURM;
# GPU tests when there is a GPU). make test-gpu: the GPU tests and benchmark.py alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast test-gpu clean

install: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

run: $(STAMP)
	bash run.sh $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slurm" $(PYTEST_ARGS)

# On a machine with a GPU: the CUDA/NCCL tests (skipped elsewhere), then the benchmark.
test-gpu: $(STAMP)
	$(PY) -m pytest tests -m gpu -rs $(PYTEST_ARGS)
	$(PY) benchmark.py

clean:
	rm -rf $(VENV) .pytest_cache __pycache__ tests/__pycache__
