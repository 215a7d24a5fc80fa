"""Typed config schema (registered in Hydra's ConfigStore) and the checks Hydra cannot express.

Hydra already rejects an unknown group option (`strategy=zero4`), an unknown key and an enum
value out of range (`train.precision=fp8`), naming the key and the allowed values. `validate`
covers the cross-field rules and fails before any process or tensor is created.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


class StrategyName(str, Enum):
    auto = "auto"  # the planner picks (trainer/plan.py)
    ddp = "ddp"
    fsdp = "fsdp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"


class Sharding(str, Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    NO_SHARD = "NO_SHARD"


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class DataName(str, Enum):
    text = "text"
    synthetic = "synthetic"


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.ddp
    offload_optimizer: bool = False
    offload_params: bool = False
    sharding: Sharding = Sharding.FULL_SHARD  # fsdp only
    wrap: Optional[List[str]] = None  # block classes to shard; None: the model's _no_split_modules
    deepspeed_config: Optional[str] = None  # a ds_config.json merged under ours (zero1/2/3)


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    shape_only: bool = False  # too big to train here: built on the meta device, for planning


@dataclass
class DataConfig:
    name: DataName = DataName.text
    path: Optional[str] = None  # a UTF-8 text file; None: the bundled corpus
    num_samples: int = 2048  # synthetic only


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step


@dataclass
class TrainConfig:
    max_steps: int = 60  # 0: run `epochs` full epochs
    epochs: int = 1
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    grad_clip: float = 1.0  # 0: no clipping (the norm is still reported)
    seed: int = 1234
    precision: Precision = Precision.fp32
    activation_checkpointing: bool = False
    log_every: int = 10


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    every_steps: int = 0
    keep_last: int = 2
    resume: str = "auto"  # auto | none | PATH


@dataclass
class PlanConfig:
    world_size: Optional[int] = None  # None: the run's (nproc, or the launcher's WORLD_SIZE)
    gpu_memory_gb: float = 80.0  # the budget per device where no GPU reports one (CPU)
    master_weights: bool = True  # False: pure bf16 training, no fp32 copy of the weights
    json: bool = False


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    nproc: int = 1  # local ranks to spawn when no launcher started this process


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="trainer_schema", node=Config)


class ConfigError(ValueError):
    """A bad setting, found before any work starts."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate(cfg: Config | DictConfig) -> None:
    s, t, m = cfg.strategy, cfg.train, cfg.model
    name = StrategyName(s.name)
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    _require(t.grad_accum_steps >= 1, "train.grad_accum_steps", f"must be >= 1, got {t.grad_accum_steps}")
    _require(t.max_steps >= 0, "train.max_steps", f"must be >= 0, got {t.max_steps}")
    _require(t.max_steps > 0 or t.epochs >= 1, "train.epochs", "must be >= 1 when train.max_steps=0")
    _require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}")
    _require(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
    _require(cfg.nproc >= 1, "nproc", f"must be >= 1, got {cfg.nproc}")
    _require(m.d_model % m.n_heads == 0, "model.n_heads", f"must divide model.d_model={m.d_model}")
    _require(m.mlp in ("gelu", "swiglu"), "model.mlp", f"allowed values: gelu, swiglu; got {m.mlp!r}")
    _require(m.norm in ("layernorm", "rmsnorm"), "model.norm", f"allowed values: layernorm, rmsnorm; got {m.norm!r}")
    _require(not m.shape_only, "model", f"model={m.name} is shape-only (for `python -m trainer.plan`); "
             "train one of tiny, small, gpt_125m, gpt_1b")
    _require(not (s.offload_params and name not in (StrategyName.fsdp, StrategyName.zero3)),
             "strategy.offload_params", f"only fsdp and zero3 shard parameters; strategy={name.value} "
             "cannot offload them (use strategy=zero3 or strategy=fsdp)")
    _require(not (s.offload_optimizer and name is StrategyName.ddp), "strategy.offload_optimizer",
             "ddp keeps the optimizer on the device; use zero1, zero2, zero3 or fsdp to offload it")
    _require(s.deepspeed_config is None or name.value.startswith("zero"), "strategy.deepspeed_config",
             f"only read by zero1/zero2/zero3, not strategy={name.value}")
    _require(Sharding(s.sharding) is Sharding.FULL_SHARD or name is StrategyName.fsdp,
             "strategy.sharding", f"only read by strategy=fsdp, not strategy={name.value}")


def to_config(cfg: DictConfig | dict) -> Config:
    """A typed Config (enums as enums) from Hydra's DictConfig or a plain dict sent to a worker."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    return OmegaConf.to_object(merged)
