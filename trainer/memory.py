"""Bytes per rank that each strategy holds, in theory: the table of DESIGN and the ZeRO paper.

`per_rank_bytes` is what the runtime metrics (DESIGN §4) are checked against and what the
planner builds on. Bytes per parameter: params and grads in the training dtype, except
FSDP2 (sharded fp32 params are the masters; gradients reduced in fp32); Adam keeps two fp32
moments; DeepSpeed ZeRO also keeps an fp32 master partition (even in fp32 training) that
we count as optimizer state, as the ZeRO paper does (K = 12 bytes per parameter).
"""
from __future__ import annotations

from trainer.config import Precision, Sharding, StrategyName

DTYPE_BYTES = {Precision.fp32: 4, Precision.bf16: 2, Precision.fp16: 2}


def fsdp_shard_count(sharding: Sharding, world_size: int, local_world_size: int) -> int:
    """Ranks one parameter is split over: NO_SHARD none, HYBRID_SHARD the ranks of one node."""
    return {Sharding.NO_SHARD: 1, Sharding.HYBRID_SHARD: local_world_size}.get(sharding, world_size)


def per_rank_bytes(strategy: StrategyName, n_params: int, world_size: int,
                   precision: Precision = Precision.fp32, fsdp_shards: int | None = None) -> dict[str, int]:
    n, p = world_size, n_params
    if strategy is StrategyName.fsdp:
        shards = fsdp_shards or n
        return {"params": 4 * p // shards, "grads": 4 * p // shards, "optim": 8 * p // shards}
    if strategy is StrategyName.ddp:  # fp32 parameters; bf16/fp16 come from autocast
        return {"params": 4 * p, "grads": 4 * p, "optim": 8 * p}
    b = DTYPE_BYTES[precision]
    optim = 12 * p // n
    if strategy is StrategyName.zero1:
        return {"params": b * p, "grads": b * p, "optim": optim}
    if strategy is StrategyName.zero2:
        return {"params": b * p, "grads": b * p // n, "optim": optim}
    return {"params": b * p // n, "grads": b * p // n, "optim": optim}
