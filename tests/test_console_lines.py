"""Rank 0's `[trainer]` lines printed while the progress bar is drawn (a stop signal's, an early
stop's, the compile time, a superseded checkpoint) start lines of their own, in a log of both
streams too (`> log 2>&1`), where `grep '^\\[trainer\\]'` finds them; the bar goes on below them."""
from __future__ import annotations

import io
import logging
import re

from tqdm import tqdm

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
