"""The learning rate of every step: a pure function of the step, so a resume needs no state for it."""
from __future__ import annotations

import math

from trainer.config import OptimConfig, Schedule


def lr_at(step: int, total_steps: int, o: OptimConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over `warmup_steps`, then
    `optim.schedule` down to `lr * min_lr_ratio` at the schedule's last step (`optim.schedule_steps`,
    else the run's `total_steps`), held there after it. A pure function of the step: resumable."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    schedule, last = Schedule(o.schedule), (o.schedule_steps or total_steps) - 1
    if schedule is Schedule.constant:
        return o.lr
    # wsd decays over its last decay_fraction, the others from the end of the warmup
    start = last - max(1, round(o.decay_fraction * (last + 1))) if schedule is Schedule.wsd else o.warmup_steps
    progress = min(1.0, max(0.0, (step - start) / max(1, last - start)))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule is Schedule.cosine else 1 - progress
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * decay)
