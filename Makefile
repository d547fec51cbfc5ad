# `make serve` and `make test` work on a fresh machine: each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build, pinned, when no torch is installed yet: an unpinned "torch" would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# Test processes beside each other (a module's tests stay in one); the serial-marked modules run alone after.
TEST_WORKERS ?= 2

.PHONY: setup serve test lint format

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/deltaserve serve $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=10 tests
	$(VENV)/bin/pytest -q -x -m serial --durations=5 tests

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
