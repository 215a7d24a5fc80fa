"""`python -m trainer.export CKPT_DIR OUT.safetensors`: full fp32 weights of a checkpoint, for
inference; `load_state_dict(safetensors.torch.load_file(OUT))` into the plain model.

A file operation: no process group, no strategy. The checkpoint may come from any strategy
and world size; parameters are assembled one at a time from the ranks' pieces.
"""
from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

from trainer.checkpoint import CheckpointError, PieceReader, latest_checkpoint, read_manifest


def export(checkpoint: Path, out: Path) -> int:
    if (checkpoint / "latest").is_file():
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    manifest = read_manifest(checkpoint)
    reader = PieceReader(checkpoint, manifest)
    weights = {name: reader.read_full(f"model.{name}").contiguous() for name in manifest["model"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out), metadata={"step": str(manifest["step"]), "strategy": manifest["strategy"]})
    return sum(w.numel() for w in weights.values())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python -m trainer.export CKPT_DIR OUT.safetensors")
    try:
        n = export(Path(argv[0]), Path(argv[1]))
    except CheckpointError as e:
        sys.exit(f"trainer.export: error: {e}")
    print(f"wrote {n:,} fp32 parameters to {argv[1]}")


if __name__ == "__main__":
    main()
