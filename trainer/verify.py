"""`python -m trainer.verify CKPT_DIR`: are a checkpoint's files as they were written? CKPT_DIR: a step
dir, or a checkpoint dir for every step dir in it. Each file's size and checksum against its manifest
(trainer/checkpoint/format.py), offline, before a long job starts or after a copy; one line per step
dir, exit 0 when none is damaged, 2 otherwise (a step dir saved before checksums: said, not counted).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trainer.checkpoint.format import MANIFEST, STEP_PREFIX, read_manifest, verify_step_dir
from trainer.errors import CheckpointError
from trainer.log import log, refuse, setup_logging


def verify(path: Path) -> list[str]:
    """Every step dir of `path` checked, one line printed each; the damaged ones' names."""
    steps = [path] if (path / MANIFEST).is_file() else sorted(path.glob(f"{STEP_PREFIX}*"))
    if not steps:
        raise CheckpointError(f"{path}: no step dir there ({MANIFEST}, or {STEP_PREFIX}N/ dirs)")
    damaged = []
    for step in steps:
        try:
            verified = verify_step_dir(step, read_manifest(step))
        except CheckpointError as e:
            damaged.append(step.name)
            print(f"{step.name}: damaged: {str(e).removeprefix('checkpoint: ')}")
            continue
        if verified:  # else verify_step_dir said that it cannot be verified
            print(f"{step.name}: intact ({verified / 1e6:,.1f} MB verified)")
    return damaged


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py parses the documented commands with it)."""
    cli = argparse.ArgumentParser(prog="python -m trainer.verify", description=__doc__.splitlines()[0])
    cli.add_argument("checkpoint", type=Path, metavar="CKPT_DIR", help="a step dir, or a checkpoint dir")
    return cli


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    setup_logging(None, is_main=True)  # the line for a step dir saved before checksums
    try:
        damaged = verify(args.checkpoint)
    except CheckpointError as e:
        refuse(e, "trainer.verify")
    if damaged:
        refuse(f"{len(damaged)} damaged: {', '.join(damaged)}; resume from an intact one", "trainer.verify")
    log.info("no damaged file found")


if __name__ == "__main__":
    main()
