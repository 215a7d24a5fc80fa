"""Activation memory and speed of long sequences (not a test: prints a table, writes JSON).

    python bench/long_context.py [--models small,qwen2] [--seqs 2048,4096,8192] [--sp 1,2,4]
                                 [--fused off,on] [--ac off,on] [--steps 3] [--out FILE] [-- OVERRIDES]

Each cell trains one row of `seq` tokens per step (micro batch 1, no accumulation, one
data-parallel replica: the same global batch in every cell) on `sp` CPU ranks that it launches
itself (`nproc=sp strategy.sp=sp`), fp32, synthetic data, and reads the step records: the
measured `mem.activations` of rank 0 (each rank of a sequence-parallel group holds the same
share) and the median `tokens_per_s` of the steps after the first. Beside them, what
`python -m trainer.plan` counts for the cell. `small` is the built-in preset (6 heads: its sp=4
cells print a line saying they are skipped); `qwen2` a tiny Qwen2 (4 heads, 2 key/value heads) built on the spot from a config.
Cells that are refused (a setting not in this build, heads that do not divide) print why.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_overrides(name: str, tmp: Path, longest: int) -> list[str]:
    if name != "qwen2":
        return [f"model={name}"]
    from trainer.demo import make_model_dir

    folder = make_model_dir(tmp / "qwen2", "qwen2", weights=False, max_position_embeddings=longest)
    return ["model=hf", f"model.path={folder}"]


def cell_overrides(seq: int, sp: int, fused: bool, ac: bool, steps: int) -> list[str]:
    return [f"model.seq_len={seq}", f"strategy.sp={sp}", f"train.fused_loss={str(fused).lower()}",
            f"train.activation_checkpointing={str(ac).lower()}", "train.micro_batch_size=1",
            "train.grad_accum_steps=1", f"train.max_steps={steps}", "train.log_every=1", "data=synthetic",
            "data.num_workers=0", "strategy=ddp"]


def planned_bytes(overrides: list[str], seq: int, sp: int, fused: bool, ac: bool) -> int:
    from hydra import compose, initialize_config_module

    from trainer.config import CONFIG_MODULE, register_configs, to_config
    from trainer.models import resolve_model
    from trainer.plan.activations import planned

    register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = to_config(compose(config_name="config", overrides=[o for o in overrides if "=" in o
                                                                    and not o.startswith(("strategy.sp", "data"))]))
    cfg.model = resolve_model(cfg.model)
    return planned(cfg, ac, fused, sp).bytes(seq, 1)


def run_cell(overrides: list[str], sp: int, run_dir: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "trainer", f"nproc={sp}", f"hydra.run.dir={run_dir}", *overrides]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mem" in r and r.get("mem")]
    rates = [r["tokens_per_s"] for r in steps[1:] if r.get("tokens_per_s")] or [steps[-1]["tokens_per_s"]]
    return {"activations": steps[-1]["mem"].get("activations"), "tokens_per_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,qwen2")
    parser.add_argument("--seqs", default="2048,4096,8192")
    parser.add_argument("--sp", default="1,2,4")
    parser.add_argument("--fused", default="off,on")
    parser.add_argument("--ac", default="off,on")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="overrides for every run")
    args = parser.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    seqs = [int(s) for s in args.seqs.split(",")]
    on = {"on": True, "off": False}
    results = []
    print(f"{'model':<7}{'seq':>6}{'sp':>4}{'fused':>6}{'AC':>4}{'activations MB':>16}{'planned MB':>12}"
          f"{'tokens/s':>10}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            base = model_overrides(model, Path(tmp), max(seqs))
            heads = 4 if model == "qwen2" else 6 if model == "small" else None
            for seq, sp, fused, ac in itertools.product(seqs, [int(n) for n in args.sp.split(",")],
                                                         [on[f] for f in args.fused.split(",")],
                                                         [on[a] for a in args.ac.split(",")]):
                cells = f"{model:<7}{seq:>6}{sp:>4}{'on' if fused else 'off':>6}{'on' if ac else 'off':>4}"
                if heads and heads % sp:
                    print(f"{cells}  skipped: {heads} attention heads do not divide by sp={sp}", flush=True)
                    continue
                overrides = [*base, *cell_overrides(seq, sp, fused, ac, args.steps), *args.extra]
                run_dir = Path(tmp) / f"{model}_{seq}_{sp}_{fused}_{ac}"
                found = run_cell(overrides, sp, run_dir, env)
                plan = planned_bytes([*base, *args.extra, f"model.seq_len={seq}"], seq, sp, fused, ac)
                results.append({"model": model, "seq": seq, "sp": sp, "fused_loss": fused,
                                "activation_checkpointing": ac, "planned": plan, **found})
                if "error" in found:
                    print(f"{cells}  refused: {found['error']}", flush=True)
                else:
                    print(f"{cells}{found['activations'] / 1e6:>16.1f}{plan / 1e6:>12.1f}{found['tokens_per_s']:>10.0f}",
                          flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"extra": args.extra, "steps": args.steps, "cells": results}, indent=1))


if __name__ == "__main__":
    main()
