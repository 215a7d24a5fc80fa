"""The data layer: token sources (`data=text|synthetic|tokens|hf|chat`), rows cut from them
(packed windows, padded documents, or whole documents packed with position ids), the held-out
split, and the stream that owns `set_epoch`."""
from __future__ import annotations

from dataclasses import asdict
from enum import Enum
from pathlib import Path

from torch.utils.data import Dataset

from trainer.config import Config, DataName, ModelKind
from trainer.data.chat import Conversations
from trainer.data.mixture import check_mixture_data, load_mixture
from trainer.data.mixture import fingerprint as sources_fingerprint
from trainer.data.preference import PairRows, PreferencePairs, split_pairs
from trainer.data.sources import (
    IGNORE_INDEX,
    DocumentRows,
    Documents,
    PackedDocuments,
    Tokens,
    TokenWindows,
    synthetic_tokens,
    text_tokens,
    token_file,
)
from trainer.data.stream import BatchStream, eval_batches
from trainer.data.tokenized import TextDocuments, TokenizedText, default_cache_dir
from trainer.errors import ConfigError
from trainer.log import log
from trainer.models.checks import check_packing

__all__ = ["IGNORE_INDEX", "BatchStream", "eval_batches", "check_data", "data_fingerprint", "load_data", "token_keys"]

TOKENIZED = (DataName.hf, DataName.chat, DataName.preference)
# How the training samples are read or held out for validation, not which they are
NOT_THE_SAMPLES = {"num_workers", "cache_dir", "val_path"}


def _tokenizer(cfg: Config) -> str | None:
    d, m = cfg.data, cfg.model
    return d.tokenizer or (m.path if ModelKind(m.kind) is ModelKind.hf else None)


def data_fingerprint(cfg: Config) -> dict:
    """What makes the training samples what they are, by setting name (the sources, the tokenizer,
    the packing, seq_len; a synthetic set's seed and vocabulary): saved with the data position, which
    means nothing in other data. Not the world size: the position holds at any (data/stream.py)."""
    d, m = cfg.data, cfg.model
    settings = {f"data.{key}": value.value if isinstance(value, Enum) else value
                for key, value in asdict(d).items() if key not in NOT_THE_SAMPLES}
    settings.update({"data.tokenizer": _tokenizer(cfg), "model.seq_len": m.seq_len,
                     "data.sources": sources_fingerprint(d.sources)})
    if DataName(d.name) is DataName.synthetic:
        settings.update({"train.seed": cfg.train.seed, "model.vocab_size": m.vocab_size})
    return settings


def token_keys(cfg: Config) -> dict[str, str]:
    """The token cache's key of every split that is tokenised (data.path, data.val_path): what its
    tokens follow from (the files by size and mtime, the tokenizer's files, the template)."""
    if DataName(cfg.data.name) not in TOKENIZED:
        return {}
    return {key: _tokenized(cfg, path, key).dir.name for key, path in _paths(cfg)}


def _tokenized(cfg: Config, path: str | None, key: str) -> TokenizedText:
    d, tokenizer = cfg.data, _tokenizer(cfg)
    name = DataName(d.name)
    encoding = Conversations(d.train_on, d.chat_template) if name is DataName.chat \
        else PreferencePairs(d.chat_template) if name is DataName.preference else TextDocuments(d.text_field)
    return TokenizedText(path, key, encoding, Path(tokenizer) if tokenizer else None,
                         Path(d.cache_dir) if d.cache_dir else default_cache_dir(), d.bad_rows)


def _paths(cfg: Config) -> list[tuple[str, str | None]]:
    d = cfg.data
    return [("data.path", d.path)] + ([("data.val_path", d.val_path)] if d.val_path else [])


def _tokens(cfg: Config, path: str | None, key: str) -> tuple[Tokens, int]:
    """The tokens of one source and the id that pads its unpacked rows."""
    d, m = cfg.data, cfg.model
    name = DataName(d.name)
    if name in TOKENIZED:
        return _tokenized(cfg, path, key).tokens()
    if name is DataName.tokens:
        return token_file(path, d.dtype.value, key), 0
    if name is DataName.synthetic:
        if key != "data.path":
            raise ConfigError(f"{key}: data=synthetic reads no file; hold out with data.val_fraction")
        return synthetic_tokens(d.num_samples, m.seq_len, m.vocab_size, cfg.train.seed), 0
    if m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size: byte-level text needs >= 256, got {m.vocab_size}")
    return text_tokens(path, key), 0


