"""A toy model whose factory also makes its rank's checkpoint writes seen, and slow or failing on
purpose, for checkpoint.async's tests: the rank file's write (`write_tensors`, as the manager calls
it) is wrapped when the model is built in the rank.

    model=custom model._target_=tests.slow_save.build strategy.wrap=[ToyBlock] +model.record=FILE
        +model.overlap_steps=[2] +model.hold_step=4 +model.fail_step=4

- record: each rank file written adds a line to FILE: {"step", "rank", "thread", "forwards_before",
  "forwards_after"}, the training forwards this rank had run when the write began and ended;
- overlap_steps: the writes of these steps wait (60 s at most) for one more training forward
  before writing: a write in the step never sees one (forwards_after == forwards_before);
- hold_step: the write of this step never ends (the process is killed during it);
- fail_step: the write of this step, on rank 1 (rank 0 alone), raises OSError.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch.distributed as dist

from examples.toy_model import ToyLM

FORWARDS = [0]  # training forwards run in this process


class Counting(ToyLM):
    def forward(self, ids):
        if self.training:
            FORWARDS[0] += 1
        return super().forward(ids)


def watched(write, record: str | None, overlap_steps: set[int], hold_step: int, fail_step: int):
    def write_tensors(tensors, path: Path):
        step, rank = int(Path(path).parent.name.rpartition("_")[2]), dist.get_rank()
        before = FORWARDS[0]
        if step == fail_step and rank == min(1, dist.get_world_size() - 1):
            raise OSError("disk full (injected)")
        deadline = time.monotonic() + 60
        while step in overlap_steps and FORWARDS[0] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        while step == hold_step:
            time.sleep(1)
        written = write(tensors, path)
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"step": step, "rank": rank, "thread": threading.current_thread().name,
                                    "forwards_before": before, "forwards_after": FORWARDS[0]}) + "\n")
        return written
    return write_tensors


def build(vocab: int = 256, dim: int = 32, layers: int = 2, record: str | None = None, overlap_steps: list[int] = (),
          hold_step: int = 0, fail_step: int = 0) -> Counting:
    from trainer.checkpoint import manager

    original = getattr(manager.write_tensors, "original", manager.write_tensors)  # built again: wrapped once
    manager.write_tensors = watched(original, record, set(overlap_steps), hold_step, fail_step)
    manager.write_tensors.original = original
    return Counting(vocab, dim, layers)
