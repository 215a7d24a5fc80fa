"""What the trainer's own per-step features cost a step (not a test: prints a table, writes JSON).

    python bench/feature_costs.py [--layers 8] [--hidden 512] [--seq 512] [--micro-batch 4] [--rounds 8]

On bench/peers.py's model (a Llama-style config with random weights, ~31M parameters, seq_len 512,
micro-batch 4, fp32) at 2 gloo ranks, one thread each: DDP steps (forward, the trainer's loss,
backward, clipping, fused AdamW), in rounds of four kinds, one after the other:
- plain: nothing of the trainer's around the step;
- mem.activations: the forward under the loop's `SavedBytes` and its walk of the graph after it
  (what a log step adds: train.log_every);
- verdict: `StepGuard.decide` after the norm, its one all-reduce and host sync (every step);
- buffer broadcast: `follow_rank0_buffers`' hook before the forward (rank 0's persistent buffers
  to every rank; a model without persistent buffers, as this Llama, gets no hook: here each block
  is given two of the hidden size, as a BatchNorm's running mean and variance).
Each kind's cost: the median of its steps minus the plain steps' median, and (verdict, the walk)
the seconds of the call itself, timed around it; both as % of the plain step. Checksums on save and
load: `python bench/checkpoint_io.py --no-checksums` (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KINDS = ("plain", "mem.activations", "verdict", "buffer broadcast")


def parse_args() -> argparse.Namespace:
    from bench.peers import add_model_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=8, help="steps of each kind (after one round of warm-up)")
    p.add_argument("--out", default=str(REPO / "bench/results/feature_costs_cpu.json"))
    return p.parse_args()


def build(args):
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    from bench.peers import llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args, args.vocab, attn_implementation="sdpa"))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)  # as trainer/strategies/ddp.py
    return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.0, fused=True)


def rank_main(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    from trainer.losses.objectives import NextToken
    from trainer.saved_bytes import SavedBytes
    from trainer.strategies.base import follow_rank0_buffers
    from trainer.training.faults import StepGuard

    objective, guard = NextToken(), StepGuard(max_bad_steps=3)
    _, plain, plain_optim = build(args)
    buffered_model, buffered, buffered_optim = build(args)
    for layer in buffered_model.model.layers:  # as a BatchNorm's running statistics: persistent buffers
        layer.register_buffer("running_mean", torch.zeros(args.hidden))
        layer.register_buffer("running_var", torch.ones(args.hidden))
    follow_rank0_buffers(buffered_model, torch.device("cpu"), args.ranks)
    generator = torch.Generator().manual_seed(rank)
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    calls: dict[str, list[float]] = {"mem.activations": [], "verdict": []}

    def step(kind: str) -> None:
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator)
        model, optimizer = (buffered, buffered_optim) if kind == "buffer broadcast" else (plain, plain_optim)
        dist.barrier()
        start = time.perf_counter()
        with SavedBytes() if kind == "mem.activations" else torch.enable_grad() as saved:
            loss = objective.loss_sum(model, [ids[:, :-1], ids[:, 1:]])[0] / ids[:, 1:].numel()
        if kind == "mem.activations":
            walk = time.perf_counter()
            saved.kept_by_functions(loss)
            calls[kind].append(time.perf_counter() - walk)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if kind == "verdict":
            decide = time.perf_counter()
            guard.decide(loss.detach(), norm, loss_scaled=False)
            calls[kind].append(time.perf_counter() - decide)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds[kind].append(time.perf_counter() - start)

    for kind in KINDS:  # warm-up
        step(kind)
    seconds = {k: [] for k in KINDS}
    calls = {k: [] for k in calls}
    for _ in range(args.rounds):
        for kind in KINDS:
            step(kind)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "calls": calls}))
    dist.destroy_process_group()


def main() -> None:
    from bench.peers import free_port

    args = parse_args()
    port = free_port()
    scratch = Path(args.out).with_suffix(".rank0.json")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(args, port, str(scratch)), nprocs=args.ranks)
    measured = json.loads(scratch.read_text())
    scratch.unlink()
    plain = statistics.median(measured["seconds"]["plain"])
    rows = []
    print(f"DDP step, {args.ranks} gloo ranks, {args.layers} layers x {args.hidden}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, fp32; median of {args.rounds} steps each (rank 0)\n")
    print("| feature | step s (median) | step - plain, ms | % of a step | the call itself, ms (median) |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        median = statistics.median(measured["seconds"][kind])
        call = statistics.median(measured["calls"][kind]) if measured["calls"].get(kind) else None
        rows.append({"feature": kind, "step_s": median, "over_plain_s": median - plain,
                     "call_s": call, "step_seconds": measured["seconds"][kind]})
        extra = "" if kind == "plain" else f"{(median - plain) * 1e3:+.1f}"
        share = "" if kind == "plain" else f"{(median - plain) / plain * 100:+.2f} %"
        print(f"| {kind} | {median:.3f} | {extra} | {share} | {'' if call is None else f'{call * 1e3:.2f}'} |")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "cpus": os.cpu_count(), "torch": torch.__version__, "settings": vars(args),
                                          "rows": rows}, indent=1))
    print(f"\n[bench] results: {args.out}")


if __name__ == "__main__":
    main()
