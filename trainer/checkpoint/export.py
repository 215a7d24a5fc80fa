"""A checkpoint's weights for inference; the command is `python -m trainer.export`."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from trainer.checkpoint.format import Portable, check_base, read_manifest, read_step_dir
from trainer.checkpoint.resume import latest_checkpoint
from trainer.errors import CheckpointError, ConfigError
from trainer.models import lora
from trainer.models.converted import Conversions
from trainer.models.weights import SafetensorsWeights, safetensors_files, save_safetensors


def export(checkpoint: Path, out: Path, merge: bool = False) -> str:
    """Write the weights of `checkpoint` to `out`; a line saying what was written."""
    if (checkpoint / "latest").is_file():
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    if out.is_file() or (out.is_dir() and any(out.iterdir())):  # as trainer.convert: never over earlier work
        raise CheckpointError(f"{out} exists{' and is not empty' if out.is_dir() else ''}: export writes to a new "
                              "file or folder (remove it, or give another OUT)")
    manifest = read_manifest(checkpoint)
    of = f"step {manifest['step']} ({manifest['strategy']}, world size {manifest['world_size']}, {checkpoint})"
    return write_weights(read_step_dir(checkpoint, moments=False), out, merge, checkpoint, of)


def write_weights(p: Portable, out: Path, merge: bool, checkpoint: Path, of: str) -> str:
    """A checkpoint read whole (`p`, from `checkpoint`) written for inference, by `export` and by
    `convert --to hf` alike; a line saying what was written (`of`: which checkpoint)."""
    source = p.source
    settings = source.get("lora")
    as_folder = out.suffix != ".safetensors"
    if merge and not settings:
        raise CheckpointError(f"--merge: {checkpoint} has no LoRA adapters to merge")
    if merge and source.get("kind") != "hf":
        raise CheckpointError(f"--merge: {checkpoint} holds a {source.get('kind')} model; merging needs model=hf "
                              "(export the adapters to a folder, and merge them with peft)")
    if as_folder and source.get("kind") != "hf" and not (settings and not merge):
        raise CheckpointError(f"{checkpoint} records no Hugging Face config (only checkpoints of model=hf do): "
                              "write its weights to a file, OUT.safetensors")
    weights = {name: w.contiguous() for name, w in p.weights.items()}
    if settings and not merge:  # the adapters alone, as peft saves them
        if not as_folder:
            raise CheckpointError(f"{checkpoint} holds LoRA adapters: export them to a folder (OUT_DIR), or merged "
                                  "into the model with --merge")
        adapters = {name: w for name, w in weights.items() if lora.is_adapter(name)}
        lora.write_adapter_folder(adapters, settings, (p.base or {}).get("path") or source.get("path"), out)
        count = sum(w.numel() for w in adapters.values())
        tokenizer, note = tokenizer_of(source)
        if tokenizer is not None:  # as TRL's SFTTrainer saves it beside the adapters
            from trainer.models.hf import save_tokenizer

            save_tokenizer(tokenizer, source.get("chat_template"), out)
        return (f"wrote the LoRA adapters ({count:,} fp32 parameters, r={settings['r']}) of {of} to {out}/ "
                f"({folder_files(out, source, tokenizer)}){note}")
    if settings:  # merged: the frozen base from its pretrained files where the checkpoint does not hold it
        from trainer.models import hf

        if p.unsaved:
            try:
                weights.update(read_pretrained(source, p.base, list(p.unsaved), checkpoint))
            except ConfigError as e:
                raise CheckpointError(f"--merge: {e}") from None
        config = hf.config_of(source)
        weights = lora.merged(weights, settings, lambda: hf.model_class(config)(config))
    count = sum(w.numel() for w in weights.values())
    # Persistent buffers (running statistics, Gemma4's layer_scalar) in the dtype the model keeps them in.
    weights.update({name: b.contiguous() for name, b in p.buffers.items()})
    what = f"{count:,} fp32 parameters{' (LoRA merged)' if settings else ''} of {of}"
    if not as_folder:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(weights, out, metadata={"step": str(p.step)})
        return f"wrote {what} to {out}"
    from trainer.models.hf import export_folder

    tokenizer, note = tokenizer_of(source)
    export_folder(weights, source, out, tokenizer)
    return f"wrote {what} to {out}/ ({folder_files(out, source, tokenizer)}){note}"


def folder_files(out: Path, source: dict, tokenizer: Path | None) -> str:
    """Every file of the written folder (export and convert write only into a new or empty one),
    and where the tokenizer's chat template is the run's own."""
    files = ", ".join(sorted(f.name for f in out.iterdir()))
    return files + ("; the tokenizer with the run's data.chat_template" if tokenizer and source.get("chat_template") else "")


def tokenizer_of(source: dict) -> tuple[Path | None, str]:
    """The tokenizer folder a checkpoint records (model=hf), and a note when it is gone."""
    tokenizer = Path(source["tokenizer"]) if source.get("tokenizer") else None
    if tokenizer is not None and not tokenizer.is_dir():
        return None, f"; the tokenizer at {source['tokenizer']} is gone: none copied"
    return tokenizer, ""


def read_pretrained(source: dict, base: dict, names: list[str], checkpoint: Path) -> dict[str, torch.Tensor]:
    """Weights a checkpoint did not save (LoRA's frozen base), from the pretrained folder it
    records, provided its files are still the ones trained on (`base`'s fingerprint: `check_base`)."""
    from trainer.models import hf

    config = hf.config_of(source)
    with torch.device("meta"):
        model = hf.model_class(config)(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if name in names}
    path = Path(source["path"])
    if not safetensors_files(path):
        raise ConfigError(f"{path}: the frozen base weights of this checkpoint are gone (no *.safetensors)")
    files = SafetensorsWeights(path, shapes, hf.checkpoint_key_renamer(model, shapes), None,
                               hf.known_extra_keys(model), Conversions(model, shapes))
    check_base(base, files.fingerprint, checkpoint)
    return {name: files.read(name, 0, math.prod(shape)).view(shape) for name, shape in shapes.items()}
