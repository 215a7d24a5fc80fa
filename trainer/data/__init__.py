"""The data layer: every `data=` kind is a source, read the one way (trainer/data/read.py); the
rows cut from data=text|synthetic|tokens|hf|chat|preference's one source (packed windows, padded
documents, whole documents or pairs packed with position ids) and its held-out split, here; those
drawn from data=mixture's several, in trainer/data/mixture.py; and the stream that owns `set_epoch`."""
from __future__ import annotations

from dataclasses import asdict
from enum import Enum

from torch.utils.data import Dataset

from trainer.config import Config, DataName, ModelKind
from trainer.data.mixture import load_mixture, sources_of, validation_by_source
from trainer.data.mixture_checks import check_mixture_data
from trainer.data.mixture_sources import fingerprint as sources_fingerprint
from trainer.data.preference import PairRows, split_pairs
from trainer.data.read import check_tokenized, prepare, read_tokens, run_tokenizer, the_source, token_cache
from trainer.data.sources import IGNORE_INDEX, DocumentRows, PackedDocuments, Tokens, TokenWindows, UnpackedDocuments
from trainer.data.stream import BatchStream, eval_batches
from trainer.log import log
from trainer.models.checks import check_packing

__all__ = ["IGNORE_INDEX", "BatchStream", "eval_batches", "check_data", "data_fingerprint", "load_data", "sources_of", "token_keys",
           "validation_by_source"]

# How the training samples are read or held out for validation, not which they are
NOT_THE_SAMPLES = {"num_workers", "cache_dir", "val_path"}


def data_fingerprint(cfg: Config) -> dict:
    """What makes the training samples what they are, by setting name (the sources, the tokenizer,
    the packing, seq_len; a synthetic set's seed and vocabulary): saved with the data position, which
    means nothing in other data. Not the world size: the position holds at any (data/stream.py)."""
    d, m = cfg.data, cfg.model
    settings = {f"data.{key}": value.value if isinstance(value, Enum) else value
                for key, value in asdict(d).items() if key not in NOT_THE_SAMPLES}
    settings.update({"data.tokenizer": run_tokenizer(cfg), "model.seq_len": m.seq_len,
                     "data.sources": sources_fingerprint(d.sources)})
    if DataName(d.name) is DataName.synthetic:
        settings.update({"train.seed": cfg.train.seed, "model.vocab_size": m.vocab_size})
    return settings


def token_keys(cfg: Config) -> dict[str, str]:
    """The token cache's key of every split that is tokenised (data.path, data.val_path): what its
    tokens follow from (the files by size and mtime, the tokenizer's files, the template)."""
    source = the_source(cfg)
    if not source.tokenized:  # data=mixture's sources are in data.sources
        return {}
    return {key: token_cache(cfg, source, path, key).dir.name for path, key in source.files()}


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
    source = the_source(cfg)
    if source.tokenized:
        for path, key in source.files():
            check_tokenized(cfg, source, path, key)
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
    source = the_source(cfg)
    prepare(cfg, [source], local_rank)
    train, pad_id = read_tokens(cfg, source, d.path, "data.path")
    val = read_tokens(cfg, source, d.val_path, "data.val_path")[0] if d.val_path else None
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
        return report(UnpackedDocuments(tokens, m.seq_len, m.vocab_size, pad_id, d.drop_long), split, tokens.bad_rows)

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
