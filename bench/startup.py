"""Startup, as a user feels it: the seconds from the command to its exit for
`trainer nproc=2 strategy=S train.max_steps=1 data=synthetic`, against a plain torchrun script
that does one step of the same backend on a model of that size (bench/plain_step.py, nothing of
the trainer imported). Median of --rounds each, run in alternating order; the ratio is what the
trainer adds (imports, checks, the launcher, the run dir).

    python bench/startup.py [--strategies ddp,fsdp,zero3] [--rounds 3] [--out bench/results/startup_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def seconds(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="ddp,fsdp,zero3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench/results/startup_cpu.json"))
    args = p.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            trainer = [str(BIN / "trainer"), "nproc=2", f"strategy={strategy}", "train.max_steps=1", "data=synthetic"]
            plain = [str(BIN / "torchrun"), "--nproc_per_node", "2", str(REPO / "bench/plain_step.py"), strategy]
            times: dict[str, list[float]] = {"trainer": [], "plain": []}
            seconds(plain, env)  # a first run warms the page cache for both
            for i in range(args.rounds):
                for name, command in (("trainer", trainer), ("plain", plain))[:: 1 if i % 2 == 0 else -1]:
                    run_dir = [f"hydra.run.dir={tmp}/{strategy}-{i}"] if name == "trainer" else []
                    times[name].append(seconds(command + run_dir, env))
            median = {name: statistics.median(ts) for name, ts in times.items()}
            results[strategy] = {"trainer_s": times["trainer"], "plain_s": times["plain"],
                                 "median_trainer_s": median["trainer"], "median_plain_s": median["plain"],
                                 "ratio": median["trainer"] / median["plain"]}
            print(f"{strategy:6s} trainer {median['trainer']:5.1f} s  plain torchrun {median['plain']:5.1f} s  "
                  f"ratio {results[strategy]['ratio']:.2f}  (median of {args.rounds})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": args.rounds, "cpus": os.cpu_count(), "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
