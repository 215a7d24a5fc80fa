"""Expert parallelism against gathering the experts, on this machine: a Qwen3-MoE of 16 experts (top-2),
8 layers, hidden 512, its experts 89 % of its parameters, random init, fp32, trained a few steps by the
trainer at 2 and 4 ranks under fsdp, fsdp ep=2, fsdp ep=4 (4 ranks), zero3 and zero2 ep=2.

    python bench/moe_ep.py [--ranks 2,4] [--steps 8] [--out /tmp/moe_ep_bench]

Per run, one table row:
- tokens/s: the global batch's tokens over the median step time (`step_time_s` of the step records)
  of the steps after the second;
- state: the bytes rank 0 holds (`mem` of the step records: params + grads + optimizer state) and
  the planner's per-rank count beside it;
- peak RSS: the largest VmHWM of the ranks' processes at the end (imports, the model, the
  collectives' buffers, everything a process holds);
- moved per step: the bytes a rank's collectives carry in the second step, counted at the dispatcher
  (a TorchDispatchMode over c10d ops among two ranks or more: a tensor's full size per all-reduce,
  all-gather or reduce-scatter, as the planner counts them; for the tokens' all-to-alls the bytes that
  leave the rank, its rows for the others), the mean over the ranks, with the planner's prediction
  (`comm`, no host copies here) beside it; of which the tokens' all-to-alls, measured and planned.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.distributed  # noqa: F401  (tells DeepSpeed, which transformers imports, the device)

QWEN3_MOE = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=8, num_experts=16, num_experts_per_tok=2,
                 moe_intermediate_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64, max_position_embeddings=512)
SEQ_LEN, MICRO_BATCH = 256, 2  # tokens a rank computes per step: 512, at every world size
RUNS = [("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("zero3", 1), ("zero2", 2)]


class CollectiveBytes(TorchDispatchMode):
    """The bytes of the c10d collectives dispatched inside, among two ranks or more (one rank's group
    moves nothing; DeepSpeed still all-reduces over such a group where ep is the world): a tensor's
    full size per all-reduce, all-gather, reduce-scatter or broadcast (the larger of its input and
    output); for an all-to-all with splits (strategy.ep's), the rows that go to the other ranks."""

    def __init__(self):
        super().__init__()
        self.bytes = {"all_to_all": 0, "collectives": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        group = process_group(args) if func.namespace == "c10d" else None
        if group is not None and group.size() > 1:
            if func.__name__.split(".")[0] == "alltoall_base_" and args[4]:  # (out, in, group, out splits, in splits, ..)
                sent, splits = args[1], args[4]
                row = sent[0].numel() * sent.element_size() if len(sent) else 0
                self.bytes["all_to_all"] += (len(sent) - splits[group.rank()]) * row
            else:  # an all-to-all of even splits (the dispatch's counts: a number per rank) at its whole size
                sizes = [sum(t.numel() * t.element_size() for t in flat(value)) for value in args]
                self.bytes["collectives"] += max(sizes, default=0)
        return func(*args, **(kwargs or {}))


def process_group(args) -> dist.ProcessGroup | None:
    """The process group among a c10d op's arguments (the dispatcher passes it boxed)."""
    for value in args:
        if isinstance(value, torch.ScriptObject) and value._type().qualified_name().endswith("c10d.ProcessGroup"):
            return dist.ProcessGroup.unbox(value)
    return None


def flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in flat(v)] if isinstance(value, (list, tuple)) else []


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def run_config(folder: Path, strategy: str, ep: int, steps: int) -> dict:
    return {"strategy": {"name": strategy, "ep": ep}, "data": {"name": "synthetic", "num_workers": 0},
            "train": {"max_steps": steps, "log_every": 1, "micro_batch_size": MICRO_BATCH},
            "optim": {"warmup_steps": 1}, "logger": {"jsonl": {}},
            "model": {"name": "hf", "kind": "hf", "path": str(folder), "seq_len": SEQ_LEN,
                      "vocab_size": QWEN3_MOE["vocab_size"]}}


def train_counting_second_step(env, cfg: dict, run_dir: str, counter: CollectiveBytes) -> None:
    """Train `cfg`, its second step under `counter`."""
    from trainer.config import to_config
    from trainer.training import loop

    step = loop.Run.train_step

    def counted(self, log_now):
        if self.step != 1:
            return step(self, log_now)
        with counter:
            return step(self, log_now)

    loop.Run.train_step = counted
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    loop.train(to_config(cfg), env, Path(run_dir))


def rank(env, cfg: dict, run_dir: str) -> dict:
    """Train `cfg`, its second step under the counter; this rank's bytes moved then, and its peak RSS."""
    counter = CollectiveBytes()
    train_counting_second_step(env, cfg, run_dir, counter)
    return {**counter.bytes, "peak_rss_mib": peak_rss_mib()}


def planned(cfg: dict, world: int, strategy: str, ep: int) -> tuple[dict, dict]:
    """The planner's option for the run: its per-rank bytes and its traffic per step."""
    from trainer.config import to_config
    from trainer.models import resolve_model
    from trainer.plan import make_plan

    typed = to_config(cfg)
    typed.model = resolve_model(typed.model)
    plan = make_plan(typed, world, 80 * 10 ** 9)
    option = next(o for o in plan.options if (o.name, o.ep, o.activation_checkpointing, o.offload)
                  == (strategy, ep, False, False))
    return option.per_gpu_bytes, option.comm_bytes


def main() -> None:
    from trainer.config import to_config
    from trainer.demo import make_model_dir
    from trainer.distributed import launch_local
    from trainer.models import model_facts
    from trainer.training.run import in_group

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="/tmp/moe_ep_bench")
    args = parser.parse_args()
    out = Path(args.out)
    folder = make_model_dir(out / "model", "qwen3_moe", weights=False, **QWEN3_MOE)
    facts = model_facts(to_config(run_config(folder, "fsdp", 1, 1)).model, None)
    print(f"Qwen3-MoE, {QWEN3_MOE['num_hidden_layers']} layers, {facts.experts} experts (top-"
          f"{QWEN3_MOE['num_experts_per_tok']}), hidden {QWEN3_MOE['hidden_size']}: {facts.params / 1e6:.1f} M "
          f"parameters, {facts.expert_params / facts.params:.0%} in experts; fp32, {MICRO_BATCH} x {SEQ_LEN} tokens "
          f"a rank and step; {torch.get_num_threads()} threads here", flush=True)
    print("| ranks | strategy | tokens/s | state MB/rank (planned) | peak RSS MiB/rank | moved MB/step/rank "
          "(planned) | of which all-to-all MB (planned) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for world in map(int, args.ranks.split(",")):
        for strategy, ep in [(s, ep) for s, ep in RUNS if world % ep == 0]:
            name = f"{strategy}_ep{ep}_{world}"
            cfg = run_config(folder, strategy, ep, args.steps)
            by_rank = launch_local(world, in_group, rank, cfg, str(out / name))
            rows = [r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())
                    if "event" not in r]
            step_s = statistics.median(r["step_time_s"] for r in rows[2:])
            held = sum(rows[-1]["mem"][k] for k in ("params", "grads", "optim"))
            plan_held, plan_comm = planned(cfg, world, strategy, ep)
            moved = statistics.mean(r["collectives"] + r["all_to_all"] for r in by_rank.values())
            a2a = statistics.mean(r["all_to_all"] for r in by_rank.values())
            label = f"{strategy}{f' ep={ep}' if ep > 1 else ''}"
            print(f"| {world} | {label} | {world * MICRO_BATCH * SEQ_LEN / step_s:,.0f} | {held / 1e6:,.1f} "
                  f"({sum(plan_held[k] for k in ('params', 'grads', 'optim')) / 1e6:,.1f}) | "
                  f"{max(r['peak_rss_mib'] for r in by_rank.values()):,.0f} | {moved / 1e6:,.1f} "
                  f"({sum(plan_comm.values()) / 1e6:,.1f}) | {a2a / 1e6:,.1f} "
                  f"({plan_comm['expert_all_to_all'] / 1e6:,.1f}) |", flush=True)


if __name__ == "__main__":
    main()
