"""A rank's life: join the group, train, leave. `worker` is the CLI's; `in_group` + `train_configs`
serve tests and benchmarks that train several configs in one process group."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer import distributed
from trainer.config import ConfigError, to_config
from trainer.faults import Stopped, TooManyBadSteps


def worker(cfg_dict: dict, run_dir: str) -> dict:
    from trainer.loop import train

    env = distributed.init(cfg_dict["collective_timeout_s"])
    try:
        run_dir = distributed.broadcast_object(run_dir)
        return train(to_config(cfg_dict), env, Path(run_dir))
    except Stopped as stopped:  # saved and recorded: leave with the signal's exit code, quietly
        leave(stopped.exit_code)
    except (ConfigError, TooManyBadSteps) as e:  # the same on every rank: said once, in one line
        if env.is_main:
            print(f"trainer: error: {e}", file=sys.stderr)
        leave(ERROR_EXIT_CODE)
    finally:
        distributed.shutdown()


ERROR_EXIT_CODE = 2  # stopped with a message: as `trainer` does on a bad setting before any rank starts


def leave(exit_code: int) -> None:
    distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # no interpreter teardown, where gloo can abort (FACTS.md)


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
