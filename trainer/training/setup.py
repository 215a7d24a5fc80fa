"""A run's model and optimizer, the same for every backend: built where the strategy wants it,
activation checkpointing and compile applied per block, then sharded by the strategy with each
rank's part of the first weights (AC -> compile -> setup, as torchtitan). convert.py and the
benches set a model up the same way."""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import Config, OptimConfig, Precision
from trainer.models import initial_weights
from trainer.models.blocks import apply_checkpointing, find_blocks
from trainer.models.checks import build_as_trained
from trainer.models.weights import WeightSource
from trainer.strategies import Strategy


def adamw_factory(o: OptimConfig, fused: bool = True):
    """AdamW with weight decay on matrices only (nanoGPT's split), over the trainable parameters
    and their full shapes, as the strategy gives them (frozen ones, LoRA's base, get no state).
    `fused`: one kernel for every parameter in place of ~12 ops each; under FSDP2 each op on a
    DTensor also pays its dispatch (30M Llama, 2 CPU ranks: 1.10 s a step -> 0.15 s). HF Trainer's
    default optim since torch 2.8 too. DeepSpeed steps its flat partitions with it."""
    def build(params: list[tuple[nn.Parameter, tuple[int, ...]]]) -> torch.optim.Optimizer:
        groups = [{"params": [p for p, shape in params if len(shape) >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p, shape in params if len(shape) < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)
    return build


def setup_model(cfg: Config, strategy: Strategy) -> tuple[nn.Module, torch.optim.Optimizer, list[nn.Module],
                                                         WeightSource]:
    """Build the model where the strategy wants it (with LoRA adapters for peft=lora), find its
    blocks, wrap them for activation checkpointing, compile them, then let the strategy shard it
    and give each rank its part of the first weights (AC -> compile -> setup, as torchtitan).
    Returns (model, optimizer, blocks, where the weights came from)."""
    model = build_as_trained(cfg, strategy.model_init_context(), cfg.peft)
    blocks = find_blocks(model, cfg.strategy.wrap)
    weights = initial_weights(cfg.model, model, cfg.train.seed, cfg.peft, strategy.full_shape)
    if cfg.train.activation_checkpointing:
        apply_checkpointing(model, blocks)
    if cfg.train.compile:  # regional: each block compiled in place (names unchanged), before sharding
        for block in blocks:
            block.compile()
    # fp16: FSDP2's sharded grad scaler hands the fused step a found_inf of shape [1] against its
    # step count's [] (torch 2.13: "output with shape [] doesn't match the broadcast shape [1]")
    fused = cfg.train.precision is not Precision.fp16
    model, optimizer = strategy.setup(model, adamw_factory(cfg.optim, fused), weights)
    return model, optimizer, blocks, weights
