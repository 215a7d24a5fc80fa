"""Bytes per rank that each strategy holds, in theory: the ZeRO paper's table (params, grads, optimizer state, each
sharded or not).

The runtime metrics (docs/design.md, Step records) are checked against `per_rank_bytes`, and the planner is
built on it. Bytes per parameter, by what each backend keeps (`master_weights=True`, ours):
- DDP: fp32 parameters and gradients (bf16/fp16 come from autocast), two fp32 Adam moments.
- FSDP2: the same, sharded: its fp32 sharded parameters are the masters, gradients reduce in fp32.
- DeepSpeed ZeRO: parameters and gradients in the training dtype, plus an fp32 master
  partition (even in fp32 training), counted as optimizer state as the ZeRO paper does: K=12.
  ZeRO-2/3 keep their reduced gradient partitions in the reduce dtype (`strategy.reduce_dtype`,
  fp32 by default); ZeRO-1 in the training dtype.
`master_weights=False` is pure low-precision training (bf16 params/grads, fp32 moments, no
fp32 copy: K=8), the "14 + 14 + 56 GB for 7B" textbook case.
"""
from __future__ import annotations

from trainer.config import GradReduce, Precision, ReduceDtype, Sharding, StrategyName

DTYPE_BYTES = {Precision.fp32: 4, Precision.bf16: 2, Precision.fp16: 2}
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4


def fsdp_shard_count(sharding: Sharding, world_size: int, local_world_size: int) -> int:
    """Ranks one parameter is split over: NO_SHARD none, HYBRID_SHARD the ranks of one node."""
    return {Sharding.NO_SHARD: 1, Sharding.HYBRID_SHARD: local_world_size}.get(sharding, world_size)


def reduce_bytes(precision: Precision, reduce_dtype: ReduceDtype = ReduceDtype.fp32) -> int:
    """Bytes per gradient element as the ranks reduce it: fp32 unless strategy.reduce_dtype names the
    training dtype (bf16 or fp16)."""
    return 4 if ReduceDtype(reduce_dtype) is ReduceDtype.fp32 else DTYPE_BYTES[Precision(precision)]


def bytes_per_param(strategy: StrategyName, precision: Precision, master_weights: bool = True,
                    reduce_dtype: ReduceDtype = ReduceDtype.fp32) -> dict[str, int]:
    """Unsharded bytes per parameter: {"params", "grads", "optim"}."""
    b = DTYPE_BYTES[precision]
    if not master_weights:
        return {"params": b, "grads": b, "optim": ADAM_MOMENT_BYTES}
    if strategy in (StrategyName.ddp, StrategyName.fsdp):
        return {"params": 4, "grads": 4, "optim": ADAM_MOMENT_BYTES}
    grads = reduce_bytes(precision, reduce_dtype) if strategy in (StrategyName.zero2, StrategyName.zero3) else b
    return {"params": b, "grads": grads, "optim": ADAM_MOMENT_BYTES + MASTER_BYTES}


def async_save_bytes(trainable: int, frozen: int, world_size: int, frozen_saved: bool = True) -> int:
    """checkpoint.async's host copy on one rank, kept for the run: its share of what a step dir holds,
    in fp32 (each range is saved by one rank, whatever the strategy): a trainable parameter's value
    and its two Adam moments, a frozen one's value unless it is read from pretrained files (LoRA's base)."""
    return 4 * (3 * trainable + (frozen if frozen_saved else 0)) // world_size


# Which of params / grads / optim each strategy splits over the ranks.
SHARDED = {StrategyName.ddp: (), StrategyName.zero1: ("optim",), StrategyName.zero2: ("grads", "optim"),
           StrategyName.zero3: ("params", "grads", "optim"), StrategyName.fsdp: ("params", "grads", "optim")}


def per_rank_bytes(strategy: StrategyName, n_params: int, world_size: int, precision: Precision = Precision.fp32,
                   fsdp_shards: int | None = None, master_weights: bool = True,
                   reduce_dtype: ReduceDtype = ReduceDtype.fp32) -> dict[str, int]:
    shards = (fsdp_shards or world_size) if strategy is StrategyName.fsdp else world_size
    per_param = bytes_per_param(strategy, precision, master_weights, reduce_dtype)
    return {k: per_param[k] * n_params // (shards if k in SHARDED[strategy] else 1) for k in per_param}


def reduce_bucket_elements(d_model: int) -> int:
    """DeepSpeed's reduce bucket as the trainer sizes it: d_model squared (the HF Trainer's "auto"),
    not DeepSpeed's default 5e8 elements (2 GB in fp32, whatever the model)."""
    return d_model * d_model


def zero3_prefetch_elements(d_model: int) -> int:
    """The parameters ZeRO-3 gathers ahead of the layer that needs them: 0.9 x d_model squared (the HF
    Trainer's "auto"), not DeepSpeed's fixed 5e7 elements (a 30M model's weights all gathered at once:
    7 % more peak memory a rank on the peers bench, at the same speed)."""
    return int(0.9 * d_model * d_model)


def peak_gradient_bytes(strategy: StrategyName, sharded_grads: int, n_params: int, grad_accum_steps: int,
                        grad_reduce: GradReduce, precision: Precision = Precision.fp32) -> int:
    """The gradient bytes a rank holds at their peak. Accumulating with grad_reduce=step, a
    sharding strategy holds every unsharded gradient until the final micro-step reduces them
    (FSDP2 in fp32; ZeRO-3 keeps its partition buffer beside them, FSDP2 and ZeRO-2 make theirs
    at that reduction). DDP and ZeRO-1 hold every gradient anyway; micro_step keeps them sharded."""
    sharding = strategy in (StrategyName.fsdp, StrategyName.zero2, StrategyName.zero3)
    if not sharding or grad_accum_steps == 1 or GradReduce(grad_reduce) is GradReduce.micro_step:
        return sharded_grads
    full = n_params * (4 if strategy is StrategyName.fsdp else DTYPE_BYTES[precision])
    return full + sharded_grads if strategy is StrategyName.zero3 else full
