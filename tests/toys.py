"""The toy model of examples/ with what some users' models have: frozen parameters
(`requires_grad=False`) and dropout.

    model=custom model._target_=tests.toys.build +model.frozen=[embed] +model.dropout=0.1 strategy.wrap=[ToyBlock]
"""
from __future__ import annotations

from torch import nn

from examples.toy_model import ToyLM


class DropoutToyLM(ToyLM):
    def __init__(self, vocab: int, dim: int, layers: int, dropout: float):
        super().__init__(vocab, dim, layers)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids):
        x = self.dropout(self.embed(ids))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(vocab: int = 64, dim: int = 16, layers: int = 2, frozen: list[str] = (), dropout: float = 0.0) -> ToyLM:
    model = DropoutToyLM(vocab, dim, layers, dropout)
    for name, p in model.named_parameters():
        if any(name == f or name.startswith(f"{f}.") for f in frozen):
            p.requires_grad_(False)
    return model
