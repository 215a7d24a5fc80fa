"""A model with frozen parameters (`requires_grad=False`), as a user freezes an embedding:

    model=custom model._target_=tests.frozen.build +model.frozen=[embed] strategy.wrap=[ToyBlock]
"""
from __future__ import annotations

from examples.toy_model import ToyLM


def build(vocab: int = 64, dim: int = 16, layers: int = 2, frozen: list[str] = ("embed",)) -> ToyLM:
    model = ToyLM(vocab, dim, layers)
    for name, p in model.named_parameters():
        if any(name == f or name.startswith(f"{f}.") for f in frozen):
            p.requires_grad_(False)
    return model
