"""`trainer [overrides]` == `python -m trainer [overrides]`: a Hydra app.

Started by a launcher (torchrun, accelerate, deepspeed, srun) each process is one rank; started
alone with nproc=N it spawns N local ranks with torch's elastic launcher.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer import distributed
from trainer.blocks import find_blocks
from trainer.checkpoint import check_fingerprint, read_manifest, resolve_resume
from trainer.config import Config, ConfigError, StrategyName, register_configs, to_config, validate
from trainer.data import check_data
from trainer.launchers import take_local_rank, with_accelerate_choice
from trainer.models import build_model, initial_weights, param_shapes, resolve_model
from trainer.plan import resolve_auto
from trainer.run import worker
from trainer.strategies import preflight


def check_before_work(cfg: Config, world_size: int) -> None:
    """Everything that can be wrong with the settings, found before a rank is started."""
    validate(cfg)
    preflight(cfg, world_size)
    model = build_model(cfg.model, torch.device("meta"))
    find_blocks(model, cfg.strategy.wrap)
    initial_weights(cfg.model, model, cfg.train.seed)  # pretrained files must fit the model
    check_data(cfg)
    resume_from = resolve_resume(cfg.checkpoint)
    if resume_from:
        check_fingerprint(read_manifest(resume_from), param_shapes(model), resume_from)


def resolve_settings(cfg: DictConfig, world_size: int) -> Config:
    """Fill in what the settings leave to the trainer (the model's vocabulary and context, the
    planner's choice for strategy=auto) in `cfg` itself, which the ranks receive; the typed copy."""
    model = resolve_model(to_config(cfg).model)
    cfg.model.seq_len, cfg.model.vocab_size = model.seq_len, model.vocab_size
    if cfg.strategy.name == StrategyName.auto:
        resolve_auto(cfg, cfg.plan.world_size or world_size, announce=distributed.launcher_rank() == 0)
    return to_config(cfg)


OmegaConf.register_new_resolver("trainer_run_dir", distributed.run_dir_resolver, replace=True)
register_configs()


CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig):
    world = int(distributed.launcher_env().get("WORLD_SIZE", cfg.nproc))
    try:
        typed = resolve_settings(cfg, world)
        check_before_work(typed, world)
    except ConfigError as e:
        sys.exit(f"trainer: error: {e}")
    run_dir = HydraConfig.get().runtime.output_dir
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if distributed.launched_externally() or typed.nproc == 1:
        # A rank of an external launcher leaves without the interpreter's teardown, where gloo
        # can abort after backward (FACTS.md); its work is done and flushed. Not under submitit,
        # which collects the return value (hydra/launcher=slurm).
        hard_exit = distributed.launched_externally() and "SUBMITIT_FOLDER" not in os.environ
        result = worker(cfg_dict, run_dir)
        if hard_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return result
    return distributed.launch_local(typed.nproc, worker, cfg_dict, run_dir)[0]


def main() -> None:
    try:
        sys.argv[1:] = with_accelerate_choice(take_local_rank(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(f"trainer: error: {e}")
    app()


if __name__ == "__main__":
    main()
