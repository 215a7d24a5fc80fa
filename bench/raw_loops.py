"""Hand-written minimal training loops, one per backend, to measure what the trainer costs.

Each is what a user would write against the backend directly, with the trainer's settings:
the same model and initial weights, data order, micro-batch, AdamW (decay on matrices only),
LR schedule, clipping and precision, and the same backend options (DDP's bucket-view
gradients, FSDP2 per-block `fully_shard`, DeepSpeed's ZeRO stage). So trainer/raw step time
is the overhead of the trainer's abstraction, and equal losses show both did the same work.

`measure` is what every rank runs: spawned ranks unpickle it by reference, so it lives here,
in an importable module, not in bench/strategies.py's __main__.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import Config, Precision, to_config
from trainer.data import BatchStream, load_data
from trainer.distributed import DistEnv
from trainer.models import builder, initial_weights, logits_of
from trainer.models.blocks import find_blocks
from trainer.models.weights import fill
from trainer.strategies.base import peak_device_bytes
from trainer.training.run import train_configs
from trainer.training.schedule import lr_at

COMPUTE_DTYPE = {Precision.bf16: torch.bfloat16, Precision.fp32: torch.float32}


def adamw(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """nanoGPT's AdamW: weight decay on matrices, none on biases, norms; fused, as the trainer's
    (one kernel for all parameters): the unfused loop rounds differently, and a loss spike grows
    that 1e-7 into a different run within a few steps."""
    o, params = cfg.optim, list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=True)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float):
    def step(loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


# Each setup returns (model, optimizer, step(loss), autocast context factory).

def ddp(model, cfg: Config, env: DistEnv):
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    model = DistributedDataParallel(model.to(env.device), device_ids=device_ids, gradient_as_bucket_view=True)
    optimizer = adamw(model, cfg)
    dtype = COMPUTE_DTYPE[Precision(cfg.train.precision)]
    autocast = contextlib.nullcontext if dtype == torch.float32 else (lambda: torch.autocast(env.device.type, dtype))
    return model, optimizer, torch_step(model, optimizer, cfg.train.grad_clip), autocast


def plain_model(cfg: Config) -> torch.nn.Module:
    """The model built plainly on the CPU, as a user would, holding the trainer's first weights
    (its per-module init, or the same pretrained files)."""
    model = builder(cfg.model)()
    fill(model, initial_weights(cfg.model, model, cfg.train.seed))
    return model


def fsdp(model, cfg: Config, env: DistEnv):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = COMPUTE_DTYPE[Precision(cfg.train.precision)]
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in find_blocks(model, cfg.strategy.wrap):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    optimizer = adamw(model, cfg)
    return model, optimizer, torch_step(model, optimizer, cfg.train.grad_clip), contextlib.nullcontext


def zero(model, cfg: Config, env: DistEnv):
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if env.device.type == "cuda" else "gloo")
    t = cfg.train
    ds_config = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": 1,
                 "gradient_clipping": t.grad_clip, "zero_optimization": {"stage": int(cfg.strategy.name.value[-1])},
                 "bf16": {"enabled": Precision(t.precision) is Precision.bf16},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model, cfg), config=ds_config)

    def step(loss):
        engine.backward(loss)
        engine.step()  # clips (gradient_clipping), steps, zeroes the gradients
    return engine, optimizer, step, contextlib.nullcontext


SETUPS = {"ddp": ddp, "fsdp": fsdp, "zero1": zero, "zero2": zero, "zero3": zero}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA runs ahead of the host: wait before reading the clock
        torch.cuda.synchronize(device)


def raw_loop(env: DistEnv, cfg: Config) -> dict:
    """cfg.train.max_steps steps of the plain loop for cfg.strategy; step times and mean losses."""
    t = cfg.train
    model, optimizer, train_step, autocast = SETUPS[cfg.strategy.name.value](plain_model(cfg), cfg, env)
    dataset, _ = load_data(cfg, env.local_rank)
    stream = BatchStream(dataset, t.micro_batch_size, 1, env.rank, env.world_size, t.seed,
                         num_workers=cfg.data.num_workers, pin_memory=env.device.type == "cuda")
    times, losses = [], []
    for step in range(t.max_steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t.max_steps, cfg.optim)
        [(x, y)] = stream.next_step()
        with autocast():
            logits = logits_of(model(x.to(env.device)))
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(env.device).flatten())
        train_step(loss)
        synchronize(env.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.detach().float())
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)  # after timing: the trainer logs the mean over ranks
    return {"step_times_s": times, "losses": (mean_losses / env.world_size).tolist(),
            "peak_bytes": peak_device_bytes(env.device)}  # as metrics' mem.peak


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr (C++, DeepSpeed and tqdm too) into a file, so the
    benchmark's own output stays readable."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def fresh_memory(device: torch.device) -> int | None:
    """Free what the previous run left (DeepSpeed holds cycles) and restart the CUDA peak;
    return the bytes still allocated (CUDA; None on the CPU)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def trainer_run(env: DistEnv, cfg: dict, run_dir: Path) -> list[dict]:
    """The trainer on `cfg`, metrics into run_dir; its logged steps (rank 0; [] elsewhere)."""
    train_configs(env, {run_dir.name: {**cfg, "logger": {"jsonl": {}}}}, str(run_dir.parent))
    if not env.is_main:
        return []
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def measure(env: DistEnv, name: str, cfg: dict, run_dir: str, rounds: int) -> dict:
    """On every rank, `rounds` times: the trainer on `cfg` and the raw loop of the same backend
    on the same config, in alternating order (T R, R T, ...) so that warm-up of the process and
    drift of a shared machine fall on both alike. Peak RSS is read right after the first trainer
    run, before any raw loop (ru_maxrss only grows)."""
    trainer, raw, peak_rss = [], [], None
    with output_to(Path(run_dir) / f"{name}.rank{env.rank}.log"):
        for r in range(rounds):
            for which in ("trainer", "raw") if r % 2 == 0 else ("raw", "trainer"):
                start_bytes = fresh_memory(env.device)
                if which == "trainer":
                    trainer.append(trainer_run(env, cfg, Path(run_dir) / f"{name}.{r}"))
                    peak_rss = peak_rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
                else:
                    raw.append({**raw_loop(env, to_config(cfg)), "start_bytes": start_bytes})  # counted in its peak
    return {"peak_rss_bytes": peak_rss, "threads": torch.get_num_threads(), "trainer": trainer, "raw": raw}
