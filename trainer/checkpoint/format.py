"""The on-disk format of a checkpoint (docs/design.md, Checkpoints), the same whichever strategy and world size wrote it:

    step_00000100/
      manifest.json           format, step, strategy, world size, model fingerprint, trainer
                              state, for every tensor key its shape and pieces, and for every
                              file its size and checksum
      rank_00000.safetensors  what rank 0 saved: flat ranges named "<key>@<start>", its RNG
      ...

Keys are `model.<param>`, `optim.<param>.exp_avg|exp_avg_sq` (fp32) and `optim.step`. Each
rank writes only the ranges it owns; a loading rank reads, from any files, only the ranges it
needs, so any strategy at any world size resumes any checkpoint. A piece is a run [start, start +
numel) of the flat tensor, `[file, start, numel]` in the manifest; or, where a rank holds columns of
a tensor (strategy.ep: LoRA's lora_B of the experts; strategy.tp: a rowwise layer's columns, a packed
layer's chunk of each part), a run of such a `Block` in its own order, `[file, start, numel, column,
width, columns]`. (torch.distributed.checkpoint
would need DTensor's even chunks; DeepSpeed's flat partitions cut parameters anywhere.)

Every file is hashed as it is written (`write_tensors`) and verified where it is read
(`PieceReader`, `verify_step_dir`): a damaged file is never trained on.

Here: the names in a checkpoint dir, the manifest written and read, the checks that it fits the
model, the checksums, `PieceReader`, a step dir published whole (`publish`), and a step dir read whole into a
`Portable` or written from one: what export and convert read and write, so neither drops what a
checkpoint holds. Saving and loading with a strategy: manager.py; which checkpoint a run resumes
from: resume.py.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import xxhash

from trainer.errors import CheckpointError
from trainer.log import log
from trainer.models.weights import Block, MappedFile, Run, read_part

# The format's vocabulary: every strategy states its pieces in these keys.

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class Piece(NamedTuple):
    """A contiguous range [start, start + numel) of a flattened tensor, as a 1-D tensor; with a
    `block`, of the columns of it that the block names, in their own order."""
    start: int
    tensor: torch.Tensor
    block: Block | None = None

    def entry(self) -> list[int]:
        """[start, numel] (+ the block's column, width, columns): the piece in the manifest, less its file."""
        return [self.start, self.tensor.numel(), *(self.block or ())]


def state_keys(name: str) -> dict[str, str]:
    """Portable keys (docs/design.md, Checkpoints) of one parameter: its fp32 value and its Adam moments."""
    return {"param": f"model.{name}", **{k: f"optim.{name}.{k}" for k in ADAM_KEYS}}


STEP_KEY = "optim.step"  # Adam's step count, one value


def buffer_key(name: str) -> str:
    """Portable key of a persistent buffer (saved whole, by rank 0)."""
    return f"buffer.{name}"


def replica_slice(start: int, flat: torch.Tensor, replicas: int, index: int, block: Block | None = None) -> Piece:
    """Of a range (of a `block`) held identically by `replicas` ranks, the part replica `index` saves."""
    chunk = -(-flat.numel() // replicas)
    return Piece(start + index * chunk, flat[index * chunk:(index + 1) * chunk], block)


@dataclass
class TrainerState:
    """What a checkpoint holds of the run besides tensors: the manifest's "trainer" entry, read and
    written here only (`from_dict`, `to_dict`). The fields in the order a save has always written
    them, so that manifests stay as they were; a field an older checkpoint lacks takes its default.
    The RNG states are tensors of each rank's file, not fields here."""
    step: int = 0  # optimizer steps done
    epoch: int = 0
    skipped: int = 0  # bad steps in a row (faults.StepGuard)
    scale_skips: int = 0  # fp16 loss-scaler overflow skips, apart from bad steps
    loss_scale: dict | None = None  # Strategy.precision.scale_state(); None without an fp16 scaler
    tokens: int = 0  # cumulative target tokens, all ranks
    input_tokens: int = 0  # cumulative non-padding tokens (before they were counted: `tokens`)
    # the data position: {"epoch", "samples_consumed", "fingerprint": the data's settings}
    data: dict = field(default_factory=lambda: {"epoch": 0, "samples_consumed": 0})
    global_batch: int | None = None  # what a resume compares against (training.resume_notes.resume_notes)
    schedule_steps: int | None = None  # the step where the learning-rate schedule ends
    run_dir: str | None = None
    early_stop: dict | None = None  # steps.EarlyStop.state_dict()
    optim: dict | None = None  # lr, betas, eps, weight_decay: other formats' param groups (convert)
    val_loss: float | None = None  # at this step's evaluation, for checkpoint.keep_best
    plan: dict | None = None  # train.on_oom=adapt: the plan in force (oom.Adaptation), None: the settings'

    @classmethod
    def from_dict(cls, saved: dict) -> TrainerState:
        known = {f.name for f in fields(cls)}
        state = cls(**{key: value for key, value in saved.items() if key in known})
        if "input_tokens" not in saved:  # saved before input tokens were counted: without padding, the same
            state.input_tokens = state.tokens
        return state

    def to_dict(self) -> dict:
        saved = asdict(self)
        if saved["plan"] is None:  # a run that never adapted: its manifests as they always were
            del saved["plan"]
        return saved


FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"  # a step dir being written: never resumed from, removed by the next save
SUPERSEDED_PREFIX = "superseded-"  # newer than the step a run resumed from (CheckpointManager._set_aside_newer)
REPLACED_PREFIX = "replaced-"  # a complete step dir while the same step is saved again (CheckpointManager._commit)
PRUNED_PREFIX = ".pruned-"  # a step dir keep_last removes, renamed first: a kill mid-removal leaves no partial step dir
# xxHash's XXH3, 128 bits: made to catch damaged data (not forgery), ~24 GB/s on one core here against
# 1.7 GB/s for hashlib's sha256 and 0.9 for blake2b, so that hashing stays a small part of a save.
CHECKSUM = "xxh3_128"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.uint8: "U8"}  # what step dirs hold: fp32 pieces, RNG states


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
                buffers: dict[str, torch.Tensor], source: dict, base: dict | None, tensors: dict[str, dict],
                checksums: dict[str, dict]) -> dict:
    """A step dir's manifest.json: `tensors` maps each key to its shape and pieces, `checksums` each
    file to its size and checksum (`write_tensors`)."""
    return {
        "format": FORMAT_VERSION, "step": step, "epoch": trainer_state["epoch"], "strategy": strategy,
        "world_size": world_size, "trainer": trainer_state,
        "model": {name: {"shape": list(shape), "dtype": "float32"} for name, shape in shapes.items()},
        "buffers": {name: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                    for name, b in buffers.items()},
        "source": source, "base": base, "files": [rank_file(r) for r in range(world_size)], "tensors": tensors,
        "checksums": checksums,
    }


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """A safetensors file written tensor by tensor, each tensor's bytes hashed as they are written
    (no second read), and flushed to disk; its manifest entry: size and checksum. The format is
    safetensors' own (8 bytes of header length, the JSON header, the tensors' bytes), read back by
    its `safe_open`; written here because `save_file` gives no hash and `save`, which returns the
    bytes, holds the file twice in memory (+978 MB for a 512 MB file, measured)."""
    arrays = {key: t.detach().cpu().contiguous() for key, t in tensors.items()}
    header, offset = {}, 0
    for key, t in arrays.items():
        size = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the tensors' bytes start 8-aligned, as safetensors writes them
    digest = xxhash.xxh3_128()
    with open(path, "wb") as f:  # mode 0666 less the umask: the group can read it on a shared cluster
        for chunk in (len(head).to_bytes(8, "little"), head, *(t.view(-1).numpy() for t in arrays.values())):
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": 8 + len(head) + offset, CHECKSUM: digest.hexdigest()}


