"""What the console shows. Rank 0's `[trainer]` lines printed while the progress bar is drawn (a stop
signal's, an early stop's, the compile time, a superseded checkpoint) start lines of their own, in a
log of both streams too (`> log 2>&1`), where `grep '^\\[trainer\\]'` finds them; the bar goes on below
them. A zero3 run prints a handful of lines (no warning repeated, one rank's bar); `log_level=info`
lets third parties (DeepSpeed's prints, their loggers) speak."""
from __future__ import annotations

import io
import logging
import re

import pytest
from tqdm import tqdm

from tests.harness import records, run_cli
from trainer.log import BelowTheBar


def test_a_line_said_while_the_bar_is_drawn_starts_a_line_of_its_own():
    both = io.StringIO()  # stdout and stderr into one file
    log = logging.getLogger("trainer.test_console_lines")
    log.propagate = False
    handler = BelowTheBar(both)
    handler.setFormatter(logging.Formatter("[trainer] %(message)s"))
    log.addHandler(handler)
    try:
        with tqdm(total=3, desc="train", file=both) as bar:
            bar.update()
            log.warning("SIGTERM: all ranks stopped after step 1")
            log.warning("early stop after step 1")
            bar.update()
    finally:
        log.removeHandler(handler)
    said = both.getvalue()
    assert re.findall(r"^\[trainer\] .*$", said, re.M) == ["[trainer] SIGTERM: all ranks stopped after step 1",
                                                          "[trainer] early stop after step 1"], said
    assert re.search(r"^\[trainer\] early stop after step 1\n\rtrain: .* 1/3", said, re.M), said  # drawn again below


@pytest.mark.slow
def test_a_zero3_run_prints_a_handful_of_lines(tmp_path):
    """Before: 75 copies of torch's FutureWarning (DeepSpeed calls deprecated collectives every
    step), DeepSpeed's 'built successfully' from each rank, all interleaved with the bar."""
    result = run_cli("strategy=zero3", "nproc=2", "train.max_steps=20", "train.log_every=5",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert len(out) == 3 and all(line.startswith("[trainer] ") for line in out), out
    assert "strategy=zero3 world_size=2" in out[0] and [r["step"] for r in records(tmp_path)] == [5, 10, 15, 20]
    lines = [line for line in result.stderr.replace("\r", "\n").split("\n") if line.strip()]
    bar = [line for line in lines if line.startswith("train:")]
    assert len(bar) <= 2 * 20 + 2, bar  # rank 0's bar only (tqdm writes an update per step to a pipe)
    others = [line for line in lines if not line.startswith("train:")]
    assert len(others) <= 4, others  # two warnings of two lines each, once each
    for warning in {line for line in others if "Warning" in line}:
        assert result.stderr.count(warning) == 1, warning


def test_log_level_lets_third_parties_speak(capsys):
    import logging

    from trainer.log import chatter, setup_logging

    for level, shown in (("warning", False), ("info", True)):
        setup_logging(None, is_main=True, level=level)
        with chatter():
            print("DeepSpeed op built")  # DeepSpeed announces its ops with print()
        assert ("DeepSpeed op built" in capsys.readouterr().out) is shown
        assert logging.getLogger("DeepSpeed").level == logging.getLevelName(level.upper())
    setup_logging(None, is_main=True)
