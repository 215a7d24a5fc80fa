"""The per-rank stream of micro-batches, loaded in the background, and the evaluation batches.

The stream owns its DistributedSampler and calls `set_epoch` itself at every epoch start, so
no loop can forget it. The sampler gives the epoch's one seeded permutation whole (one replica);
its position is kept as global samples consumed in the epoch, c, which does not depend on the
world size: from there rank r reads the elements c+r, c+r+N, c+r+2N, ... of it (from c = 0, what
a DistributedSampler of N replicas hands rank r), so the ranks together read the next elements
in order at any N, and a position saved at one world size continues at any other. A torch
DataLoader with worker processes reads the batches ahead of the step; which samples it reads
follows from the position alone, so resuming needs nothing of the loader's own state.

A dataset that plans its rows per epoch (data=mixture: `rows_in(epoch)`, items addressed (epoch,
row), rows already in training order) takes the place of the sampler's permutation, so the same
position rule holds; the stream also counts what each of its sources gave (`counts`), which the
data position carries.
"""
from __future__ import annotations

import math
import sys
import weakref
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from trainer.data.sources import IGNORE_INDEX
from trainer.distributed import title_loader_worker
from trainer.errors import ConfigError


class _EpochBatches(Sampler):
    """This rank's micro-batches (index lists) from the stream's position to the epoch's end."""

    def __init__(self, stream: BatchStream):
        # No reference cycle stream -> loader -> sampler -> stream: a stream that goes out of
        # use stops its loader's worker processes at once, not at the next garbage collection.
        self.stream = weakref.proxy(stream)

    def __iter__(self):
        s = self.stream
        mine = s.rank_order(s.samples_consumed, s.steps_left() * s.per_step)
        return iter([mine[i:i + s.micro_batch_size] for i in range(0, len(mine), s.micro_batch_size)])

    def __len__(self) -> int:
        s = self.stream
        return s.steps_left() * s.grad_accum_steps


