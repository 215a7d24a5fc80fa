"""What each `data=` reads, as one stream of token ids (documents back to back), and the ways
to cut it into training rows: packed windows, one padded document per row, or whole documents
packed into rows (data=chat) whose position ids restart at each document.

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

from trainer.errors import ConfigError

IGNORE_INDEX = -100  # a target that is no token (padding): left out of the loss


@dataclass
class Tokens:
    ids: np.ndarray  # 1-D unsigned ints; a memory map for files
    doc_starts: np.ndarray | None = None  # where each document begins; None: one running text
    targets: np.ndarray | None = None  # uint8 per token: 1 where it is a target (data=chat); None: all are
    bad_rows: int = 0  # rows of the source left out, unreadable (data.bad_rows=skip)

    def split(self, fraction: float) -> tuple[Tokens, Tokens]:
        """(kept, held out): the last `fraction` of the tokens, cut at a document start; the source's
        bad rows are counted with the kept part."""
        cut = int(len(self.ids) * (1 - fraction))
        if self.doc_starts is None:
            return Tokens(self.ids[:cut]), Tokens(self.ids[cut:])
        first_held = int(np.searchsorted(self.doc_starts, cut))
        cut = int(self.doc_starts[first_held]) if first_held < len(self.doc_starts) else len(self.ids)
        targets = (None, None) if self.targets is None else (self.targets[:cut], self.targets[cut:])
        return (Tokens(self.ids[:cut], self.doc_starts[:first_held], targets[0], self.bad_rows),
                Tokens(self.ids[cut:], self.doc_starts[first_held:] - cut, targets[1]))


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


def document_spans(tokens: Tokens, longest: int, drop_long: bool) -> tuple[np.ndarray, int, int]:
    """[start, end) of each document that is a row's worth: cut to its first `longest` tokens (or
    left out, with `drop_long`), holding at least one target after its first token. Also how
    many documents were longer than `longest`, and how many had no target in those tokens."""
    starts = tokens.doc_starts.astype(np.int64)
    ends = np.append(starts[1:], len(tokens.ids))
    long = ends - starts > longest
    ends = np.minimum(ends, starts + longest)
    if tokens.targets is None:
        has_target = ends - starts >= 2
    else:  # targets among tokens start+1 .. end-1 (the first token is no one's prediction)
        seen = np.concatenate([[0], np.cumsum(tokens.targets, dtype=np.int64)])
        has_target = seen[ends] - seen[np.minimum(starts + 1, ends)] > 0
    keep = has_target & ~(long & drop_long)
    return np.stack([starts[keep], ends[keep]], axis=1), int(long.sum()), int((~has_target).sum())


def document_windows(tokens: Tokens, longest: int) -> tuple[np.ndarray, int, int]:
    """[start, end) of windows of at most `longest` tokens that cover each document, a running
    text's windows within it (each starts at the last token of the one before, which is the first
    input whose target is in the new one): every token after a document's first is a target
    once. Also how many documents were longer than `longest` and how many had no target (one token)."""
    starts = tokens.doc_starts.astype(np.int64)
    lengths = np.append(starts[1:], len(tokens.ids)) - starts
    step = longest - 1
    pieces = np.maximum(lengths - 1 + step - 1, 0) // step  # ceil((length - 1) / step) windows of a document
    nth = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    first = np.repeat(starts, pieces) + step * nth
    ends = np.minimum(first + longest, np.repeat(starts + lengths, pieces))
    return np.stack([first, ends], axis=1), int((lengths > longest).sum()), int((lengths < 2).sum())


def spans_as_documents(tokens: Tokens, spans: np.ndarray) -> Tokens:
    """The spans' tokens one after another, each a document (a copy: spans may share a token)."""
    lengths = spans[:, 1] - spans[:, 0]
    doc_starts = np.cumsum(lengths) - lengths
    index = np.repeat(spans[:, 0] - doc_starts, lengths) + np.arange(int(lengths.sum()))
    return Tokens(tokens.ids[index], doc_starts)


class DocumentRows(Dataset):
    """Rows of whole documents, cut to `seq_len + 1` tokens: inputs, next tokens (IGNORE_INDEX
    where no target) and, for packed rows, position ids. `long`: the documents that were longer;
    `untargeted`: those left out for having no target within the row."""

    def __init__(self, tokens: Tokens, seq_len: int, vocab_size: int, pad_id: int, drop_long: bool = False):
        self.ids, self.targets = tokens.ids, tokens.targets
        self.seq_len, self.vocab_size, self.pad_id = seq_len, vocab_size, pad_id
        self.spans, self.long, self.untargeted = document_spans(tokens, seq_len + 1, drop_long)

    def inputs_and_targets(self, start: int, end: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One document's inputs and next-token targets, `end - start - 1` of each."""
        ids = as_long(self.ids[start:end], self.vocab_size, where)
        y = ids[1:].clone()
        if self.targets is not None:
            y[torch.from_numpy(self.targets[start + 1:end] == 0)] = IGNORE_INDEX
        return ids[:-1], y

    def empty_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((self.seq_len,), self.pad_id, dtype=torch.long),
                torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long))


class UnpackedDocuments(DocumentRows):
    """Unpacked: one document per row, truncated to `seq_len + 1` tokens and padded on the
    right; padded positions are no target (IGNORE_INDEX). With causal attention the padding,
    which comes last, changes nothing before it."""

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = (int(v) for v in self.spans[i])
        x, y = self.empty_row()
        inputs, targets = self.inputs_and_targets(start, end, f"document {i}")
        x[:len(inputs)], y[:len(targets)] = inputs, targets
        return x, y


def packed_row_starts(widths: list[int], capacity: int) -> list[int]:
    """Padding-free packing, in order: the first item of each row (a new row where the next item's
    width no longer fits in `capacity` positions), then len(widths), one more than the rows."""
    starts, used = [0], 0
    for i, width in enumerate(widths):
        if i and used + width > capacity:
            starts.append(i)
            used = 0
        used += width
    starts.append(len(widths))
    return starts


class PackedDocuments(DocumentRows):
    """Padding-free: whole documents (each cut to `seq_len + 1` tokens) joined in order into rows
    of `seq_len`, a new row when the next one does not fit; only a row's tail is padding. The
    position ids restart at 0 for each document (and for the padded tail), which is how the model
    keeps attention within a document (FACTS.md: transformers builds that mask from them)."""

    def __init__(self, tokens: Tokens, seq_len: int, vocab_size: int, pad_id: int, drop_long: bool = False):
        super().__init__(tokens, seq_len, vocab_size, pad_id, drop_long)
        # A document of n tokens fills n - 1 positions (inputs; targets are the next tokens).
        self.row_starts = packed_row_starts((self.spans[:, 1] - self.spans[:, 0] - 1).tolist(), seq_len)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.empty_row()
        position_ids = torch.empty(self.seq_len, dtype=torch.long)
        at = 0
        for d in range(self.row_starts[i], self.row_starts[i + 1]):
            inputs, targets = self.inputs_and_targets(*(int(v) for v in self.spans[d]), f"document {d}")
            x[at:at + len(inputs)], y[at:at + len(targets)] = inputs, targets
            position_ids[at:at + len(inputs)] = torch.arange(len(inputs))
            at += len(inputs)
        position_ids[at:] = torch.arange(self.seq_len - at)
        return x, y, position_ids
