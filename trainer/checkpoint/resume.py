"""Which checkpoint a run starts from (checkpoint.resume, checkpoint.dir), found before any work, and
whether its data position fits this run's data (what else a resume changes: training/resume_notes.py).

A step dir counts once its manifest reads back whole: a save writes it last, before the rename
that publishes the dir, so a save that died leaves none (trainer/checkpoint/format.py). One run
writes a checkpoint dir at a time (`hold_checkpoint_dir`).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from trainer.checkpoint.format import (
    LATEST,
    MANIFEST,
    STEP_PREFIX,
    TMP_PREFIX,
    read_manifest,
    readable_manifest,
    verify_step_dir,
)
from trainer.config import CheckpointConfig, Config
from trainer.data import data_fingerprint
from trainer.distributed import restart_count
from trainer.errors import CheckpointError
from trainer.log import log

WRITER_LOCK = ".writer.lock"  # in checkpoint.dir: locked by the run that writes there, naming it
RESTART_WAIT_S = 60  # how long a restart waits for its job's old process to let go of the lock


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


def newest_intact(root: Path, newest: Path) -> Path:
    """The newest complete step dir whose files are as written (`verify_step_dir`), from `newest` back;
    each damaged one skipped with a line that names its file. None intact: refused."""
    for path in [newest, *(p for p in reversed(checkpoints_with_manifest(root)) if p != newest)]:
        if intact(path, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()))):
            return path
    raise CheckpointError(f"checkpoint.dir={root}: no checkpoint there is intact (python -m trainer.verify {root} "
                          "lists them); checkpoint.resume=PATH names one, another checkpoint.dir starts over")


@functools.cache
def intact(path: Path, files: tuple) -> bool:
    """`verify_step_dir`, a damaged step dir said in one line. Once per process while its files (`files`:
    name, size, mtime of each) stay as they are: a run resolves its resume up to three times (the
    checks before work, an external launcher's worker, the loop)."""
    try:
        verify_step_dir(path, read_manifest(path))
        return True
    except CheckpointError as e:
        log.warning(f"checkpoint: skipping step {step_of(path)}, damaged: {str(e).removeprefix('checkpoint: ')}")
        return False


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


def hold_checkpoint_dir(root: Path) -> IO:
    """One writer per checkpoint dir: the lock of root/.writer.lock, taken by the process that lives
    for the whole job (the launcher of nproc=N, rank 0's under an external launcher) and held until
    it ends: keep the returned file open. A POSIX lock (lockf): the kernel drops it when the process
    dies, it is the process's alone (not the loader workers' it forks), and NFS carries it across
    nodes (docs/checkpoints.md). A restart of the same job (restart_count) waits up to RESTART_WAIT_S
    for its old process to go; another run is refused at once, in one line naming the holder."""
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / WRITER_LOCK, "a+")
    deadline = time.monotonic() + (RESTART_WAIT_S if restart_count() else 0)
    while True:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except (BlockingIOError, PermissionError):  # held by another process
            if time.monotonic() >= deadline:
                lock.seek(0)
                holder = lock.read()
                lock.close()
                raise CheckpointError(f"checkpoint.dir={root} is in use by another run ({holder_of(holder)}); one run "
                                      "writes a checkpoint dir at a time: wait for that one to end, or give another "
                                      "checkpoint.dir") from None
            time.sleep(0.5)
        except OSError as e:  # a filesystem without locks (NFS without lockd: ENOLCK)
            log.warning(f"checkpoint.dir={root}: cannot lock {WRITER_LOCK} ({e.strerror or e}): nothing keeps a "
                        "second run from writing there too")
            return lock
    lock.truncate(0)
    lock.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}))
    lock.flush()
    return lock


def holder_of(text: str) -> str:
    """Who holds the lock, as its file says; the file is written right after the lock is taken."""
    try:
        holder = json.loads(text)
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "which has not written its host and pid yet"


