"""How long a save stops training: checkpoint.async off and on, beside torch DCP's `async_save`
(thread and process checkpointers) of the same state, in one run (prints a table and JSON).

    python bench/async_save.py [--nproc 1] [--strategy ddp] [--d-model 1024] [--layers 24] [--saves 2]
                               [--variants off,on,thread,process]

The model: the reference GPT at d_model x layers (1024 x 24, vocab 256: 302M parameters), one
training step taken so that its AdamW state exists: 3.6 GB of fp32 state (weights and two
moments), on one rank, or split over --nproc ranks (ddp: each rank saves its share).
- blocked s: what the training thread waits for, from the save's call to its return
  (checkpoint.async off: the whole save; on: the copy to host memory and the thread's start;
  DCP: its staging copy and its plan);
- done s: from the call until the checkpoint is on disk (ours: published; DCP: the future's result);
- each variant saves --saves times; the first pays for allocating its host copy (ours is kept and
  reused) and the process checkpointer starts its process: the first and the best of the rest shown.
DCP gets its state from `get_state_dict(model, optimizer)` (the same tensors), writes its own
format (no checksums), and runs its collectives on the training's group.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # spawned ranks import this module as bench.async_save


def timed_saves(start, wait, saves: int) -> list[tuple[float, float]]:
    """(blocked s, done s) of each save: `start(i)` returns what `wait` waits on."""
    out = []
    for i in range(saves):
        t0 = time.perf_counter()
        pending = start(i)
        blocked = time.perf_counter() - t0
        wait(pending)
        out.append((blocked, time.perf_counter() - t0))
    return out


VARIANTS = ("off", "on", "thread", "process")


def done(s, results: dict, name: str, root: str) -> None:
    """A variant measured: its numbers said at once (rank 0; a later variant may run out of memory),
    its files removed once every rank is done with them."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    if s.is_main:
        print(f"rank 0: {name}: (blocked s, done s) per save: {results[name]}", flush=True)
        shutil.rmtree(f"{root}/{name}", ignore_errors=True)
    gc.collect()


def measure(env, model: dict, strategy: str, root: str, saves: int, variants: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from trainer.checkpoint.manager import CheckpointManager
    from trainer.config import to_config
    from trainer.losses.objectives import token_loss_sum
    from trainer.strategies import build_strategy
    from trainer.strategies.base import optimizer_step
    from trainer.training.setup import setup_model

    cfg = to_config({"strategy": {"name": strategy}, "model": model})
    s = build_strategy(cfg, env)
    net, optimizer, _, _ = setup_model(cfg, s)
    x = torch.randint(0, cfg.model.vocab_size, (1, 33))
    s.backward(token_loss_sum(net(x[:, :-1]), x[:, 1:]) / 32)
    optimizer_step(s, 1.0)
    state = {"step": 1, "epoch": 0, "data": {"epoch": 0, "samples_consumed": 0}}
    results = {}

    def ours(name: str, asynchronous: bool) -> None:
        checkpoint = to_config({"checkpoint": {"dir": f"{root}/{name}", "keep_last": 1, "async": asynchronous}})
        manager = CheckpointManager(checkpoint.checkpoint, s, strategy)
        dist.barrier()
        results[name] = timed_saves(lambda i: manager.save(i + 1, state), lambda _: manager.wait(), saves)
        results[name + " host bytes"] = manager.host.bytes
        manager.close()
        manager.host.buffers = {}  # its copy freed before the next variant's
        done(s, results, name, root)

    def dcp_async(name: str, kind) -> None:
        model_sd, optim_sd = get_state_dict(net, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        dist.barrier()
        results[name] = timed_saves(
            lambda i: dcp.async_save(sd, checkpoint_id=f"{root}/{name}/{i}", async_checkpointer_type=kind),
            lambda future: future.result(), saves)
        done(s, results, name, root)

    for variant in variants:
        {"off": lambda: ours("async off", False), "on": lambda: ours("async on", True),
         "thread": lambda: dcp_async("DCP async_save thread", AsyncCheckpointerType.THREAD),
         "process": lambda: dcp_async("DCP async_save process", AsyncCheckpointerType.PROCESS)}[variant]()
    s.teardown()
    return results


def main() -> None:
    from bench.async_save import measure as measure_fn  # by module name, for the spawned ranks
    from trainer import distributed
    from trainer.config import to_config
    from trainer.plan import count_params
    from trainer.training.run import in_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--strategy", default="ddp", help="fsdp at 2 ranks: ddp holds the whole state on each")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}; off comes first")
    args = parser.parse_args()
    model = {"name": "bench", "vocab_size": 256, "seq_len": 32, "d_model": args.d_model, "n_layers": args.layers,
             "n_heads": args.d_model // 64, "d_ff": 4 * args.d_model}
    n_params = count_params(to_config({"model": model}))
    print(f"reference GPT d_model={args.d_model} layers={args.layers}: {n_params / 1e6:.0f}M parameters, "
          f"{12 * n_params / 1e9:.2f} GB of fp32 state (weights + AdamW moments), {args.nproc} rank(s), {args.strategy}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        ranks = distributed.launch_local(args.nproc, in_group, measure_fn, model, args.strategy, root, args.saves,
                                         args.variants.split(","))
    # a save is as slow as its slowest rank
    results = {name: [tuple(max(r[name][i][k] for r in ranks.values()) for k in (0, 1))
                      for i in range(args.saves)] if "bytes" not in name else ranks[0][name]
               for name in ranks[0]}
    synchronous = min(finished for _, finished in results["async off"]) if "async off" in results else float("nan")
    print(f"{'':<26}{'blocked s':>10}{'(first)':>9}{'done s':>8}{'(first)':>9}{'blocked / sync save':>21}")
    for name, runs in results.items():
        if "bytes" in name:
            continue
        best = min(runs[1:] or runs)
        print(f"{name:<26}{best[0]:>10.2f}{runs[0][0]:>9.2f}{best[1]:>8.2f}{runs[0][1]:>9.2f}"
              f"{best[0] / synchronous:>20.1%}")
    if "async on" in results:
        print(f"checkpoint.async's host copy: {results['async on host bytes'] / 1e9:.2f} GB a rank")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
