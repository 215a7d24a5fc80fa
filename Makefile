# `make train` and `make test` set up .venv on first use: torch==2.13.0 first (the CPU wheel
# on this machine's disk), then the project with its dev extras.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup train test bench soak clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

train: setup
	$(PY) -m trainer $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

bench: setup
	$(PY) bench/strategies.py --threads 1 $(ARGS)

soak: setup  # the multi-process fault paths, many times (not part of `make test`)
	$(PY) tests/soak.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
