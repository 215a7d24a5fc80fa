"""What the checkpoint package needs of whoever holds the training state: a Strategy (docs/design.md, The Strategy)
satisfies it. Written here, as a Protocol, so that checkpoints stand below the strategies, which
build on the format (format.Piece), and never import them."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from trainer.checkpoint.format import Piece
from trainer.distributed import DistEnv


class StateHolder(Protocol):
    env: DistEnv  # this rank: rank, world size, device, is_main

    @property
    def module(self) -> nn.Module:
        """The model, unwrapped: its parameter names and shapes are the checkpoint's keys."""

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """A parameter's full shape, also where this rank holds a part of it."""

    def state_dict(self, model_only: bool = False) -> dict[str, Piece]:
        """The flat ranges this rank saves; together the ranks' pieces cover every key once."""

    def state_layout(self) -> dict[str, tuple[int, int]]:
        """key -> (start, numel): the ranges this rank needs to resume."""

    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Take the fp32 ranges of `state_layout`."""


class NativeSaver(Protocol):
    """A DeepSpeed strategy, as `convert --to deepspeed` holds one: it writes its engine's own checkpoint."""

    def save_native(self, directory: Path, tag: str) -> None:
        """The engine's checkpoint, by DeepSpeed's own code (`save_checkpoint`)."""
