# `make serve` and `make test` set everything up on a fresh machine: a virtual environment,
# torch, then this package: with what serving needs for `serve`, with the dev extras for `test`.
# torch: the CUDA build where `nvidia-smi` runs; elsewhere TORCH_CPU as pip finds it. PyPI's
# Linux wheel of torch is the CUDA build (several GB): for the CPU build (~200 MB) name
# PyTorch's CPU index, `make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?=

# `make serve` runs the bundled demo checkpoint; MODEL=/path/to/checkpoint serves another.
MODEL ?= checkpoints/kimi-vl-shapes
PORT  ?= 8000
CONFIG ?= configs/local.yaml

.PHONY: setup serve-setup test lint bench serve clean

serve-setup: $(VENV)/.serving
setup: $(VENV)/.installed

$(VENV)/.serving: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q torch; \
	else \
	  $(PY) -m pip install -q $(TORCH_CPU) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.serving
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check epd shapes tests scripts
	$(VENV)/bin/ruff format --check epd shapes tests scripts
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

serve: serve-setup
	exec $(PY) -m epd.cli serve --config $(CONFIG) --model "$(MODEL)" --port $(PORT) $(SERVE_FLAGS)

bench: setup
	$(PY) scripts/bench_model.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
