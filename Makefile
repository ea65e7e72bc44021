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
	$(PY) -m pip install -q -e '.[dev,demo]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest

# On a CUDA machine, with its own Python (no venv): see README, "Development".
test-gpu:
	bash scripts/test_gpu.sh

# Each pass (5 on a GPU, in bf16-mixed) serves the photos 4 times, one a batch: a
# pass is captured for once earlier passes ran long enough eagerly, and the later
# passes show the steady state.
demo: $(STAMP)
	$(PY) scripts/predict.py data.batch_size=1 data.repeats=4 \
		$$($(PY) -c 'import torch; print("trainer=gpu" * torch.cuda.is_available())')

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_cg examples bench tests scripts
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) outputs multirun
