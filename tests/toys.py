"""The toy model of examples/ with what some users' models have: frozen parameters
(`requires_grad=False`), dropout, and running statistics in persistent buffers (which may centre
the output, so that the loss depends on them); and a signal
to its own process (rank 0) during the forward of a chosen training step, or of the first
evaluation.

    model=custom model._target_=tests.toys.build +model.frozen=[embed] +model.dropout=0.1 +model.stats=true +model.centre=true strategy.wrap=[ToyBlock]
"""
from __future__ import annotations

import os
import signal as signals

import torch
import torch.distributed as dist
from torch import nn

from examples.toy_model import ToyLM


class RunningStats(nn.Module):
    """BatchNorm's bookkeeping: a running mean of its input and a step count. `centre`: the output
    is the input less the running mean of the batches before (as BatchNorm in eval mode uses its
    statistics), so a rank's buffer shows in its loss; else the output is the input (BatchNorm's
    batch statistics would depend on the micro-batch size, so on the world size)."""

    def __init__(self, dim: int, momentum: float = 0.1, centre: bool = False):
        super().__init__()
        self.momentum, self.centre = momentum, centre
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = x - self.mean if self.centre else x
        if self.training:
            self.mean.lerp_(x.detach().float().mean(dim=(0, 1)), self.momentum)
            self.count += 1
        return out


class Toy(ToyLM):
    def __init__(self, vocab: int, dim: int, layers: int, dropout: float, stats: bool, centre: bool, signal: str,
                 signal_at_step: int, signal_in_eval: bool):
        super().__init__(vocab, dim, layers)
        self.dropout = nn.Dropout(dropout)
        self.stats = RunningStats(dim, centre=centre) if stats or centre else nn.Identity()
        self.signal, self.signal_at_step, self.signal_in_eval, self.steps = signal, signal_at_step, signal_in_eval, 0

    def forward(self, ids):
        self.steps += self.training  # one forward per step (no accumulation where this is used)
        now = self.steps == self.signal_at_step if self.training else self.signal_in_eval
        if now and dist.is_initialized() and dist.get_rank() == 0:
            self.signal_at_step, self.signal_in_eval = 0, False
            os.kill(os.getpid(), getattr(signals, self.signal))
        x = self.stats(self.dropout(self.embed(ids)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(vocab: int = 64, dim: int = 16, layers: int = 2, frozen: list[str] = (), dropout: float = 0.0,
          stats: bool = False, centre: bool = False, signal: str = "SIGTERM", signal_at_step: int = 0,
          signal_in_eval: bool = False) -> ToyLM:
    model = Toy(vocab, dim, layers, dropout, stats, centre, signal, signal_at_step, signal_in_eval)
    for name, p in model.named_parameters():
        if any(name == f or name.startswith(f"{f}.") for f in frozen):
            p.requires_grad_(False)
    return model


def save_gemma4_with_scaled_buffers(directory) -> nn.Module:
    """A tiny Gemma4 text model whose persistent buffers (`layer_scalar`, which scales each layer's
    output) hold values other than their start value, saved as a Hugging Face folder; returned."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=128, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 / (i + 1))
    model.save_pretrained(str(directory), safe_serialization=True)
    return model
