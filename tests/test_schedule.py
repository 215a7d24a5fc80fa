"""The learning-rate schedules (trainer/training/schedule.py) step by step, against their closed forms as
docs/checkpoints.md states them: linear warmup to `lr`, then the named decay to `lr * min_lr_ratio`
at the schedule's last step, held after it. The end points alone would let one schedule pass for
another (cosine and linear meet at both ends and at the middle), so the interior is checked too.
(tests/test_first_hour.py checks the end points and the shape of every schedule.)"""
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
