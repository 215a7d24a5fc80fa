"""What the console and the run dir's trainer.log show.

The trainer's own lines (`[trainer] ...`) come from rank 0, on its console and in trainer.log
(Hydra's job log, which the launching process writes too). Other ranks print warnings only.
Third-party chatter is held to `log_level` (default warning): each Python warning is shown
once per run, by rank 0; DeepSpeed's, torch's and the Hugging Face libraries' loggers log at
that level; DeepSpeed's bare prints are dropped below info. So is setuptools' compiler logger
(`compilers`), which logs each command of DeepSpeed's probe for libaio (`deepspeed.init_distributed`
compiles and links a test program) at INFO: under an external launcher every rank runs Hydra,
whose logging setup shows INFO (under nproc the ranks do not, which is why they were quiet).
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from pathlib import Path
from typing import Iterator, NoReturn

from tqdm import tqdm

from trainer.errors import ERROR_EXIT_CODE

log = logging.getLogger("trainer")
THIRD_PARTY = ("DeepSpeed", "torch", "transformers", "datasets", "accelerate", "compilers")
_chatter_level = logging.WARNING
_show_warning = warnings.showwarning
_warnings_shown: set[tuple[type, str]] = set()


# Warnings about a library's own calls into another, which a user can do nothing about: shown at
# log_level=info or debug only. DeepSpeed's ZeRO-3 calls collectives torch has deprecated (FACTS.md);
# peft initialises LoRA weights that ZeRO-3 has already partitioned away (empty on this rank).
LIBRARY_NOISE = ("`torch.distributed.all_gather_into_tensor` is deprecated",
                 "`torch.distributed.reduce_scatter_tensor` is deprecated",
                 "Initializing zero-element tensors is a no-op")


def _show_warning_once(message, category, filename, lineno, file=None, line=None) -> None:
    # Deduplicated where warnings are shown, not by a filter: libraries that touch the filters
    # (DeepSpeed does, every step) reset Python's own "once" and "default" bookkeeping.
    if _chatter_level > logging.INFO and str(message).startswith(LIBRARY_NOISE):
        return
    if (category, str(message)) not in _warnings_shown:
        _warnings_shown.add((category, str(message)))
        _show_warning(message, category, filename, lineno, file, line)


class BelowTheBar(logging.StreamHandler):
    """The console's lines while the progress bar is drawn (tqdm, on stderr): each ends the bar's
    line first and the bar is drawn again under it, so that a line starts a line of its own, for a
    reader and for `grep '^\\[trainer\\]'` of a log of both streams (tqdm.write only wipes the bar,
    with a carriage return that a file keeps)."""

    def emit(self, record: logging.LogRecord) -> None:
        bars = list(tqdm._instances)  # the bars open now (a disabled one is never among them)
        for bar in bars:
            bar.fp.write("\n")
            bar.fp.flush()
        super().emit(record)
        for bar in bars:
            bar.refresh()


def setup_logging(run_dir: Path | None, is_main: bool, level: str = "warning") -> None:
    global _chatter_level
    _chatter_level = logging.getLevelName(level.upper())
    log.handlers.clear()
    log.propagate = False  # Hydra's root handlers would print each line a second time
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    console = BelowTheBar(sys.stdout)
    console.setFormatter(logging.Formatter("[trainer] %(message)s"))
    log.addHandler(console)
    if is_main and run_dir is not None:
        file = logging.FileHandler(Path(run_dir) / "trainer.log")
        file.setFormatter(logging.Formatter("[%(asctime)s][trainer] %(message)s"))
        log.addHandler(file)
    warnings.showwarning = _show_warning_once
    if not is_main:
        warnings.simplefilter("ignore")
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(_chatter_level if is_main else max(_chatter_level, logging.WARNING))


@contextlib.contextmanager
def chatter() -> Iterator[None]:
    """Around third-party calls that print() what is no warning (DeepSpeed announcing the ops it
    built): kept only at log_level=info or debug."""
    if _chatter_level <= logging.INFO:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class QuietRankExits(logging.Filter):
    """Drops torch elastic's failure report (with a traceback) for ranks that left with one of
    `exit_codes` (a stop signal's: they saved and stopped as asked; a bad setting's: rank 0 said
    which) or were killed by a signal (the launcher names the rank in one line; there is no
    traceback to show), and its lines about passing a stop signal on (the launcher's own line
    says where the ranks stopped)."""

    def __init__(self, exit_codes: set[int]):
        super().__init__()
        self.needles = [f"exitcode: {code})" for code in exit_codes] + ["exitcode: -"]
        # passing a stop signal on to the ranks: the launcher's own line says what came of it
        self.needles += ["death signal, shutting down workers", "via signal SIGTERM", "via signal SIGUSR1",
                         "via signal SIGINT"]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(needle in record.getMessage() for needle in self.needles)


def refuse(message: object, prog: str = "trainer") -> NoReturn:
    """`PROG: error: MESSAGE` on one line, exit 2: the convention of every command
    (docs/troubleshooting.md: Exit codes)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(ERROR_EXIT_CODE)
