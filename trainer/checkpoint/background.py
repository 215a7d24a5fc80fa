"""checkpoint.async: a save's state copied to host memory at its step, then written, hashed and
published on a thread of its own while training goes on (CheckpointManager decides what is
written and how it is published; here, where the copy lives and where the writing runs).

The thread's collectives (whether rank 0 could prepare the step dir, every rank's outcome, the
publish's verdict) run on a gloo group of their own, made on every rank when the manager is made:
on the training's group they would interleave with the step's collectives in an order no two
ranks agree on (gloo matches calls by order; NCCL would hang or mix buffers). The thread touches
no device and no tensor of the model; the training thread never waits on its group.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.errors import CheckpointError


class HostCopy:
    """The host buffers a rank's pieces are copied into at a save (fp32, pinned on CUDA so the
    copies are DMA), kept and reused by the next save: one save's worth of host memory for the run."""

    def __init__(self, pinned: bool):
        self.pinned, self.buffers = pinned, {}

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of `tensors` in fp32 on the host, done when this returns (the step that follows
        changes the originals)."""
        kept, out = self.buffers, {}
        for key, t in tensors.items():
            buffer = kept.get(key)
            if buffer is None or buffer.shape != t.shape:
                buffer = torch.empty(t.shape, dtype=torch.float32, pin_memory=self.pinned)
            buffer.copy_(t.detach(), non_blocking=self.pinned and t.device.type == "cuda")
            out[key] = buffer
        if self.pinned:
            torch.cuda.synchronize()
        self.buffers = out
        return out

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class Writer:
    """One job at a time on a thread, with its own gloo group over every rank (made here: a
    collective, so every rank makes its Writer at the same point)."""

    def __init__(self, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.thread: threading.Thread | None = None
        self.outcome = None
        self.error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self.thread is not None

    def start(self, job) -> None:
        """job(group) on the thread; its return value is what `wait` gives."""
        assert self.thread is None, "one save in flight at a time: wait for it first"
        self.outcome, self.error = None, None

        def run() -> None:
            try:
                self.outcome = job(self.group)
            except BaseException as e:  # raised on the training thread by `wait`
                self.error = e

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self):
        """The job's return value, once it is done; a failure of the job itself (not a failed save,
        which the job returns) as one CheckpointError."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        if self.error is not None:
            first_line = (str(self.error).splitlines() or [""])[0]  # said in one line (a gloo error has several)
            raise CheckpointError(f"checkpoint: the background writer failed: {type(self.error).__name__}: "
                                  f"{first_line}") from self.error
        return self.outcome

    def close(self) -> None:
        """Its group released, once no job runs (one left running, by a failing rank that does not
        wait for it, dies with the process: its step dir is never published)."""
        if self.thread is None and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
