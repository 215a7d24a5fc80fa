"""The optional packages behind some settings (pyproject's extras: hf, ft, sweep, launchers): each
`require_*` says, before any work and in one line, which package a setting needs and how to get it.
Low in the house: the data, the models and the checks before work all ask here."""
from __future__ import annotations

import importlib.util

from trainer.errors import ConfigError


def require_hf(key: str, module: str = "transformers", extra: str = "hf") -> None:
    """The Hugging Face libraries are extras (hf; ft for peft): say how to get them, before any work."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{key}: needs the `{module}` package, from the {extra!r} extra: "
                          f"pip install 'strategy-trainer[{extra}]'")


# The Hydra plugins behind our hydra/* config groups' options (conf/hydra/), and their extras.
HYDRA_PLUGINS = {"hydra/sweeper": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper", "sweep"),
                 "hydra/launcher": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher", "launchers")}


def require_hydra_plugin(group: str, option: str) -> None:
    """hydra/sweeper=optuna, hydra/launcher=submitit_*: the Hydra plugin that provides the option."""
    if group in HYDRA_PLUGINS and importlib.util.find_spec(HYDRA_PLUGINS[group][0]) is None:
        _, package, extra = HYDRA_PLUGINS[group]
        raise ConfigError(f"{group}={option}: needs the Hydra plugin {package}, from the {extra!r} extra: "
                          f"pip install 'strategy-trainer[{extra}]'")
