"""`python -m trainer.convert SRC DST --to trainer|dcp|deepspeed|hf` (docs/design.md, Interchange): checkpoints in and
out of the trainer's format. SRC's format is detected:
- ours: a step dir (or a checkpoint dir, for its newest);
- torch DCP: a dir with `.metadata` (plain FSDP2 programs' `{"model", "optim"}`; torchtitan's, the model's
  keys flattened at the top level and a flattened `optimizer`), or what `accelerate save_state` writes
  under FSDP2 (`pytorch_model_fsdp_0/`, `optimizer_0/`);
- DeepSpeed: a dir with `latest` and `global_stepN/` (or one tag dir), ZeRO-1/2/3 at any world
  size, as engines, the HF Trainer and `accelerate save_state` write it; read through DeepSpeed's
  own `ds_to_universal`;
- a DeepSpeed universal checkpoint (`zero/<param>/fp32.pt, exp_avg.pt, ...`);
- a Hugging Face folder (safetensors weights only);
- `accelerate save_state` of a DDP or one-process run (`model.safetensors` + `optimizer.bin`: the
  weights; its moments are keyed by position, not name, and are not read).

In between, a checkpoint is `Portable` (trainer/checkpoint/format.py): fp32 weights and Adam
moments by parameter name, the step, and what the source lacks; from ours also its buffers, trainer
state and frozen base. Our step dirs are read and written by the format's own functions (files
verified against their checksums as they are read, and written with theirs; a save publishes its
step dirs with the same `publish`), and `--to hf` is `trainer.checkpoint.export`'s writer, so
a LoRA checkpoint gives its PEFT folder, or with `--merge` the merged model. Conversions read
whole tensors in one process: memory is the full model plus its two moments (the cost `checkpoint.resume=SRC` pays once, before the ranks start).
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from trainer.checkpoint import convert as formats
from trainer.checkpoint.convert import TARGETS
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.strategies.deepspeed import DeepSpeedStrategy


@contextmanager
def zero1_holding(step_dir: Path, model: dict) -> Iterator[DeepSpeedStrategy]:
    """A ZeRO-1 strategy of one rank, its model built again from `model` (what the checkpoint
    records of it), holding `step_dir`'s weights and moments: what --to deepspeed saves through
    `DeepSpeedStrategy.save_native`. The job composes model and strategy; the checkpoint package does not."""
    from trainer import distributed
    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import to_config
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    cfg = to_config({"strategy": {"name": "zero1"}, "model": model, "train": {"micro_batch_size": 1}})
    env = distributed.init()
    try:
        strategy = build_strategy(cfg, env)
        setup_model(cfg, strategy)
        CheckpointManager(cfg.checkpoint, strategy, "zero1").load(step_dir)
        yield strategy
        strategy.teardown()
    finally:
        distributed.shutdown()


def convert(src: Path, dst: Path, to: str, merge: bool = False) -> str:
    """trainer.checkpoint.convert.convert, with a ZeRO-1 engine for --to deepspeed."""
    return formats.convert(src, dst, to, merge, holding=zero1_holding)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py parses the documented commands with it)."""
    cli = argparse.ArgumentParser(prog="python -m trainer.convert", description=__doc__.splitlines()[0])
    cli.add_argument("src", type=Path)
    cli.add_argument("dst", type=Path)
    cli.add_argument("--to", choices=TARGETS, required=True)
    cli.add_argument("--merge", action="store_true", help="--to hf of a LoRA checkpoint: the adapters merged")
    return cli


def main(argv: list[str] | None = None) -> None:
    from trainer.log import refuse, setup_logging

    setup_logging(None, is_main=True)  # [trainer] lines (a DeepSpeed op build), as the trainer's
    args = parser().parse_args(argv)
    try:
        print(convert(args.src, args.dst, args.to, args.merge))
    except CheckpointError as e:
        refuse(e, "trainer.convert")


if __name__ == "__main__":
    main()
