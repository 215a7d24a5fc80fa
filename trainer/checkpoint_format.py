"""The on-disk format of a checkpoint (DESIGN §5), the same whichever strategy and world size wrote it:

    step_00000100/
      manifest.json           format, step, strategy, world size, model fingerprint, trainer
                              state, and for every tensor key its shape and pieces
      rank_00000.safetensors  what rank 0 saved: flat ranges named "<key>@<start>", its RNG
      ...

Keys are `model.<param>`, `optim.<param>.exp_avg|exp_avg_sq` (fp32) and `optim.step`. Each
rank writes only the ranges it owns; a loading rank reads, from any files, only the ranges it
needs, so any strategy at any world size resumes any checkpoint. (torch.distributed.checkpoint
would need DTensor's even chunks; DeepSpeed's flat partitions cut parameters anywhere.)

Here: the names in a checkpoint dir, the manifest written and read, the checks that it fits the
model, and `PieceReader`. Saving and loading with a strategy: trainer/checkpoint.py; which
checkpoint a run resumes from: trainer/resume.py.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open

from trainer.errors import CheckpointError
from trainer.log import log

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"  # a step dir being written: never resumed from, removed by the next save
SUPERSEDED_PREFIX = "superseded-"  # newer than the step a run resumed from (CheckpointManager._set_aside_newer)
REPLACED_PREFIX = "replaced-"  # a complete step dir while the same step is saved again (CheckpointManager._commit)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def readable_manifest(path: Path) -> bool:
    """A step dir counts only when its manifest reads back whole (a save that died mid-write, a
    truncated file on a full disk: skipped, with a warning)."""
    try:
        json.loads((path / MANIFEST).read_text())["tensors"]
        return True
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning(f"checkpoint: skipping {path}: its {MANIFEST} cannot be read ({type(e).__name__}: {e})")
        return False


def read_manifest(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint: {path} has no {MANIFEST}: not a checkpoint, or one whose save "
                              "did not finish")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint: {path}/{MANIFEST} is damaged ({e}); resume from another step dir") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint: {path} has format {manifest.get('format')!r}; this trainer reads "
                              f"format {FORMAT_VERSION}")
    return manifest


def manifest_of(step: int, trainer_state: dict, strategy: str, world_size: int, shapes: dict[str, tuple[int, ...]],
                buffers: dict[str, torch.Tensor], source: dict, base: dict | None, tensors: dict[str, dict]) -> dict:
    """A step dir's manifest.json: `tensors` maps each key to its shape and pieces."""
    return {
        "format": FORMAT_VERSION, "step": step, "epoch": trainer_state["epoch"], "strategy": strategy,
        "world_size": world_size, "trainer": trainer_state,
        "model": {name: {"shape": list(shape), "dtype": "float32"} for name, shape in shapes.items()},
        "buffers": {name: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                    for name, b in buffers.items()},
        "source": source, "base": base, "files": [rank_file(r) for r in range(world_size)], "tensors": tensors,
    }


def fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_fingerprint(manifest: dict, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    saved = {name: tuple(spec["shape"]) for name, spec in manifest["model"].items()}
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    differ = sorted(n for n in set(saved) & set(shapes) if saved[n] != shapes[n])
    if missing or unexpected or differ:
        problems = [f"{n}: checkpoint {list(saved[n])}, model {list(shapes[n])}" for n in differ[:10]]
        problems += [f"{n}: not in the checkpoint" for n in missing[:10]]
        problems += [f"{n}: not in the model" for n in unexpected[:10]]
        raise CheckpointError(f"checkpoint: {path} holds another model ({len(differ)} shapes differ, "
                              f"{len(missing)} missing, {len(unexpected)} unexpected):\n  " + "\n  ".join(problems))


def check_base(manifest: dict, fingerprint: str | None, path: Path) -> None:
    """A checkpoint without its frozen weights resumes only on the same pretrained files."""
    base = manifest.get("base")
    if base and base["fingerprint"] != fingerprint:
        now = "weights whose names, shapes or file sizes differ" if fingerprint else "no pretrained weights"
        raise CheckpointError(f"checkpoint: {path} holds adapters trained on the frozen weights of {base['path']} "
                              f"(fingerprint {base['fingerprint']}), which it does not save; this run has {now}: "
                              f"set model.path to those weights")


class PieceReader:
    """Reads ranges of flat tensors from the pieces of a checkpoint, touching only what overlaps."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.tensors, self.files = path, manifest["tensors"], {}

    def _file(self, name: str):
        if name not in self.files:
            self.files[name] = safe_open(str(self.path / name), framework="pt")
        return self.files[name]

    def read(self, key: str, start: int, numel: int) -> torch.Tensor:
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint: {self.path} has no {key}")
        out = torch.empty(numel, dtype=torch.float32)
        covered = 0
        for file, piece_start, piece_numel in self.tensors[key]["pieces"]:
            lo, hi = max(start, piece_start), min(start + numel, piece_start + piece_numel)
            if lo < hi:
                part = self._file(file).get_slice(f"{key}@{piece_start}")[lo - piece_start:hi - piece_start]
                out[lo - start:hi - start] = part
                covered += hi - lo
        if covered != numel:
            raise CheckpointError(f"checkpoint: {self.path} covers {covered} of the {numel} values of {key} "
                                  f"from {start}")
        return out

    def read_full(self, key: str) -> torch.Tensor:
        shape = self.tensors[key]["shape"]
        return self.read(key, 0, math.prod(shape)).reshape(shape)
