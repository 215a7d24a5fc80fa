"""Which checkpoint a run starts from (checkpoint.resume, checkpoint.dir), found before any work.

A step dir counts once its manifest reads back whole: a save writes it last, before the rename
that publishes the dir, so a save that died leaves none (trainer/checkpoint_format.py).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from trainer.checkpoint_format import LATEST, MANIFEST, STEP_PREFIX, TMP_PREFIX, read_manifest, readable_manifest
from trainer.config import CheckpointConfig
from trainer.errors import CheckpointError


def checkpoints_with_manifest(root: Path) -> list[Path]:
    """Step dirs with a readable manifest, oldest first (the manifest is written last, before the rename)."""
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if readable_manifest(p))


def latest_checkpoint(root: Path) -> Path | None:
    latest = root / LATEST
    if latest.is_file():
        path = root / latest.read_text().strip()
        if readable_manifest(path):
            return path
    done = checkpoints_with_manifest(root)
    return done[-1] if done else None


def check_writable(root: Path) -> None:
    """checkpoint.dir must take files: tried by writing one (permission bits do not tell for root,
    read-only mounts, /proc); whatever the try created is removed again."""
    created = [p for p in (root, *root.parents) if not p.exists()][::-1]
    probe = root / f"{TMP_PREFIX}write-test"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={root}: cannot write there ({e.strerror or e})") from None
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()


def resolve_resume(cfg: CheckpointConfig) -> Path | None:
    """The step dir to resume from, or None to start fresh. Raises before any work starts."""
    if cfg.resume not in ("auto", "none"):
        path = Path(cfg.resume)
        if path.is_dir() and not (path / MANIFEST).exists() and (path / LATEST).exists():
            path = latest_checkpoint(path)  # a checkpoint root: its newest
        read_manifest(path)
        return path
    root = Path(cfg.dir) if cfg.dir else None
    found = latest_checkpoint(root) if root and root.is_dir() else None
    if cfg.resume == "none" and found:
        raise CheckpointError(f"checkpoint.dir={root} already holds checkpoints (newest {found.name}); "
                              "checkpoint.resume=auto continues from it, another checkpoint.dir starts over")
    return found if cfg.resume == "auto" else None
