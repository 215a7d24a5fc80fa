"""The trainer's own lines: `[trainer] ...` on rank 0's console, and in the run dir's trainer.log
(Hydra's job log, which the launching process writes too). Other ranks print only warnings."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("trainer")


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    log.handlers.clear()
    log.propagate = False  # Hydra's root handlers would print each line a second time
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("[trainer] %(message)s"))
    log.addHandler(console)
    if is_main and run_dir is not None:
        file = logging.FileHandler(Path(run_dir) / "trainer.log")
        file.setFormatter(logging.Formatter("[%(asctime)s][trainer] %(message)s"))
        log.addHandler(file)
