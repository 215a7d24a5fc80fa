"""The training loop. It talks to the Strategy only: no backend import, no isinstance."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from trainer.blocks import apply_checkpointing, find_blocks
from trainer.checkpoint import CheckpointManager, resolve_resume
from trainer.config import Config, OptimConfig
from trainer.data import BatchStream, build_dataset
from trainer.distributed import DistEnv, seed_everything
from trainer.model import ModelShape, build_model
from trainer.strategies import build_strategy


def model_shape(cfg: Config) -> ModelShape:
    m = cfg.model
    return ModelShape(m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.d_ff, m.mlp, m.norm, m.bias)


def lr_at(step: int, total_steps: int, o: OptimConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def adamw_factory(o: OptimConfig):
    """AdamW with weight decay on matrices only (nanoGPT's split)."""
    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        # ZeRO-3 partitions parameters as they are built; their shape is kept in ds_shape.
        is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in model.parameters()]
        params = list(model.parameters())
        groups = [{"params": [p for p, m in zip(params, is_matrix) if m], "weight_decay": o.weight_decay},
                  {"params": [p for p, m in zip(params, is_matrix) if not m], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return build


class MetricsLog:
    """metrics.jsonl (DESIGN §4): one JSON object per line, flushed per line; rank 0 only."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(cfg: Config, env: DistEnv, run_dir: Path) -> dict:
    t = cfg.train
    seed_everything(t.seed)
    strategy = build_strategy(cfg, env)
    dataset = build_dataset(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, t.seed)
    stream = BatchStream(dataset, t.micro_batch_size, t.grad_accum_steps, env.rank, env.world_size, t.seed)
    total_steps = t.max_steps or t.epochs * stream.steps_per_epoch

    with strategy.model_init_context():
        model = build_model(model_shape(cfg))
    if t.activation_checkpointing:
        apply_checkpointing(model, find_blocks(model, cfg.strategy.wrap))
    model, optimizer = strategy.setup(model, adamw_factory(cfg.optim))

    checkpoints = CheckpointManager(cfg.checkpoint, strategy, cfg.strategy.name.value)
    step = 0
    resume_from = resolve_resume(cfg.checkpoint)
    if resume_from:
        state = checkpoints.load(resume_from)
        step = state["step"]
        stream.load_state_dict(state["data"])

    metrics = MetricsLog(run_dir / "metrics.jsonl") if env.is_main else None
    if metrics:
        print(f"[trainer] strategy={cfg.strategy.name.value} world_size={env.world_size} device={env.device} "
              f"model={cfg.model.name} steps={total_steps}; metrics: {metrics.path}", flush=True)
        if resume_from:
            print(f"[trainer] resumed from {resume_from} at step {step}", flush=True)
    tokens_per_step = t.micro_batch_size * t.grad_accum_steps * env.world_size * cfg.model.seq_len
    progress = tqdm(total=total_steps, initial=step, disable=not env.is_main, desc="train", dynamic_ncols=True)
    last = {}
    since, steps_since = time.perf_counter(), 0
    while step < total_steps:
        lr = lr_at(step, total_steps, cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = stream.next_step()
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(micro_batches):
            with strategy.no_sync(i < len(micro_batches) - 1):
                with strategy.autocast():
                    loss = model(x.to(env.device), y.to(env.device))
                strategy.backward(loss / t.grad_accum_steps)
            loss_sum += loss.detach().float()
        step += 1
        log_now = step % t.log_every == 0 or step == total_steps
        mem = strategy.memory_bytes() if log_now else None  # gradients are held right now
        grad_norm = strategy.step(t.grad_clip)
        steps_since += 1
        progress.update()
        if checkpoints.due(step, total_steps):
            saving = time.perf_counter()
            checkpoints.save(step, {"step": step, "epoch": stream.epoch, "data": stream.state_dict()})
            since += time.perf_counter() - saving  # step times leave the save out
        if not log_now:
            continue
        mean_loss = strategy.all_reduce(loss_sum / t.grad_accum_steps).item() / env.world_size
        elapsed = time.perf_counter() - since
        last = {"step": step, "epoch": stream.epoch, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": step * tokens_per_step, "tokens_per_s": steps_since * tokens_per_step / elapsed,
                "step_time_s": elapsed / steps_since, "mem": mem}
        if metrics:
            metrics.write(last)
            progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
        since, steps_since = time.perf_counter(), 0
    progress.close()
    strategy.barrier()
    if metrics:
        metrics.write({"event": "end", "step": step})
        metrics.close()
        print(f"[trainer] done: {step} steps, final loss {last.get('loss', float('nan')):.4f}; "
              f"metrics: {metrics.path}", flush=True)
    strategy.teardown()
    return last
