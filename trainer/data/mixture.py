"""data=mixture: several sources, each one of data=text|tokens|hf|chat, drawn by weight.

An epoch draws `data.epoch_samples` documents (default: the sum of the sources' documents), each
source its share by weight, exactly: the largest-remainder allocation of all the epochs' documents
so far less that of the epochs before (so the rounding never adds up), not a coin flip per
document, so the shares hold on small data too. Each source's documents come as a stream of
passes over them, each pass a fresh permutation (seeded by train.seed, the source's place in the
list and the pass): epoch e takes the source's share from where epoch e - 1's ended.
A source drawn below its size so shows other documents each epoch; one whose share is more than
its documents goes round again (data.exhausted=repeat) or gives each once, its share ending there
(stop); HF's stopping strategies size the epoch instead: it ends as the first source is through its
documents (first_exhausted) or as every source is (all_exhausted). A source's max_samples keeps its first documents only; repeat on every source
(MosaicML's) replaces the weights: each epoch draws repeat x the source's documents. With
data.weights_by=tokens a weight is the source's share of the tokens drawn (Megatron's and
MosaicML's blends), not of the documents: each document counts its weight over its source's mean
document length. The epoch's
draws of all sources are then shuffled together (seeded by train.seed and the epoch) and cut into
rows: whole documents of any source packed into rows of model.seq_len, their
position ids restarting at each (data.packing), or one padded row each.

All of this follows from the seed, the epoch and the sources' document lengths: the rows and
their order are the same at any world size, and a resume finds its place from the data position
alone (trainer/data/stream.py), reading no token. An hf source's documents are its texts (each
ended by EOS; one longer than a row is cut into windows of a row, unless its long_documents says
truncate or drop), a chat source's its conversations; a text or tokens source, one running text,
is cut into windows of model.seq_len + 1 tokens, each a document that fills a row.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.config import (
    BadRows,
    Config,
    DataConfig,
    DataName,
    Exhausted,
    LongDocuments,
    ModelKind,
    SourceConfig,
    SourceKind,
    TokenDtype,
    TrainOn,
    WeightsBy,
)
from trainer.data.chat import Conversations
from trainer.data.sources import (
    IGNORE_INDEX,
    Documents,
    PackedDocuments,
    Tokens,
    TokenWindows,
    as_long,
    document_spans,
    document_windows,
    packed_row_starts,
    spans_as_documents,
    text_tokens,
    token_file,
)
from trainer.data.tokenized import TextDocuments, TokenizedText, default_cache_dir, open_dataset
from trainer.errors import ConfigError
from trainer.log import log
from trainer.models.checks import check_packing

# The keys each kind reads besides kind, path, name, weight and val_path; the others stay null.
KIND_KEYS = {SourceKind.text: (), SourceKind.tokens: ("dtype",),
             SourceKind.hf: ("text_field", "tokenizer", "long_documents"),
             SourceKind.chat: ("tokenizer", "train_on", "chat_template", "long_documents")}
COMMON_KEYS = ("kind", "path", "name", "weight", "val_path", "max_samples", "repeat")
KIND_ONLY_KEYS = tuple(dict.fromkeys(k for keys in KIND_KEYS.values() for k in keys))
ENUMS = {"kind": SourceKind, "dtype": TokenDtype, "train_on": TrainOn, "long_documents": LongDocuments}
TOKENIZED = (SourceKind.hf, SourceKind.chat)
# HF interleave_datasets' stopping strategies: the epoch's size follows from the sources' sizes.
EPOCH_SIZED = (Exhausted.first_exhausted, Exhausted.all_exhausted)
# The data.* keys a mixture does not read: each source has its own (or the kind's default).
NOT_FOR_MIXTURES = ("path", "val_path", "chat_template")
EXAMPLE = "data.sources=[{kind:hf,path:a.jsonl,weight:0.7},{kind:hf,path:b.jsonl,weight:0.3}]"


def check_source_nodes(nodes: object, key: str = "data.sources") -> None:
    """The sources as written on the command line, before Hydra (whose own messages are several
    lines): a list of {key: value} with keys of the schema and values of its enums."""
    if not isinstance(nodes, list):
        raise ConfigError(f"{key}: a list of sources, e.g. '{EXAMPLE}'")
    known = [f for f in SourceConfig.__dataclass_fields__]
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise ConfigError(f"{key}[{i}]: a source is {{kind:..., path:..., weight:...}}, got {node!r}")
        for name, value in node.items():
            if name not in known:
                raise ConfigError(f"{key}[{i}].{name}: not a key of a source; keys: {', '.join(known)}")
            allowed = [e.value for e in ENUMS[name]] if name in ENUMS else None
            if allowed and value not in allowed:
                raise ConfigError(f"{key}[{i}].{name}: allowed values: {', '.join(allowed)}; got {value}")


def source_names(sources: list[SourceConfig]) -> list[str]:
    """Each source's name: its own, else its file's stem (a folder's name), else its kind."""
    return [s.name or (Path(s.path).stem if s.path else SourceKind(s.kind).value) for s in sources]


def shared_tokenizer(cfg: Config) -> str | None:
    d, m = cfg.data, cfg.model
    return d.tokenizer or (m.path if ModelKind(m.kind) is ModelKind.hf else None)


def check_mixture(cfg: Config) -> None:
    """The settings of data=mixture (and data.sources elsewhere), each refusal naming its key."""
    d = cfg.data
    if DataName(d.name) is not DataName.mixture:
        if d.sources:
            raise ConfigError(f"data.sources: only read by data=mixture, not data={DataName(d.name).value}")
        given = [key for key, changed in (("data.exhausted", Exhausted(d.exhausted) is not Exhausted.repeat),
                                          ("data.epoch_samples", bool(d.epoch_samples)),
                                          ("data.weights_by", WeightsBy(d.weights_by) is not WeightsBy.documents))
                 if changed]
        if given:
            raise ConfigError(f"{given[0]}: only read by data=mixture, not data={DataName(d.name).value}")
        return
    if not d.sources:
        raise ConfigError(f"data.sources: data=mixture needs its sources, e.g. '{EXAMPLE}'")
    for key in NOT_FOR_MIXTURES:
        if getattr(d, key) is not None:
            raise ConfigError(f"data.{key}: data=mixture reads each source's own (data.sources[i].{key})")
    if TrainOn(d.train_on) is not TrainOn.assistant:
        raise ConfigError("data.train_on: data=mixture reads each chat source's own (data.sources[i].train_on)")
    if d.epoch_samples and Exhausted(d.exhausted) in EPOCH_SIZED:
        raise ConfigError(f"data.epoch_samples: data.exhausted={Exhausted(d.exhausted).value} sizes the epoch by the sources; "
                          "leave epoch_samples 0")
    if d.epoch_samples < 0:
        raise ConfigError(f"data.epoch_samples: must be >= 0 (0: the sum of the sources' documents), got "
                          f"{d.epoch_samples}")
    names = source_names(d.sources)
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if s.kind is None:
            raise ConfigError(f"{key}.kind: required, one of {', '.join(k.value for k in SourceKind)}")
        kind = SourceKind(s.kind)
        for name in KIND_ONLY_KEYS:
            if getattr(s, name) is not None and name not in KIND_KEYS[kind]:
                raise ConfigError(f"{key}.{name}: not a key of a kind={kind.value} source; its keys: "
                                  f"{', '.join(COMMON_KEYS + KIND_KEYS[kind])}")
        if not (isinstance(s.weight, (int, float)) and math.isfinite(s.weight) and s.weight >= 0):
            raise ConfigError(f"{key}.weight: must be >= 0 (0: the source is off), got {s.weight}")
        if s.max_samples is not None and s.max_samples < 1:
            raise ConfigError(f"{key}.max_samples: must be >= 1 (null: all its documents), got {s.max_samples}")
        check_repeat(s, key, d)
        if s.path is None and kind is not SourceKind.text:
            raise ConfigError(f"{key}.path: a kind={kind.value} source needs its file, e.g. "
                              f"{{kind:{kind.value},path:{'train.bin' if kind is SourceKind.tokens else 'a.jsonl'}}}")
        if kind is SourceKind.chat and s.long_documents == LongDocuments.split:
            raise ConfigError(f"{key}.long_documents: split is for hf sources (a conversation is not cut into "
                              "windows); truncate or drop")
        if s.val_path is not None and d.val_fraction:
            raise ConfigError(f"{key}.val_path: give a source's val_path or data.val_fraction (which holds out that "
                              "fraction of every source), not both")
        if names[i] in names[:i]:
            raise ConfigError(f"{key}.name: {names[i]!r} names two sources (the file's stem unless given); give each its own name")
    if len({s.repeat is None for s in d.sources if s.weight}) > 1:
        raise ConfigError("data.sources: repeat on some sources and not on others: give every source its repeat "
                          "(each epoch draws repeat x its documents) or none (weights share data.epoch_samples)")
    if not any(s.weight > 0 for s in d.sources):
        raise ConfigError("data.sources: every weight is 0 (off): give one source a weight > 0")
    kinds = {SourceKind(s.kind) for s in d.sources}
    if SourceKind.text in kinds and kinds - {SourceKind.text}:
        raise ConfigError("data.sources: mixed tokenizers: kind=text sources are bytes, kind="
                          f"{'/'.join(sorted(k.value for k in kinds - {SourceKind.text}))} sources are token ids of "
                          "another vocabulary; tokenise the text (kind=hf) or keep to kind=text")
    tokenizer = shared_tokenizer(cfg)
    for i, s in enumerate(d.sources):
        if s.tokenizer is not None and (tokenizer is None or Path(s.tokenizer).resolve() != Path(tokenizer).resolve()):
            raise ConfigError(f"data.sources[{i}].tokenizer: mixed tokenizers: {s.tokenizer} is not the run's "
                              f"({tokenizer or 'none'}: data.tokenizer, else model.path); all sources share one")


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


def check_repeat(s: SourceConfig, key: str, d: DataConfig) -> None:
    """A source's repeat: MosaicML's absolute count of an epoch (repeat x its documents), so in
    place of a weight and of data.epoch_samples."""
    if s.repeat is None:
        return
    if not (math.isfinite(s.repeat) and s.repeat > 0):
        raise ConfigError(f"{key}.repeat: must be > 0 (weight 0 switches a source off), got {s.repeat}")
    if s.weight not in (0, 1):
        raise ConfigError(f"{key}.repeat: give a weight (a share of the epoch) or repeat (its documents x repeat "
                          f"an epoch), not both; weight {s.weight:g}")
    if d.epoch_samples:
        raise ConfigError(f"{key}.repeat: the sources' repeats make the epoch; data.epoch_samples must stay 0")
    if WeightsBy(d.weights_by) is WeightsBy.tokens:
        raise ConfigError(f"{key}.repeat: counts documents; data.weights_by=tokens is for weights")
    if Exhausted(d.exhausted) in EPOCH_SIZED:
        raise ConfigError(f"{key}.repeat: the repeats size the epoch, as data.exhausted={Exhausted(d.exhausted).value} would: "
                          "give one")
    if s.repeat > 1 and Exhausted(d.exhausted) is Exhausted.stop:
        raise ConfigError(f"{key}.repeat: {s.repeat:g} draws documents again, which data.exhausted=stop forbids; "
                          "data.exhausted=repeat")


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


def _tokenized(cfg: Config, s: SourceConfig, path: str, key: str):
    d, tokenizer = cfg.data, shared_tokenizer(cfg)
    encoding = Conversations(s.train_on or TrainOn.assistant, s.chat_template) if SourceKind(s.kind) is SourceKind.chat \
        else TextDocuments(s.text_field or "text")
    return TokenizedText(path, key, encoding, Path(tokenizer) if tokenizer else None,
                         Path(d.cache_dir) if d.cache_dir else default_cache_dir(), BadRows(d.bad_rows))


def _files(cfg: Config) -> list[tuple[SourceConfig, str, str]]:
    """(source, path, key) of every file the mixture reads: each source's data and held-out data
    (a source of weight 0 is off: none of its files)."""
    return [(s, path, f"data.sources[{i}].{what}") for i, s in enumerate(cfg.data.sources) if s.weight > 0
            for what, path in (("path", s.path), ("val_path", s.val_path)) if path is not None or what == "path"]


def _read(cfg: Config, s: SourceConfig, path: str | None, key: str) -> tuple[Tokens, int]:
    kind = SourceKind(s.kind)
    if kind in TOKENIZED:
        return _tokenized(cfg, s, path, key).tokens()
    if kind is SourceKind.tokens:
        return token_file(path, TokenDtype(s.dtype or TokenDtype.uint16).value, key), 0
    if cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size: byte-level text (kind=text) needs >= 256, got {cfg.model.vocab_size}")
    return text_tokens(path, key), 0


def check_mixture_data(cfg: Config) -> None:
    """Before any rank starts: the files, the tokenizer against the model, the first rows of each
    hf/chat file (tokenising waits for the run); no source without documents."""
    for s, path, key in _files(cfg):
        if SourceKind(s.kind) in TOKENIZED:
            source = _tokenized(cfg, s, path, key)
            source.check(cfg.model.vocab_size)
            if not source.ready:
                if len(open_dataset(source.path, key, source.cache_root)) == 0:
                    raise ConfigError(f"{key}: {path} has no rows: a source with no documents")
        elif not len(windows(len(_read(cfg, s, path, key)[0].ids), cfg.model.seq_len)):
            raise ConfigError(f"{key}: {path or 'the bundled text'} holds fewer than model.seq_len + 1 = "
                              f"{cfg.model.seq_len + 1} tokens: a source with no documents")
    if cfg.data.packing and ModelKind(cfg.model.kind) is not ModelKind.reference:
        check_packing(cfg.model)  # the reference model keeps packed documents apart (tests/test_chat.py)


def load_sources(cfg: Config, local_rank: int) -> list[Source]:
    """Every source's documents and held-out rows; text to tokenise is tokenised once per node
    (trainer/data/tokenized.py)."""
    d, m = cfg.data, cfg.model
    for s, path, key in _files(cfg):
        if SourceKind(s.kind) in TOKENIZED:
            source = _tokenized(cfg, s, path, key)
            source.prepare() if local_rank == 0 else source.wait()
    out = []
    for i, (s, name) in enumerate(zip(d.sources, source_names(d.sources))):
        key, kind = f"data.sources[{i}]", SourceKind(s.kind)
        if not s.weight:
            log.info(f"data source {name} ({kind.value}): weight 0, off (not read)")
            continue
        tokens, pad_id = _read(cfg, s, s.path, f"{key}.path")
        val = _read(cfg, s, s.val_path, f"{key}.val_path")[0] if s.val_path else None
        if d.val_fraction:
            tokens, val = tokens.split(d.val_fraction)
        rule = long_documents(s, d.drop_long) if kind in TOKENIZED else None
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
    rows = PackedDocuments if d.packing else Documents
    return rows(tokens, m.seq_len, m.vocab_size, pad_id, rule is LongDocuments.drop)


def allocate(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` split in proportion to `weights` in whole numbers: each its share rounded down, the
    rest one each to the largest remainders (the earlier source first on a tie)."""
    shares = total * np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    counts = np.floor(shares).astype(np.int64)
    rest = total - int(counts.sum())
    counts[np.argsort(-(shares - counts), kind="stable")[:rest]] += 1
    return counts


class WithPositions(Dataset):
    """Windows of a running text as packed rows are: with position ids (one document each)."""

    def __init__(self, rows: Dataset):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y = self.rows[i]
        return x, y, torch.arange(len(x))


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


@dataclass
class EpochPlan:
    """One epoch's documents in training order (`source` and `document` in it, each), and the
    first document of each row (`row_starts`, one more than the rows)."""
    source: np.ndarray
    document: np.ndarray
    row_starts: np.ndarray


class MixtureRows(Dataset):
    """The training rows of a mixture, addressed (epoch, row): the stream (trainer/data/stream.py)
    asks `rows_in(epoch)` and reads the rows of each epoch in order; `drawn` says which sources a
    range of rows came from."""

    def __init__(self, sources: list[Source], seq_len: int, vocab_size: int, packing: bool, seed: int,
                 epoch_samples: int, exhausted: Exhausted, weights_by: WeightsBy = WeightsBy.documents):
        self.sources, self.seq_len, self.vocab_size, self.packing = sources, seq_len, vocab_size, packing
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
        return allocate(math.floor(self.epoch_draws * epochs + 1e-9), self.weights)

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
