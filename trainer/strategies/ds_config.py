"""The ds_config of a zero run: built from our settings, a user's file merged in, checked before
any work (no `import deepspeed` here: the checks run before any rank starts)."""
from __future__ import annotations

import json
from pathlib import Path

from trainer.config import GradReduce, Precision, ReduceDtype, StrategyName
from trainer.distributed import device_type
from trainer.errors import ConfigError

ZERO_STAGE = {StrategyName.zero1: 1, StrategyName.zero2: 2, StrategyName.zero3: 3}
# ZeRO-3 keeps parameters of fewer elements than this whole on every rank (DeepSpeed's default
# stage3_param_persistence_threshold): they are gathered once per step, not per forward/backward.
ZERO3_PERSISTENCE_THRESHOLD = 100_000
# Keys the loop owns: a user's ds_config may leave them "auto" or repeat our value, nothing else.
OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
              "gradient_clipping", "zero_optimization.stage", "bf16.enabled", "fp16.enabled",
              "communication_data_type", "data_types.grad_accum_dtype")


def _merge(ours: dict, theirs: dict, path: str = "") -> dict:
    """`theirs` over `ours`; their "auto" takes our value; owned keys must agree with ours."""
    merged = dict(ours)
    for key, value in theirs.items():
        full = f"{path}{key}"
        if isinstance(value, dict) and isinstance(ours.get(key), dict):
            merged[key] = _merge(ours[key], value, f"{full}.")
        elif value == "auto":
            if key not in ours:
                raise ConfigError(f"strategy.deepspeed_config: no value of ours can fill {full}='auto'")
        elif full in OWNED_KEYS and key in ours and value != ours[key]:
            raise ConfigError(f"strategy.deepspeed_config: {full}={value!r} disagrees with the trainer's "
                              f"{ours[key]!r}; set it through the trainer's config or write \"auto\"")
        elif full in ("optimizer", "scheduler"):
            raise ConfigError(f"strategy.deepspeed_config: '{full}' comes from optim.* here; remove it")
        else:
            merged[key] = value
    return merged


def reduce_dtypes(reduce: ReduceDtype, precision: Precision, stage: int) -> dict:
    """strategy.reduce_dtype as DeepSpeed's settings. Under bf16 DeepSpeed reduces in bf16 by
    default; fp32 here means reducing in fp32 ("communication_data_type") and, on ZeRO-2/3, keeping
    the reduced gradient partitions in fp32 ("grad_accum_dtype"). ZeRO-1 keeps them in bf16:
    DeepSpeed gives bf16 + fp32 accumulation on stage 1 to another optimizer (BF16_Optimizer)."""
    if precision is Precision.fp32:
        return {}
    dtype = ReduceDtype(reduce).value  # DeepSpeed's names are ours: fp32, bf16, fp16
    return {"communication_data_type": dtype, **({"data_types": {"grad_accum_dtype": dtype}} if stage > 1 else {})}


def build_ds_config(cfg, world_size: int) -> dict:
    """Our settings as a ds_config (a user's file merged in); raises ConfigError before any work."""
    s, t = cfg.strategy, cfg.train
    precision = Precision(t.precision)
    if precision is Precision.fp16 and device_type() == "cpu":
        raise ConfigError("train.precision: DeepSpeed on CPU supports bf16 and fp32, not fp16")
    from trainer.memory import reduce_bucket_elements, zero3_prefetch_elements
    from trainer.models import model_facts

    # Buckets sized by the model (DeepSpeed's default reduce bucket of 5e8 elements is 2 GB in fp32).
    d_model = model_facts(cfg.model, s.wrap).d_model
    zero: dict = {"stage": ZERO_STAGE[StrategyName(s.name)], "reduce_bucket_size": reduce_bucket_elements(d_model)}
    if zero["stage"] == 3:
        zero["stage3_prefetch_bucket_size"] = zero3_prefetch_elements(d_model)
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type() == "cuda"}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type() == "cuda"}
    ours = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": t.micro_batch_size * world_size,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": precision is Precision.bf16},
        "fp16": {"enabled": precision is Precision.fp16},
        **reduce_dtypes(ReduceDtype(s.reduce_dtype), precision, zero["stage"]),
        # The loop owns accumulation. grad_reduce=step: DeepSpeed's managed accumulation over
        # single micro-steps, their reductions coalesced by `micro_step`; micro_step: unmanaged,
        # every backward reduces (ZeRO-2/3: into partitions) and engine.step() is the boundary.
        "managed_gradient_accumulation": GradReduce(s.grad_reduce) is GradReduce.step,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2 ** 31,
        "wall_clock_breakdown": False,
    }
    if s.tp > 1:  # DeepSpeed's AutoTP (ds_tp.py)
        # AutoTP's own vocabulary-parallel head stays off: it would split a tied output layer with its
        # embedding and replace a Hugging Face model's loss; ds_tp.py splits an untied one's logits
        ours["tensor_parallel"] = {"autotp_size": s.tp, "vocab_parallel_lm_head": False}
        # with AutoTP, ZeRO-1/2 check train_batch_size against micro x the world, ZeRO-3 against micro x
        # the data-parallel ranks: no value passes both; left out, each derives its own
        del ours["train_batch_size"]
    if not s.deepspeed_config:
        return ours
    path = Path(s.deepspeed_config)
    if not path.is_file():
        raise ConfigError(f"strategy.deepspeed_config: no file {path}")
    merged = _merge(ours, json.loads(path.read_text()))
    for key, setting in (("offload_optimizer", "strategy.offload_optimizer"), ("offload_param", "strategy.offload_params")):
        theirs = (merged["zero_optimization"].get(key) or {}).get("device", "none") != "none"
        if theirs != (key in zero):
            raise ConfigError(f"strategy.deepspeed_config: zero_optimization.{key} turns offload "
                              f"{'on' if theirs else 'off'}, {setting}={str(key in zero).lower()} turns it "
                              f"{'on' if key in zero else 'off'}; choose with {setting}")
    said = (merged.get("tensor_parallel") or {}).get("autotp_size", 0)
    if said not in ((0, 1) if s.tp == 1 else (s.tp,)):  # AutoTP splits weights the trainer must know split
        raise ConfigError(f"strategy.deepspeed_config: tensor_parallel.autotp_size={said} disagrees with "
                          f"strategy.tp={s.tp}; choose with strategy.tp")
    return merged