def file_checksum(path: Path, chunk: int = 16 << 20) -> str:
    digest = xxhash.xxh3_128()
    buffer = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(memoryview(buffer)[:n])
    return digest.hexdigest()


def verify_file(step_dir: Path, manifest: dict, name: str) -> None:
    """File `name` of a step dir as it was written: its size, then all its bytes hashed (a file of a
    checkpoint from before checksums passes unchecked: `verify_step_dir` says so)."""
    written = manifest.get("checksums", {}).get(name)
    if written is None:
        return
    path = step_dir / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} is missing")
    if (size := path.stat().st_size) != written["bytes"]:
        raise CheckpointError(f"checkpoint: {path} has {size} bytes, {written['bytes']} were written: truncated or "
                              "replaced since")
    if file_checksum(path) != written[CHECKSUM]:
        raise CheckpointError(f"checkpoint: {path} does not match the {CHECKSUM} checksum recorded when it was "
                              "written: its bytes changed since (a bad disk, a bad copy)")


def unverifiable(path: Path, manifest: dict) -> bool:
    """A step dir saved before checksums (by an older trainer) loads, with a line that says so."""
    if "checksums" in manifest:
        return False
    log.warning(f"checkpoint: {path} was saved without checksums (by an older trainer): it loads, but whether "
                "its files are intact cannot be verified")
    return True


