"""`python -m trainer.metrics RUN_DIR` (or a metrics.jsonl): a run's step and evaluation records as
they stand, one JSON object per line.

A restart (`max_restarts`, torchrun's) or a resume into the same run dir trains again the steps
after its checkpoint, so metrics.jsonl holds their records twice (with the same losses: the
restart continues exactly). Its `{"event": "restarted"|"resumed", "step": N}` record marks the
place: the records of steps after N written before it are superseded by those written after it.
Plots and tables should read the records through `read_metrics`, which drops the superseded ones.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESTARTS = ("restarted", "resumed")


def metrics_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(path: Path, events: bool = False) -> list[dict]:
    """The records of `path` (a run dir or its metrics.jsonl) without the superseded ones; with
    `events`, the event records too (each where it was written)."""
    kept: list[dict] = []
    for line in metrics_file(Path(path)).read_text().splitlines():
        record = json.loads(line)
        if record.get("event") in RESTARTS:
            kept = [r for r in kept if "event" in r or r["step"] <= record["step"]]
        if events or "event" not in record:
            kept.append(record)
    return kept


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py parses the documented commands with it)."""
    cli = argparse.ArgumentParser(prog="python -m trainer.metrics",
                                  description="A run's step and evaluation records as they stand, one JSON object per line.")
    cli.add_argument("run", type=Path, metavar="RUN_DIR", help="a run dir that holds metrics.jsonl, or the file")
    return cli


def main(argv: list[str] | None = None) -> None:
    from trainer.log import refuse

    run = parser().parse_args(argv).run
    if not run.exists():
        refuse(f"{run} does not exist: give a run dir that holds metrics.jsonl, or the file", "trainer.metrics")
    if not metrics_file(run).is_file():
        refuse(f"{run} holds no metrics.jsonl: give a run dir that holds one, or the file", "trainer.metrics")
    try:
        for record in read_metrics(run):
            print(json.dumps(record))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head` read what it wanted: that is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail


if __name__ == "__main__":
    main()
