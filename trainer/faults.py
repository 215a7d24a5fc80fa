"""Faults (DESIGN §7) that every rank must agree on: a stop signal, a non-finite step.

Each step ends with one small all-reduce of a CPU tensor (gloo, also beside NCCL on CUDA), so
all ranks take the same decision at the same step boundary whichever rank saw the fault.
"""
from __future__ import annotations

import signal
import threading

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


class TooManyBadSteps(RunError):
    """train.max_bad_steps non-finite steps in a row: the same on every rank (they agree on each step)."""


class StepGuard:
    """Notes stop signals as they arrive (the handler only sets a flag) and, at each step
    boundary, shares with every rank whether one arrived anywhere and whether this step's loss
    and gradient norm were finite everywhere."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps, self.bad_in_a_row, self.skipped = max_bad_steps, 0, 0
        self.signum = 0  # received here
        self.good, self.stop_signal = True, 0  # agreed by all ranks at the last check
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)

    # Forked loader workers inherit this handler: a signal to the whole process group (SLURM, a
    # terminal) does not kill them mid-batch before the save; their loader stops them after.
    def _note(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def check(self, finite: torch.Tensor) -> bool:
        """Whether this step is finite on every rank (then the optimizer steps), and the stop signal
        any rank received (`stop_signal`, 0: none). `finite` is read here: the one host sync of a
        step, needed to decide before the update."""
        self.good = not self._agree(bad=not bool(finite))
        return self.good

    def check_stop(self) -> int:
        """The stop signal any rank received since the last check (0: none), agreed by every rank:
        asked after a save or an evaluation, long enough for a signal to arrive during them."""
        self._agree(bad=False)
        return self.stop_signal

    def _agree(self, bad: bool) -> bool:
        """One all-reduce: whether any rank is `bad`, and the stop signal any rank received."""
        flags = torch.tensor([int(bad), self.signum], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flags[1].item())
        return bool(flags[0].item())

    def count(self, step: int) -> None:
        """Count a skipped step; too many in a row end the run."""
        if self.good:
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        self.skipped += 1
        if self.bad_in_a_row >= self.max_bad_steps:
            raise TooManyBadSteps(f"step {step}: {self.bad_in_a_row} steps in a row with a non-finite loss or "
                                  f"gradient norm (train.max_bad_steps={self.max_bad_steps}); no update was made "
                                  "from any of them. Lower optim.lr, check the data, or resume from a checkpoint")

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
