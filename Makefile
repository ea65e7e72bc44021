# Two commands from a bare checkout: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all test-gpu demo lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest

# On a CUDA machine, with its own Python (no venv): see README, "Development".
test-gpu:
	bash scripts/test_gpu.sh

demo: $(STAMP)
	$(PY) scripts/predict.py

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_cg bench tests scripts

clean:
	rm -rf $(VENV) outputs multirun
