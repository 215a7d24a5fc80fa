"""Under sequence parallelism each rank of a group draws its own dropout masks (the ranks start
every micro-batch from the same random state: without this the mask of a row repeats every
seq_len / sp tokens), reproducibly from the seed, and the group's shared generator stays alike on
every rank (training/sequence_shares.py). In one process: the two ranks' shares, one after the other."""
from __future__ import annotations

import torch

from trainer.models.sequence import SequenceGroup
from trainer.training.sequence_shares import rank_share


def dropout_mask(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dropout mask rank `rank` of an sp=2 group draws in its forward over a row of 64 tokens, the
    next draw of the shared generator after it)."""
    torch.manual_seed(seed)
    row = torch.ones(1, 64)
    (inputs, *_), context = rank_share([row, row], SequenceGroup(None, 2, rank))
    with context:
        mask = torch.nn.functional.dropout(inputs, p=0.5, training=True) != 0
    return mask, torch.rand(4)


def test_each_rank_of_a_group_draws_its_own_dropout_mask_reproducibly():
    (first, after_first), (second, after_second) = dropout_mask(0, seed=3), dropout_mask(1, seed=3)
    assert not torch.equal(first, second)  # other masks for the other half of the row
    assert torch.equal(after_first, after_second)  # the shared generator: alike on both ranks after the forward
    again, _ = dropout_mask(0, seed=3)
    assert torch.equal(first, again)  # the same seed: the same masks
    other_seed, _ = dropout_mask(0, seed=4)
    assert not torch.equal(first, other_seed)
