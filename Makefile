# `make test` and friends set everything up on a fresh machine: a virtual
# environment, torch (the CPU wheel when no CUDA driver is present, so no
# multi-GB download), then this package with its dev extras.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0

# `make serve` runs the bundled demo checkpoint; MODEL=/path/to/checkpoint serves another.
MODEL ?= checkpoints/kimi-vl-shapes
PORT  ?= 8000
CONFIG ?= configs/local.yaml

.PHONY: setup test lint bench serve clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q torch; \
	else \
	  $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check epd shapes tests scripts
	$(VENV)/bin/ruff format --check epd shapes tests scripts
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

serve: setup
	exec $(PY) -m epd.cli serve --config $(CONFIG) --model "$(MODEL)" --port $(PORT) $(SERVE_FLAGS)

bench: setup
	$(PY) scripts/bench_model.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
