"""One backend per file; `build_strategy` is the only place that maps a name to a backend."""
from __future__ import annotations

from trainer.config import Config, StrategyName
from trainer.distributed import DistEnv
from trainer.strategies.base import Strategy


def build_strategy(cfg: Config, env: DistEnv) -> Strategy:
    name = StrategyName(cfg.strategy.name)
    if name is StrategyName.ddp:
        from trainer.strategies.ddp import DDPStrategy as cls
    elif name is StrategyName.fsdp:
        from trainer.strategies.fsdp import FSDPStrategy as cls
    else:
        from trainer.strategies.deepspeed import DeepSpeedStrategy as cls
    return cls(cfg, env)
