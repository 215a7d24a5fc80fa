"""The sampling of data=mixture: which documents of which sources each epoch draws, in what
order, and the rows they fill.

An epoch draws `data.epoch_samples` documents (default: the sum of the sources' documents), each
source its share by weight, exactly: the largest-remainder allocation of all the epochs' documents
so far less that of the epochs before (so the rounding never adds up), not a coin flip per
document, so the shares hold on small data too. Each source's documents come as a stream of
passes over them, each pass a fresh permutation (seeded by train.seed, the source's place in the
list and the pass): epoch e takes the source's share from where epoch e - 1's ended.
A source drawn below its size so shows other documents each epoch; one whose share is more than
its documents goes round again (data.exhausted=repeat) or gives each once, its share ending there
(stop); HF's stopping strategies size the epoch instead: it ends as the first source is through its
documents (first_exhausted) or as every source is (all_exhausted). A source's max_samples keeps
its first documents only; repeat on every source (MosaicML's) replaces the weights: each epoch
draws repeat x the source's documents. With data.weights_by=tokens a weight is the source's share
of the tokens drawn (Megatron's and MosaicML's blends), not of the documents: each document counts
its weight over its source's mean document length. The epoch's draws of all sources are then
shuffled together (seeded by train.seed and the epoch) and cut into rows: whole documents of any
source packed into rows of model.seq_len, their position ids restarting at each (data.packing), or
one padded row each.

All of this follows from the seed, the epoch and the sources' document lengths: the rows and
their order are the same at any world size, and a resume finds its place from the data position
alone (trainer/data/stream.py), reading no token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer.config import Exhausted, WeightsBy
from trainer.data.mixture_sources import Source
from trainer.data.sources import packed_row_starts


def split_in_proportion(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` split in proportion to `weights` in whole numbers: each its share rounded down, the
    rest one each to the largest remainders (the earlier source first on a tie)."""
    shares = total * np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    counts = np.floor(shares).astype(np.int64)
    rest = total - int(counts.sum())
    counts[np.argsort(-(shares - counts), kind="stable")[:rest]] += 1
    return counts


@dataclass
class EpochPlan:
    """One epoch's documents in training order (`source` and `document` in it, each), and the
    first document of each row (`row_starts`, one more than the rows)."""
    source: np.ndarray
    document: np.ndarray
    row_starts: np.ndarray


