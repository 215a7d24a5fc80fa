"""`python -m trainer.export CKPT OUT`: the full fp32 weights of a checkpoint (CKPT: a step dir,
or a checkpoint dir for its newest), for inference:
- OUT.safetensors: one flat file; `load_state_dict(safetensors.torch.load_file(OUT))` into the
  plain model;
- OUT_DIR (model=hf): a Hugging Face folder (config.json, generation_config.json,
  model.safetensors, sharded with an index above 5 GB, and the tokenizer's files) that
  `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads. The line it prints names every file.
A LoRA run (peft=lora): OUT_DIR is a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors) that `PeftModel.from_pretrained(base, OUT_DIR)` loads; with `--merge`,
the adapters merged into the model's weights (by peft), written as above.

A file operation: no process group, no strategy. The checkpoint may come from any strategy
and world size; parameters are assembled one at a time from the ranks' pieces
(`checkpoint_format.read_step_dir`), each file verified against its checksum first: a damaged
checkpoint is refused. `python -m trainer.convert CKPT DIR --to hf [--merge]` writes through the
same `write_weights`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trainer.checkpoint.export import export
from trainer.errors import CheckpointError
from trainer.log import refuse


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py parses the documented commands with it)."""
    cli = argparse.ArgumentParser(prog="python -m trainer.export",
                                  description="The full weights of a checkpoint (its newest step, or a step dir).")
    cli.add_argument("checkpoint", type=Path, metavar="CKPT_DIR")
    cli.add_argument("out", type=Path, metavar="OUT", help="OUT.safetensors: one flat file; else a folder")
    cli.add_argument("--merge", action="store_true", help="LoRA: the adapters merged into a full model folder")
    return cli


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        print(export(args.checkpoint, args.out, args.merge))
    except CheckpointError as e:
        refuse(e, "trainer.export")


if __name__ == "__main__":
    main()