def verify_step_dir(path: Path, manifest: dict) -> int:
    """Every file of a step dir as it was written (CheckpointError naming the first that is not);
    the bytes verified (0: `unverifiable`)."""
    if unverifiable(path, manifest):
        return 0
    for name in manifest["checksums"]:
        verify_file(path, manifest, name)
    return sum(written["bytes"] for written in manifest["checksums"].values())


def fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp: Path, manifest: dict) -> None:
    """The last file of a step dir written under a temporary name, flushed with the dir's entries."""
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync(tmp / MANIFEST)
    fsync(tmp)


def publish(tmp: Path, final: Path) -> None:
    """Make a step dir written whole under a temporary name (`write_manifest` last) a checkpoint:
    renamed to `final` (a step dir of that name already there is kept until then), then `latest`
    replaced atomically. A crash at any point leaves the previous checkpoint and `latest` as they were."""
    root = final.parent
    replaced = None
    if final.exists():  # the same step saved again (a resume from an older one): kept until replaced
        replaced = final.with_name(f"{REPLACED_PREFIX}{final.name}")
        final.rename(replaced)
    tmp.rename(final)
    fsync(root)
    latest_tmp = root / f"{TMP_PREFIX}{LATEST}"
    latest_tmp.write_text(final.name + "\n")
    fsync(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    fsync(root)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)


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


def check_base(base: dict | None, fingerprint: str | None, path: Path) -> None:
    """A checkpoint without its frozen weights (its manifest's `base`) resumes or merges only on the
    same pretrained files: the same `layout+values` fingerprint (trainer.models.weights.fingerprint).
    One recorded before values were sampled (its layout alone) passes on the same layout, with a warning."""
    if not base or base["fingerprint"] == fingerprint:
        return
    layout_only = "+" not in base["fingerprint"]
    if layout_only and fingerprint and fingerprint.partition("+")[0] == base["fingerprint"]:
        log.warning(f"checkpoint: {path} records its frozen base {base['path']} by tensor names, shapes and file "
                    "sizes only (saved before values were fingerprinted): those match, but whether these are the "
                    "same values (not a fine-tuned variant of that base) cannot be checked")
        return
    now = "other weights (names, shapes, file sizes or values differ)" if fingerprint else "no pretrained weights"
    raise CheckpointError(f"checkpoint: {path} holds adapters trained on the frozen weights of {base['path']} "
                          f"(fingerprint {base['fingerprint']}), which it does not save; this run has {now}: "
                          f"set model.path to those weights")


class PieceReader:
    """Reads ranges of flat tensors from the pieces of a checkpoint, copying only the values asked
    (`read_part`); each file it opens verified first, whole (`verify_file`)."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest, self.tensors, self.files = path, manifest, manifest["tensors"], {}

    def open(self, name: str) -> MappedFile:
        if name not in self.files:
            verify_file(self.path, self.manifest, name)
            self.files[name] = MappedFile(self.path / name)
        return self.files[name]

    def piece(self, file: str, key: str) -> torch.Tensor:
        return self.open(file)[key]

    def read(self, key: str, start: int, numel: int, block: Block | None = None) -> torch.Tensor:
        """Values [start, start + numel) of `key`'s flat tensor (of a `block` of it, in its order)."""
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint: {self.path} has no {key}")
        # a piece is a run of the flat tensor, or of a block of it (its values at increasing places of the tensor)
        stored = ((Run(piece_start, piece_numel, Block(*columns) if columns else None),
                   partial(self.piece, file, f"{key}@{piece_start}"))
                  for file, piece_start, piece_numel, *columns in self.tensors[key]["pieces"])
        out, covered = read_part(Run(start, numel, block), stored)
        if covered != numel:
            raise CheckpointError(f"checkpoint: {self.path} covers {covered} of the {numel} values of {key} "
                                  f"from {start}")
        return out

    def read_full(self, key: str) -> torch.Tensor:
        shape = self.tensors[key]["shape"]
        return self.read(key, 0, math.prod(shape)).reshape(shape)


