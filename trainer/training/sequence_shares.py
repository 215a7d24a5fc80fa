"""strategy.sp: a rank's share of a micro-batch. The ranks of a sequence-parallel group read the
same rows; each keeps its consecutive `seq_len / sp` tokens of every field (inputs, targets,
position ids, ...), and attention (models/sequence.py) sees the whole rows through the group; each
draws its own random numbers (dropout: `sharded_with_own_random`)."""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import torch

from trainer.models.sequence import SequenceGroup, sharded


def rank_share(batch: list[torch.Tensor], group: SequenceGroup) -> tuple[list[torch.Tensor], AbstractContextManager]:
    """(this rank's share of `batch` (inputs, targets[, position_ids, ...]), the context its forward
    and backward run in). A share always carries position ids: those of the whole row (plain rows:
    0..seq_len-1), so that a rank's learned or rotary positions are the global ones; packed rows'
    whole position ids also give attention its documents (found once, as the context is entered).
    At sp=1 the batch as it is."""
    if group.size == 1:
        return batch, sharded(group, batch[2] if len(batch) > 2 else None)
    inputs, targets, *rest = batch
    whole = rest[0] if rest else None
    positions = whole if whole is not None else torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    # copies, also where a slice is contiguous already (one row a micro-batch): a view would keep the
    # whole row's storage alive for backward (the embedding and the loss save their indices)
    local = [group.local(t, dim=1).clone(memory_format=torch.contiguous_format)
             for t in (inputs, targets, positions, *rest[1:])]
    return local, sharded_with_own_random(group, whole, inputs.device)


@contextmanager
def sharded_with_own_random(group: SequenceGroup, whole: torch.Tensor | None, device: torch.device) -> Iterator[None]:
    """`sharded(group, whole)`, and random draws inside (dropout) this rank's own: the ranks of a group
    start every micro-batch from the same random state, and their dropout masks would repeat every
    seq_len / sp tokens of a row. The generators (CPU and this rank's GPU) are forked, seeded from one
    draw of the shared generator (which so advances every micro-batch, alike on every rank of the
    group, reproducibly) plus this rank's place in the group, and put back after."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    with sharded(group, whole), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed + group.rank)
        yield