class Draws:
    """The draws of a mixture's sources (their documents' spans and target tokens, weights or
    repeats), epoch by epoch: how many of each source, which of its documents, in what order, and
    the first document of each row."""

    def __init__(self, sources: list[Source], seq_len: int, packing: bool, seed: int, epoch_samples: int,
                 exhausted: Exhausted, weights_by: WeightsBy = WeightsBy.documents):
        self.sources, self.seq_len, self.packing = sources, seq_len, packing
        self.names = [s.name for s in sources]
        self.seed = seed % 2 ** 63
        self.sizes = np.array([len(s.spans) for s in sources], dtype=np.int64)
        if sources[0].repeat is not None:  # each source repeat x its documents an epoch (MosaicML's repeat)
            self.weights = np.array([s.repeat for s in sources], dtype=np.float64) * self.sizes
            self.epoch_draws = float(self.weights.sum())
        else:  # each source its weight's share of data.epoch_samples
            self.weights = np.array([s.weight for s in sources], dtype=np.float64)
            if WeightsBy(weights_by) is WeightsBy.tokens:  # per document drawn: its source's weight over its mean length
                self.weights /= np.array([np.mean(s.spans[:, 1] - s.spans[:, 0]) for s in sources])
            self.epoch_draws = float(epoch_samples or self.sizes.sum())
        # HF's stopping strategies: the most draws in which no source gives a document twice, or the
        # fewest in which every source gives each of its documents (the shares are within 1 of exact).
        self.exhausted = Exhausted(exhausted)
        runs_out = self.sizes * self.weights.sum() / self.weights  # the epoch's draws at which each source is through
        if self.exhausted is Exhausted.first_exhausted:
            self.epoch_draws = float(np.floor(runs_out.min() + 1e-9))
        elif self.exhausted is Exhausted.all_exhausted:
            self.epoch_draws = float(np.ceil(runs_out.max() - 1e-9))
        # Where each epoch's draws start in each source's stream of passes: row e, epochs 0..e-1's draws.
        self._starts = np.zeros((1, len(sources)), dtype=np.int64)
        self._plans: dict[int, EpochPlan] = {}
        self._passes: dict[tuple[int, int], np.ndarray] = {}

    def drawn_by(self, epochs: int) -> np.ndarray:
        """Each source's documents in the first `epochs` epochs together: their draws (whole, the
        rest rounded down) split in proportion to the weights."""
        return split_in_proportion(math.floor(self.epoch_draws * epochs + 1e-9), self.weights)

    def shares(self, epoch: int) -> np.ndarray:
        """Each source's documents in the epoch: what the allocation of all epochs so far gives, less
        that of the epochs before, so that the rounding does not add up: after E epochs each
        source has drawn within 1 of its share x E (weight x epoch_samples, or repeat x its
        documents; as Megatron's blending keeps it)."""
        return self.drawn_by(epoch + 1) - self.drawn_by(epoch)

    def per_epoch(self, epoch: int) -> np.ndarray:
        """What each source gives in the epoch: its share, or at most its documents once (stop)."""
        shares = self.shares(epoch)
        return np.minimum(shares, self.sizes) if self.exhausted is Exhausted.stop else shares

    def stream_starts(self, epoch: int) -> np.ndarray:
        """Each source's place in its stream of passes at the start of the epoch."""
        if self.exhausted is not Exhausted.stop:
            return self.drawn_by(epoch)
        while len(self._starts) <= epoch:  # stop: a sum over the epochs before (each capped at the sizes)
            self._starts = np.vstack([self._starts, self._starts[-1] + self.per_epoch(len(self._starts) - 1)])
        return self._starts[epoch]

    def describe(self) -> list[dict]:
        """Each source: its documents, target tokens, weight (or repeat), fraction of the draws and
        documents drawn in the first epoch (the start record)."""
        fractions = self.weights / self.weights.sum()
        return [{"name": s.name, "kind": s.kind.value, "documents": len(s.spans), "tokens": int(s.targets.sum()),
                 "weight": s.weight, **({} if s.repeat is None else {"repeat": s.repeat}),
                 "fraction": float(f), "per_epoch": int(n)}
                for s, f, n in zip(self.sources, fractions, self.per_epoch(0))]

    def pass_order(self, i: int, p: int) -> np.ndarray:
        """Source i's documents in the order of its pass p over them."""
        if (i, p) not in self._passes:
            if len(self._passes) > 64:
                self._passes.clear()
            self._passes[i, p] = np.random.default_rng([self.seed, 1 + i, p]).permutation(len(self.sources[i].spans))
        return self._passes[i, p]

    def drawn_documents(self, i: int, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of source i's stream of passes."""
        n = len(self.sources[i].spans)
        parts = [self.pass_order(i, p)[max(start - p * n, 0):min(end - p * n, n)]
                 for p in range(start // n, (end - 1) // n + 1)] if end > start else []
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            if len(self._plans) > 2:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = self._plan(epoch)
        return self._plans[epoch]

    def _plan(self, epoch: int) -> EpochPlan:
        counts, starts = self.per_epoch(epoch), self.stream_starts(epoch)
        source = np.repeat(np.arange(len(self.sources)), counts)
        source = source[np.random.default_rng([self.seed, 0, epoch]).permutation(len(source))]
        document = np.empty(len(source), dtype=np.int64)
        for i, (start, n) in enumerate(zip(starts.tolist(), counts.tolist())):
            document[source == i] = self.drawn_documents(i, start, start + n)
        if not self.packing:
            return EpochPlan(source, document, np.arange(len(source) + 1))
        # A document of n tokens fills n - 1 positions; a new row where the next does not fit.
        widths = np.empty(len(source), dtype=np.int64)
        for i, s in enumerate(self.sources):
            mine = source == i
            widths[mine] = s.spans[document[mine], 1] - s.spans[document[mine], 0] - 1
        return EpochPlan(source, document, np.asarray(packed_row_starts(widths.tolist(), self.seq_len), dtype=np.int64))

    def rows_in(self, epoch: int) -> int:
        return len(self.plan(epoch).row_starts) - 1

    def drawn(self, epoch: int, start: int, end: int) -> tuple[list[int], list[int]]:
        """Documents and target tokens per source in rows [start, end) of the epoch."""
        plan = self.plan(epoch)
        a, b = int(plan.row_starts[start]), int(plan.row_starts[min(end, len(plan.row_starts) - 1)])
        source, document = plan.source[a:b], plan.document[a:b]
        tokens = [int(s.targets[document[source == i]].sum()) for i, s in enumerate(self.sources)]
        return np.bincount(source, minlength=len(self.sources)).tolist(), tokens
