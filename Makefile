# `make train` sets up .venv on first use with the core alone, `make test` (and lint, bench, soak)
# with the dev extras and DeepSpeed's CPU ops: both install uv.lock's exact versions (`uv sync
# --frozen`: the versions the suite last passed with; torch 2.13.0's CPU build from /opt/wheels).
# `make test-latest` runs the quick suite on the newest releases pyproject's ranges admit instead,
# in its own venv; `make lock` moves uv.lock to them once that passes.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# uv, pinned, installed beside the repo on first use (not into a venv it manages)
UV_VERSION := 0.13.9
UV := .uv/bin/uv
# make test's wall-time budget: past it tests/conftest.py fails `make test` where CI=1 is set
# (.ci/run); test-all prints the quick tests' summed durations over the workers against it.
TEST_BUDGET_S := 360
# Tests run in TEST_WORKERS processes (pytest-xdist), a test file at a time each, so that a file's
# shared runs (module fixtures) are made once: a launch leaves a core idle while ranks start and
# wait on each other, and a second worker fills it (`make test TEST_WORKERS=1` runs them in turn).
TEST_WORKERS ?= 2
PYTEST_IN = $(1)/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadfile
PYTEST := $(call PYTEST_IN,$(VENV))
QUICK := -m "not slow and not docs_in_order"
LATEST := .venv-latest

.PHONY: setup train test test-all test-latest test-matrix test-docs lint lock bench bench-peers soak clean

# DeepSpeed JIT-compiles its CPU ops at first use: its shared-memory collectives at the first
# zero run, CPUAdam at the first optimizer offload (about 100 s together here). Built once at
# the test setup instead, where there is no CUDA (the build lands in the venv's torch_extensions/,
# where trainer.distributed points DeepSpeed, built with the venv's ninja as a run's are); a
# training run builds them at first use.
CPU_OPS := import trainer.distributed, torch; from deepspeed.accelerator import get_accelerator; torch.cuda.is_available() or [get_accelerator().create_op_builder(name).load(verbose=False) for name in ("ShareMemCommBuilder", "CPUAdamBuilder")]

setup: $(VENV)/.dev

# --frozen: uv.lock as it is, never re-resolved; --inexact: what else the venv holds stays (the
# dev extras under make train, pip from --seed for the docs' `pip install -e '.[hf]'`).
UV_SYNC := UV_PROJECT_ENVIRONMENT=$(VENV) $(UV) sync -q --frozen --inexact

$(UV):
	python3 -m pip install -q --disable-pip-version-check --target .uv uv==$(UV_VERSION)

$(VENV)/.core: pyproject.toml uv.lock | $(UV)
	[ -d $(VENV) ] || $(UV) venv -q --seed --python python3.11 $(VENV)
	$(UV_SYNC)
	touch $@

# The test venv byte-compiled whole at install (uv: in parallel, 13 s here): where
# PYTHONDONTWRITEBYTECODE is set (this machine, CI) nothing else writes the .pyc files, and each of
# the suite's hundreds of processes would compile all it imports from source (torch: 2.4 s).
$(VENV)/.dev: $(VENV)/.core
	$(UV_SYNC) --extra dev --compile-bytecode
	DS_ACCELERATOR=cpu $(PY) -c '$(CPU_OPS)'
	touch $@

# The core venv is not compiled at install: its first run writes the .pyc files of what it imports,
# as Python does where PYTHONDONTWRITEBYTECODE is not set (a fresh clone's first loss: 2.4 s later,
# against 13 s to compile every module).
train: $(VENV)/.core
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m trainer $(ARGS)

test: setup  # every unit test, one multi-process run of each strategy, parity and resume (minutes)
	TEST_BUDGET_S=$(TEST_BUDGET_S) $(PYTEST) $(QUICK)

test-all: setup  # everything: also the tests marked slow (HF families, launchers, faults, 20 chaos kills); what CI runs
	TEST_BUDGET_S=$(TEST_BUDGET_S) $(PYTEST) -m "not docs_in_order"

test-chaos: setup  # only bench/chaos.py's 20 kills (in make test-all too), each resumed under another strategy (tests/test_chaos.py, ~7 min)
	$(PY) -m pytest -q -p no:cacheprovider -m chaos

test-latest: | $(UV)  # make test on the newest releases pyproject's ranges admit (not uv.lock's; torch stays 2.13.0), in .venv-latest
	rm -rf $(LATEST)
	$(UV) venv -q --python python3.11 $(LATEST)
	VIRTUAL_ENV=$(LATEST) $(UV) pip install -q --compile-bytecode --find-links /opt/wheels torch==2.13.0 -e '.[dev]'
	VIRTUAL_ENV=$(LATEST) $(UV) pip list | grep -E '^(transformers|deepspeed|peft|trl|accelerate|datasets|torch) '
	DS_ACCELERATOR=cpu $(LATEST)/bin/python -c '$(CPU_OPS)'
	TEST_BUDGET_S=$(TEST_BUDGET_S) $(call PYTEST_IN,$(LATEST)) $(QUICK)

lock: | $(UV)  # uv.lock to the newest releases the ranges admit: run after make test-latest passes, then make test-all
	$(UV) lock --upgrade

test-matrix: setup  # test-all with every crossing a test lists pairs of as the full product (tests/harness.py: crossings)
	TRAINER_TEST_FULL_MATRIX=1 $(PYTEST) -m "not docs_in_order"

test-docs: setup  # the docs' commands in reading order in one fresh dir, as a new user runs them (tests/test_docs_in_order.py)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 -m docs_in_order

lint: setup  # pyflakes, bugbear, import order ([tool.ruff] in pyproject.toml); CI runs it first
	$(VENV)/bin/ruff check trainer tests bench examples

bench: setup
	$(PY) bench/strategies.py --threads 1 $(ARGS)

bench-peers: setup  # the trainer against HF Trainer and TRL on the same model, data and batch (bench/peers.py; long)
	$(UV_SYNC) --extra dev --extra peers
	$(PY) bench/peers.py $(ARGS)

soak: setup  # the multi-process fault paths, many times (not part of `make test`)
	$(PY) tests/soak.py $(ARGS)

clean:
	rm -rf $(VENV) $(LATEST) .uv outputs multirun .pytest_cache
