"""CheckpointManager: step dirs saved and loaded by any strategy, atomic commit, keep_last and
keep_best (docs/design.md, Checkpoints), written in the step or, with checkpoint.async, on a thread while
training goes on (trainer/checkpoint/background.py). The format on disk: trainer/checkpoint/format.py;
which checkpoint a run resumes from: trainer/checkpoint/resume.py.
"""
from __future__ import annotations

import math
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.background import HostCopy, Writer
from trainer.checkpoint.format import (
    LATEST,
    PRUNED_PREFIX,
    REPLACED_PREFIX,
    STEP_KEY,
    STEP_PREFIX,
    SUPERSEDED_PREFIX,
    TMP_PREFIX,
    Piece,
    PieceReader,
    TrainerState,
    buffer_key,
    check_base,
    check_fingerprint,
    manifest_of,
    publish,
    rank_file,
    read_manifest,
    state_keys,
    step_dir_name,
    write_manifest,
    write_tensors,
)
from trainer.checkpoint.holder import StateHolder
from trainer.checkpoint.resume import checkpoints_with_manifest, latest_checkpoint
from trainer.config import CheckpointConfig
from trainer.distributed import broadcast_object
from trainer.errors import CheckpointError
from trainer.log import log
from trainer.models import param_shapes
from trainer.models.weights import canonical_name, persistent_buffers


