"""Faults (docs/design.md, Faults) that every rank must agree on: a stop signal, a non-finite step.

Each step ends with one small all-reduce of a CPU tensor (gloo, also beside NCCL on CUDA), so
all ranks take the same decision at the same step boundary whichever rank saw the fault.
"""
from __future__ import annotations

import signal
import threading
from enum import Enum

import torch
import torch.distributed as dist

from trainer.errors import RunError, signal_exit_code

# SIGTERM: what schedulers and launchers send before SIGKILL. SIGUSR1: SLURM's warning before
# the time limit (`#SBATCH --signal`). SIGINT: Ctrl-C. The trainer treats all three the same way.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """All ranks stopped at a step boundary on a stop signal, after saving."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        """What a process killed by the signal would return (143 for SIGTERM): not 0, the run is unfinished."""
        return signal_exit_code(self.signum)


class Verdict(Enum):
    """What a step does, agreed by every rank."""
    update = "update"
    overflow = "overflow"  # an fp16 loss scaler's own skip: counted apart (scale_skips)
    bad = "bad"  # a non-finite loss or gradient norm: skipped, counted toward train.max_bad_steps


class TooManyBadSteps(RunError):
    """train.max_bad_steps non-finite steps in a row: the same on every rank (they agree on each step)."""


class StepGuard:
    """Notes stop signals as they arrive (the handler only sets a flag) and, at each step
    boundary, shares with every rank whether one arrived anywhere and whether this step's loss
    and gradient norm were finite everywhere."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps, self.bad_in_a_row, self.skipped, self.scale_skips = max_bad_steps, 0, 0, 0
        self.signum = 0  # received here
        self.verdict, self.stop_signal = Verdict.update, 0  # agreed by all ranks at the last check
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)

    # Forked loader workers inherit this handler: a signal to the whole process group (SLURM, a
    # terminal) does not kill them mid-batch before the save; their loader stops them after.
    def _note(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor, loss_scaled: bool) -> Verdict:
        """Whether this step updates, from its loss on every rank and its global gradient norm, and
        the stop signal any rank received (`stop_signal`, 0: none). The one host sync of a step,
        needed to decide before the update. Under an fp16 loss scaler (`loss_scaled`), finite losses
        with non-finite gradients are the scaler's overflow: a skip that is not a fault."""
        bad_loss, bad_norm = self._agree(~torch.isfinite(loss).cpu(), ~torch.isfinite(grad_norm).cpu())
        if not bad_loss and not bad_norm:
            self.verdict = Verdict.update
        elif loss_scaled and not bad_loss:
            self.verdict = Verdict.overflow
        else:
            self.verdict = Verdict.bad
        return self.verdict

    def check_stop(self) -> int:
        """The stop signal any rank received since the last check (0: none), agreed by every rank:
        asked after a save or an evaluation, long enough for a signal to arrive during them."""
        self._agree(torch.tensor(False), torch.tensor(False))
        return self.stop_signal

    def _agree(self, bad_loss: torch.Tensor, bad_norm: torch.Tensor) -> tuple[bool, bool]:
        """One all-reduce: whether any rank had a non-finite loss, or gradient norm, and the stop
        signal any rank received."""
        flags = torch.tensor([int(bad_loss), int(bad_norm), self.signum], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flags[2].item())
        return bool(flags[0].item()), bool(flags[1].item())

    def count(self, step: int) -> None:
        """Count this step's verdict: too many bad steps in a row end the run; a loss scaler's
        overflow is counted apart and neither breaks nor extends a run of bad steps."""
        if self.verdict is Verdict.update:
            self.bad_in_a_row = 0
        elif self.verdict is Verdict.overflow:
            self.scale_skips += 1
        else:
            self.bad_in_a_row += 1
            self.skipped += 1
            if self.bad_in_a_row >= self.max_bad_steps:
                raise TooManyBadSteps(f"step {step}: {self.bad_in_a_row} steps in a row with a non-finite loss or "
                                      f"gradient norm (train.max_bad_steps={self.max_bad_steps}); no update was made "
                                      "from any of them. Lower optim.lr, check the data, or resume from a checkpoint")

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
