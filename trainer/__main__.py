"""`trainer [overrides]` == `python -m trainer [overrides]`: a Hydra app.

Started by a launcher (torchrun, accelerate, deepspeed, srun) each process is one rank; started
alone with nproc=N it spawns N local ranks with torch's elastic launcher.
"""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import distributed
from trainer.blocks import find_blocks
from trainer.config import ConfigError, register_configs, to_config, validate


def check_before_work(cfg) -> None:
    """Everything that can be wrong with the settings, found before a rank is started."""
    from trainer.loop import model_shape
    from trainer.model import build_model

    validate(cfg)
    with torch.device("meta"):
        find_blocks(build_model(model_shape(cfg)), cfg.strategy.wrap)


def worker(cfg_dict: dict, run_dir: str) -> dict:
    """One rank: join the group, take rank 0's run dir, train."""
    from trainer.loop import train

    env = distributed.init()
    try:
        run_dir = distributed.broadcast_object(run_dir)
        return train(to_config(cfg_dict), env, Path(run_dir))
    finally:
        distributed.shutdown()


def spawn(cfg_dict: dict, run_dir: str, nproc: int) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{distributed.free_port()}",
                          rdzv_configs={"rank": 0, "timeout": 120}, max_restarts=0, monitor_interval=0.1)
    return elastic_launch(config, worker)(cfg_dict, run_dir)[0]


OmegaConf.register_new_resolver("trainer_run_dir", distributed.run_dir_resolver, replace=True)
register_configs()


CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig):
    typed = to_config(cfg)
    try:
        check_before_work(typed)
    except ConfigError as e:
        sys.exit(f"trainer: error: {e}")
    run_dir = HydraConfig.get().runtime.output_dir
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if distributed.launched_externally() or typed.nproc == 1:
        result = worker(cfg_dict, run_dir)
        if distributed.launched_externally():
            # gloo can abort at interpreter exit after backward (FACTS.md); the work is done and
            # flushed, so leave without running the interpreter's teardown.
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(0)
        return result
    return spawn(cfg_dict, run_dir, typed.nproc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
