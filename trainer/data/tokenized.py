"""data=hf and data=chat: rows read with the `datasets` library and tokenised once, into a cache
reused by every rank and every later run.

An encoding turns rows into documents: `TextDocuments` (data=hf) one text column, each document
ended by EOS, every token a target; `Conversations` (data=chat, trainer/data/chat.py) rendered
with a chat template, with a per-token target mask. The cache holds the token ids of all
documents back to back (`ids.bin`), where each document starts (`doc_starts.npy`) and, for an
encoding with targets, one uint8 per token: 1 where the token is a target (`targets.bin`);
packing or padding happens when reading. Its key is the data files (path, size, mtime), the
tokenizer's own files, the `tokenizers` version and the encoding's settings, so a changed file,
tokenizer or setting makes a new one.

The first process of each node asks for an entry; of several nodes sharing the cache dir, the
one that takes the entry's lock file writes it and the others wait on the lock. The node's other
ranks wait for the entry to appear. All of this is outside any collective, so a corpus may take
longer than `collective_timeout_s`. The entry is written under a temporary name, in batches
whose progress is recorded, so a writer that dies leaves a partial entry the next writer
continues; it is renamed when complete.

A row the encoding cannot read stops the run, naming it (`data.bad_rows=error`), or is left out and
counted in the entry (`skip`); the first rows are read before any rank starts, either way.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Protocol

import numpy as np

from trainer.config import BadRows
from trainer.data.sources import Tokens
from trainer.errors import ConfigError
from trainer.extras import require_hf
from trainer.log import log

FORMAT = 1
BATCH_DOCUMENTS = 1000  # tokenised, written and recorded together: what a resumed writer may redo
PROGRESS_EVERY_S = 30.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
CHECKED_ROWS = 16  # encoded before any rank starts: a row the encoding cannot read is refused early
SAID_BAD_ROWS = 5  # skipped rows named in the log, each; the others are counted

# A document: its token ids, and which of them are targets (1) or context only (0); None: all are.
Document = tuple[list[int], "list[int] | None"]


class BadRow(ValueError):
    """A row an encoding cannot read; the cache names the file and the row."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"row {index}: {reason}")


class Encoding(Protocol):
    name: str  # data=<name>
    what: str  # what the rows hold, for messages: "text in column 'text'", "conversations"
    has_targets: bool  # documents carry a target mask (else every token is a target)

    def key(self) -> dict:
        """The settings the cached tokens depend on (besides the files and the tokenizer)."""

    def check(self, dataset, tokenizer, path: Path) -> None:
        """Before any rank starts: the columns and the tokenizer fit the encoding."""

    def encode(self, tokenizer, rows: dict[str, list], first: int) -> list[Document | BadRow]:
        """The documents of a batch of rows (a dict of columns), the first being row `first`; a row
        it cannot read is a BadRow in its place."""


class TextDocuments:
    """data=hf: the text of one column; each document ends with EOS; every token is a target."""
    name, has_targets = "hf", False

    def __init__(self, text_field: str):
        self.text_field = text_field
        self.what = f"text in column {text_field!r}"

    def key(self) -> dict:
        return {"text_field": self.text_field}

    def check(self, dataset, tokenizer, path: Path) -> None:
        if self.text_field not in dataset.column_names:
            raise ConfigError(f"data.text_field: no column {self.text_field!r} in {path}; "
                              f"columns: {', '.join(dataset.column_names)}")

    def encode(self, tokenizer, rows: dict[str, list], first: int) -> list[Document]:
        eos = tokenizer.eos_token_id
        texts = [t or "" for t in rows[self.text_field]]
        return [(ids if ids and ids[-1] == eos else ids + [eos], None)
                for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer"


def data_files(path: Path, key: str) -> tuple[str, list[Path]] | None:
    """(datasets builder, files) of a file or a folder of files; None for a save_to_disk folder."""
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if path.is_dir() and any((path / f).is_file() for f in SAVED_DATASET_FILES):
        return None
    files = train_split(path, sorted(f for f in path.rglob("*") if f.suffix in BUILDERS)) if path.is_dir() else [path]
    if not files or files[0].suffix not in BUILDERS:
        raise ConfigError(f"{key}: {path} is no {'/'.join(BUILDERS)} file, folder of them, or Dataset.save_to_disk "
                          "folder")
    builders = {BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ConfigError(f"{key}: {path} mixes file types ({', '.join(sorted(builders))}); keep one kind per folder")
    return builders.pop(), files


def train_split(folder: Path, files: list[Path]) -> list[Path]:
    """A folder whose files name their splits (`data/train-00000-of-00001.parquet`, `test.jsonl`: a
    Hub dataset's layout): the train split's files, as `datasets.load_dataset(folder)` takes them."""
    from datasets.data_files import get_data_patterns

    try:
        patterns = {str(split): found for split, found in get_data_patterns(str(folder)).items()}
    except Exception:  # no files it knows (datasets' EmptyDatasetError): the checks after say what is wrong
        return files
    if len(patterns) < 2 or "train" not in patterns:
        return files
    train = {f for pattern in patterns["train"] for f in folder.glob(pattern)}
    return [f for f in files if f in train]


def open_dataset(path: Path, key: str, cache_dir: Path):
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    found = data_files(path, key)
    if found is None:
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"{key}: {path} holds splits {list(loaded)}; point at one of them")
            loaded = loaded["train"]
        return loaded
    builder, files = found
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                 cache_dir=str(cache_dir / "datasets"))


