"""A model that goes wrong on purpose, on one rank at chosen training steps: NaN logits (NaN
gradients), or -inf logits for every token but id 0 (an infinite loss with finite gradients).

    model=custom model._target_=tests.faulty.build +model.nan_steps=[3] +model.rank=1 strategy.wrap=[ToyBlock]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from examples.toy_model import ToyLM


class NaNAtSteps(ToyLM):
    def __init__(self, vocab: int, dim: int, layers: int, nan_steps: list[int], rank: int, inf_steps: list[int]):
        super().__init__(vocab, dim, layers)
        self.nan_steps, self.inf_steps, self.rank, self.calls = set(nan_steps), set(inf_steps), rank, 0

    def forward(self, ids):
        logits = super().forward(ids)
        if self.training:  # one forward per step (no accumulation in these tests)
            self.calls += 1
            if self.calls in self.nan_steps and dist.get_rank() == self.rank:
                logits = logits * float("nan")
            if self.calls in self.inf_steps and dist.get_rank() == self.rank:
                logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) > 0, float("-inf"))
        return logits


def build(vocab: int = 256, dim: int = 32, layers: int = 2, nan_steps: list[int] = (), rank: int = 0,
          inf_steps: list[int] = ()) -> NaNAtSteps:
    return NaNAtSteps(vocab, dim, layers, list(nan_steps), rank, list(inf_steps))
