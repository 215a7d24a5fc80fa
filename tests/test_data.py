"""The data stream calls set_epoch itself; shards are disjoint and cover the data."""
from __future__ import annotations

from trainer.data import BatchStream
from trainer.data.sources import TokenWindows, text_tokens


def stream(rank: int, world: int, seed: int = 7, mbs: int = 4, accum: int = 2) -> BatchStream:
    dataset = TokenWindows(text_tokens(None), seq_len=64, vocab_size=256)
    return BatchStream(dataset, mbs, accum, rank, world, seed)


def epoch_indices(s: BatchStream) -> list[int]:
    """Every sample index this rank sees in one epoch, in order."""
    seen = []
    for _ in range(s.steps_per_epoch):
        s.next_step()
        seen += [i for micro in s.last_indices for i in micro]
    return seen


def test_orders_differ_between_epochs_and_repeat_for_the_same_seed():
    s = stream(0, 1)
    first, second = epoch_indices(s), epoch_indices(s)
    assert s.epoch == 1
    assert sorted(first) == sorted(second) and first != second  # same samples, new order
    again = stream(0, 1)
    assert epoch_indices(again) == first and epoch_indices(again) == second
    assert epoch_indices(stream(0, 1, seed=8)) != first


def test_rank_shards_are_disjoint_and_cover_the_epoch():
    world = 4
    shards = [epoch_indices(stream(rank, world)) for rank in range(world)]
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)), "ranks must not share samples"
    one_rank = stream(0, 1, mbs=4 * world)
    assert sorted(seen) == sorted(epoch_indices(one_rank)), "together the ranks see what one rank sees"


def test_a_step_sees_the_same_global_samples_at_any_world_size():
    one = stream(0, 1, mbs=8, accum=1)
    two = [stream(r, 2, mbs=2, accum=2) for r in range(2)]
    for _ in range(5):
        one.next_step()
        for s in two:
            s.next_step()
        together = sorted(i for s in two for micro in s.last_indices for i in micro)
        assert together == sorted(one.last_indices[0])


def test_position_resumes_mid_epoch_without_replay_or_skip():
    straight = stream(0, 2)
    order = [epoch_indices(straight)]
    resumed = stream(0, 2)
    first_half = []
    for _ in range(3):
        resumed.next_step()
        first_half += [i for m in resumed.last_indices for i in m]
    restarted = stream(0, 2)
    restarted.load_state_dict(resumed.state_dict())
    rest = []
    for _ in range(restarted.steps_per_epoch - 3):
        restarted.next_step()
        rest += [i for m in restarted.last_indices for i in m]
    assert first_half + rest == order[0]