class BatchStream:
    """Yields, per optimizer step, this rank's `grad_accum_steps` micro-batches; a step never
    spans two epochs (the tail that cannot fill a whole step is dropped, the same on all ranks)."""

    @staticmethod
    def check_size(samples: int, micro_batch_size: int, grad_accum_steps: int, world_size: int, what: str = "") -> int:
        """Steps per epoch (each rank takes len // world_size samples, the sampler's drop_last); at least one.
        `what`: what a sample is, where a user would count something else (data=preference's packed pairs)."""
        steps = samples // world_size // (micro_batch_size * grad_accum_steps)
        if steps == 0:
            raise ConfigError(
                f"train.micro_batch_size: {micro_batch_size} x grad_accum_steps {grad_accum_steps} x world size "
                f"{world_size} exceeds the {samples} samples of one epoch{what}: the data set is too small for one step")
        return steps

    def __init__(self, dataset: Dataset, micro_batch_size: int, grad_accum_steps: int, rank: int, world_size: int,
                 seed: int, num_workers: int = 0, pin_memory: bool = False):
        self.micro_batch_size, self.grad_accum_steps, self.world_size = micro_batch_size, grad_accum_steps, world_size
        self.per_step = micro_batch_size * grad_accum_steps
        self.dataset, self.rank = dataset, rank
        self.planned = callable(getattr(dataset, "rows_in", None))  # rows planned per epoch (data=mixture)
        # Planned rows come in their own order; the sampler's permutation serves the other datasets.
        self.sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        self._steps: dict[int, int] = {}
        self.steps_per_epoch = self.steps_in(0)  # the first epoch's (every epoch's, unless planned)
        names = getattr(dataset, "names", []) if self.planned else []
        self.by_source = {"samples_by_source": dict.fromkeys(names, 0), "tokens_by_source": dict.fromkeys(names, 0)}
        self.epoch = 0
        self.samples_consumed = 0  # global (all ranks), in this epoch
        self.last_indices: list[list[int]] = []  # this rank's sample indices of the last step
        self._order: tuple[int, list[int]] = (-1, [])
        self.loader = DataLoader(dataset, batch_sampler=_EpochBatches(self), num_workers=num_workers,
                                 pin_memory=pin_memory, persistent_workers=num_workers > 0,
                                 # Each new iterator draws its workers' base seed: from a generator of
                                 # its own, not torch's, which dropout draws from (a resume would differ).
                                 generator=torch.Generator().manual_seed(seed), worker_init_fn=title_loader_worker,
                                 # Ranks started by the elastic launcher default to spawn, which
                                 # imports torch again in every worker (seen: 2 s); fork is Linux's default.
                                 multiprocessing_context="fork" if num_workers and sys.platform == "linux" else None)
        self._batches = None  # the loader's iterator over the rest of the current epoch

    def steps_in(self, epoch: int) -> int:
        if epoch not in self._steps:
            rows = self.dataset.rows_in(epoch) if self.planned else len(self.dataset)
            self._steps[epoch] = self.check_size(rows, self.micro_batch_size, self.grad_accum_steps, self.world_size,
                                                 getattr(self.dataset, "sample_words", ""))
        return self._steps[epoch]

    def steps_for(self, epochs: int) -> int:
        """The optimizer steps of the first `epochs` epochs."""
        return sum(self.steps_in(e) for e in range(epochs)) if self.planned else epochs * self.steps_per_epoch

    def epoch_order(self) -> list:
        """The epoch's samples in the order the ranks together read them."""
        if self._order[0] != self.epoch:
            if self.planned:  # rows addressed (epoch, row)
                self._order = (self.epoch, [(self.epoch, row) for row in range(self.dataset.rows_in(self.epoch))])
            else:
                self.sampler.set_epoch(self.epoch)
                self._order = (self.epoch, list(self.sampler))
        return self._order[1]

    def rank_order(self, position: int, count: int) -> list:
        """This rank's next `count` samples from the epoch's global `position`: every world size-th one."""
        return self.epoch_order()[position + self.rank:position + count * self.world_size:self.world_size]

    def steps_left(self) -> int:
        """The whole steps of the epoch from the position: its steps end where the epoch's first
        steps_in(epoch) global batches end (a position saved at another world size need not fall on a step)."""
        global_batch = self.per_step * self.world_size
        return max(0, (self.steps_in(self.epoch) * global_batch - self.samples_consumed) // global_batch)

    def counts(self) -> dict:
        """data=mixture: the documents and target tokens each source gave so far, all ranks together."""
        return {key: dict(values) for key, values in self.by_source.items()} if self.planned else {}

    def next_step(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of the next step: (inputs, targets[, position_ids]) each."""
        if not self.steps_left():
            self.epoch, self.samples_consumed = self.epoch + 1, 0
            self._batches = None
        if self._batches is None:
            self._batches = iter(self.loader)  # reads ahead from the current position
        order = self.rank_order(self.samples_consumed, self.per_step)
        mbs = self.micro_batch_size
        self.last_indices = [order[i:i + mbs] for i in range(0, self.per_step, mbs)]
        if self.planned:  # the step's rows of all ranks: the epoch's next per_step x world size
            samples, tokens = self.dataset.drawn(self.epoch, self.samples_consumed,
                                                 self.samples_consumed + self.per_step * self.world_size)
            for name, n, t in zip(self.dataset.names, samples, tokens):
                self.by_source["samples_by_source"][name] += n
                self.by_source["tokens_by_source"][name] += t
        self.samples_consumed += self.per_step * self.world_size
        return [next(self._batches) for _ in range(self.grad_accum_steps)]

    def close(self) -> None:
        """Stop the loader's worker processes (they hold copies of the process's sockets)."""
        self._batches, self.loader = None, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed, **self.counts()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.samples_consumed = state["epoch"], state["samples_consumed"]
        for key, values in self.by_source.items():
            values.update({name: n for name, n in state.get(key, {}).items() if name in values})
        self._batches = None


def eval_batches(dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 max_batches: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's share of the validation set (items rank, rank + N, ...) in micro-batches of
    (inputs, targets[, position_ids]). Every rank gets the same number of batches (sharded models
    run collectives in forward): a slot past the end repeats item 0 with no targets, so it counts
    for nothing."""
    per_rank = math.ceil(len(dataset) / world_size)
    n_batches = math.ceil(per_rank / micro_batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        items = []
        for j in range(micro_batch_size):
            i = rank + world_size * (b * micro_batch_size + j)
            if i < len(dataset):
                items.append(dataset[i])
            else:
                x, y, *rest = dataset[0]
                items.append((x, torch.full_like(y, IGNORE_INDEX), *rest))
        yield tuple(torch.stack(field) for field in zip(*items))
