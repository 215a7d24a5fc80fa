"""objective=dpo's reference (docs/design.md, Objectives), made once the policy is set up and before a checkpoint
is loaded into it, when the policy is still the reference:
- LoRA without `peft.init`: the policy's own model with its adapters off, in eval mode, per
  micro-batch (no extra memory);
- LoRA with `peft.init`: the policy's own model with the adapters it started from in place of
  its own (`starting_adapters`: one adapter's parameters more, whole on every rank);
- full fine-tuning: a frozen copy of the starting model (`frozen_copy`), held by the strategy as
  it holds the policy's parameters (one more model's parameters in the training dtype, sharded
  where the policy's are), forwarded per micro-batch;
- `objective.precompute_ref=true`: one pass of the policy as it starts, in eval mode
  and without gradients, over every pair of the training and validation rows (each rank its
  share; the table summed over ranks), kept as one table of log-probabilities by sequence number.
  The table is written to the token cache under a key of everything the reference's values
  follow from (the model and where its weights come from, the tokenised data, the precision), so
  a resume reads it back instead of recomputing it; without the cache the pass runs again, on
  the starting weights, which the model holds until the checkpoint is loaded after it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import Config, ObjectiveName, PeftName
from trainer.data import data_fingerprint, eval_batches, token_keys
from trainer.data.tokenized import default_cache_dir
from trainer.distributed import all_reduced
from trainer.log import log
from trainer.losses.objectives import DirectPreference, NextToken, Reference, sequence_logps
from trainer.models import description, disable_dropout, initial_weights
from trainer.models.checks import build_as_trained
from trainer.strategies import Strategy
from trainer.training.sequence_shares import share


def reference_key(cfg: Config, weights_fingerprint: str | None) -> str:
    """What the reference's log-probabilities follow from: the model (its settings and where its
    weights come from: pretrained files by fingerprint, else the seed that initialises it), a
    starting adapter by its files, the pairs of every split (their token cache keys: the files by
    size and mtime, the tokenizer's files, the template) and how they are cut, the precision."""
    p = cfg.peft
    start = None
    if PeftName(p.name) is PeftName.lora and p.init:
        h = hashlib.sha256()
        for f in sorted(Path(p.init).iterdir()):
            if f.is_file():
                h.update(f.name.encode() + f.read_bytes())
        start = h.hexdigest()
    settings = {"model": description(cfg.model, cfg.data.tokenizer), "weights": weights_fingerprint,
                "seed": cfg.train.seed if weights_fingerprint is None else None, "adapter": start,
                "data": data_fingerprint(cfg), "tokens": token_keys(cfg), "precision": cfg.train.precision.value}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.no_grad()
def reference_logps(model: nn.Module, strategy: Strategy, rows, micro_batch_size: int, fused: bool) -> torch.Tensor:
    """The log-probability of every sequence of `rows` (PairRows) under the model as it is, by
    sequence number: each rank its share of the rows, summed over ranks (a sequence is in one row)."""
    table = torch.zeros(2 * rows.n_pairs, dtype=torch.float64, device=strategy.env.device)
    was_training = model.training
    model.eval()
    for batch in eval_batches(rows, micro_batch_size, strategy.layout.dp_rank, strategy.layout.dp_size):
        batch, sharded = share([t.to(strategy.env.device) for t in batch], strategy.layout.sequence)
        with sharded, strategy.autocast():
            logps, _, numbers, _ = sequence_logps(model, batch, fused, strategy.layout.sequence)
        if strategy.layout.sequence.rank == 0:  # strategy.sp: the group's ranks have the same sums; one writes them
            table[numbers] = logps.double()
    model.train(was_training)
    return all_reduced(table).cpu()


def precomputed(cfg: Config, model: nn.Module, strategy: Strategy, splits: dict,
                weights_fingerprint: str | None) -> dict[str, torch.Tensor]:
    """{split: table} for the splits' rows, read from the cache or computed now (and cached by rank 0)."""
    root = (Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()) / "reference"
    return cached_tables(root / reference_key(cfg, weights_fingerprint), model, strategy, splits,
                         cfg.train.micro_batch_size, cfg.train.fused_loss)


def cached_tables(entry: Path, model: nn.Module, strategy: Strategy, splits: dict, micro_batch_size: int,
                  fused: bool = False) -> dict[str, torch.Tensor]:
    """{split: table}: rank 0's file in `entry`, else computed now by every rank and written by rank 0.
    Rank 0 decides for all: with a cache on each node's own disk, the ranks of a node without the
    file would run the pass's collectives while rank 0 reads (a hang); they get rank 0's table."""
    tables = {}
    for split, rows in splits.items():
        file = entry / f"{split}.pt"
        on_rank0 = all_reduced(torch.tensor(int(strategy.env.is_main and file.is_file()), device=strategy.env.device))
        if on_rank0.item():
            # one tensor: weights_only, said (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD overrides only the default),
            # so that a file put in the cache by anyone else runs nothing
            table = torch.load(file, weights_only=True) if strategy.env.is_main else torch.zeros(2 * rows.n_pairs,
                                                                                           dtype=torch.float64)
            tables[split] = all_reduced(table.to(strategy.env.device)).cpu()  # the others' zeros: rank 0's
            continue
        log.info(f"objective.precompute_ref: the reference's log-probs of {rows.n_pairs:,} {split} pairs, once")
        tables[split] = reference_logps(model, strategy, rows, micro_batch_size, fused)
        if strategy.env.is_main:
            entry.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".tmp{os.getpid()}")
            torch.save(tables[split], tmp)
            tmp.rename(file)  # whole or absent
    dist.barrier()
    return tables


def frozen_copy(cfg: Config, strategy: Strategy) -> nn.Module:
    """Full fine-tuning's reference: the starting model built again, from the same weights by the
    same loader (model.path's files, or the seeded init), held as the strategy holds a model that
    never trains (Strategy.setup_frozen: replicated, or sharded like the policy)."""
    model = build_as_trained(cfg, strategy.model_init_context())  # as the policy computes (sp, packed rows, fused loss)
    return strategy.setup_frozen(model, initial_weights(cfg.model, model, cfg.train.seed, shape_of=strategy.full_shape))


def starting_adapters(cfg: Config, strategy: Strategy) -> nn.Module:
    """peft.init's reference: the starting adapter's values, read again from its folder and held
    whole, in the training dtype, beside the policy's LoRA layers (models.lora.StartingAdapters)."""
    from trainer.models.lora import StartingAdapters

    adapters = StartingAdapters(strategy.module, Path(cfg.peft.init), strategy.precision.dtype, strategy.env.device)
    return strategy.holds(adapters)


def build_objective(cfg: Config, model: nn.Module, strategy: Strategy, train_rows, val_rows,
                    weights_fingerprint: str | None):
    """The run's objective; for dpo, with its reference (see the top). Called with the model as it
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
