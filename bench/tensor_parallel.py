"""Tensor parallelism on this machine: the built-in transformer at about 100 M parameters (model=small
widened: d_model 768, 12 layers, 12 heads, d_ff 3072, a vocabulary of 8,192; 97.8 M), random init,
fp32, synthetic data, trained a few steps by the trainer at 2 and 4 ranks under fsdp, fsdp tp=2,
zero2 tp=2 and zero3 tp=2 (not a test: prints a markdown table, writes JSON).

    python bench/tensor_parallel.py [--ranks 2,4] [--runs fsdp:1,fsdp:2,zero2:2,zero3:2] [--steps 4]
                                    [--micro-batch 1] [--seq-len 256] [--out /tmp/tp_bench]

Every rank computes `--micro-batch` rows of `--seq-len` tokens a step, whatever the run: a tensor
group's ranks read the same rows, so the global batch is world / tp x micro batch rows. The ranks
are launched as bench/moe_ep.py launches them (the trainer's `launch_local`, one launch a run), and
each run gives one table row:
- tokens/s: the global batch's tokens over the median `step_time_s` of the step records after the
  first (the trainer's own `tokens_per_s` counts a tensor group's rows once);
- state: the bytes rank 0 holds (`mem` of the last step record: params + grads + optimizer state);
- activations: the bytes rank 0's forward saves for backward in the last step, as the rank holds
  them: the step records' `mem.activations` (trainer/saved_bytes.py: a saved DTensor by its local
  tensor, a weight's share made by `DTensor.to_local` a parameter, not an activation);
- peak RSS: the largest VmHWM of the ranks' processes at the end (torch, the model, the gathered
  parameters, the collectives' buffers: everything a process holds);
- moved per step: the bytes a rank's collectives carry in the second step, counted at the dispatcher,
  the mean over the ranks: bench/moe_ep.py's counter (c10d ops among two ranks or more: FSDP2's,
  DeepSpeed's and AutoTP's; a tensor's full size per all-reduce, all-gather or reduce-scatter) and
  DTensor's functional collectives (`_c10d_functional.*`: fsdp tp's activations and their gradients,
  the vocabulary-parallel loss) at the same sizes; of which on the tensor group (its ranks: tp
  consecutive ones), where the group is not the world. A sequence-parallel layer's all-gather and
  reduce-scatter count a full tensor each, where the all-reduce they replace counts one (the same
  bytes on a ring; docs/planning.md counts the pair as the all-reduce).
A run that is refused or fails prints its last error line in the row instead of numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench.moe_ep` importable here and in the spawned ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.moe_ep import CollectiveBytes, flat, peak_rss_mib, process_group, train_counting_second_step  # noqa: E402

MODEL = dict(name="small", vocab_size=8192, seq_len=256, d_model=768, n_layers=12, n_heads=12, d_ff=3072)
RUNS = "fsdp:1,fsdp:2,zero2:2,zero3:2"


class AllCollectiveBytes(CollectiveBytes):
    """bench/moe_ep.py's counter (c10d ops), and DTensor's functional collectives besides
    (`_c10d_functional.all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, ..., which reach
    the process group without a c10d op): the larger of a collective's input and output, among two
    ranks or more. `by_group` splits the total by group: its global ranks, "0,1" ("0,2" the data-parallel
    group of rank 0 at 4 ranks and tp=2)."""

    def __init__(self):
        super().__init__()
        self.bytes["functional"] = 0
        self.by_group: dict[str, int] = {}

    def add(self, group: dist.ProcessGroup, moved: int) -> None:
        key = ",".join(map(str, dist.get_process_group_ranks(group)))
        self.by_group[key] = self.by_group.get(key, 0) + moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait_tensor"):
            out = func(*args, **(kwargs or {}))
            name = next((a for a in args if isinstance(a, str) and a.isdigit()), None) or args[-1]
            group = dist.distributed_c10d._resolve_process_group(name) if isinstance(name, str) else None
            if group is not None and group.size() > 1:
                moved = max(sum(t.numel() * t.element_size() for t in flat(v)) for v in (args, out))
                self.bytes["functional"] += moved
                self.add(group, moved)
            return out
        if func.namespace == "c10d":
            group = process_group(args)
            if group is not None and group.size() > 1:
                before = sum(self.bytes.values())
                out = super().__torch_dispatch__(func, types, args, kwargs)
                moved = sum(self.bytes.values()) - before
                self.add(group, moved)
                return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def run_config(strategy: str, tp: int, args) -> dict:
    return {"strategy": {"name": strategy, "tp": tp}, "data": {"name": "synthetic", "num_workers": 0},
            "model": {**MODEL, "seq_len": args.seq_len},
            "train": {"max_steps": args.steps, "log_every": 1, "micro_batch_size": args.micro_batch},
            "optim": {"warmup_steps": 1}, "logger": {"jsonl": {}}}


def rank(env, cfg: dict, run_dir: str) -> dict:
    """Train `cfg`, its second step under the counter; this rank's bytes moved then, and its peak RSS."""
    counter = AllCollectiveBytes()
    train_counting_second_step(env, cfg, run_dir, counter)
    return {"moved": sum(counter.bytes.values()), "bytes": counter.bytes, "by_group": counter.by_group,
            "peak_rss_mib": peak_rss_mib()}


def refused(cfg: dict, world: int) -> str | None:
    """The one line the trainer's checks before work (trainer/checks.py) refuse the run with, or None."""
    from trainer.checks import check_settings
    from trainer.config import to_config
    from trainer.errors import ConfigError
    from trainer.models import resolve_model

    typed = to_config(cfg)
    typed.model = resolve_model(typed.model)
    try:
        check_settings(typed, world)
    except ConfigError as e:
        return str(e)
    return None


def one_run(strategy: str, tp: int, world: int, args) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainer.distributed import launch_local
    from trainer.training.run import in_group

    cfg = run_config(strategy, tp, args)
    row = {"ranks": world, "strategy": strategy, "tp": tp}
    if reason := refused(cfg, world):
        return {**row, "error": f"refused: {reason}"}
    folder = Path(args.out) / f"{strategy}_tp{tp}_{world}"
    started = time.perf_counter()
    try:
        by_rank = launch_local(world, in_group, rank, cfg, str(folder))
    except ChildFailedError as e:  # a failed rank: its error, one line
        message = str(e.get_first_failure()[1].message or e)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        return {**row, "error": f"failed: {lines[-1] if lines else type(e).__name__}"}
    records = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
               if "event" not in r and r.get("mem")]
    step_s = statistics.median(r["step_time_s"] for r in records[1:])
    mem = records[-1]["mem"]
    tokens = world // tp * args.micro_batch * args.seq_len
    return {**row, "seconds": time.perf_counter() - started, "step_time_s": step_s, "tokens_per_s": tokens / step_s,
            "global_batch_tokens": tokens, "state_bytes": sum(mem[k] for k in ("params", "grads", "optim")),
            "mem": mem, "activation_bytes": mem.get("activations"),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in by_rank.values()),
            "moved_bytes": statistics.mean(r["moved"] for r in by_rank.values()),
            # a tensor group: tp consecutive ranks (trainer/layout.py's ("dp", "tp") mesh)
            "moved_tp_group_bytes": statistics.mean(
                r["by_group"].get(",".join(map(str, range(i // tp * tp, i // tp * tp + tp))), 0)
                for i, r in by_rank.items()) if 1 < tp < world else None,
            "moved_by_group": {i: r["by_group"] for i, r in by_rank.items()},
            "moved_by_kind": {k: statistics.mean(r["bytes"][k] for r in by_rank.values())
                              for k in next(iter(by_rank.values()))["bytes"]},
            "losses": [r["loss"] for r in records]}


def table_row(r: dict) -> str:
    label = r["strategy"] + (f" tp={r['tp']}" if r["tp"] > 1 else "")
    if "error" in r:
        return f"| {r['ranks']} | {label} | {r['error']} ||||||"
    tp_group = f"{r['moved_tp_group_bytes'] / 1e6:,.1f}" if r["moved_tp_group_bytes"] is not None else (
        "all" if r["tp"] > 1 else "-")
    return (f"| {r['ranks']} | {label} | {r['tokens_per_s']:,.0f} | {r['state_bytes'] / 1e6:,.1f} | "
            f"{r['activation_bytes'] / 1e6:,.1f} | {r['peak_rss_mib']:,.0f} | {r['moved_bytes'] / 1e6:,.1f} | "
            f"{tp_group} |")


def main() -> None:
    from trainer.config import to_config
    from trainer.models import model_facts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--runs", default=RUNS, help="strategy:tp, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1, help="rows a rank computes per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", default="/tmp/tp_bench", help="run folders and results.json")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = model_facts(to_config({"model": {**MODEL, "seq_len": args.seq_len}}).model, None)
    print(f"built-in transformer, d_model {MODEL['d_model']}, {MODEL['n_layers']} layers, {MODEL['n_heads']} heads, "
          f"d_ff {MODEL['d_ff']}, vocabulary {MODEL['vocab_size']}: {facts.params / 1e6:.1f} M parameters; fp32, "
          f"{args.micro_batch} x {args.seq_len} tokens a rank and step, {args.steps} steps; load average "
          f"{os.getloadavg()[0]:.1f} at the start", flush=True)
    print("| ranks | strategy | tokens/s | state MB/rank | activations MB/rank | peak RSS MiB/rank | moved MB/step/rank "
          "| of which tensor group MB |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = {"model": MODEL, "params": facts.params, "args": vars(args), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for world in map(int, args.ranks.split(",")):
        for strategy, tp in (run.split(":") for run in args.runs.split(",")):
            tp = int(tp)
            if world % tp:
                continue
            load = os.getloadavg()[0]
            r = {**one_run(strategy, tp, world, args), "load_before": load}
            results["runs"].append(r)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            print(table_row(r), flush=True)


if __name__ == "__main__":
    main()