def check_data(cfg: Config, world_size: int) -> None:
    """What can be wrong with the data settings, found before any rank starts: files, and one
    step's worth of samples (text to tokenise: once it is, at the start of the run)."""
    name = DataName(cfg.data.name)
    if name is DataName.mixture:
        return check_mixture_data(cfg)
    # preference rows always carry position ids: a pair's two sequences share a row
    packed = (name is DataName.chat and cfg.data.packing) or name is DataName.preference
    if packed and ModelKind(cfg.model.kind) is not ModelKind.reference:
        check_packing(cfg.model)  # the reference model keeps packed documents apart (tests/test_chat.py)
    if name in TOKENIZED:
        for key, path in _paths(cfg):
            _tokenized(cfg, path, key).check(cfg.model.vocab_size)
        return
    train, _ = load_data(cfg, local_rank=0)  # memory maps: reads nothing
    t = cfg.train
    BatchStream.check_size(len(train), t.micro_batch_size, t.grad_accum_steps, world_size)


def load_data(cfg: Config, local_rank: int) -> tuple[Dataset, Dataset | None]:
    """(training rows, validation rows or None). Text to tokenise is tokenised once, by the
    first process of a node, while the others wait (outside any collective: data/tokenized.py)."""
    d = cfg.data
    if DataName(d.name) is DataName.mixture:
        return load_mixture(cfg, local_rank)
    if DataName(d.name) in TOKENIZED:
        for key, path in _paths(cfg):
            source = _tokenized(cfg, path, key)
            source.prepare() if local_rank == 0 else source.wait()
    train, pad_id = _tokens(cfg, d.path, "data.path")
    val = _tokens(cfg, d.val_path, "data.val_path")[0] if d.val_path else None
    preference = DataName(d.name) is DataName.preference
    if d.val_fraction:
        train, val = split_pairs(train, d.val_fraction) if preference else train.split(d.val_fraction)
    m = cfg.model
    chat = DataName(d.name) is DataName.chat

    def rows(tokens: Tokens, split: str) -> Dataset:
        if preference:
            return report(PairRows(tokens, m.seq_len, m.vocab_size, pad_id, d.drop_long, d.packing), split,
                          tokens.bad_rows)
        if chat and d.packing:
            return report(PackedDocuments(tokens, m.seq_len, m.vocab_size, pad_id, d.drop_long), split, tokens.bad_rows)
        if d.packing:
            return TokenWindows(tokens, m.seq_len, m.vocab_size)
        return report(Documents(tokens, m.seq_len, m.vocab_size, pad_id, d.drop_long), split, tokens.bad_rows)

    def report(rows: DocumentRows, split: str, bad_rows: int) -> Dataset:
        """One line (rank 0's) on what became of the documents: rows, those too long, those
        left without a target, rows of the source that could not be read."""
        what, longest = "conversations" if chat else "pairs" if preference else "documents", m.seq_len + 1
        notes = [f"{rows.long:,} longer than model.seq_len + 1 = {longest} tokens "
                 + ("dropped (data.drop_long)" if d.drop_long else "truncated (data.drop_long=true drops them)")
                 ] if rows.long else []
        notes += [f"{rows.untargeted:,} left out: no target in their first {longest} tokens"] if rows.untargeted else []
        notes += [f"{bad_rows:,} bad rows skipped (data.bad_rows=skip)"] if bad_rows else []
        width, count = (2 * m.seq_len, len(rows.pairs)) if preference else (m.seq_len, len(rows.spans))
        log.info(f"{split}: {count:,} {what} in {len(rows):,} {'packed' if d.packing else 'padded'} rows "
                 f"of {width} tokens" + "".join(f"; {note}" for note in notes))
        return rows
    return rows(train, "data"), rows(val, "validation data") if val is not None else None
