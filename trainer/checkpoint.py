"""CheckpointManager: step dirs, atomic commit, keep_last, auto-resume (DESIGN §5).

Layout of one checkpoint, the same whichever strategy and world size wrote it:

    step_00000100/
      manifest.json           format, step, strategy, world size, model fingerprint, trainer
                              state, and for every tensor key its shape and pieces
      rank_00000.safetensors  what rank 0 saved: flat ranges named "<key>@<start>", its RNG
      ...

Keys are `model.<param>`, `optim.<param>.exp_avg|exp_avg_sq` (fp32) and `optim.step`. Each
rank writes only the ranges it owns; a loading rank reads, from any files, only the ranges it
needs, so any strategy at any world size resumes any checkpoint. (torch.distributed.checkpoint
would need DTensor's even chunks; DeepSpeed's flat partitions cut parameters anywhere.)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from trainer.config import CheckpointConfig
from trainer.distributed import broadcast_object
from trainer.errors import CheckpointError
from trainer.log import log
from trainer.models.weights import canonical_name, save_safetensors
from trainer.strategies.base import STEP_KEY, Piece, Strategy, buffer_key, state_keys

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"  # a step dir being written: never resumed from, removed by the next save
SUPERSEDED_PREFIX = "superseded-"  # newer than the step a run resumed from (see _set_aside_newer)
REPLACED_PREFIX = "replaced-"  # a complete step dir while the same step is saved again (see _commit)


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


def complete_checkpoints(root: Path) -> list[Path]:
    """Step dirs with a readable manifest, oldest first (the manifest is written last, before the rename)."""
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if readable_manifest(p))


def latest_checkpoint(root: Path) -> Path | None:
    latest = root / LATEST
    if latest.is_file():
        path = root / latest.read_text().strip()
        if readable_manifest(path):
            return path
    done = complete_checkpoints(root)
    return done[-1] if done else None


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


def fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def rng_state_of_new_rank(rank0_state: torch.Tensor, rank: int, device: str = "cpu") -> torch.Tensor:
    """An RNG state for a rank beyond the saved world size: seeded by rank 0's state and the rank,
    so it is the same on every resume and differs from every other rank's."""
    seed = (zlib.crc32(rank0_state.numpy().tobytes()) * 1_000_003 + rank) % 2 ** 63
    return torch.Generator(device=device).manual_seed(seed).get_state()


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


def attempt(fn, who: str) -> list[str]:
    """fn(), its failure (any exception) as a message for every rank instead of a raise on one."""
    try:
        fn()
        return []
    except Exception as e:
        return [f"{who}: {type(e).__name__}: {e}"]