def tokenizer_folder(path: Path | None, key: str, data: str = "hf") -> Path:
    if path is None:
        raise ConfigError(f"{key}: data={data} needs a tokenizer folder (data.tokenizer=DIR, or a model.path that has "
                          "one)")
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    return path


def load_tokenizer(path: Path | None, key: str):
    from transformers import AutoTokenizer

    path = tokenizer_folder(path, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: no Hugging Face tokenizer in {path}: {e}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}: the tokenizer in {path} has no EOS token, which ends every document")
    return tokenizer


def cache_key(path: Path, tokenizer_dir: Path, settings: dict) -> str:
    """The data files by path, size and mtime; the tokenizer by the content of its own files (not
    the weights beside them in a model folder) and the `tokenizers` version that runs it; the
    encoding's settings."""
    from importlib.metadata import version

    found = data_files(path, "data.path")
    files = found[1] if found else sorted(f for f in path.rglob("*") if f.is_file())
    h = hashlib.sha256(json.dumps({"format": FORMAT, **settings, "tokenizers": version("tokenizers")},
                                  sort_keys=True).encode())
    for f in files:
        stat = f.stat()
        h.update(f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            h.update(name.encode() + (tokenizer_dir / name).read_bytes())
    return h.hexdigest()[:16]


class TokenizedText:
    """One source (data.path or data.val_path) with its encoding, tokenizer and cache entry."""

    def __init__(self, path: str | None, key: str, encoding: Encoding, tokenizer_dir: Path | None, cache_root: Path,
                 bad_rows: BadRows = BadRows.error):
        data = f"data={encoding.name}"
        require_hf(data, "datasets")
        require_hf(data, "transformers")
        if path is None:
            raise ConfigError(f"{key}: {data} needs a file or folder, e.g. {key}=train.jsonl")
        self.path, self.key, self.encoding, self.cache_root = Path(path), key, encoding, cache_root
        self.bad_rows = BadRows(bad_rows)
        self.tokenizer_dir = tokenizer_folder(tokenizer_dir, "data.tokenizer", encoding.name)
        # An entry that skipped rows is not one that may have none.
        self.dir = cache_root / "tokenized" / cache_key(self.path, self.tokenizer_dir,
                                                        {**encoding.key(), "bad_rows": self.bad_rows.value})

    @property
    def ready(self) -> bool:
        return (self.dir / "meta.json").is_file()

    def check(self, vocab_size: int) -> None:
        """Before any rank starts: the tokenizer fits the model; the encoding reads the columns
        and the first rows."""
        tokenizer = load_tokenizer(self.tokenizer_dir, "data.tokenizer")
        if len(tokenizer) > vocab_size:
            raise ConfigError(f"data.tokenizer: {self.tokenizer_dir} has {len(tokenizer)} tokens, more than the "
                              f"model's {vocab_size} embeddings")
        if not self.ready:
            dataset = open_dataset(self.path, self.key, self.cache_root)
            self.encoding.check(dataset, tokenizer, self.path)
            documents, bad = self._encode(tokenizer, dataset[:CHECKED_ROWS], 0)
            if bad and not documents:
                raise ConfigError(f"{self.key}: {self.path}, none of the first {len(bad)} rows can be read; {bad[0]}")

    def _encode(self, tokenizer, rows: dict[str, list], first: int) -> tuple[list[Document], list[BadRow]]:
        """The documents of the rows, and the rows skipped (data.bad_rows=skip; else the first stops the run)."""
        documents, bad = [], []
        for document in self.encoding.encode(tokenizer, rows, first):
            if isinstance(document, BadRow) and self.bad_rows is BadRows.error:
                raise ConfigError(f"{self.key}: {self.path}, {document} (data.bad_rows=skip leaves such rows out)")
            (bad if isinstance(document, BadRow) else documents).append(document)
        return documents, bad

    def wait(self) -> None:
        """Until the entry is published (by this node's first process; if that one fails, the
        launcher stops this one)."""
        while not self.ready:
            time.sleep(0.2)

    def prepare(self) -> None:
        """Tokenise into the cache unless it is there or another node's process does (see the top)."""
        if self.ready:
            return
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.dir.with_name(f".{self.dir.name}.lock")
        with open(lock_path, "a") as lock:
            self._take(lock)
            if not self.ready:
                self._tokenise()
                # Published before removed: whoever still waits on this file finds the entry ready.
                lock_path.unlink(missing_ok=True)

    def _take(self, lock: IO) -> None:
        """Hold the entry's lock; while another process holds it, say what it has done so far."""
        said = 0.0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() - said >= PROGRESS_EVERY_S:
                    done = self._progress()
                    log.info(f"waiting for {self.dir}, which another process is tokenising "
                             f"({done['documents']:,} documents so far)")
                    said = time.monotonic()
                time.sleep(0.2)

    @property
    def _tmp(self) -> Path:
        return self.dir.with_name(f".tmp-{self.dir.name}")

    def _progress(self) -> dict:
        """What the partial entry holds: documents and bytes of ids.bin written, in whole batches."""
        try:
            return json.loads((self._tmp / "progress.json").read_text())
        except (OSError, ValueError):
            return {"documents": 0, "ids_bytes": 0, "bad_rows": 0}

    def _tokenise(self) -> None:
        started = time.perf_counter()
        tokenizer = load_tokenizer(self.tokenizer_dir, "data.tokenizer")
        dataset = open_dataset(self.path, self.key, self.cache_root)
        dtype = np.uint16 if len(tokenizer) <= 2 ** 16 else np.uint32
        self._tmp.mkdir(exist_ok=True)
        done = self._progress()
        written = done["ids_bytes"] // np.dtype(dtype).itemsize  # tokens in the recorded batches
        # What a writer that died wrote past its last recorded batch is cut off, then continued.
        sizes = {"ids": done["ids_bytes"], "doc_starts": (done["documents"] - done["bad_rows"]) * 8}
        if self.encoding.has_targets:
            sizes["targets"] = written  # one byte per token
        for name, size in sizes.items():
            with open(self._tmp / f"{name}.bin", "ab") as f:
                f.truncate(size)
        # rows, as the file counts them (a preference row becomes two documents, its pair's sequences)
        log.info(f"tokenising {len(dataset):,} rows of {self.path} with {self.tokenizer_dir} (once; cached in "
                 f"{self.dir})" + (f", continuing after {done['documents']:,}" if done["documents"] else ""))
        total, bad_rows, said = written, done["bad_rows"], time.monotonic()
        with ExitStack() as stack:
            files = {name: stack.enter_context(open(self._tmp / f"{name}.bin", "ab")) for name in sizes}
            for first in range(done["documents"], len(dataset), BATCH_DOCUMENTS):
                docs, bad = self._encode(tokenizer, dataset[first:first + BATCH_DOCUMENTS], first)
                for row in bad[:max(0, SAID_BAD_ROWS - bad_rows)]:
                    log.warning(f"{self.key}: {self.path}, {row}: skipped (data.bad_rows=skip)")
                bad_rows += len(bad)
                lengths = np.asarray([len(ids) for ids, _ in docs], dtype=np.int64)
                starts = total + np.concatenate([[0], np.cumsum(lengths)[:-1]])
                files["doc_starts"].write(starts.astype(np.int64).tobytes())
                files["ids"].write(np.asarray([i for ids, _ in docs for i in ids], dtype=dtype).tobytes())
                if self.encoding.has_targets:
                    files["targets"].write(np.asarray([t for _, targets in docs for t in targets], np.uint8).tobytes())
                total += int(lengths.sum())
                for f in files.values():
                    f.flush()
                    os.fsync(f.fileno())
                documents = min(first + BATCH_DOCUMENTS, len(dataset))  # rows read, those skipped too
                (self._tmp / "progress.json").write_text(json.dumps({"documents": documents, "bad_rows": bad_rows,
                                                                     "ids_bytes": files["ids"].tell()}))
                if time.monotonic() - said >= PROGRESS_EVERY_S:
                    log.info(f"tokenised {documents:,} of {len(dataset):,} rows")
                    said = time.monotonic()
        if not total:
            raise ConfigError(f"{self.key}: {self.path} has no {self.encoding.what}")
        doc_starts = np.fromfile(self._tmp / "doc_starts.bin", dtype=np.int64)
        np.save(self._tmp / "doc_starts.npy", doc_starts)
        (self._tmp / "doc_starts.bin").unlink()
        (self._tmp / "progress.json").unlink()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "documents": len(doc_starts), "tokens": total,
                "pad_id": pad_id, "targets": self.encoding.has_targets, "bad_rows": bad_rows,
                "source": str(self.path.resolve()), "tokenizer": str(self.tokenizer_dir.resolve()),
                **self.encoding.key()}
        (self._tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        self._tmp.rename(self.dir)  # published whole: readers look for dir/meta.json
        log.info(f"tokenised: {len(dataset):,} rows into {len(doc_starts):,} documents, {total:,} tokens in "
                 f"{time.perf_counter() - started:.1f} s" + (f"; {bad_rows:,} bad rows skipped" if bad_rows else ""))

    def tokens(self) -> tuple[Tokens, int]:
        """The cached tokens (with their target mask, where the encoding has one) and the id that
        pads unpacked rows."""
        meta = json.loads((self.dir / "meta.json").read_text())
        ids = np.memmap(self.dir / "ids.bin", dtype=meta["dtype"], mode="r")
        targets = np.memmap(self.dir / "targets.bin", dtype=np.uint8, mode="r") if meta.get("targets") else None
        return Tokens(ids, np.load(self.dir / "doc_starts.npy"), targets, meta["bad_rows"]), meta["pad_id"]
