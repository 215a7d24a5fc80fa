"""Load time and host memory of a Qwen3-MoE-shaped checkpoint (random weights, bf16 as the Hub ships
them, one tensor per expert; written on the spot): the trainer at 2 ranks on fsdp and zero3 (model
built, each rank's share read and fused, optimizer made: up to the first step) against transformers'
`from_pretrained(dtype=float32)` in one process; and fsdp at strategy.ep=2 (each rank holds, and reads,
half of every layer's experts whole).

    python bench/moe_load.py [OUT_DIR (default /tmp/moe_load_bench)] [--layers N]

Per rank: seconds to load, the process's resident memory before loading (imports done; for the
trainer, its backend's group up) and its peak (VmHWM) after; the peak minus the before is what
loading cost. Each measurement in a fresh process. "SafetensorsWeights: a half" reads, in one
process, the second half of every parameter (rank 1 of 2's flat range) into buffers allocated
before it starts: its peak-before is what the reading itself holds above the share.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import trainer.distributed  # noqa: F401  (tells DeepSpeed, which transformers imports, the device)

QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                 moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


def resident_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def write_checkpoint(out: Path, layers: int) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(QWEN3_MOE, num_hidden_layers=layers)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if not (out / "config.json").is_file():
        model.save_pretrained(str(out))
    return model.num_parameters()


def trainer_rank(env, strategy_name: str, path: str, ep: int = 1) -> dict:
    from trainer.config import to_config
    from trainer.strategies import build_strategy
    from trainer.training.setup import setup_model

    cfg = to_config({"strategy": {"name": strategy_name, "ep": ep}, "data": {"name": "synthetic"},
                     "model": {"name": "hf", "kind": "hf", "path": path, "seq_len": 256, "vocab_size": 32000}})
    strategy = build_strategy(cfg, env)  # the backend imported and its group up (DeepSpeed: its comm op built)
    before = resident_mib("VmRSS")
    start = time.perf_counter()
    setup_model(cfg, strategy)
    seconds = time.perf_counter() - start
    row = {"seconds": seconds, "before": before, "peak": resident_mib("VmHWM")}
    strategy.teardown()
    return row


def reads_only(env, path: str, ranks: int) -> dict:
    """What SafetensorsWeights alone costs: the last of `ranks` ranks' flat share of every parameter,
    read into buffers allocated first (so the peak above them is the reading's own)."""
    from trainer.config import ModelConfig, ModelKind
    from trainer.models import build_model, param_shapes
    from trainer.models.hf import pretrained_weights

    cfg = ModelConfig(kind=ModelKind.hf, path=path, seq_len=256)
    shapes = param_shapes(build_model(cfg, torch.device("meta")))
    weights = pretrained_weights(cfg, build_model(cfg, torch.device("meta")), shapes)
    shares = {name: torch.empty(math.prod(shape) - math.prod(shape) // ranks * (ranks - 1))
              for name, shape in shapes.items()}
    before = resident_mib("VmRSS")
    start = time.perf_counter()
    for name, share in shares.items():
        share.copy_(weights.read(name, math.prod(shapes[name]) - share.numel(), share.numel()))
    return {"seconds": time.perf_counter() - start, "before": before, "peak": resident_mib("VmHWM")}


def transformers_process(env, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    before = resident_mib("VmRSS")
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {"seconds": time.perf_counter() - start, "before": before, "peak": resident_mib("VmHWM")}


def main() -> None:
    from trainer.distributed import launch_local
    from trainer.training.run import in_group

    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="/tmp/moe_load_bench")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = write_checkpoint(out, args.layers)
    files = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"Qwen3-MoE shape, {args.layers} layers, {QWEN3_MOE['num_experts']} experts: {params / 1e6:.0f} M "
          f"parameters, {files / 2**30:.2f} GiB of bf16 safetensors; fp32 model {params * 4 / 2**30:.2f} GiB")
    print(f"{'who':<30} {'rank':>4} {'load s':>7} {'before MiB':>10} {'peak MiB':>9} {'peak-before':>11}")
    rows = [("transformers from_pretrained", launch_local(1, in_group, transformers_process, str(out)))]
    rows.append(("SafetensorsWeights: a half", launch_local(1, in_group, reads_only, str(out), 2)))
    for strategy, ep in (("fsdp", 1), ("fsdp", 2), ("zero3", 1)):
        who = f"trainer {strategy}{f' ep={ep}' if ep > 1 else ''}, 2 ranks"
        rows.append((who, launch_local(2, in_group, trainer_rank, strategy, str(out), ep)))
    for who, by_rank in rows:
        for rank, r in sorted(by_rank.items()):
            print(f"{who:<30} {rank:>4} {r['seconds']:>7.1f} {r['before']:>10.0f} {r['peak']:>9.0f} "
                  f"{r['peak'] - r['before']:>11.0f}")


if __name__ == "__main__":
    main()
