"""How far apart bf16 runs of the sharded strategies drift (not a test: prints numbers, writes JSON).

    python bench/bf16_agreement.py [--steps 200] [--model small] [--ranks 2] [--out bench/results/bf16_agreement_cpu.json]

Each strategy trains the same model from the same fp32 weights on the same data, bf16, at the
same world size; the step losses are then compared pair by pair. Printed: per pair the largest
relative difference over all steps and at the last step, and the largest of all pairs. Extra
arguments after `--` go to every run (e.g. `-- strategy.reduce_dtype=bf16`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "split" not in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategies", default="fsdp,zero2,zero3")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="overrides for every run")
    args = parser.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            run_dir = Path(tmp) / strategy
            cmd = [sys.executable, "-m", "trainer", f"nproc={args.ranks}", f"strategy={strategy}", f"model={args.model}",
                   "train.precision=bf16", f"train.max_steps={args.steps}", "train.log_every=1",
                   "data.num_workers=0", f"hydra.run.dir={run_dir}", *args.extra]
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{strategy} failed:\n{done.stderr[-3000:]}")
            runs[strategy] = losses(run_dir)
            print(f"{strategy}: final loss {runs[strategy][-1]:.6f}", flush=True)
    pairs = {}
    for a, b in itertools.combinations(runs, 2):
        rel = [abs(x - y) / abs(y) for x, y in zip(runs[a], runs[b])]
        pairs[f"{a}/{b}"] = {"max_rel": max(rel), "last_rel": rel[-1]}
        print(f"{a} vs {b}: largest relative difference {max(rel):.2e} (last step {rel[-1]:.2e})")
    worst = max(p["max_rel"] for p in pairs.values())
    print(f"largest relative difference between any two: {worst:.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"steps": args.steps, "model": args.model, "ranks": args.ranks,
                                        "extra": args.extra, "pairs": pairs, "max_rel": worst, "losses": runs},
                                       indent=1))


if __name__ == "__main__":
    main()
