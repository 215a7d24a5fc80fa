"""`python -m trainer.export CKPT OUT`: the full fp32 weights of a checkpoint (CKPT: a step dir,
or a checkpoint dir for its newest), for inference:
- OUT.safetensors: one flat file; `load_state_dict(safetensors.torch.load_file(OUT))` into the
  plain model;
- OUT_DIR (model=hf): a Hugging Face folder (config.json, model.safetensors, sharded with an
  index above 5 GB, and the tokenizer) that `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.

A file operation: no process group, no strategy. The checkpoint may come from any strategy
and world size; parameters are assembled one at a time from the ranks' pieces.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointError, PieceReader, latest_checkpoint, read_manifest
from trainer.log import refuse
from trainer.models.weights import save_safetensors


def export(checkpoint: Path, out: Path) -> str:
    """Write the weights of `checkpoint` to `out`; a line saying what was written."""
    if (checkpoint / "latest").is_file():
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    manifest = read_manifest(checkpoint)
    source = manifest.get("source", {})
    as_folder = out.suffix != ".safetensors"
    if as_folder and source.get("kind") != "hf":
        raise CheckpointError(f"{checkpoint} holds a {source.get('kind', 'reference')} model, which has no "
                              "Hugging Face config: export it to a file, OUT.safetensors")
    reader = PieceReader(checkpoint, manifest)
    weights = {name: reader.read_full(f"model.{name}").contiguous() for name in manifest["model"]}
    count = sum(w.numel() for w in weights.values())
    # Persistent buffers (running statistics, Gemma4's layer_scalar) in the dtype the model keeps them in.
    weights.update({name: reader.read_full(f"buffer.{name}").to(getattr(torch, spec["dtype"])).contiguous()
                    for name, spec in manifest.get("buffers", {}).items()})
    what = (f"{count:,} fp32 parameters of step {manifest['step']} ({manifest['strategy']}, world size "
            f"{manifest['world_size']}, {checkpoint})")
    if not as_folder:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(weights, out, metadata={"step": str(manifest["step"]), "strategy": manifest["strategy"]})
        return f"wrote {what} to {out}"
    from trainer.models.hf import export_folder

    tokenizer = Path(source["tokenizer"]) if source.get("tokenizer") else None
    note = ""
    if tokenizer is not None and not tokenizer.is_dir():
        tokenizer, note = None, f"; the tokenizer at {source['tokenizer']} is gone: none copied"
    files = export_folder(weights, source, out, tokenizer)
    return f"wrote {what} to {out}/ ({', '.join(files)}){note}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        refuse("usage: python -m trainer.export CKPT_DIR OUT.safetensors|OUT_DIR", "trainer.export")
    try:
        print(export(Path(argv[0]), Path(argv[1])))
    except CheckpointError as e:
        refuse(e, "trainer.export")


if __name__ == "__main__":
    main()
