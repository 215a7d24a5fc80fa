# `make train` sets up .venv on first use with the core alone: torch==2.13.0 first (the CPU wheel
# on this machine's disk), then the project. `make test` (and lint, bench, soak) add the dev
# extras and DeepSpeed's CPU ops into the same venv.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# make test's wall-time budget: past it tests/conftest.py fails `make test` where CI=1 is set
# (.ci/run); test-all prints the quick tests' summed durations over the workers against it.
TEST_BUDGET_S := 360
# Tests run in TEST_WORKERS processes (pytest-xdist), a test file at a time each, so that a file's
# shared runs (module fixtures) are made once: a launch leaves a core idle while ranks start and
# wait on each other, and a second worker fills it (`make test TEST_WORKERS=1` runs them in turn).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup train test test-all test-matrix test-docs lint bench bench-peers soak clean

# DeepSpeed JIT-compiles its CPU ops at first use: its shared-memory collectives at the first
# zero run, CPUAdam at the first optimizer offload (about 100 s together here). Built once at
# the test setup instead, where there is no CUDA (the build lands in the venv's torch_extensions/,
# where trainer.distributed points DeepSpeed, built with the venv's ninja as a run's are); a
# training run builds them at first use.
CPU_OPS := import trainer.distributed, torch; from deepspeed.accelerator import get_accelerator; torch.cuda.is_available() or [get_accelerator().create_op_builder(name).load(verbose=False) for name in ("ShareMemCommBuilder", "CPUAdamBuilder")]

setup: $(VENV)/.dev

# pip byte-compiles every module at install (torch: 61 s of its install here, 23 s without):
# kept, since where PYTHONDONTWRITEBYTECODE is set (this machine, CI) nothing else writes the
# .pyc files, and every rank process would compile all it imports from source, every time.
PIP_INSTALL := $(PY) -m pip install -q

$(VENV)/.core: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PIP_INSTALL) -e '.[dev]'
	DS_ACCELERATOR=cpu $(PY) -c '$(CPU_OPS)'
	touch $@

train: $(VENV)/.core
	$(PY) -m trainer $(ARGS)

test: setup  # every unit test, one multi-process run of each strategy, parity and resume (minutes)
	TEST_BUDGET_S=$(TEST_BUDGET_S) $(PYTEST) -m "not slow and not docs_in_order"

test-all: setup  # everything: also the tests marked slow (HF families, launchers, faults); what CI runs
	TEST_BUDGET_S=$(TEST_BUDGET_S) $(PYTEST) -m "not docs_in_order"

test-matrix: setup  # test-all with every crossing a test lists pairs of as the full product (tests/harness.py: crossings)
	TRAINER_TEST_FULL_MATRIX=1 $(PYTEST) -m "not docs_in_order"

test-docs: setup  # the docs' commands in reading order in one fresh dir, as a new user runs them (tests/test_docs_in_order.py)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 -m docs_in_order

lint: setup  # pyflakes, bugbear, import order ([tool.ruff] in pyproject.toml); CI runs it first
	$(VENV)/bin/ruff check trainer tests bench examples

bench: setup
	$(PY) bench/strategies.py --threads 1 $(ARGS)

bench-peers: setup  # the trainer against HF Trainer and TRL on the same model, data and batch (bench/peers.py; long)
	$(PY) -m pip install -q -e '.[peers]'
	$(PY) bench/peers.py $(ARGS)

soak: setup  # the multi-process fault paths, many times (not part of `make test`)
	$(PY) tests/soak.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
