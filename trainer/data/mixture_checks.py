"""data=mixture's checks: its settings (data.sources as written, then each source's keys
against its kind, the weights, repeats and the one tokenizer), each refusal naming its key; and,
before any rank starts, its files (trainer/checks.py and trainer/data/__init__.py call them)."""
from __future__ import annotations

import math
from pathlib import Path

from trainer.config import (
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
from trainer.data.mixture_sources import source_names, sources_on, windows
from trainer.data.read import check_tokenized, read_tokens, run_tokenizer
from trainer.data.tokenized import open_dataset
from trainer.errors import ConfigError
from trainer.models.checks import check_packing

# The keys each kind reads besides kind, path, name, weight and val_path; the others stay null.
KIND_KEYS = {SourceKind.text: (), SourceKind.tokens: ("dtype",),
             SourceKind.hf: ("text_field", "tokenizer", "long_documents"),
             SourceKind.chat: ("tokenizer", "train_on", "chat_template", "long_documents")}
COMMON_KEYS = ("kind", "path", "name", "weight", "val_path", "max_samples", "repeat")
KIND_ONLY_KEYS = tuple(dict.fromkeys(k for keys in KIND_KEYS.values() for k in keys))
ENUMS = {"kind": SourceKind, "dtype": TokenDtype, "train_on": TrainOn, "long_documents": LongDocuments}
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
    tokenizer = run_tokenizer(cfg)
    for i, s in enumerate(d.sources):
        if s.tokenizer is not None and (tokenizer is None or Path(s.tokenizer).resolve() != Path(tokenizer).resolve()):
            raise ConfigError(f"data.sources[{i}].tokenizer: mixed tokenizers: {s.tokenizer} is not the run's "
                              f"({tokenizer or 'none'}: data.tokenizer, else model.path); all sources share one")


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


def check_mixture_data(cfg: Config) -> None:
    """Before any rank starts: the files, the tokenizer against the model, the first rows of each
    hf/chat file (tokenising waits for the run); no source without documents."""
    for source in sources_on(cfg):
        for path, key in source.files():
            if source.tokenized:
                entry = check_tokenized(cfg, source, path, key)
                if not entry.ready and len(open_dataset(entry.path, key, entry.cache_root)) == 0:
                    raise ConfigError(f"{key}: {path} has no rows: a source with no documents")
            elif not len(windows(len(read_tokens(cfg, source, path, key)[0].ids), cfg.model.seq_len)):
                raise ConfigError(f"{key}: {path or 'the bundled text'} holds fewer than model.seq_len + 1 = "
                                  f"{cfg.model.seq_len + 1} tokens: a source with no documents")
    if cfg.data.packing and ModelKind(cfg.model.kind) is not ModelKind.reference:
        check_packing(cfg.model)  # the reference model keeps packed documents apart (tests/test_chat.py)
