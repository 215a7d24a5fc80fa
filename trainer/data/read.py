"""One source, read: every `data=` kind is a source (data=text|synthetic|tokens|hf|chat|preference
one, data=mixture's `data.sources` several), and each is read the one way here: the run's one
tokenizer, its files, the token cache of those to tokenise (trainer/data/tokenized.py), and its
token ids with the id that pads its unpacked rows.

How a source's tokens become rows is its kind's (trainer/data/__init__.py for one source,
trainer/data/mixture.py for several): reading them is the same for both.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.config import Config, DataConfig, DataName, ModelKind, SourceConfig, SourceKind, TokenDtype, TrainOn
from trainer.data.chat import Conversations
from trainer.data.preference import PreferencePairs
from trainer.data.sources import Tokens, synthetic_tokens, text_tokens, token_file
from trainer.data.tokenized import TextDocuments, TokenizedText, default_cache_dir
from trainer.errors import ConfigError

TOKENIZED = (DataName.hf, DataName.chat, DataName.preference)  # read with `datasets`, tokenised into the cache


@dataclass(frozen=True)
class SourceSpec:
    """What one source is and where its settings are (`at`: "data", "data.sources[i]"), each key
    filled in: data=<kind>'s own keys, or a mixture source's (else its kind's defaults)."""
    kind: DataName
    at: str
    path: str | None
    val_path: str | None
    dtype: TokenDtype
    text_field: str
    train_on: TrainOn
    chat_template: str | None
    in_mixture: bool = False  # its messages name its kind (kind=text)

    @property
    def tokenized(self) -> bool:
        return self.kind in TOKENIZED

    def files(self) -> list[tuple[str | None, str]]:
        """(path, key) of its data and, where given, its held-out data."""
        return [(self.path, f"{self.at}.path")] + ([(self.val_path, f"{self.at}.val_path")] if self.val_path else [])


def the_source(cfg: Config) -> SourceSpec:
    """data=<kind>'s one source (not data=mixture's)."""
    d = cfg.data
    return SourceSpec(DataName(d.name), "data", d.path, d.val_path, TokenDtype(d.dtype), d.text_field,
                      TrainOn(d.train_on), d.chat_template)


def mixture_source(s: SourceConfig, i: int) -> SourceSpec:
    """Source i of data=mixture: its own keys, else its kind's defaults (data=<kind>'s)."""
    defaults = DataConfig()
    return SourceSpec(DataName(SourceKind(s.kind).value), f"data.sources[{i}]", s.path, s.val_path,
                      TokenDtype(s.dtype or defaults.dtype), s.text_field or defaults.text_field,
                      TrainOn(s.train_on or defaults.train_on), s.chat_template, in_mixture=True)


def run_tokenizer(cfg: Config) -> str | None:
    """The run's one tokenizer, which every source shares: data.tokenizer, else an hf model's folder."""
    d, m = cfg.data, cfg.model
    return d.tokenizer or (m.path if ModelKind(m.kind) is ModelKind.hf else None)


def token_cache(cfg: Config, source: SourceSpec, path: str | None, key: str) -> TokenizedText:
    """The token cache entry of one file of a source read with `datasets`."""
    d, tokenizer = cfg.data, run_tokenizer(cfg)
    encoding = Conversations(source.train_on, source.chat_template) if source.kind is DataName.chat \
        else PreferencePairs(source.chat_template) if source.kind is DataName.preference \
        else TextDocuments(source.text_field)
    return TokenizedText(path, key, encoding, Path(tokenizer) if tokenizer else None,
                         Path(d.cache_dir) if d.cache_dir else default_cache_dir(), d.bad_rows)


def prepare(cfg: Config, sources: list[SourceSpec], local_rank: int) -> None:
    """Text to tokenise is tokenised once, by the first process of a node, while the others wait
    (outside any collective: trainer/data/tokenized.py)."""
    for source in sources:
        if source.tokenized:
            for path, key in source.files():
                entry = token_cache(cfg, source, path, key)
                entry.prepare() if local_rank == 0 else entry.wait()


def read_tokens(cfg: Config, source: SourceSpec, path: str | None, key: str) -> tuple[Tokens, int]:
    """The tokens of one file of a source (tokenised ones from the cache, which `prepare` filled)
    and the id that pads its unpacked rows."""
    m = cfg.model
    if source.tokenized:
        return token_cache(cfg, source, path, key).tokens()
    if source.kind is DataName.tokens:
        return token_file(path, source.dtype.value, key), 0
    if source.kind is DataName.synthetic:
        if key != "data.path":
            raise ConfigError(f"{key}: data=synthetic reads no file; hold out with data.val_fraction")
        return synthetic_tokens(cfg.data.num_samples, m.seq_len, m.vocab_size, cfg.train.seed), 0
    if m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size: byte-level text{' (kind=text)' if source.in_mixture else ''} needs >= 256, "
                          f"got {m.vocab_size}")
    return text_tokens(path, key), 0


def check_tokenized(cfg: Config, source: SourceSpec, path: str | None, key: str) -> TokenizedText:
    """Before any rank starts, one file of a tokenised source: the tokenizer fits the model's
    vocabulary, the encoding reads the columns and the first rows. Its entry, checked."""
    entry = token_cache(cfg, source, path, key)
    entry.check(cfg.model.vocab_size)
    return entry
