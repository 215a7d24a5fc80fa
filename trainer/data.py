"""Datasets and the per-rank stream of micro-batches.

The stream owns its DistributedSampler and calls `set_epoch` itself at every epoch start, so
no loop can forget it. Its position is kept as global samples consumed in the epoch, which
does not depend on the world size: DistributedSampler hands rank r the elements r, r+N, r+2N,
... of one seeded permutation, so after k samples per rank the ranks together have consumed
exactly the first k*N elements of it, at any N.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler

from trainer.config import ConfigError, DataConfig, DataName


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens; item i is (inputs, next-token targets)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


def bundled_text() -> bytes:
    return resources.files("trainer").joinpath("assets/licenses.txt").read_bytes()


def text_tokens(path: str | None) -> torch.Tensor:
    """Byte-level tokens (vocabulary 256) of a text file, or of the bundled corpus."""
    raw = Path(path).read_bytes() if path else bundled_text()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def synthetic_tokens(num_samples: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab (random start and stride per window): learnable, no file."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    stride = torch.randint(1, 8, (num_samples, 1), generator=g)
    windows = (start + stride * torch.arange(seq_len)) % vocab_size
    return torch.cat([windows.flatten(), windows[:1, 0]])


def build_dataset(cfg: DataConfig, seq_len: int, vocab_size: int, seed: int) -> TokenWindows:
    if DataName(cfg.name) is DataName.text:
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size: byte-level text needs >= 256, got {vocab_size}")
        tokens = text_tokens(cfg.path)
    else:
        tokens = synthetic_tokens(cfg.num_samples, seq_len, vocab_size, seed)
    return TokenWindows(tokens, seq_len)


class BatchStream:
    """Yields, per optimizer step, this rank's `grad_accum_steps` micro-batches; a step never
    spans two epochs (the tail that cannot fill a whole step is dropped, the same on all ranks)."""

    def __init__(self, dataset: TokenWindows, micro_batch_size: int, grad_accum_steps: int,
                 rank: int, world_size: int, seed: int):
        self.dataset = dataset
        self.micro_batch_size, self.grad_accum_steps, self.world_size = micro_batch_size, grad_accum_steps, world_size
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                          seed=seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // (micro_batch_size * grad_accum_steps)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train.micro_batch_size: {micro_batch_size} x grad_accum_steps {grad_accum_steps} x world size "
                f"{world_size} exceeds the {len(dataset)} samples of one epoch")
        self.epoch = 0
        self.samples_consumed = 0  # global (all ranks), in this epoch
        self.last_indices: list[list[int]] = []  # this rank's sample indices of the last step
        self._order: tuple[int, list[int]] = (-1, [])

    def _epoch_order(self) -> list[int]:
        if self._order[0] != self.epoch:
            self.sampler.set_epoch(self.epoch)
            self._order = (self.epoch, list(self.sampler))
        return self._order[1]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_step = self.micro_batch_size * self.grad_accum_steps
        start = self.samples_consumed // self.world_size
        if start + per_step > self.steps_per_epoch * per_step:
            self.epoch, self.samples_consumed, start = self.epoch + 1, 0, 0
        order = self._epoch_order()[start:start + per_step]
        self.samples_consumed += per_step * self.world_size
        mbs = self.micro_batch_size
        self.last_indices = [order[i:i + mbs] for i in range(0, per_step, mbs)]
        return [tuple(torch.stack(t) for t in zip(*(self.dataset[j] for j in idx))) for idx in self.last_indices]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict) -> None:
        if state["samples_consumed"] % self.world_size:
            raise ConfigError(f"checkpoint: {state['samples_consumed']} samples consumed in the epoch cannot be "
                              f"split over world size {self.world_size}")
        self.epoch, self.samples_consumed = state["epoch"], state["samples_consumed"]
