"""A Hugging Face model through the sharded strategies (not a test: prints numbers, writes JSON).

    python bench/hf_model.py                    # ~134M Llama-shaped model, 2 ranks, fsdp and zero3
    python bench/hf_model.py --layers 2 --hidden 128 --vocab 1024 --steps 4 --warmup 1   # quick check
    python bench/hf_model.py --precision bf16 --load-strategies zero1,zero2,fsdp,zero3 --strategies ""  # setup memory

1. Loading pretrained weights: a Llama-shaped model is built from its config and saved with
   `save_pretrained` (fp32 safetensors); then, per strategy, 2 fresh ranks build it where the
   strategy wants it (meta / zero.Init) and read their parts of the file. Reported per rank:
   the peak growth of resident memory (VmHWM, reset before) across `setup_model`, against the
   rank's own share of the weights and the largest single tensor: the goal is "own shard + one
   tensor", not the whole model (ddp, which replicates, shows the whole model for comparison).
2. Speed: the trainer against a hand-written loop of the same backend on the same HF model,
   weights, data and settings (bench/raw_loops.py), alternating, median step time after warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MB = 1e6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--strategies", default="fsdp,zero3")
    p.add_argument("--load-strategies", default="ddp,fsdp,zero3")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="train.precision of the loading runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default=str(REPO / "bench/results/hf_llama_cpu.json"))
    return p.parse_args()


def save_model(args, directory: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 256))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    sizes = [p.numel() * 4 for p in model.parameters()]
    return {"params": sum(p.numel() for p in model.parameters()), "weight_bytes": sum(sizes),
            "largest_tensor_bytes": max(sizes)}


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def loading_memory(env, cfg_dict: dict) -> dict:
    """On every rank, growth of resident memory: its peak while the model is built and its
    weights are read into the rank's parameters (up to the end of `weights.fill`), then its peak
    across the whole `setup_model` (+ the backend's wrapper: DDP's gradient buckets, DeepSpeed's
    fp32 masters and gradient partitions), and what stays."""
    import gc

    import torch
    import torch.distributed as dist

    import trainer.models.weights as weights
    from trainer.config import to_config
    from trainer.models import build_model
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    cfg = to_config(cfg_dict)
    strategy = build_strategy(cfg, env)
    build_model(cfg.model, torch.device("meta"))  # imports done before measuring
    loaded = {}
    fill = weights.fill

    def measured_fill(*args, **kwargs):
        fill(*args, **kwargs)
        loaded["peak"] = rss("VmHWM")
    for module in [m for m in sys.modules.values() if getattr(m, "fill", None) is fill]:
        module.fill = measured_fill  # where the strategies imported it
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss("VmRSS")
    started = time.perf_counter()
    setup_model(cfg, strategy)
    seconds = time.perf_counter() - started
    held = strategy.memory_bytes()
    result = {"loading_peak_growth_bytes": loaded["peak"] - before, "peak_growth_bytes": rss("VmHWM") - before,
              "stays_bytes": rss("VmRSS") - before, "params_bytes": held["params"], "optim_bytes": held["optim"],
              "seconds": seconds}
    strategy.teardown()
    return result


def main() -> None:
    args = parse_args()
    import os

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from bench.raw_loops import measure
    from bench.strategies import summarise
    from trainer import distributed
    from trainer.config import to_config
    from trainer.models import model_facts
    from trainer.training.run import in_group

    directory = Path(tempfile.mkdtemp(prefix="bench-hf-"))
    started = time.perf_counter()
    facts = save_model(args, directory / "model")
    print(f"[bench] Llama-shaped model, {facts['params'] / 1e6:.1f}M params, {facts['weight_bytes'] / MB:.0f} MB of "
          f"fp32 weights saved in {time.perf_counter() - started:.0f} s ({directory / 'model'})", flush=True)
    model = {"name": "hf", "kind": "hf", "path": str(directory / "model"), "seq_len": args.seq,
             "vocab_size": args.vocab}
    results = {"settings": {**vars(args), **facts}, "loading": [], "runs": []}

    for strategy in args.load_strategies.split(","):
        cfg = {"strategy": {"name": strategy}, "model": model, "data": {"name": "synthetic"},
               "train": {"precision": args.precision}}
        per_rank = distributed.launch_local(args.ranks, in_group, loading_memory, cfg)
        row = {"strategy": strategy, "ranks": args.ranks, "precision": args.precision,
               "per_rank": [per_rank[r] for r in sorted(per_rank)]}
        results["loading"].append(row)
        for r, m in enumerate(row["per_rank"]):
            print(f"[bench] load {strategy} rank {r}: RSS peak while loading +{m['loading_peak_growth_bytes'] / MB:.0f}"
                  f" MB; across setup +{m['peak_growth_bytes'] / MB:.0f} MB, after "
                  f"+{m['stays_bytes'] / MB:.0f} MB; the rank holds {m['params_bytes'] / MB:.0f} MB of weights "
                  f"(+{m['optim_bytes'] / MB:.0f} MB of DeepSpeed fp32 masters); whole model "
                  f"{facts['weight_bytes'] / MB:.0f} MB, largest tensor {facts['largest_tensor_bytes'] / MB:.0f} MB; "
                  f"{m['seconds']:.1f} s", flush=True)

    seq_facts = model_facts(to_config({"model": model}).model, None)
    settings = {"global_batch": args.global_batch, "seq_len": args.seq, "warmup": args.warmup, "peak_flops": None,
                "flops_per_token": seq_facts.flops_per_token}
    run_dir = directory / "runs"
    run_dir.mkdir()
    for strategy in filter(None, args.strategies.split(",")):
        cfg = {"strategy": {"name": strategy}, "model": model, "data": {"name": "synthetic", "num_samples": 512},
               "train": {"max_steps": args.steps, "log_every": 1,
                         "micro_batch_size": args.global_batch // args.ranks}}
        per_rank = distributed.launch_local(args.ranks, in_group, measure, f"hf_{strategy}", cfg, str(run_dir),
                                            args.rounds)
        trainer, raw = per_rank[0]["trainer"], per_rank[0]["raw"]
        run = {"strategy": strategy, "ranks": args.ranks,
               "trainer_step_times_s": [[row["step_time_s"] for row in rows] for rows in trainer],
               "raw_step_times_s": [r["step_times_s"] for r in raw],
               "trainer_losses": [[row["loss"] for row in rows] for rows in trainer],
               "raw_losses": [r["losses"] for r in raw], "raw": {}}
        summarise(run, settings)
        results["runs"].append(run)
        print(f"[bench] {strategy} x{args.ranks}: trainer {run['step_time_s']:.3f} s/step "
              f"({run['tokens_per_s']:.0f} tokens/s), raw {run['raw']['step_time_s']:.3f} s/step, ratio "
              f"{run['overhead_ratio']:.3f} (fastest steps {run['overhead_ratio_fastest']:.3f}); largest loss "
              f"difference {run['loss_max_abs_diff']:.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    ratios = [r["overhead_ratio"] for r in results["runs"]]
    if ratios:
        print(f"[bench] trainer/raw, geometric mean: {statistics.geometric_mean(ratios):.3f}")
    print(f"[bench] results: {out}")


if __name__ == "__main__":
    main()
