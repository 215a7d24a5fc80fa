"""What each `data=` reads, as one stream of token ids (documents back to back), and the two
ways to cut it into training rows: packed windows, or one padded document per row.

Token ids stay in the smallest unsigned type that holds them (uint8 for bytes, uint16/uint32
for tokenizers) and files are memory-mapped: a rank never holds its data set as int64.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.config import ConfigError

IGNORE_INDEX = -100  # a target that is no token (padding): left out of the loss


@dataclass
class Tokens:
    ids: np.ndarray  # 1-D unsigned ints; a memory map for files
    doc_starts: np.ndarray | None = None  # where each document begins; None: one running text

    def split(self, fraction: float) -> tuple[Tokens, Tokens]:
        """(kept, held out): the last `fraction` of the tokens, cut at a document start."""
        cut = int(len(self.ids) * (1 - fraction))
        if self.doc_starts is None:
            return Tokens(self.ids[:cut]), Tokens(self.ids[cut:])
        first_held = int(np.searchsorted(self.doc_starts, cut))
        cut = int(self.doc_starts[first_held]) if first_held < len(self.doc_starts) else len(self.ids)
        return (Tokens(self.ids[:cut], self.doc_starts[:first_held]),
                Tokens(self.ids[cut:], self.doc_starts[first_held:] - cut))


def bundled_text() -> bytes:
    return resources.files("trainer").joinpath("assets/licenses.txt").read_bytes()


def memory_map(path: str, dtype, key: str) -> np.ndarray:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: no file {file}")
    size = file.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0 or size % itemsize:
        raise ConfigError(f"{key}: {file} has {size} bytes, not a whole number (> 0) of {np.dtype(dtype).name} tokens")
    return np.memmap(file, dtype=dtype, mode="r")


def text_tokens(path: str | None, key: str = "data.path") -> Tokens:
    """Byte-level tokens (vocabulary 256) of a text file, or of the bundled corpus."""
    if path is None:
        return Tokens(np.frombuffer(bundled_text(), dtype=np.uint8))
    return Tokens(memory_map(path, np.uint8, key))


def token_file(path: str | None, dtype: str, key: str = "data.path") -> Tokens:
    """A flat file of token ids (nanoGPT's train.bin, Megatron-style), memory-mapped."""
    if path is None:
        raise ConfigError(f"{key}: data=tokens needs a file of {dtype} token ids, e.g. {key}=train.bin")
    return Tokens(memory_map(path, dtype, key))


def synthetic_tokens(num_samples: int, seq_len: int, vocab_size: int, seed: int) -> Tokens:
    """Arithmetic sequences mod vocab (random start and stride per window): learnable, no file."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    stride = torch.randint(1, 8, (num_samples, 1), generator=g)
    windows = (start + stride * torch.arange(seq_len)) % vocab_size
    ids = torch.cat([windows.flatten(), windows[:1, 0]]).numpy()
    return Tokens(ids.astype(np.uint16 if vocab_size <= 2 ** 16 else np.uint32))


def as_long(ids: np.ndarray, vocab_size: int, where: str) -> torch.Tensor:
    out = torch.from_numpy(ids.astype(np.int64))
    if out.numel() and int(out.max()) >= vocab_size:
        raise ValueError(f"data: token id {int(out.max())} in {where} is outside the model's vocabulary "
                         f"({vocab_size}); was the data tokenised for another model?")
    return out


class TokenWindows(Dataset):
    """Packed: non-overlapping windows of `seq_len + 1` tokens; item i is (inputs, next tokens)."""

    def __init__(self, tokens: Tokens, seq_len: int, vocab_size: int):
        self.ids, self.seq_len, self.vocab_size = tokens.ids, seq_len, vocab_size
        self.n = max(0, (len(self.ids) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = as_long(self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1], self.vocab_size, f"window {i}")
        return w[:-1], w[1:]


class Documents(Dataset):
    """Unpacked: one document per row, truncated to `seq_len + 1` tokens and padded on the
    right; padded positions are no target (IGNORE_INDEX). With causal attention the padding,
    which comes last, changes nothing before it."""

    def __init__(self, tokens: Tokens, seq_len: int, vocab_size: int, pad_id: int):
        self.ids, self.seq_len, self.vocab_size, self.pad_id = tokens.ids, seq_len, vocab_size, pad_id
        ends = np.append(tokens.doc_starts[1:], len(tokens.ids))
        keep = ends - tokens.doc_starts >= 2  # a target needs two tokens
        self.spans = np.stack([tokens.doc_starts[keep], ends[keep]], axis=1)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = (int(v) for v in self.spans[i])
        row = as_long(self.ids[start:min(end, start + self.seq_len + 1)], self.vocab_size, f"document {i}")
        x = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        y = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        x[:len(row) - 1], y[:len(row) - 1] = row[:-1], row[1:]
        return x, y
