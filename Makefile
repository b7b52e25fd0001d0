# make install: a virtual environment in .venv; make run: the main job locally;
# make test: install if needed, then every test (SLURM tests run when root can start SLURM).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast clean

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

clean:
	rm -rf $(VENV) .pytest_cache __pycache__ tests/__pycache__