class CheckpointManager:
    """Used by the loop with any strategy: saves and loads the strategy's portable state plus
    the trainer's state (step, data position, RNG). Every method is called on all ranks."""

    def __init__(self, cfg: CheckpointConfig, strategy: Strategy, strategy_name: str, source: dict | None = None,
                 records=None, base_fingerprint: str | None = None):
        self.cfg, self.strategy, self.strategy_name = cfg, strategy, strategy_name
        self.source = source or {}  # where the model came from (trainer.models.description), for export
        # Frozen weights read from pretrained files (LoRA's base) are never saved, only recorded
        # by the files' fingerprint, which a resume checks.
        self.base_fingerprint = base_fingerprint
        self.unsaved = {state_keys(canonical_name(n))["param"] for n, p in strategy.module.named_parameters()
                        if not p.requires_grad} if base_fingerprint else set()
        self.records = records  # the run's loggers: failed saves are recorded
        self.root = Path(cfg.dir) if cfg.dir else None
        self.resumed_older: Path | None = None  # the step dir this run resumed from, when newer ones exist
        self.failed_in_a_row = 0

    def due(self, step: int, total_steps: int) -> bool:
        """Every `every_steps` steps, and always the last step, whenever checkpoint.dir is set."""
        every = self.cfg.every_steps
        return self.root is not None and (step == total_steps or (every > 0 and step % every == 0))

    def save(self, step: int, trainer_state: dict, last: bool = False) -> Path | None:
        """Write step_N; a save that fails on any rank leaves the previous checkpoints and `latest`
        as they were, is reported, and returns None: training goes on, unless it was the
        `max_failed_saves`-th failure in a row or the `last` step's (CheckpointError)."""
        s = self.strategy
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        failed = attempt(lambda: self._prepare(tmp), "rank 0") if s.is_main else []
        if not broadcast_object(failed):
            outcome = self._write_rank_file(tmp)
            outcomes = [None] * s.world_size
            dist.all_gather_object(outcomes, outcome)
            failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if "error" in o]
            if not failed and s.is_main:
                failed = attempt(lambda: self._commit(tmp, final, step, trainer_state, outcomes), "rank 0")
        failed = broadcast_object(failed)
        if not failed:
            self.failed_in_a_row = 0
            if s.is_main:
                self._prune(keep=final)
            return final
        if s.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.failed_in_a_row += 1
        message = (f"checkpoint: saving step {step} failed ({self.failed_in_a_row} in a row); the previous "
                   f"checkpoints and {LATEST} are untouched: " + "; ".join(failed))
        if self.records:
            self.records.log({"event": "save_failed", "step": step, "error": "; ".join(failed)})
        if self.failed_in_a_row >= self.cfg.max_failed_saves:
            raise CheckpointError(f"{message}. Stopping: checkpoint.max_failed_saves={self.cfg.max_failed_saves}")
        if last:
            newest = latest_checkpoint(self.root)
            raise CheckpointError(f"{message}. It was the last step: the run is not saved"
                                  + (f"; the newest checkpoint is {newest}" if newest else ""))
        if s.is_main:
            log.error(f"{message}. Training goes on")
        return None

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):  # left by a save that died
            shutil.rmtree(stale, ignore_errors=True)
        for replaced in self.root.glob(f"{REPLACED_PREFIX}*"):  # a save of the same step died: ...
            original = replaced.with_name(replaced.name[len(REPLACED_PREFIX):])
            if original.exists():  # ... after its rename: the new one is complete
                shutil.rmtree(replaced, ignore_errors=True)
            else:  # ... before it: the old one is the checkpoint
                replaced.rename(original)
        tmp.mkdir()

    def _write_rank_file(self, tmp: Path) -> dict:
        s = self.strategy
        try:
            pieces = {key: piece for key, piece in s.state_dict().items() if key not in self.unsaved}
            if s.is_main:
                pieces.update({buffer_key(name): Piece(0, b.view(-1)) for name, b in s.buffers().items()})
            tensors = {f"{key}@{p.start}": p.tensor.detach().float().cpu().clone() for key, p in pieces.items()}
            bad = [key for key, t in tensors.items() if not torch.isfinite(t).all()]
            if bad:  # never saved: a checkpoint must be one to go back to
                raise ValueError(f"non-finite values in {', '.join(bad[:3])}")
            tensors["rng.torch"] = torch.get_rng_state()
            if self.strategy.device.type == "cuda":
                tensors["rng.cuda"] = torch.cuda.get_rng_state()
            path = tmp / rank_file(s.rank)
            save_safetensors(tensors, path)
            fsync(path)
            return {"pieces": {key: [p.start, p.tensor.numel()] for key, p in pieces.items()}}
        except Exception as e:  # reported to all ranks, so that none waits forever
            return {"error": f"{type(e).__name__}: {e}"}

    def _commit(self, tmp: Path, final: Path, step: int, trainer_state: dict, outcomes: list[dict]) -> None:
        shapes = self.strategy.param_shapes()
        tensors: dict[str, dict] = {}
        for rank, outcome in enumerate(outcomes):
            for key, (start, numel) in outcome["pieces"].items():
                tensors.setdefault(key, {"pieces": []})["pieces"].append([rank_file(rank), start, numel])
        key_shapes = {key: shape for name, shape in shapes.items() for key in state_keys(name).values()}
        key_shapes[STEP_KEY] = (1,)
        buffers = self.strategy.buffers()
        key_shapes.update({buffer_key(name): tuple(b.shape) for name, b in buffers.items()})
        for key, spec in tensors.items():
            spec["shape"] = list(key_shapes[key])
        base = {"path": self.source.get("path"), "fingerprint": self.base_fingerprint,
                "params": len(self.unsaved)} if self.unsaved else None
        manifest = manifest_of(step, trainer_state, self.strategy_name, self.strategy.world_size, shapes,
                               buffers, self.source, base, tensors)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync(tmp / MANIFEST)
        fsync(tmp)
        self._set_aside_newer(step)
        old = None
        if final.exists():  # the same step saved again (a resume from an older one): keep it until replaced
            old = final.with_name(f"{REPLACED_PREFIX}{final.name}")
            final.rename(old)
        tmp.rename(final)
        fsync(self.root)
        latest_tmp = self.root / f"{TMP_PREFIX}{LATEST}"
        latest_tmp.write_text(final.name + "\n")
        fsync(latest_tmp)
        os.replace(latest_tmp, self.root / LATEST)
        fsync(self.root)
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def _set_aside_newer(self, step: int) -> None:
        """A run resumed from an older step: step dirs newer than the one it saves belong to the
        history it left. Renamed `superseded-step_N` (kept, never resumed from nor pruned) rather
        than deleted, at its first save, so they no longer count as its newest."""
        if self.resumed_older is None:
            return
        for path in self.root.glob(f"{STEP_PREFIX}*"):
            if path.name > step_dir_name(step):
                aside = path.with_name(f"{SUPERSEDED_PREFIX}{path.name}")
                n = 1
                while aside.exists():  # set aside by an earlier resume of an older step: kept too
                    n += 1
                    aside = path.with_name(f"{SUPERSEDED_PREFIX}{n}-{path.name}")
                path.rename(aside)
                log.warning(f"checkpoint: {path.name} is newer than this run, which resumed from "
                            f"{self.resumed_older.name}: renamed {aside.name}")

    def _prune(self, keep: Path) -> None:
        """Keep the newest `keep_last`, the `keep_best` of lowest validation loss, the one just
        written and an older one this run resumed from. The save is complete by now: a step dir
        that cannot be removed is a warning, not a failed save."""
        if self.cfg.keep_last <= 0:
            return
        done = complete_checkpoints(self.root)
        kept = {keep, self.resumed_older, *self.best(done)}
        for path in done[:-self.cfg.keep_last]:
            if path not in kept:
                try:
                    shutil.rmtree(path)
                except OSError as e:
                    log.warning(f"checkpoint: saved {keep.name}, but could not remove the older {path.name} "
                                f"(checkpoint.keep_last={self.cfg.keep_last}): {e}")

    def best(self, done: list[Path]) -> list[Path]:
        """Of the step dirs `done`, the `keep_best` saved at an evaluation with the lowest val loss."""
        if not self.cfg.keep_best:
            return []
        scored = [(read_manifest(p)["trainer"].get("val_loss"), p) for p in done]
        return [p for val_loss, p in sorted(s for s in scored if s[0] is not None)[:self.cfg.keep_best]]

    def load(self, path: Path) -> dict:
        """Load model and optimizer state into the strategy; return the trainer's state."""
        s = self.strategy
        manifest = read_manifest(path)
        check_fingerprint(manifest, s.param_shapes(), path)
        check_base(manifest, self.base_fingerprint, path)
        if self.root and path.parent.resolve() == self.root.resolve() and any(
                newer.name > path.name for newer in self.root.glob(f"{STEP_PREFIX}*")):
            self.resumed_older = path  # not the newest: see _set_aside_newer
        layout = {key: where for key, where in s.state_layout().items() if key not in self.unsaved}
        values, rng = {}, {}
        buffers = s.buffers()
        saved_buffers = {name for name in buffers if buffer_key(name) in manifest["tensors"]}
        if s.is_main and len(saved_buffers) < len(buffers):  # a checkpoint from before buffers were saved
            log.warning(f"checkpoint: {path} holds no value for {len(buffers) - len(saved_buffers)} persistent "
                        f"buffers of the model (e.g. {sorted(set(buffers) - saved_buffers)[0]}); they keep their "
                        "start values")
        layout.update({buffer_key(name): (0, buffers[name].numel()) for name in saved_buffers})

        def read() -> None:  # this rank's ranges and RNG, from any rank's files
            reader = PieceReader(path, manifest)
            values.update({key: reader.read(key, start, numel) for key, (start, numel) in layout.items()})
            saved_rank = s.rank if s.rank < manifest["world_size"] else 0
            with safe_open(str(path / rank_file(saved_rank)), framework="pt") as f:
                rng.update({key: f.get_tensor(key) for key in ("rng.torch", "rng.cuda") if key in f.keys()})
            if saved_rank != s.rank:  # a rank the saving run did not have: a stream of its own
                rng.update({key: rng_state_of_new_rank(state, s.rank, "cuda" if key == "rng.cuda" else "cpu")
                            for key, state in rng.items()})

        failed = [None] * s.world_size  # a rank that cannot read stops every rank, none is left waiting
        dist.all_gather_object(failed, attempt(read, f"rank {s.rank}"))
        failed = [message for messages in failed for message in messages]
        if failed:
            raise CheckpointError(f"checkpoint: cannot read {path}: " + "; ".join(failed))
        with torch.no_grad():
            for name in saved_buffers:
                buffers[name].copy_(values.pop(buffer_key(name)).view_as(buffers[name]))
        s.load_state_dict(values)
        if "rng.torch" in rng:  # not in a checkpoint converted from another format
            torch.set_rng_state(rng["rng.torch"])
        if s.device.type == "cuda" and "rng.cuda" in rng:
            torch.cuda.set_rng_state(rng["rng.cuda"])
        s.barrier()
        return manifest["trainer"]
