"""`train.compile=true` compiles the model's blocks (regional compilation) under each wrapper that runs
them (DDP's, FSDP2's, DeepSpeed's engine) for the eager losses, and times the compiling step apart."""
from __future__ import annotations

import json

import pytest

from tests.harness import FULL_MATRIX, case, on_ranks, records, train_cases

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


# Measured here (fp32, 6 steps): compiled blocks give the eager losses to 3e-7 relative.
COMPILE_RTOL = 1e-5


def graphs_compiled_per_case(env, cases: dict, out_dir: str) -> dict[str, int]:
    """Train each case; the graphs torch.compile captured while it ran (0: nothing was compiled).
    Dynamo's caches are emptied first, or a case would reuse the graphs of the one before."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    compiled = {}
    for name, cfg in cases.items():
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        train_cases(env, {name: cfg}, out_dir)
        compiled[name] = counters["stats"]["unique_graphs"] - before
    return compiled


# One strategy per wrapper the compiled blocks run under: DDP's, FSDP2's fully_shard, DeepSpeed's
# engine with its parameter hooks (zero1/2: the same engine without them); all five under FULL_MATRIX.
COMPILED = STRATEGIES if FULL_MATRIX else ["ddp", "fsdp", "zero3"]


@pytest.mark.slow
def test_regional_compile_keeps_the_losses_under_each_wrapper(tmp_path):
    cases = {}
    for s in COMPILED:
        cases[f"{s}"] = case(s, steps=6)
        cases[f"{s}_compiled"] = case(s, steps=6, train__compile=True)
    graphs = on_ranks(2, graphs_compiled_per_case, cases, str(tmp_path))[0]
    for s in COMPILED:
        assert graphs[s] == 0 and graphs[f"{s}_compiled"] > 0, (s, graphs)  # the flag compiles the blocks
        eager = [r["loss"] for r in records(tmp_path / s)]
        compiled = [r["loss"] for r in records(tmp_path / f"{s}_compiled")]
        assert compiled == pytest.approx(eager, rel=COMPILE_RTOL), s
        events = [json.loads(line) for line in (tmp_path / f"{s}_compiled" / "metrics.jsonl").read_text().splitlines()]
        assert events[0]["event"] == "compiled" and events[0]["first_step_s"] > 0  # timed apart
