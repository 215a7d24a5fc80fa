"""Checkpoints in and out of the trainer's format (docs/design.md, Interchange); the command is `python -m trainer.convert`,
whose text says what each format gives."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import torch

from trainer.checkpoint import untrusted
from trainer.checkpoint.format import ADAM_KEYS, LATEST, MANIFEST, Portable, read_step_dir, write_step_dir
from trainer.checkpoint.holder import NativeSaver
from trainer.checkpoint.resume import latest_checkpoint
from trainer.errors import ERROR_EXIT_CODE, CheckpointError
from trainer.models.weights import safetensors_files

# A strategy of one rank holding a step dir of ours, its model built again from what the checkpoint
# records of it (the manifest's source["model"]), for as long as the block runs: composed by the
# job (python -m trainer.convert), which may build models and strategies; this package does neither.
Holding = Callable[[Path, dict], AbstractContextManager[NativeSaver]]

FORMATS = ("trainer", "dcp", "deepspeed", "universal", "hf", "accelerate")
# accelerate save_state of a DDP or one-process run: the model's weights, the optimizer by position
ACCELERATE_FILES = ("model.safetensors", "optimizer.bin")
# torchtitan's DCP entries beside the model's (flattened to the top level) in its checkpoints
TORCHTITAN_ENTRIES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


# -- detection -----------------------------------------------------------------------------------

def detect(path: Path) -> str:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / MANIFEST).is_file() or ((path / LATEST).is_file() and latest_checkpoint(path) is not None):
        return "trainer"
    if (path / ".metadata").is_file() or (path / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return "dcp"
    if (path / "zero").is_dir() or universal_tag(path) is not None:
        return "universal"
    if deepspeed_tag(path) is not None:
        return "deepspeed"
    if (path / "config.json").is_file() and safetensors_files(path):
        return "hf"
    if all((path / name).is_file() for name in ACCELERATE_FILES):
        return "accelerate"
    raise CheckpointError(f"{path}: not a checkpoint this trainer reads (ours: manifest.json; torch DCP: .metadata; "
                          "DeepSpeed: latest + global_stepN/; universal: zero/; Hugging Face: config.json + "
                          "*.safetensors; accelerate save_state: model.safetensors + optimizer.bin)")


def deepspeed_tag(path: Path) -> Path | None:
    """The tag dir of a DeepSpeed checkpoint: `path` itself, or the one its `latest` names."""
    if list(path.glob("mp_rank_*_model_states.pt")):
        return path
    if (path / "latest").is_file():
        tag = path / (path / "latest").read_text().strip()
        return tag if list(tag.glob("mp_rank_*_model_states.pt")) else None
    return None


def universal_tag(path: Path) -> Path | None:
    if (path / "latest_universal").is_file():
        tag = path / (path / "latest_universal").read_text().strip()
        return tag if (tag / "zero").is_dir() else None
    return None


# -- reading -------------------------------------------------------------------------------------

def read(path: Path) -> Portable:
    return READERS[detect(path)](path)


def read_trainer(path: Path) -> Portable:
    return read_step_dir(path if (path / MANIFEST).is_file() else latest_checkpoint(path))


def from_optimizer_state(weights: dict, optim: dict, lacks: list[str]) -> Portable:
    """A torch optimizer state dict keyed by parameter name (`get_optimizer_state_dict`'s form)."""
    state = optim.get("state", {})
    moments = {name: {k: s[k].float() for k in ADAM_KEYS} for name, s in state.items() if "exp_avg" in s}
    steps = {int(s["step"]) for s in state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer state holds different step counts ({sorted(steps)})")
    if not moments:
        lacks.append("Adam moments (no optimizer state)")
    return Portable(weights, moments, steps.pop() if steps else 0, lacks)


def read_dcp(path: Path) -> Portable:
    """torch DCP, read whole as DCP's own `dcp_to_torch_save` reads it, running nothing it carries
    (trainer.checkpoint.untrusted.load_dcp)."""
    accelerate = (path / "pytorch_model_fsdp_0").is_dir()  # accelerate save_state under FSDP2
    parts = {"model": path / "pytorch_model_fsdp_0", "optim": path / "optimizer_0"} if accelerate else {"": path}
    loaded: dict = {}
    for part, folder in parts.items():
        if (folder / ".metadata").is_file():
            whole = untrusted.load_dcp(folder)
            loaded.update({part: whole.get(part, whole)} if part else whole)  # accelerate: {"model": ...}
    model = loaded.get("model")
    if model is None and any(isinstance(v, torch.Tensor) for v in loaded.values()):  # torchtitan: flattened
        model = {k: v for k, v in loaded.items() if k not in TORCHTITAN_ENTRIES}
        loaded["optim"] = unflatten_optimizer_state(loaded.get("optimizer") or {})
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: a DCP checkpoint without a `model` entry ({', '.join(loaded)})")
    optim = loaded.get("optim") or {}
    optim = optim.get("optimizer", optim) if isinstance(optim, dict) else {}
    ours = json.loads(loaded["train"]["trainer"]) if "trainer" in loaded.get("train", {}) else None
    lacks = ["the RNG state"] + ([] if ours else ["the data position", "a learning-rate schedule (the trainer's "
                                                   "continues from the step)"])
    weights = {name: t.float() for name, t in model.items() if isinstance(t, torch.Tensor)}
    portable = from_optimizer_state(weights, optim, lacks)
    portable.train = ours
    return portable


def unflatten_optimizer_state(flat: dict) -> dict:
    """`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`'s form (torchtitan's
    "optimizer": `state.<param name>.<key>` and `param_groups.<param name>.<key>`) as the nested
    one keyed by parameter name."""
    state: dict = {}
    for key, value in flat.items():
        if key.startswith("state."):
            name, _, entry = key.removeprefix("state.").rpartition(".")
            state.setdefault(name, {})[entry] = value
    return {"state": state}


def read_universal(path: Path) -> Portable:
    """A DeepSpeed universal checkpoint, as ds_to_universal writes it: zero/<param name>/{fp32,
    exp_avg,exp_avg_sq}.pt (each its tensor under "param") and step.pt."""
    zero = path / "zero" if (path / "zero").is_dir() else universal_tag(path) / "zero"
    weights, moments, steps = {}, {}, set()
    def load(file: Path):  # a dict with the tensor under "param"; the step a bare tensor
        value = untrusted.load(file) if file.is_file() else None
        return value["param"] if isinstance(value, dict) else value

    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        weights[folder.name] = load(folder / "fp32.pt").float()
        if (folder / "exp_avg.pt").is_file():
            moments[folder.name] = {k: load(folder / f"{k}.pt").float().view_as(weights[folder.name])
                                    for k in ADAM_KEYS}
        step = load(folder / "step.pt")
        if step is not None:
            steps.add(int(step))
    lacks = ["the data position", "the RNG state", "a learning-rate schedule (the trainer's continues from the step)"]
    return Portable(weights, moments, max(steps) if steps else 0, lacks)


def read_deepspeed(path: Path) -> Portable:
    """Any ZeRO stage at any world size, through DeepSpeed's own ds_to_universal."""
    with tempfile.TemporaryDirectory() as tmp:
        to_universal(deepspeed_tag(path), Path(tmp) / "universal")
        return read_universal(Path(tmp) / "universal")


def to_universal(tag: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, run by trainer.checkpoint.untrusted: weights-only loads, DeepSpeed's
    globals allowed, anything else refused in one line."""
    done = subprocess.run([sys.executable, "-m", "trainer.checkpoint.untrusted", "--input_folder", str(tag),
                           "--output_folder", str(out), "--inject_missing_state"], capture_output=True, text=True)
    if done.returncode == ERROR_EXIT_CODE:
        raise CheckpointError(done.stderr.strip().splitlines()[-1])
    if done.returncode:
        raise CheckpointError(f"{tag}: DeepSpeed's ds_to_universal failed: {done.stderr.strip()[-1500:]}")


def read_hf(path: Path) -> Portable:
    from safetensors.torch import load_file

    weights = {}
    for file in safetensors_files(path):
        weights.update({name: t.float() for name, t in load_file(str(file)).items()})
    return Portable(weights, {}, 0, ["Adam moments", "a step count", "the data position", "the RNG state"])


def read_accelerate(path: Path) -> Portable:
    """`accelerate save_state` of a DDP or one-process run: the weights of model.safetensors. Its
    optimizer.bin is torch's state dict, whose moments are keyed by their place in the optimizer's
    parameter list, which only the program that made the optimizer knows: not read."""
    from safetensors.torch import load_file

    weights = {name: t.float() for name, t in load_file(str(path / ACCELERATE_FILES[0])).items()}
    return Portable(weights, {}, 0, ["Adam moments (optimizer.bin keys them by position, not by name)", "a step count",
                                     "the data position", "the RNG state"])


READERS = {"trainer": read_trainer, "dcp": read_dcp, "universal": read_universal, "deepspeed": read_deepspeed,
           "hf": read_hf, "accelerate": read_accelerate}


# -- writing -------------------------------------------------------------------------------------

def optimizer_groups(p: Portable, lr: float = 3e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                     weight_decay: float = 0.1) -> list[dict]:
    """Param groups as the trainer builds them (weight decay on matrices only), with every key of a
    torch AdamW group, so that a program's `get_state_dict` finds each one it asks for."""
    trained = [n for n in p.weights if n in p.moments]
    probe = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=tuple(betas), eps=eps)
    keys = {k: v for k, v in probe.state_dict()["param_groups"][0].items() if k != "params"}
    matrices = [n for n in trained if p.weights[n].dim() >= 2]
    return [{**keys, "weight_decay": weight_decay, "params": matrices},
            {**keys, "weight_decay": 0.0, "params": [n for n in trained if n not in matrices]}]


def write_dcp(p: Portable, out: Path) -> Path:
    """`{"model", "optim", "train"}` in the form of torch.distributed.checkpoint.state_dict's
    `get_state_dict`, which a plain FSDP2 program at any world size loads with dcp.load + set_state_dict."""
    import torch.distributed.checkpoint as dcp

    optim = {"state": {n: {"step": torch.tensor(float(p.step)), **m} for n, m in p.moments.items()},
             "param_groups": optimizer_groups(p, **(p.train or {}).get("optim", {}))}
    train = {"step": p.step, **({"trainer": json.dumps(p.train)} if p.train else {})}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": p.weights, "optim": optim, "train": train}, checkpoint_id=str(out), no_dist=True)
    return out


def write_deepspeed(p: Portable, out: Path, holding: Holding | None) -> Path:
    """A DeepSpeed universal checkpoint (an engine resumes it with "checkpoint": {"load_universal":
    true}), made by DeepSpeed's own code: a ZeRO-1 strategy of one rank (`holding`) takes the weights
    and moments (the trainer's own resume) and saves its engine's checkpoint (`DeepSpeedStrategy.save_native`),
    and ds_to_universal converts that."""
    if holding is None:
        raise CheckpointError("--to deepspeed: needs a DeepSpeed engine built with the model; "
                              "python -m trainer.convert (trainer.convert.convert) builds one")
    if "model" not in p.source:
        raise CheckpointError("--to deepspeed: the source does not record its model (a checkpoint of this trainer "
                              "does); convert it --to trainer first and resume it with your model's settings")
    tag = f"global_step{p.step}"
    with tempfile.TemporaryDirectory() as tmp:
        ours = write_step_dir(p, Path(tmp) / "ours")
        with holding(ours, p.source["model"]) as strategy:
            strategy.save_native(Path(tmp) / "deepspeed", tag)
        to_universal(Path(tmp) / "deepspeed" / tag, out / tag)
    (out / "latest_universal").write_text(tag)
    return out


WRITERS = {"trainer": write_step_dir, "dcp": write_dcp}
TARGETS = ["trainer", "dcp", "deepspeed", "hf"]  # deepspeed: write_deepspeed; hf: trainer.checkpoint.export's writer


def convert(src: Path, dst: Path, to: str, merge: bool = False, holding: Holding | None = None) -> str:
    """Convert; a line that says what came across and what the source lacks. `merge` (--to hf of a
    LoRA checkpoint): the adapters merged into the model, as `trainer.export --merge` does."""
    if merge and to != "hf":
        raise CheckpointError(f"--merge: merges LoRA adapters into a Hugging Face folder (--to hf), not --to {to}")
    kind = detect(src)
    p = READERS[kind](src)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty: give a new directory")
    lacks = f"; {kind} lacks {', '.join(p.lacks)}" if p.lacks else ""
    if to == "hf":
        from trainer.checkpoint.export import write_weights

        return f"{kind} -> hf: {write_weights(p, dst, merge, src, f'step {p.step} of {src}')}{lacks}"
    written = write_deepspeed(p, dst, holding) if to == "deepspeed" else WRITERS[to](p, dst)
    moments = f", Adam moments of {len(p.moments)}" if p.moments else ""
    return f"{kind} {src} -> {to} {written}: {len(p.weights)} weights{moments}, step {p.step}{lacks}"