@dataclass
class Portable:
    """A checkpoint whole, as the trainer keys it, whatever format it came from (trainer.checkpoint.convert)."""
    weights: dict[str, torch.Tensor]  # fp32, by parameter name
    moments: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"}
    step: int
    lacks: list[str] = field(default_factory=list)  # what the source does not hold
    train: dict | None = None  # the trainer's own state (data position, ...), from our format
    source: dict = field(default_factory=dict)  # where the model came from (ours: the manifest's)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # persistent buffers, in their own dtype
    base: dict | None = None  # frozen pretrained weights recorded, not held (LoRA's base): path, fingerprint
    unsaved: dict[str, tuple[int, ...]] = field(default_factory=dict)  # their shapes, by parameter name

    def tensors(self):
        yield from self.weights.values()
        yield from (t for moments in self.moments.values() for t in moments.values())

    def fit(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Keep the parameters of a model with these shapes: a state dict also names a tied matrix
        by its second name (`lm_head.weight`), which is no parameter of its own; other differences
        are for the fingerprint check to name."""
        for name in [n for n in self.weights if n not in shapes]:
            twin = next((k for k in shapes if k in self.weights and torch.equal(self.weights[k], self.weights[name])),
                        None)
            if twin is not None:
                del self.weights[name]
                self.moments.pop(name, None)


def read_step_dir(path: Path, moments: bool = True) -> Portable:
    """A step dir whole: weights, (Adam moments,) buffers, step, trainer state, source and base."""
    manifest = read_manifest(path)
    unverifiable(path, manifest)
    reader = PieceReader(path, manifest)
    saved = [n for n in manifest["model"] if state_keys(n)["param"] in reader.tensors]
    weights = {n: reader.read_full(state_keys(n)["param"]) for n in saved}
    adam = {n: {k: reader.read_full(state_keys(n)[k]) for k in ADAM_KEYS}
            for n in manifest["model"] if moments and state_keys(n)["exp_avg"] in reader.tensors}
    buffers = {n: reader.read_full(buffer_key(n)).to(getattr(torch, spec["dtype"]))
               for n, spec in manifest.get("buffers", {}).items() if buffer_key(n) in reader.tensors}
    unsaved = {n: tuple(spec["shape"]) for n, spec in manifest["model"].items() if n not in weights}
    lacks = ["the frozen base weights (read from model.path by a run)"] if manifest.get("base") else []
    step = int(reader.read_full(STEP_KEY).item()) if STEP_KEY in reader.tensors else manifest["step"]
    return Portable(weights, adam, step, lacks, manifest["trainer"], manifest.get("source", {}), buffers,
                    manifest.get("base"), unsaved)


def write_step_dir(p: Portable, root: Path) -> Path:
    """A step dir under `root` (and `latest`), every tensor whole in one rank file, published as a
    save publishes it: any strategy at any world size resumes it."""
    final = root / step_dir_name(p.step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that died
    tmp.mkdir(parents=True)
    tensors = {state_keys(n)["param"]: w for n, w in p.weights.items()}
    for name, weight in p.weights.items():  # zeros, Adam's own start, where the source has no moments
        moments = p.moments.get(name) or {k: torch.zeros_like(weight) for k in ADAM_KEYS}
        tensors.update({state_keys(name)[k]: v for k, v in moments.items()})
    tensors[STEP_KEY] = torch.tensor([float(p.step)])
    tensors.update({buffer_key(n): b for n, b in p.buffers.items()})
    checksum = write_tensors({f"{key}@0": t.detach().float().view(-1) for key, t in tensors.items()}, tmp / rank_file(0))
    pieces = {key: {"pieces": [[rank_file(0), 0, t.numel()]], "shape": list(t.shape)} for key, t in tensors.items()}
    shapes = {n: tuple(w.shape) for n, w in p.weights.items()} | p.unsaved
    write_manifest(tmp, manifest_of(p.step, p.train or TrainerState(step=p.step).to_dict(), "converted", 1, shapes,
                                     p.buffers, p.source, p.base, pieces, {rank_file(0): checksum})
                   | ({"lacks": p.lacks} if p.lacks else {}))  # what a resume from it cannot restore
    publish(tmp, final)
    return final