def resolve_resume(cfg: CheckpointConfig) -> Path | None:
    """The step dir to resume from, or None to start fresh. Raises before any work starts.

    checkpoint.resume says where the first start begins. A restart (torchrun --max-restarts,
    max_restarts, a requeued SLURM job: the same settings again) continues from the newest
    checkpoint in checkpoint.dir when that is newer than what the setting names (docs/design.md, Faults): the
    named one is older work by then, or pruned by keep_last."""
    root = Path(cfg.dir) if cfg.dir else None
    found = latest_checkpoint(root) if root and root.is_dir() else None
    if cfg.resume == "none" and found and not restart_count():
        raise CheckpointError(f"checkpoint.dir={root} already holds checkpoints (newest {found.name}); "
                              "checkpoint.resume=auto continues from it, another checkpoint.dir starts over")
    if found and (cfg.resume == "auto" or restart_count()):
        found = newest_intact(root, found)
    if cfg.resume in ("auto", "none"):
        return found  # none: a restart, from this run's own saves
    path = Path(cfg.resume)
    if path.is_dir() and not (path / MANIFEST).exists() and (path / LATEST).exists():
        path = latest_checkpoint(path)  # a checkpoint root: its newest
    if found and restart_count() and (not readable_manifest(path) or step_of(found) > step_of(path)):
        return found
    verify_step_dir(path, read_manifest(path))  # named: refused when damaged
    return path


def step_of(path: Path) -> int:
    return read_manifest(path)["step"]


def data_changes(saved: dict, cfg: Config) -> list[str]:
    """How this run's data differ from those of the checkpoint's data position `saved`, by setting:
    those both record (a setting added since, or a checkpoint from before fingerprints, is no change)."""
    then, now = saved.get("fingerprint", {}), data_fingerprint(cfg)
    return [f"{key}={value}, now {now[key]}" for key, value in then.items() if key in now and now[key] != value]


def data_position(saved: dict, cfg: Config) -> dict | None:
    """The checkpoint's data position where this run's data are the checkpoint's (at any world size);
    None for other data, which start at their beginning: the old position means nothing there."""
    return None if data_changes(saved, cfg) else saved


# What a resume restores, and the words of a converted checkpoint's `lacks` (trainer.checkpoint.convert,
# recorded in its manifest by write_step_dir) that say it is not there.
RESTORED = (("model", None), ("optimizer state", "Adam moments"), ("schedule", "learning-rate schedule"),
            ("data position", "data position"), ("RNG state", "RNG state"))
STARTED_FRESH = {"optimizer state": "optimizer state (Adam starts from zero moments)",
                 "schedule": "schedule (the learning rate follows this run's, from the step)",
                 "data position": "data position (the data start at their beginning)"}


def restored(manifest: dict, data_kept: bool) -> tuple[list[str], list[str]]:
    """(what a resume from the step dir of `manifest` restores, what it cannot because the source
    lacked it). `data_kept`: this run's data are the checkpoint's (`data_position`); other data are
    neither (the resume notes say why they start at their beginning)."""
    lacks = manifest.get("lacks", [])
    got, missing = [], []
    for what, lacked_as in RESTORED:
        gone = lacked_as is not None and any(lacked_as in lack for lack in lacks)
        if what == "data position" and not gone and not data_kept:
            continue
        (missing if gone else got).append(what)
    return got, missing


def resumed_line(resume_from: Path, step: int, manifest: dict, data_kept: bool) -> str:
    """The line that says what a resume restored, built from what the checkpoint holds."""
    got, missing = restored(manifest, data_kept)
    line = f"resumed from {resume_from} at step {step}: {', '.join(got[:-1])} and {got[-1]}"
    if missing:  # a converted checkpoint whose source had none
        line += ("; not in the converted checkpoint, so started fresh: "
                 + ", ".join(STARTED_FRESH.get(what, what) for what in missing))
    return line
