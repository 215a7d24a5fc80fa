"""How a run ends on purpose, and the exit code that says so (docs/troubleshooting.md: Exit
codes). Imports nothing of the trainer, so that every module can raise these.

- A `RunError`: something the user can fix, said in one line. The command prints
  `PROG: error: MESSAGE` (`trainer.log.refuse`; under several ranks rank 0 alone prints it) and
  exits ERROR_EXIT_CODE (2).
- A rank out of memory (oom, train.on_oom=adapt): it says so in one line, records it in
  the run dir and leaves with OUT_OF_MEMORY_EXIT_CODE (3), which a restart adapts to; under
  train.on_oom=fail it leaves with ERROR_EXIT_CODE.
- A stop signal (faults.Stopped): the ranks save and leave with `signal_exit_code(signum)`,
  128 + the signal's number, what a process killed by it would return (143 for SIGTERM, 138 for
  SIGUSR1).

A launcher of ranks (trainer.__main__.launch_ranks, launch/slurm.sbatch) passes either code on
unchanged: the ranks have said why they left.
"""
from __future__ import annotations

ERROR_EXIT_CODE = 2
OUT_OF_MEMORY_EXIT_CODE = 3


def signal_exit_code(signum: int) -> int:
    return 128 + int(signum)


class RunError(Exception):
    """A run that cannot start or go on, for a reason said in one line (no traceback): the same on
    every rank, so it is said once."""


class ConfigError(RunError, ValueError):
    """A bad setting, found before any work starts."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written; nothing on disk was changed. A ConfigError: most
    come from a setting (checkpoint.resume, checkpoint.dir), and are refused with the settings."""
