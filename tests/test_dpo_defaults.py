"""`objective=dpo` brings its own optimizer defaults (TRL's DPOConfig: lr 1e-6, no
weight decay) where the user names none; peft=lora's win over them, the command line over both;
the start line says the objective, its beta and the rate."""
from __future__ import annotations

from types import SimpleNamespace

import torch

import trainer.__main__  # noqa: F401  (registers the schema Hydra composes against)
from trainer.config import CONFIG_MODULE, to_config
from trainer.training.report import describe


def composed(*overrides: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_dpo_trains_at_trls_rate_unless_lora_or_the_command_line_names_another():
    rates = {o: (cfg.optim.lr, cfg.optim.weight_decay) for o, cfg in ((o, composed(*o)) for o in [
        (), ("objective=dpo", "data=preference"), ("objective=dpo", "data=preference", "peft=lora"),
        ("objective=dpo", "data=preference", "optim.lr=5e-7", "optim.weight_decay=0.01")])}
    assert list(rates.values()) == [(3e-3, 0.1), (1e-6, 0.0), (1e-4, 0.0), (5e-7, 0.01)], rates


def test_the_start_line_names_the_objective_its_beta_and_rate():
    cfg = composed("objective=dpo", "data=preference", "objective.beta=0.25")
    strategy = SimpleNamespace(layout=SimpleNamespace(dp_size=1), start_settings=lambda: {"offload": "none"})
    env = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    line = describe(cfg, env, strategy, 10, SimpleNamespace(params=1, active=1))
    assert "objective=dpo beta=0.25 loss=sigmoid" in line and "lr=1e-06 weight_decay=0" in line, line
