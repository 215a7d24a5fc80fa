"""Step time, tokens/s and bytes per rank of every strategy (not a test: prints numbers).

    python bench/strategies.py [--model small] [--nproc 2] [--steps 12]

Each strategy trains the same model on the same data at the same global batch; the median
step time skips the first steps (warm-up, DeepSpeed's lazy state).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from trainer import distributed
from trainer.run import in_group, train_configs

STRATEGIES = {"ddp": {}, "fsdp": {}, "fsdp_grad_op": {"sharding": "SHARD_GRAD_OP"}, "zero1": {}, "zero2": {},
              "zero3": {}, "zero3_offload": {"offload_optimizer": True, "offload_params": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from omegaconf import OmegaConf

    model = OmegaConf.to_container(OmegaConf.load(Path(__file__).parent.parent / "conf/model" / f"{args.model}.yaml"))
    cases = {name: {"strategy": {"name": name.split("_")[0], **extra}, "model": model,
                    "train": {"max_steps": args.steps, "log_every": 1, "micro_batch_size": args.micro_batch_size}}
             for name, extra in STRATEGIES.items()}
    out = Path(tempfile.mkdtemp(prefix="bench-"))
    distributed.launch_local(args.nproc, in_group, train_configs, cases, str(out))

    results = {}
    print(f"model={args.model} ranks={args.nproc} micro_batch={args.micro_batch_size} steps={args.steps}")
    print(f"{'strategy':<15}{'step s':>9}{'tokens/s':>11}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}")
    for name in cases:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "event" not in r]
        step_s = statistics.median(r["step_time_s"] for r in rows[3:])
        mem = rows[-1]["mem"]
        results[name] = {"step_time_s": step_s, "tokens_per_s": rows[-1]["tokens"] / rows[-1]["step"] / step_s,
                         "mem": mem, "final_loss": rows[-1]["loss"]}
        print(f"{name:<15}{step_s:>9.3f}{results[name]['tokens_per_s']:>11.0f}"
              f"{mem['params'] / 1e6:>11.1f}{mem['grads'] / 1e6:>10.1f}{mem['optim'] / 1e6:>10.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