def rng_state_of_new_rank(rank0_state: torch.Tensor, rank: int, device: str = "cpu") -> torch.Tensor:
    """An RNG state for a rank beyond the saved world size: seeded by rank 0's state and the rank,
    so it is the same on every resume and differs from every other rank's."""
    seed = (zlib.crc32(rank0_state.numpy().tobytes()) * 1_000_003 + rank) % 2 ** 63
    return torch.Generator(device=device).manual_seed(seed).get_state()


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

    def __init__(self, cfg: CheckpointConfig, strategy: StateHolder, strategy_name: str, source: dict | None = None,
                 records=None, base_fingerprint: str | None = None, collective_timeout_s: float = 600):
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
        self.pending: tuple[int, bool] = (0, False)  # the newest save's step, and whether it was the last
        self.outcome: Path | None = None  # the newest save's step dir once published
        # checkpoint.async (with somewhere to save): the writer's thread and group, made here on every rank
        self.writer = Writer(collective_timeout_s) if cfg.async_ and self.root and strategy is not None else None
        self.host = HostCopy(pinned=strategy is not None and strategy.env.device.type == "cuda")

    def due(self, step: int, total_steps: int) -> bool:
        """Every `every_steps` steps, and always the last step, whenever checkpoint.dir is set."""
        every = self.cfg.every_steps
        return self.root is not None and (step == total_steps or (every > 0 and step % every == 0))

    def save(self, step: int, trainer_state: dict, last: bool = False, wait: bool = False) -> Path | None:
        """Write step_N; a save that fails on any rank leaves the previous checkpoints and `latest`
        as they were, is reported, and returns None: training goes on, unless it was the
        `max_failed_saves`-th failure in a row or the `last` step's (CheckpointError).
        checkpoint.async: the state is copied to host memory here and written on the writer's
        thread; the step dir it will have is returned, and what became of it is known (reported,
        counted, raised) at the next save or `wait` (here at once for the `last` step, or `wait`)."""
        if self.writer:
            self.wait()  # one save in flight: the one before, published (or reported failed) first
        s = self.strategy
        snapshot = self._snapshot()
        shapes = param_shapes(s.module, s.full_shape)  # the model's facts, read here: the writer touches no module
        buffers = {name: torch.empty(b.shape, dtype=b.dtype, device="meta")
                   for name, b in persistent_buffers(s.module).items()}

        def job(group) -> list[str]:
            return self._publish(step, trainer_state, snapshot, shapes, buffers, group)

        self.pending = (step, last)
        if not self.writer:
            self.outcome = self._settle(job(None))
            return self.outcome
        self.writer.start(job)
        return self.wait() if last or wait else self.root / step_dir_name(step)

    def wait(self) -> Path | None:
        """The newest save's step dir once it is published (checkpoint.async: waited for here, its
        failure reported as `save` reports one), None if it failed or there was none."""
        if self.writer and self.writer.busy:
            self.outcome = self._settle(self.writer.wait())
        return self.outcome

    def close(self, wait: bool = True) -> None:
        """At the run's end, or on its way out: the save in flight waited for (`wait`: when every rank
        goes the same way, none left on a dead peer), the writer's group released."""
        if not self.writer:
            return
        if wait:
            try:
                self.wait()
            except CheckpointError as e:
                log.error(str(e))
        self.writer.close()

    def _snapshot(self) -> dict:
        """What this rank saves, taken now: its pieces (with checkpoint.async, copies of them in host
        memory), the RNG states, or the error that stops this rank saving (reported to all ranks, so
        that none waits forever)."""
        s = self.strategy
        try:
            pieces = {key: piece for key, piece in s.state_dict().items() if key not in self.unsaved}
            if s.env.is_main:
                pieces.update({buffer_key(name): Piece(0, b.view(-1))
                               for name, b in persistent_buffers(s.module).items()})
            tensors = {f"{key}@{p.start}": p.tensor for key, p in pieces.items()}
            tensors = self.host.take(tensors) if self.writer else {
                key: t.detach().float().cpu() for key, t in tensors.items()}
            tensors["rng.torch"] = torch.get_rng_state()
            if s.env.device.type == "cuda":
                tensors["rng.cuda"] = torch.cuda.get_rng_state()
            return {"tensors": tensors, "pieces": {key: p.entry() for key, p in pieces.items()}}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def _publish(self, step: int, trainer_state: dict, snapshot: dict, shapes: dict, buffers: dict,
                 group) -> list[str]:
        """Every rank writes its file, rank 0 the manifest, then publishes the step dir whole; the
        failures of every rank (the same list on all ranks). `group`: where its collectives run."""
        s = self.strategy
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        failed = attempt(lambda: self._prepare(tmp), "rank 0") if s.env.is_main else []
        if not broadcast_object(failed, group=group):
            outcome = self._write_rank_file(tmp, snapshot)
            outcomes = [None] * s.env.world_size
            dist.all_gather_object(outcomes, outcome, group=group)
            failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if "error" in o]
            if not failed and s.env.is_main:
                failed = attempt(lambda: self._commit(tmp, final, step, trainer_state, outcomes, shapes, buffers),
                                 "rank 0")
        failed = broadcast_object(failed, group=group)
        if s.env.is_main:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._prune(keep=final)
        return failed

    def _settle(self, failed: list[str]) -> Path | None:
        """A save's outcome: its step dir, or its failure reported and counted (raised where it stops the run)."""
        s = self.strategy
        step, last = self.pending
        if not failed:
            self.failed_in_a_row = 0
            return self.root / step_dir_name(step)
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
        if s.env.is_main:
            log.error(f"{message}. Training goes on")
        return None

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # left by a save, or a prune, that died
        for stale in [*self.root.glob(f"{TMP_PREFIX}*"), *self.root.glob(f"{PRUNED_PREFIX}*")]:
            shutil.rmtree(stale, ignore_errors=True)
        for replaced in self.root.glob(f"{REPLACED_PREFIX}*"):  # a save of the same step died: ...
            original = replaced.with_name(replaced.name[len(REPLACED_PREFIX):])
            if original.exists():  # ... after its rename: the new one is complete
                shutil.rmtree(replaced, ignore_errors=True)
            else:  # ... before it: the old one is the checkpoint
                replaced.rename(original)
        tmp.mkdir()

    def _write_rank_file(self, tmp: Path, snapshot: dict) -> dict:
        s = self.strategy
        try:
            if "error" in snapshot:
                raise RuntimeError(snapshot["error"])
            tensors = snapshot["tensors"]
            bad = [key for key, t in tensors.items()
                   if t.is_floating_point() and not torch.isfinite(t).all()]
            if bad:  # never saved: a checkpoint must be one to go back to
                raise ValueError(f"non-finite values in {', '.join(bad[:3])}")
            checksum = write_tensors(tensors, tmp / rank_file(s.env.rank))
            return {"pieces": snapshot["pieces"], "checksum": checksum}
        except Exception as e:  # reported to all ranks, so that none waits forever
            return {"error": f"{type(e).__name__}: {e}"}

    def _commit(self, tmp: Path, final: Path, step: int, trainer_state: dict, outcomes: list[dict], shapes: dict,
                buffers: dict) -> None:
        tensors: dict[str, dict] = {}
        for rank, outcome in enumerate(outcomes):
            for key, entry in outcome["pieces"].items():
                tensors.setdefault(key, {"pieces": []})["pieces"].append([rank_file(rank), *entry])
        key_shapes = {key: shape for name, shape in shapes.items() for key in state_keys(name).values()}
        key_shapes[STEP_KEY] = (1,)
        key_shapes.update({buffer_key(name): tuple(b.shape) for name, b in buffers.items()})
        for key, spec in tensors.items():
            spec["shape"] = list(key_shapes[key])
        base = {"path": self.source.get("path"), "fingerprint": self.base_fingerprint,
                "params": len(self.unsaved)} if self.unsaved else None
        checksums = {rank_file(rank): outcome["checksum"] for rank, outcome in enumerate(outcomes)}
        write_manifest(tmp, manifest_of(step, trainer_state, self.strategy_name, self.strategy.env.world_size, shapes,
                                        buffers, self.source, base, tensors, checksums))
        self._set_aside_newer(step)
        publish(tmp, final)

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
        done = checkpoints_with_manifest(self.root)
        kept = {keep, self.resumed_older, *self.best(done)}
        for path in done[:-self.cfg.keep_last]:
            if path not in kept:
                try:
                    # renamed first (atomic): a kill during the removal leaves a hidden dir, which the
                    # next save removes, never a step dir with files missing
                    pruned = path.rename(path.with_name(f"{PRUNED_PREFIX}{path.name}"))
                    shutil.rmtree(pruned)
                except OSError as e:
                    log.warning(f"checkpoint: saved {keep.name}, but could not remove the older {path.name} "
                                f"(checkpoint.keep_last={self.cfg.keep_last}): {e}")

    def best(self, done: list[Path]) -> list[Path]:
        """Of the step dirs `done`, the `keep_best` saved at an evaluation with the lowest val loss
        (of equal ones, the older; a NaN is none)."""
        if not self.cfg.keep_best:
            return []
        scored = [(TrainerState.from_dict(read_manifest(p)["trainer"]).val_loss, p) for p in done]
        return [p for val_loss, p in sorted(s for s in scored if s[0] is not None and not math.isnan(s[0]))
                [:self.cfg.keep_best]]

    def load(self, path: Path) -> dict:
        """Load model and optimizer state into the strategy; return the trainer's state."""
        s = self.strategy
        manifest = read_manifest(path)
        check_fingerprint(manifest, param_shapes(s.module, s.full_shape), path)
        check_base(manifest.get("base"), self.base_fingerprint, path)
        if self.root and path.parent.resolve() == self.root.resolve() and any(
                newer.name > path.name for newer in self.root.glob(f"{STEP_PREFIX}*")):
            self.resumed_older = path  # not the newest: see _set_aside_newer
        layout = {key: where for key, where in s.state_layout().items() if key not in self.unsaved}
        values, rng = {}, {}
        buffers = persistent_buffers(s.module)
        saved_buffers = {name for name in buffers if buffer_key(name) in manifest["tensors"]}
        if s.env.is_main and len(saved_buffers) < len(buffers):  # a checkpoint from before buffers were saved
            log.warning(f"checkpoint: {path} holds no value for {len(buffers) - len(saved_buffers)} persistent "
                        f"buffers of the model (e.g. {sorted(set(buffers) - saved_buffers)[0]}); they keep their "
                        "start values")
        layout.update({buffer_key(name): (0, buffers[name].numel()) for name in saved_buffers})

        def read() -> None:  # this rank's ranges and RNG, from any rank's files
            reader = PieceReader(path, manifest)
            values.update({key: reader.read(key, *where) for key, where in layout.items()})
            saved_rank = s.env.rank if s.env.rank < manifest["world_size"] else 0
            f = reader.open(rank_file(saved_rank))
            rng.update({key: f[key].clone() for key in ("rng.torch", "rng.cuda") if key in f})
            if saved_rank != s.env.rank:  # a rank the saving run did not have: a stream of its own
                rng.update({key: rng_state_of_new_rank(state, s.env.rank, "cuda" if key == "rng.cuda" else "cpu")
                            for key, state in rng.items()})

        failed = [None] * s.env.world_size  # a rank that cannot read stops every rank, none is left waiting
        dist.all_gather_object(failed, attempt(read, f"rank {s.env.rank}"))
        failed = [message for messages in failed for message in messages]
        if failed:
            raise CheckpointError(f"checkpoint: cannot read {path}: " + "; ".join(failed))
        with torch.no_grad():
            for name in saved_buffers:
                buffers[name].copy_(values.pop(buffer_key(name)).view_as(buffers[name]))
        s.load_state_dict(values)
        if "rng.torch" in rng:  # not in a checkpoint converted from another format
            torch.set_rng_state(rng["rng.torch"])
        if s.env.device.type == "cuda" and "rng.cuda" in rng:
            torch.cuda.set_rng_state(rng["rng.cuda"])
        dist.barrier()
        return manifest["trainer"]
