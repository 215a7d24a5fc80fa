"""A rank's life: join the group, train, leave. `worker` is the CLI's; `in_group` + `train_configs`
serve tests and benchmarks that train several configs in one process group."""
from __future__ import annotations

from pathlib import Path

from trainer import distributed
from trainer.config import to_config


def worker(cfg_dict: dict, run_dir: str) -> dict:
    from trainer.loop import train

    env = distributed.init()
    try:
        run_dir = distributed.broadcast_object(run_dir)
        return train(to_config(cfg_dict), env, Path(run_dir))
    finally:
        distributed.shutdown()


def in_group(fn, *args):
    """fn(env, *args) inside a process group that lives exactly as long as the call."""
    env = distributed.init()
    try:
        return fn(env, *args)
    finally:
        distributed.shutdown()


def train_configs(env, configs: dict[str, dict], out_dir: str) -> None:
    """Train each config (plain dicts, as Hydra would give) in turn, into out_dir/<name>/."""
    from trainer.loop import train

    for name, cfg in configs.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        train(to_config(cfg), env, run_dir)
