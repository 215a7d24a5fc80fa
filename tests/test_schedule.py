"""The learning-rate schedules (trainer/training/schedule.py) step by step, against their closed forms as
docs/checkpoints.md states them: linear warmup to `lr`, then the named decay to `lr * min_lr_ratio`
at the schedule's last step, held after it. The end points alone would let one schedule pass for
another (cosine and linear meet at both ends and at the middle), so the interior is checked too, and
so is the shape of each: never rising after the warmup, wsd stable until its decay, linear in equal
steps, cosine falling at every step to its floor; `optim.schedule_steps` ends the decay early."""
from __future__ import annotations

import math

import pytest

from trainer.config import OptimConfig
from trainer.training.schedule import lr_at

LR, WARMUP, FLOOR, STEPS = 2.0, 3, 0.1, 20


def expected(schedule: str, step: int, last: int = STEPS - 1, decay_fraction: float = 0.1) -> float:
    """The closed form: decay `d` from 1 (at the start of the decay) to 0 (at `last`), between
    `lr` and `lr * min_lr_ratio`. wsd holds `lr` until its last `decay_fraction` of the steps."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    start = last - round(decay_fraction * (last + 1)) if schedule == "wsd" else WARMUP
    t = min(1.0, max(0.0, (step - start) / (last - start)))
    d = {"cosine": (1 + math.cos(math.pi * t)) / 2, "linear": 1 - t, "wsd": 1 - t, "constant": 1.0}[schedule]
    return LR * (FLOOR + (1 - FLOOR) * d)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_step_of_every_schedule_has_its_closed_form_value(schedule):
    o = OptimConfig(lr=LR, warmup_steps=WARMUP, min_lr_ratio=FLOOR, schedule=schedule, decay_fraction=0.25)
    lrs = [lr_at(step, STEPS, o) for step in range(STEPS + 4)]
    assert lrs == pytest.approx([expected(schedule, s, decay_fraction=0.25) for s in range(STEPS + 4)], rel=1e-12)
    if schedule == "cosine":  # a quarter of the way down, a cosine has lost about 15 % of its fall, a line 25 %
        quarter = WARMUP + (STEPS - 1 - WARMUP) // 4  # step 7 of 3..19
        assert lrs[quarter] == pytest.approx(LR * (FLOOR + (1 - FLOOR) * (1 + math.cos(math.pi / 4)) / 2), rel=1e-12)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_schedule_steps_sets_the_end_of_the_decay_inside_a_longer_run(schedule):
    o = OptimConfig(lr=LR, warmup_steps=WARMUP, min_lr_ratio=FLOOR, schedule=schedule, schedule_steps=12)
    lrs = [lr_at(step, STEPS, o) for step in range(STEPS)]
    assert lrs == pytest.approx([expected(schedule, s, last=11) for s in range(STEPS)], rel=1e-12)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_warms_up_then_ends_where_it_should(schedule):
    from trainer.config import OptimConfig
    from trainer.training.schedule import lr_at

    o = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule=schedule, decay_fraction=0.25)
    lrs = [lr_at(step, 20, o) for step in range(24)]
    assert lrs[:2] == [0.5, 1.0]
    if schedule == "constant":
        assert set(lrs[2:]) == {1.0}
        return
    assert lrs[19] == pytest.approx(0.1) and lrs[23] == pytest.approx(0.1)  # the end, then held
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # never rises after the warmup
    if schedule == "wsd":  # stable until the last quarter (5 steps) of the 20, then linear
        assert lrs[:15] == [0.5] + [1.0] * 14 and lrs[15] < 1.0
        assert lrs[17] - lrs[18] == pytest.approx(lrs[18] - lrs[19])
    if schedule == "linear":
        assert lrs[10] - lrs[11] == pytest.approx(lrs[11] - lrs[12])
    shorter = OptimConfig(**{**vars(o), "schedule_steps": 10})  # optim.schedule_steps: its own end
    assert lr_at(9, 20, shorter) == pytest.approx(0.1) and lr_at(15, 20, shorter) == pytest.approx(0.1)


def test_the_cosine_reaches_its_floor_at_the_last_step():
    from trainer.config import OptimConfig
    from trainer.training.schedule import lr_at

    o = OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(step, 10, o) for step in range(10)]
    assert lrs[1] == o.lr and lrs[-1] == pytest.approx(o.lr * o.min_lr_ratio, rel=1e-12)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # from the end of warmup down
