"""The data position is a count of the epoch's samples, so it continues at any
world size, one that does not divide it too (another global batch): the ranks together read the
epoch's next samples in order, none twice, none skipped."""
from __future__ import annotations

import pytest

from tests.test_mixture import mixture
from trainer.data import BatchStream
from trainer.data.sources import TokenWindows, text_tokens


def windows():
    return TokenWindows(text_tokens(None), seq_len=64, vocab_size=256)


@pytest.mark.parametrize("dataset", [windows, mixture], ids=["sampled", "mixture"])
def test_a_position_continues_at_a_world_size_that_does_not_divide_it(dataset):
    order = BatchStream(dataset(), 1, 1, 0, 1, seed=7).epoch_order()  # the epoch's samples in global order
    two = [BatchStream(dataset(), 4, 2, r, 2, seed=7) for r in range(2)]  # global batch 16
    before = []
    for _ in range(3):
        for s in two:
            s.next_step()
            before += [i for micro in s.last_indices for i in micro]
    state = two[0].state_dict()
    assert state["samples_consumed"] == 48 and state == two[1].state_dict()
    five = [BatchStream(dataset(), 1, 1, r, 5, seed=7) for r in range(5)]  # global batch 5: 48 % 5 == 3
    for s in five:
        s.load_state_dict(state)
    steps = five[0].steps_left()
    assert steps == (five[0].steps_in(0) * 5 - 48) // 5 > 0
    for k in range(steps):
        step = []
        for s in five:
            s.next_step()
            step += [i for micro in s.last_indices for i in micro]
        assert sorted(step) == sorted(order[48 + 5 * k:53 + 5 * k]), k  # the next five, in order
    assert sorted(before) == sorted(order[:48])
    for s in five:  # the epoch's end: the next step is the next epoch's first
        s.next_step()
    assert five[0].epoch == 1 and five[0].samples_consumed == 5
    # The loader (its worker processes read ahead) reads what the step's indices say.
    resumed = BatchStream(dataset(), 2, 1, 1, 3, seed=7)
    resumed.load_state_dict(state)
    first = next(iter(resumed.loader))
    assert all(first[0][j].equal(dataset()[order[49 + 3 * j]][0]) for j in range(2))
