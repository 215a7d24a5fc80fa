"""`train.profile=A:B` traces steps A to B, both ends included and nothing else, on every rank under
every strategy (a torch profiler trace per rank, with its aten ops)."""
from __future__ import annotations

import json

import pytest

from tests.harness import case, on_ranks, train_cases

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def test_a_profile_range_holds_both_of_its_ends_and_nothing_else(tmp_path):
    """train.profile=2:3: steps 2 and 3, inclusive (docs/watching.md)."""
    import torch

    from trainer.training.steps import StepProfiler

    profiler, x = StepProfiler("2:3", tmp_path, 0, torch.device("cpu")), torch.ones(8, 8)
    for step in range(1, 5):
        profiler.before(step)
        x = x @ x / 8
        profiler.after(step)
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}


@pytest.mark.slow
def test_a_profile_of_the_chosen_steps_under_every_strategy(tmp_path):
    cases = {s: case(s, steps=4, train__profile="2:3") for s in STRATEGIES}
    on_ranks(2, train_cases, cases, str(tmp_path))
    for strategy in STRATEGIES:
        for rank in (0, 1):
            trace = json.loads((tmp_path / strategy / "profile" / f"trace_rank{rank}.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert {"ProfilerStep#2", "ProfilerStep#3"} <= names, (strategy, sorted(n for n in names if "Step" in n))
            assert any("aten::" in n for n in names), strategy
