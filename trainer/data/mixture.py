"""data=mixture: several sources, each one of data=text|tokens|hf|chat, drawn by weight: the
training rows (addressed by epoch and row) and the validation set of its sources. Its checks are
in trainer/data/mixture_checks.py, its sources read in trainer/data/mixture_sources.py, the
arithmetic of its draws in trainer/data/sampling.py.

The draws follow from the seed, the epoch and the sources' document lengths alone (the same rows
in the same order at any world size, and on resume). An hf source's documents are its texts (each
ended by EOS; one longer than a row is cut into windows of a row, unless its long_documents says
truncate or drop), a chat source's its conversations; a text or tokens source, one running text,
is cut into windows of model.seq_len + 1 tokens, each a document that fills a row.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.config import Config, Exhausted, WeightsBy
from trainer.data.mixture_sources import Source, load_sources
from trainer.data.sampling import Draws
from trainer.data.sources import IGNORE_INDEX, as_long
from trainer.log import log


class SourcesValidation(Dataset):
    """The sources' validation rows one after the other, and each apart (`by_source`), for a val
    loss per source; `fractions`: each source's fraction of the training draws, to blend them."""

    def __init__(self, by_source: dict[str, Dataset], fractions: dict[str, float]):
        self.by_source, self.fractions = by_source, fractions
        self.ends = np.cumsum([len(rows) for rows in by_source.values()])

    def blended(self, losses: dict[str, float]) -> float:
        """The sources' val losses weighted as training draws them (Megatron's and MosaicML's blend):
        the loss of the mixture itself, where the plain `loss` weights each source by its held-out tokens."""
        total = sum(self.fractions[name] for name in losses)
        return sum(self.fractions[name] * loss for name, loss in losses.items()) / total

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        k = int(np.searchsorted(self.ends, i, side="right"))
        return list(self.by_source.values())[k][i - (int(self.ends[k - 1]) if k else 0)]


class MixtureRows(Draws, Dataset):
    """The training rows of a mixture, addressed (epoch, row): the stream (trainer/data/stream.py)
    asks `rows_in(epoch)` and reads the rows of each epoch in order; `drawn` says which sources a
    range of rows came from."""


    def __init__(self, sources: list[Source], seq_len: int, vocab_size: int, packing: bool, seed: int,
                 epoch_samples: int, exhausted: Exhausted, weights_by: WeightsBy = WeightsBy.documents):
        super().__init__(sources, seq_len, packing, seed, epoch_samples, exhausted, weights_by)
        self.vocab_size = vocab_size

    def __len__(self) -> int:  # the first epoch's rows
        return self.rows_in(0)

    def document(self, i: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source i's document d: inputs and next-token targets (IGNORE_INDEX where no target)."""
        s = self.sources[i]
        start, end = (int(v) for v in s.spans[d])
        ids = as_long(s.tokens.ids[start:end], self.vocab_size, f"document {d} of source {s.name}")
        y = ids[1:].clone()
        if s.tokens.targets is not None:
            y[torch.from_numpy(s.tokens.targets[start + 1:end] == 0)] = IGNORE_INDEX
        return ids[:-1], y

    def __getitem__(self, index: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        epoch, row = index
        plan = self.plan(epoch)
        first, last = int(plan.row_starts[row]), int(plan.row_starts[row + 1])
        pad = self.sources[int(plan.source[first])].pad_id
        x = torch.full((self.seq_len,), pad, dtype=torch.long)
        y = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.empty(self.seq_len, dtype=torch.long)
        at = 0
        for k in range(first, last):
            inputs, targets = self.document(int(plan.source[k]), int(plan.document[k]))
            x[at:at + len(inputs)], y[at:at + len(targets)] = inputs, targets
            position_ids[at:at + len(inputs)] = torch.arange(len(inputs))
            at += len(inputs)
        if not self.packing:
            return x, y
        position_ids[at:] = torch.arange(self.seq_len - at)
        return x, y, position_ids


def load_mixture(cfg: Config, local_rank: int) -> tuple[MixtureRows, SourcesValidation | None]:
    d, m = cfg.data, cfg.model
    sources = load_sources(cfg, local_rank)
    rows = MixtureRows(sources, m.seq_len, m.vocab_size, d.packing, cfg.train.seed, d.epoch_samples,
                       Exhausted(d.exhausted), WeightsBy(d.weights_by))
    log.info(f"data: a mixture of {len(sources)} sources, {int(rows.per_epoch(0).sum()):,} documents an epoch ("
             + ", ".join(f"{s['name']} {s['per_epoch']:,}" for s in rows.describe())
             + f") in {len(rows):,} {'packed' if d.packing else 'padded'} rows of {m.seq_len} tokens in the first epoch")
    held_out = {s.name: s.val for s in sources if s.val is not None}
    fractions = {s["name"]: s["fraction"] for s in rows.describe()}
    return rows, SourcesValidation(held_out, fractions) if held_out else None


def sources_of(rows: Dataset) -> list[dict]:
    """The sources training rows draw from, each's name, kind, documents, tokens, weight and documents
    per epoch (the `sources` record); [] for rows of one data= kind, which are no mixture."""
    return rows.describe() if isinstance(rows, MixtureRows) else []


def validation_by_source(rows: Dataset | None) -> dict[str, Dataset]:
    """Each source's held-out rows apart, by name; {} for validation rows of one data= kind."""
    return rows.by_source if isinstance(rows, SourcesValidation) else {}
