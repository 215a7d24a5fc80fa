"""Adam's state as every backend creates it and counts its steps: one small object a backend
constructs in `setup` and calls explicitly (where the state lives and how its update runs stay the
backend's: the tensors and the update are given to it)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


@contextmanager
def zero_lr(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


class AdamState:
    """The torch optimizer that holds Adam's state (DeepSpeed's is inside its own), the tensors it
    updates (the parameters that train, or a backend's flat master partitions) and the way the
    backend runs its update (default: `optimizer.step()`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, stepped: list[torch.Tensor],
                 update: Callable[[], None] | None = None):
        self.optimizer, self.stepped = optimizer, stepped
        self.update = update or optimizer.step

    @torch.no_grad()
    def create(self) -> None:
        """Adam creates its moments at its first step: take one on zero gradients with lr 0 (which
        leaves the parameters as they are), so that a checkpoint has somewhere to go. Its step
        count stays 0: no update was made."""
        if self.optimizer.state:
            return
        missing = [t for t in self.stepped if t.grad is None]
        for t in missing:
            t.grad = torch.zeros_like(t)
        with zero_lr(self.optimizer):
            self.update()
        for t in missing:
            t.grad = None
        self.set_step_count(0)

    def step_count(self) -> float:
        return float(next(iter(self.optimizer.state.values()))["step"])

    def set_step_count(self, step: float) -> None:
        for state in self.optimizer.state.values():
            if isinstance(state["step"], torch.Tensor):
                state["step"].fill_(step)
            else:  # DeepSpeed's CPU Adam counts in an int
                state["step"] = int(step)
