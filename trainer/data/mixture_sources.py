"""data=mixture's sources, read: each source's documents as spans of its tokens (a running text's
windows, an hf source's long documents split, truncated or dropped, its first max_samples), the
target tokens of each, its held-out rows, and the line that says what it gave."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.config import Config, LongDocuments, SourceConfig, SourceKind
from trainer.data.read import SourceSpec, mixture_source, prepare, read_tokens
from trainer.data.sources import (
    PackedDocuments,
    Tokens,
    TokenWindows,
    UnpackedDocuments,
    document_spans,
    document_windows,
    spans_as_documents,
)
from trainer.errors import ConfigError
from trainer.log import log


def source_names(sources: list[SourceConfig]) -> list[str]:
    """Each source's name: its own, else its file's stem (a folder's name), else its kind."""
    return [s.name or (Path(s.path).stem if s.path else SourceKind(s.kind).value) for s in sources]


def fingerprint(sources: list[SourceConfig]) -> list[dict]:
    """What makes each source's samples (not its held-out data), for the checkpoint's data fingerprint."""
    return [{k: v.value if isinstance(v, Enum) else v for k, v in asdict(s).items() if k != "val_path"}
            for s in sources]


@dataclass
class Source:
    """One source, read: its documents as [start, end) spans of its token ids (each cut to a row's
    worth), the target tokens of each, and its held-out rows (None without)."""
    name: str
    kind: SourceKind
    weight: float
    tokens: Tokens
    spans: np.ndarray
    targets: np.ndarray
    pad_id: int
    val: Dataset | None = None
    repeat: float | None = None  # each epoch draws repeat x its documents (else: its weight's share)


def windows(n_tokens: int, seq_len: int) -> np.ndarray:
    """A running text's documents: non-overlapping windows of seq_len + 1 tokens (as TokenWindows)."""
    starts = np.arange(max(0, (n_tokens - 1) // seq_len), dtype=np.int64) * seq_len
    return np.stack([starts, starts + seq_len + 1], axis=1)


def target_counts(tokens: Tokens, spans: np.ndarray) -> np.ndarray:
    """The target tokens of each span: those after its first token, where the mask (if any) says."""
    if tokens.targets is None:
        return spans[:, 1] - spans[:, 0] - 1
    seen = np.concatenate([[0], np.cumsum(tokens.targets, dtype=np.int64)])
    return seen[spans[:, 1]] - seen[np.minimum(spans[:, 0] + 1, spans[:, 1])]


def long_documents(s: SourceConfig, drop_long: bool) -> LongDocuments:
    """What becomes of an hf or chat source's documents longer than a row: its own setting, else
    dropped with data.drop_long, else an hf document split into windows, a conversation truncated."""
    if s.long_documents is not None:
        return LongDocuments(s.long_documents)
    if drop_long:
        return LongDocuments.drop
    return LongDocuments.split if SourceKind(s.kind) is SourceKind.hf else LongDocuments.truncate


def cut_documents(tokens: Tokens, rule: LongDocuments | None, seq_len: int) -> tuple[np.ndarray, int, int]:
    """A source's documents as [start, end) spans of at most a row's worth (seq_len + 1 tokens), and
    how many were longer and how many had no target."""
    if tokens.doc_starts is None:
        return windows(len(tokens.ids), seq_len), 0, 0
    if rule is LongDocuments.split:
        return document_windows(tokens, seq_len + 1)
    return document_spans(tokens, seq_len + 1, rule is LongDocuments.drop)


def sources_on(cfg: Config) -> list[SourceSpec]:
    """The sources the mixture reads, each as read (trainer/data/read.py): those of weight > 0 (a
    source of weight 0 is off: none of its files)."""
    return [mixture_source(s, i) for i, s in enumerate(cfg.data.sources) if s.weight > 0]


def load_sources(cfg: Config, local_rank: int) -> list[Source]:
    """Every source's documents and held-out rows; text to tokenise is tokenised once per node
    (trainer/data/tokenized.py)."""
    d, m = cfg.data, cfg.model
    prepare(cfg, sources_on(cfg), local_rank)
    out = []
    for i, (s, name) in enumerate(zip(d.sources, source_names(d.sources))):
        key, kind = f"data.sources[{i}]", SourceKind(s.kind)
        if not s.weight:
            log.info(f"data source {name} ({kind.value}): weight 0, off (not read)")
            continue
        spec = mixture_source(s, i)
        tokens, pad_id = read_tokens(cfg, spec, s.path, f"{key}.path")
        val = read_tokens(cfg, spec, s.val_path, f"{key}.val_path")[0] if s.val_path else None
        if d.val_fraction:
            tokens, val = tokens.split(d.val_fraction)
        rule = long_documents(s, d.drop_long) if spec.tokenized else None
        spans, long, untargeted = cut_documents(tokens, rule, m.seq_len)
        beyond = max(0, len(spans) - s.max_samples) if s.max_samples else 0
        spans = spans[:len(spans) - beyond]
        if not len(spans):
            raise ConfigError(f"{key}: {s.path or 'the bundled text'} ({name}) holds no document with a target "
                              f"within model.seq_len + 1 = {m.seq_len + 1} tokens: a source with no documents")
        if val is not None:
            val = held_out_rows(val, rule, cfg, pad_id)
            if not len(val):
                raise ConfigError(f"{key}.{'val_path' if s.val_path else 'path'}: the validation split of {name} "
                                  f"holds no row of model.seq_len={m.seq_len} tokens with a target")
        out.append(Source(name, kind, float(s.weight), tokens, spans, target_counts(tokens, spans), pad_id, val,
                          s.repeat))
        cut = {LongDocuments.split: "split into windows", LongDocuments.truncate: "truncated",
               LongDocuments.drop: "dropped"}
        notes = [f"{long:,} longer than {m.seq_len + 1} tokens {cut[rule]}"
                 + ("" if rule is LongDocuments.split else f": {lost_targets(tokens, out[-1].targets):,} target "
                    "tokens left out")] if long else []
        notes += [f"{untargeted:,} without a target left out"] if untargeted else []
        notes += [f"{tokens.bad_rows:,} bad rows skipped"] if tokens.bad_rows else []
        notes += [f"the {beyond:,} after the first {s.max_samples:,} left out (max_samples)"] if beyond else []
        log.info(f"data source {name} ({kind.value}): {len(spans):,} "
                 f"{'windows' if tokens.doc_starts is None else 'documents'}, {int(out[-1].targets.sum()):,} "
                 f"target tokens, " + (f"weight {s.weight:g}" if s.repeat is None else f"repeat {s.repeat:g}")
                 + "".join(f"; {note}" for note in notes))
    return out


def lost_targets(tokens: Tokens, kept: np.ndarray) -> int:
    """The target tokens of a source's documents (each after its document's first token) that its
    spans (with `kept` targets each) leave out."""
    firsts = tokens.doc_starts.astype(np.int64)
    offered = len(tokens.ids) - len(firsts) if tokens.targets is None else \
        int(tokens.targets.sum(dtype=np.int64)) - int(tokens.targets[firsts].sum(dtype=np.int64))
    return offered - int(kept.sum())


def held_out_rows(tokens: Tokens, rule: LongDocuments | None, cfg: Config, pad_id: int) -> Dataset:
    """A source's validation rows, cut as its training documents are (`rule`: its long documents)."""
    d, m = cfg.data, cfg.model
    if tokens.doc_starts is None:
        windows = TokenWindows(tokens, m.seq_len, m.vocab_size)
        return WithPositions(windows) if d.packing else windows
    if rule is LongDocuments.split:
        tokens = spans_as_documents(tokens, document_windows(tokens, m.seq_len + 1)[0])
    rows = PackedDocuments if d.packing else UnpackedDocuments
    return rows(tokens, m.seq_len, m.vocab_size, pad_id, rule is LongDocuments.drop)


class WithPositions(Dataset):
    """Windows of a running text as packed rows are: with position ids (one document each)."""

    def __init__(self, rows: Dataset):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y = self.rows[i]
        return x, y, torch.arange(len(x))
