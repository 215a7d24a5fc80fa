"""Every weight right: what a pretrained folder may hold, fresh initialisation with
transformers' own spread, frozen parameters and persistent buffers under every strategy, uneven
shards, signals at the edges of a step, resumes that are exact (dropout, new ranks), and a
tokenised-data cache that outlasts the collective timeout, a killed writer and shared nodes."""
from __future__ import annotations

import pytest
import torch

from tests.harness import (
    case,
    on_ranks,
)
from trainer.config import to_config
from trainer.strategies.base import optimizer_step

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def reduced_bytes(env) -> dict:
    """Bytes the gradient collectives carry in one bf16 step, per strategy and strategy.reduce_dtype."""
    from tests.harness import CollectiveBytes
    from tests.test_core_behaviour import build, loss_of

    out = {}
    for strategy_name in ("ddp", "fsdp", "zero2", "zero3"):
        for dtype in ("fp32", "bf16"):
            strategy, model, _ = build(env, case(strategy_name, train__precision="bf16",
                                                 strategy__reduce_dtype=dtype))
            x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
            counter = CollectiveBytes()
            with counter:
                with strategy.autocast():
                    loss = loss_of(model, x)
                strategy.backward(loss)
                optimizer_step(strategy, 1.0)
            strategy.teardown()
            out[(strategy_name, dtype)] = counter.bytes
    return out


@pytest.mark.slow
def test_gradients_are_reduced_in_the_reduce_dtype_on_every_backend():
    from trainer.config import GradReduce, Precision, ReduceDtype, StrategyName
    from trainer.models import model_facts
    from trainer.plan import step_traffic
    from trainer.strategies.ds_config import ZERO3_PERSISTENCE_THRESHOLD

    measured = on_ranks(2, reduced_bytes)[0]
    facts = model_facts(to_config(case("ddp")).model, None)
    for (strategy, dtype), carried in measured.items():
        planned = step_traffic(StrategyName(strategy), facts.params, facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), 2, Precision.bf16, 1,
                               GradReduce.step, offload=False, reduce_dtype=ReduceDtype(dtype))
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert carried[kind] == pytest.approx(planned[kind], rel=0.02, abs=64), (strategy, dtype, carried, planned)
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        fp32, bf16 = measured[(strategy, "fp32")], measured[(strategy, "bf16")]
        kind = "all_reduce" if strategy in ("ddp", "zero2") else "reduce_scatter"
        assert fp32[kind] == pytest.approx(2 * bf16[kind], rel=0.02), (strategy, fp32, bf16)


@pytest.mark.parametrize("precision,reduce_dtype", [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "bf16")])
def test_gradients_reduce_in_fp32_or_the_training_dtype(precision, reduce_dtype):
    from trainer.checks import validate
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=f"strategy.reduce_dtype: fp32, or the training dtype "
                                          f"\\(train.precision={precision}\\); got {reduce_dtype}"):
        validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": reduce_dtype}}))
    validate(to_config({"train": {"precision": precision}, "strategy": {"reduce_dtype": precision}}))
