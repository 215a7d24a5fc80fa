"""model=custom: any nn.Module from a factory, `model._target_=pkg.module.factory`, whose other
`model.*` keys are the factory's keyword arguments. The module maps token ids [b, t] to logits
[b, t, vocab] (or to an output with `.logits`); `strategy.wrap` names its block classes when it
has no `_no_split_modules`."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.errors import ConfigError


def factory(cfg: ModelConfig) -> Callable[..., nn.Module]:
    """The factory, imported from the installed packages or the current directory (the
    `trainer` command, unlike `python -m`, does not put it on the path)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    module_name, _, attr = cfg.target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"model._target_: cannot import {cfg.target!r}: {type(e).__name__}: {e}") from None


def builder(cfg: ModelConfig) -> Callable[[], nn.Module]:
    make = factory(cfg)

    def build() -> nn.Module:
        try:
            model = make(**cfg.args)
        except TypeError as e:
            raise ConfigError(f"model._target_: {cfg.target}({', '.join(f'{k}=' for k in cfg.args)}...) "
                              f"failed: {e}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model._target_: {cfg.target} returned a {type(model).__name__}, not an nn.Module")
        return model
    return build


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The vocabulary from the model itself: the last dimension of its logits, from a forward
    on the meta device (no memory, no compute)."""
    with torch.device("meta"):
        model = builder(cfg)()
        try:
            logits = logits_of(model(torch.zeros(1, 2, dtype=torch.long)))
        except Exception as e:  # a forward that needs real values: the vocabulary must be given
            if cfg.vocab_size:
                return cfg
            raise ConfigError(f"model.vocab_size: {cfg.target}'s forward does not run on the meta device "
                              f"({type(e).__name__}: {e}); give its vocabulary size") from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 2):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(f"model._target_: {cfg.target} must map token ids [b, t] to logits [b, t, vocab]; "
                          f"for [1, 2] it gave {got}")
    cfg.vocab_size = logits.shape[-1]
    return cfg


def logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
