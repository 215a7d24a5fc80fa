"""Shared, built once per test session: tiny Hugging Face models, a tokenizer, text data."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

# One thread per process, for this process and every rank and command the tests start: the tests'
# models are tiny, and the suite runs several processes at once on few cores (two workers, each
# launching ranks), where ops split over threads wait for each other (8 tiny zero3 steps: 0.9 s on
# one thread, 5.6 s on two, measured with a second worker busy). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_STARTED = time.monotonic()
_QUICK = {"seconds": 0.0, "slow_ran": False}  # the controller's count, from every test's reports


def pytest_runtest_logreport(report):
    if "slow" in report.keywords:
        _QUICK["slow_ran"] = True
    else:
        _QUICK["seconds"] += report.duration  # setup, call and teardown


def pytest_sessionfinish(session, exitstatus):
    """The quick tests' time against their budget (TEST_BUDGET_S, which the Makefile passes), said
    at the end: `make test`'s own wall time, which past the budget on CI (CI=1) fails the run; under
    `make test-all`, whose quick and slow tests share the workers, the quick tests' summed
    durations over the workers, said only (a sum is not the wall time the budget is of)."""
    budget = os.environ.get("TEST_BUDGET_S")
    if not budget or hasattr(session.config, "workerinput"):  # the controller's clock
        return
    workers = getattr(session.config.option, "numprocesses", None) or 1
    if _QUICK["slow_ran"]:
        took = _QUICK["seconds"] / workers
        said = f"make test's tests took {_QUICK['seconds']:.0f} s in all here, {took:.0f} s over {workers} workers"
    else:
        took = time.monotonic() - _STARTED
        said = f"make test took {took:.0f} s"
    past = took > float(budget)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.ensure_newline()
    reporter.write_line(
        f"{said}, {'past' if past else 'within'} its budget of {float(budget):.0f} s (TEST_BUDGET_S in the Makefile)")
    if past and os.environ.get("CI") and not _QUICK["slow_ran"]:  # test-all's figure is a sum, said only
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def hf_assets(tmp_path_factory):
    from trainer.demo import FAMILIES, documents, make_model_dir, train_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("hf")
    docs = documents()
    tokenizer = train_tokenizer(root / "tokenizer", docs)
    return SimpleNamespace(
        root=root, docs=docs, tokenizer=tokenizer,
        jsonl=write_jsonl(root / "train.jsonl", docs),
        cache=root / "cache",
        # from config.json only, and with saved weights + the tokenizer
        config_only={f: make_model_dir(root / f"{f}_config", f, weights=False) for f in FAMILIES},
        pretrained={f: make_model_dir(root / f"{f}_weights", f, weights=True, tokenizer=tokenizer, seed=1)
                    for f in FAMILIES},
    )
