"""A model the trainer has never heard of:

    trainer model=custom model._target_=examples.toy_model.build strategy.wrap=[ToyBlock] +model.dim=64
"""
from __future__ import annotations

from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ToyLM(nn.Module):
    """Token ids [b, t] -> logits [b, t, vocab]; no attention, no _no_split_modules."""

    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(vocab: int = 256, dim: int = 32, layers: int = 2) -> ToyLM:
    return ToyLM(vocab, dim, layers)
