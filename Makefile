# Each target builds or reuses .venv from nothing: a fresh machine needs only python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEV_STAMP := $(VENV)/.dev-installed
CORE_STAMP := $(VENV)/.core-installed
DEMO_DIR ?= demo_out

.PHONY: test demo lint bench bench-reader clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(CORE_STAMP): setup.py setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(DEV_STAMP): setup.py setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,dask]'
	touch $@ $(CORE_STAMP)

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -ra

demo: $(CORE_STAMP)
	$(BIN)/python -m wsi_pipeline.demo --out $(DEMO_DIR)

bench: bench-reader

bench-reader: $(CORE_STAMP)
	$(BIN)/python benchmarks/bench_reader.py

clean:
	rm -rf $(VENV) $(DEMO_DIR)
