"""data=hf: text read with the `datasets` library and tokenised once, into a cache reused by
every rank and every later run.

The cache holds the token ids of all documents back to back, each ended by EOS (`ids.bin`),
and where each document starts (`doc_starts.npy`); packing or padding happens when reading.
Its key is the data files (path, size, mtime), the tokenizer's files and the text field, so a
changed file or tokenizer makes a new one. One process per node writes it, under a temporary
name renamed when complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from trainer.config import ConfigError, require_hf
from trainer.data.sources import Tokens
from trainer.log import log

FORMAT = 1
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer"


def data_files(path: Path, key: str) -> tuple[str, list[Path]] | None:
    """(datasets builder, files) of a file or a folder of files; None for a save_to_disk folder."""
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if path.is_dir() and any((path / f).is_file() for f in SAVED_DATASET_FILES):
        return None
    files = sorted(f for f in path.rglob("*") if f.suffix in BUILDERS) if path.is_dir() else [path]
    if not files or files[0].suffix not in BUILDERS:
        raise ConfigError(f"{key}: {path} is no {'/'.join(BUILDERS)} file, folder of them, or Dataset.save_to_disk "
                          "folder")
    builders = {BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ConfigError(f"{key}: {path} mixes file types ({', '.join(sorted(builders))}); keep one kind per folder")
    return builders.pop(), files


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


def tokenizer_folder(path: Path | None, key: str) -> Path:
    if path is None:
        raise ConfigError(f"{key}: data=hf needs a tokenizer folder (data.tokenizer=DIR, or a model.path that has one)")
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


def cache_key(path: Path, tokenizer_dir: Path, text_field: str) -> str:
    found = data_files(path, "data.path")
    files = found[1] if found else sorted(f for f in path.rglob("*") if f.is_file())
    h = hashlib.sha256(json.dumps({"format": FORMAT, "field": text_field}).encode())
    for f in files:
        stat = f.stat()
        h.update(f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for f in sorted(tokenizer_dir.iterdir()):
        if f.is_file() and f.stat().st_size < 2 ** 28:
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


class TokenizedText:
    """One text source (data.path or data.val_path) with its tokenizer and cache entry."""

    def __init__(self, path: str | None, key: str, text_field: str, tokenizer_dir: Path | None, cache_root: Path):
        require_hf("data=hf", "datasets")
        require_hf("data=hf", "transformers")
        if path is None:
            raise ConfigError(f"{key}: data=hf needs a file or folder, e.g. {key}=train.jsonl")
        self.path, self.key, self.text_field, self.cache_root = Path(path), key, text_field, cache_root
        self.tokenizer_dir = tokenizer_folder(tokenizer_dir, "data.tokenizer")
        self.dir = cache_root / "tokenized" / cache_key(self.path, self.tokenizer_dir, text_field)

    @property
    def ready(self) -> bool:
        return (self.dir / "meta.json").is_file()

    def check(self, vocab_size: int) -> None:
        """Before any rank starts: the field is there, the tokenizer fits the model."""
        tokenizer = load_tokenizer(self.tokenizer_dir, "data.tokenizer")
        if len(tokenizer) > vocab_size:
            raise ConfigError(f"data.tokenizer: {self.tokenizer_dir} has {len(tokenizer)} tokens, more than the "
                              f"model's {vocab_size} embeddings")
        if not self.ready:
            columns = open_dataset(self.path, self.key, self.cache_root).column_names
            if self.text_field not in columns:
                raise ConfigError(f"data.text_field: no column {self.text_field!r} in {self.path}; "
                                  f"columns: {', '.join(columns)}")

    def prepare(self) -> None:
        """Tokenise into the cache unless it is there (one process per node calls this)."""
        if self.ready:
            return
        started = time.perf_counter()
        tokenizer = load_tokenizer(self.tokenizer_dir, "data.tokenizer")
        dataset = open_dataset(self.path, self.key, self.cache_root)
        log.info(f"tokenising {len(dataset):,} documents of {self.path} with {self.tokenizer_dir} (once; cached in "
                 f"{self.dir})")
        dtype = np.uint16 if len(tokenizer) <= 2 ** 16 else np.uint32
        eos = tokenizer.eos_token_id
        tmp = self.dir.with_name(f".tmp-{self.dir.name}-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        starts, total = [], 0
        with open(tmp / "ids.bin", "wb") as out:
            for batch in dataset.iter(batch_size=1000):
                texts = [t or "" for t in batch[self.text_field]]
                for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
                    if not ids or ids[-1] != eos:
                        ids = ids + [eos]
                    starts.append(total)
                    total += len(ids)
                    out.write(np.asarray(ids, dtype=dtype).tobytes())
        np.save(tmp / "doc_starts.npy", np.asarray(starts, dtype=np.int64))
        if not total:
            raise ConfigError(f"{self.key}: {self.path} has no text in column {self.text_field!r}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "documents": len(starts), "tokens": total,
                "pad_id": pad_id,
                "source": str(self.path.resolve()), "tokenizer": str(self.tokenizer_dir.resolve()),
                "text_field": self.text_field}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(self.dir)
        except OSError:  # another node's process finished first: its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"tokenised: {len(starts):,} documents, {total:,} tokens in {time.perf_counter() - started:.1f} s")

    def tokens(self) -> tuple[Tokens, int]:
        """The cached tokens and the id that pads unpacked rows."""
        meta = json.loads((self.dir / "meta.json").read_text())
        ids = np.memmap(self.dir / "ids.bin", dtype=meta["dtype"], mode="r")
        return Tokens(ids, np.load(self.dir / "doc_starts.npy")), meta["pad_id"]
