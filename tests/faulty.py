"""A model that goes wrong on purpose, on one rank at chosen training steps: NaN logits (NaN
gradients), -inf logits for every token but id 0 (an infinite loss with finite gradients), or
logits whose gradient is a million times too large (a finite loss whose scaled fp16 gradients
overflow: an fp16 loss scaler's own skip).

    model=custom model._target_=tests.faulty.build +model.nan_steps=[3] +model.rank=1 strategy.wrap=[ToyBlock]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from examples.toy_model import ToyLM


class Boosted(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by a million."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6


class NaNAtSteps(ToyLM):
    def __init__(self, vocab: int, dim: int, layers: int, nan_steps: list[int], rank: int, inf_steps: list[int],
                 overflow_steps: list[int]):
        super().__init__(vocab, dim, layers)
        self.nan_steps, self.inf_steps, self.rank, self.calls = set(nan_steps), set(inf_steps), rank, 0
        self.overflow_steps = set(overflow_steps)

    def forward(self, ids):
        logits = super().forward(ids)
        if self.training:  # one forward per step (no accumulation in these tests)
            self.calls += 1
            if self.calls in self.nan_steps and dist.get_rank() == self.rank:
                logits = logits * float("nan")
            if self.calls in self.inf_steps and dist.get_rank() == self.rank:
                logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) > 0, float("-inf"))
            if self.calls in self.overflow_steps and dist.get_rank() == self.rank:
                logits = Boosted.apply(logits)
        return logits


def build(vocab: int = 256, dim: int = 32, layers: int = 2, nan_steps: list[int] = (), rank: int = 0,
          inf_steps: list[int] = (), overflow_steps: list[int] = ()) -> NaNAtSteps:
    return NaNAtSteps(vocab, dim, layers, list(nan_steps), rank, list(inf_steps), list(overflow_steps))
