"""strategy.sp: a rank's share of a micro-batch. The ranks of a sequence-parallel group read the
same rows; each keeps its consecutive `seq_len / sp` tokens of every field (inputs, targets,
position ids, ...), and attention (models/sequence.py) sees the whole rows through the group."""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from trainer.models.sequence import SequenceGroup, sharded


def share(batch: list[torch.Tensor], group: SequenceGroup) -> tuple[list[torch.Tensor], AbstractContextManager]:
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
    local = [group.local(t, dim=1).contiguous() for t in (inputs, targets, positions, *rest[1:])]
    return local, sharded(group, whole)
