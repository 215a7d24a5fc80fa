"""One backend per file; `build_strategy` is the only place that maps a name to a backend."""
from __future__ import annotations

from trainer.config import Config, Sharding, StrategyName
from trainer.distributed import DistEnv, launcher_env
from trainer.errors import ConfigError
from trainer.strategies.base import Strategy


def build_strategy(cfg: Config, env: DistEnv) -> Strategy:
    name = StrategyName(cfg.strategy.name)
    if name is StrategyName.auto:
        raise ValueError("strategy=auto must be resolved by the planner before a strategy is built")
    if name is StrategyName.ddp:
        from trainer.strategies.ddp import DDPStrategy as cls
    elif name is StrategyName.fsdp:
        from trainer.strategies.fsdp import FSDPStrategy as cls
    else:
        from trainer.strategies.deepspeed import DeepSpeedStrategy as cls
    return cls(cfg, env)


# coalesce_grad_reduction (0.19.2); unmanaged accumulation (0.19.5); ZeRO-3's overflow check as
# trainer.patches replaces it, and combine_grad_norm_groups (0.19.8)
MIN_DEEPSPEED = "0.19.8"


def check_deepspeed_version(installed: str) -> None:
    from packaging.version import Version

    if Version(installed) < Version(MIN_DEEPSPEED):
        raise ConfigError(f"strategy: DeepSpeed {installed} is installed; the zero strategies need >= {MIN_DEEPSPEED} "
                          f"(engine.coalesce_grad_reduction, unmanaged gradient accumulation): "
                          f"pip install 'deepspeed>={MIN_DEEPSPEED}'")


def preflight(cfg: Config, world_size: int) -> None:
    """Backend-specific checks of the settings, run once before any rank starts."""
    if StrategyName(cfg.strategy.name) is StrategyName.fsdp and Sharding(cfg.strategy.sharding) is Sharding.HYBRID_SHARD:
        node = int(launcher_env().get("LOCAL_WORLD_SIZE", cfg.nproc))  # HSDP shards within a node
        if world_size % node:
            raise ConfigError(f"strategy.sharding: HYBRID_SHARD shards within a node ({node} ranks) and replicates "
                              f"across nodes, so the world size {world_size} must be a multiple of {node}")
    sharding = Sharding(cfg.strategy.sharding)
    if cfg.strategy.ep > 1 and StrategyName(cfg.strategy.name) is StrategyName.fsdp and sharding not in (
            Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP):
        raise ConfigError(f"strategy.ep: with strategy.sharding={sharding.value} the other weights would replicate "
                          "across nodes while the experts shard over world / ep, which is not tested yet; use "
                          "strategy.sharding=FULL_SHARD or SHARD_GRAD_OP")
    if StrategyName(cfg.strategy.name).value.startswith("zero"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("deepspeed")
        except PackageNotFoundError:  # a refusal like any other (an out-of-memory restart skips the fallback)
            raise ConfigError(f"strategy: strategy={StrategyName(cfg.strategy.name).value} needs DeepSpeed, which is "
                              f"not installed: pip install 'deepspeed>={MIN_DEEPSPEED}'") from None
        check_deepspeed_version(installed)
        from trainer.strategies.ds_config import build_ds_config

        build_ds_config(cfg, world_size)
