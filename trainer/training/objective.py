"""The run's objective (losses/objectives.py), built from the settings: the next-token loss, or DPO with
its reference (training/dpo_reference.py: the policy's own model with its adapters off or the starting
ones, a frozen copy, or a precomputed table)."""
from __future__ import annotations

from torch import nn

from trainer.config import Config, ObjectiveName, PeftName
from trainer.losses.objectives import DirectPreference, NextToken, Reference
from trainer.models import disable_dropout
from trainer.strategies import Strategy
from trainer.training.dpo_reference import frozen_copy, precomputed, starting_adapters


def build_objective(cfg: Config, model: nn.Module, strategy: Strategy, train_rows, val_rows,
                    weights_fingerprint: str | None):
    """The run's objective; for dpo, with its reference (dpo_reference.py's top says which). Called with the model as it
    starts, before a checkpoint is loaded into it."""
    o, fused, sequence = cfg.objective, cfg.train.fused_loss, strategy.layout.sequence
    if ObjectiveName(o.name) is ObjectiveName.lm:
        return NextToken(fused=fused)
    if o.disable_dropout:  # else step 1 is not ln 2 and the rewards are noise (TRL disables it too)
        disable_dropout(model)
    if not o.precompute_ref and PeftName(cfg.peft.name) is PeftName.lora:
        adapters = starting_adapters(cfg, strategy) if cfg.peft.init else None
        reference = Reference(autocast=strategy.autocast, adapters=adapters, fused=fused, sequence=sequence)
        return DirectPreference(o, reference, fused=fused, sequence=sequence)
    if not o.precompute_ref:
        reference = Reference(autocast=strategy.autocast, frozen=frozen_copy(cfg, strategy), fused=fused,
                              sequence=sequence)
        return DirectPreference(o, reference, fused=fused, sequence=sequence)
    splits = {"train": train_rows, **({"val": val_rows} if val_rows is not None else {})}
    tables = precomputed(cfg, model, strategy, splits, weights_fingerprint)
    return DirectPreference(o, Reference(tables["train"]), {split: Reference(table) for split, table in tables.items()},
                            fused=fused, sequence=sequence)
