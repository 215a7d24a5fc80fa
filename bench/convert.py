"""Checkpoint conversion cost (not a test: prints numbers, writes JSON).

    python bench/convert.py                      # gpt_125m (~124M parameters), one CPU process each

Trains the preset for one step with a checkpoint, then times `python -m trainer.convert` in each
direction (ours -> DCP, DCP -> ours, ours -> DeepSpeed universal, universal -> ours), each in a
fresh process, and reports wall time and peak resident memory (the process's and its children's:
ds_to_universal runs in one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
MEASURE = """
import resource, sys
from pathlib import Path
from trainer.convert import convert
print(convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print("PEAK_KB", kb)
"""


def timed_convert(src: Path, dst: Path, to: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(dst), to], cwd=REPO, env=ENV,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    peak = int(next(line for line in done.stdout.splitlines() if line.startswith("PEAK_KB")).split()[1])
    return {"seconds": round(time.perf_counter() - started, 2), "peak_rss_gb": round(peak / 1e6, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt_125m")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "convert_cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train = subprocess.run([sys.executable, "-m", "trainer", f"model={args.model}", "train.max_steps=1",
                                "train.micro_batch_size=1", "model.seq_len=128", f"checkpoint.dir={root / 'ours'}",
                                f"hydra.run.dir={root / 'run'}"], cwd=REPO, env=ENV, capture_output=True, text=True)
        if train.returncode:
            raise SystemExit(train.stderr[-3000:])
        size = sum(f.stat().st_size for f in (root / "ours").rglob("*") if f.is_file())
        results = {"model": args.model, "checkpoint_gb": round(size / 1e9, 3), "directions": {
            "ours -> dcp": timed_convert(root / "ours", root / "dcp", "dcp"),
            "dcp -> ours": timed_convert(root / "dcp", root / "from_dcp", "trainer"),
            "ours -> deepspeed universal": timed_convert(root / "ours", root / "universal", "deepspeed"),
            "deepspeed universal -> ours": timed_convert(root / "universal", root / "from_universal", "trainer"),
        }}
    print(f"{args.model}: checkpoint {results['checkpoint_gb']} GB (fp32 weights and two Adam moments)")
    for direction, r in results["directions"].items():
        print(f"  {direction:<30} {r['seconds']:>7.1f} s   peak RSS {r['peak_rss_gb']:.2f} GB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
