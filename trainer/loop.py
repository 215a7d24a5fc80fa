"""The training loop. It talks to the Strategy only: no backend import, no isinstance."""
from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from trainer.blocks import apply_checkpointing, find_blocks
from trainer.checkpoint import CheckpointManager
from trainer.checkpoint_format import read_manifest
from trainer.config import Config, OptimConfig, Schedule, StrategyName, profile_steps
from trainer.data import IGNORE_INDEX, BatchStream, eval_batches, load_data
from trainer.distributed import DistEnv, on_main, peak_flops, restart_count, seed_everything
from trainer.faults import StepGuard, Stopped
from trainer.log import log, setup_logging
from trainer.loggers import RunLog
from trainer.models import build_model, description, initial_weights, logits_of, model_facts
from trainer.models.weights import WeightSource
from trainer.resume import resolve_resume
from trainer.strategies import Strategy, build_strategy


def lr_at(step: int, total_steps: int, o: OptimConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over `warmup_steps`, then
    `optim.schedule` down to `lr * min_lr_ratio` at the schedule's last step (`optim.schedule_steps`,
    else the run's `total_steps`), held there after it. A pure function of the step: resumable."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    schedule, last = Schedule(o.schedule), (o.schedule_steps or total_steps) - 1
    if schedule is Schedule.constant:
        return o.lr
    # wsd decays over its last decay_fraction, the others from the end of the warmup
    start = last - max(1, round(o.decay_fraction * (last + 1))) if schedule is Schedule.wsd else o.warmup_steps
    progress = min(1.0, max(0.0, (step - start) / max(1, last - start)))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule is Schedule.cosine else 1 - progress
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * decay)


def resume_notes(state: dict, cfg: Config, global_batch: int, total_steps: int, run_dir: Path) -> list[str]:
    """What a resume changes against the run that saved the checkpoint, one line each."""
    notes, step, o = [], state["step"], cfg.optim
    if state.get("global_batch", global_batch) != global_batch:
        notes.append(f"the checkpoint was trained at global batch {state['global_batch']} and this run's is "
                     f"{global_batch}: the data order from here on, and so the losses, differ from those of the "
                     "run that saved it (the learning rate is not rescaled)")
    saved_end, end = state.get("schedule_steps"), o.schedule_steps or total_steps
    if saved_end and saved_end != end:
        before = lr_at(step, saved_end, OptimConfig(**{**vars(o), "schedule_steps": saved_end}))
        notes.append(f"the learning-rate schedule now ends at step {end}, not {saved_end}: step {step + 1} trains "
                     f"at {lr_at(step, total_steps, o):.3g} instead of {before:.3g}; "
                     f"optim.schedule_steps={saved_end} keeps the old end")
    if state.get("run_dir") and Path(state["run_dir"]) != run_dir:
        notes.append(f"the steps before {step + 1} are in {state['run_dir']}/metrics.jsonl")
    if not cfg.checkpoint.dir:
        notes.append("no checkpoint.dir: nothing of this run is saved (checkpoint.resume only reads)")
    return notes


def adamw_factory(o: OptimConfig):
    """AdamW with weight decay on matrices only (nanoGPT's split)."""
    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        # Frozen parameters (LoRA's base) get no optimizer state. ZeRO-3 partitions parameters as
        # they are built; their shape is kept in ds_shape.
        params = [p for p in model.parameters() if p.requires_grad]
        is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
        groups = [{"params": [p for p, m in zip(params, is_matrix) if m], "weight_decay": o.weight_decay},
                  {"params": [p for p, m in zip(params, is_matrix) if not m], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return build


def setup_model(cfg: Config, strategy: Strategy) -> tuple[nn.Module, torch.optim.Optimizer, list[nn.Module],
                                                         WeightSource]:
    """Build the model where the strategy wants it (with LoRA adapters for peft=lora), find its
    blocks, wrap them for activation checkpointing, compile them, then let the strategy shard it
    and give each rank its part of the first weights (AC -> compile -> setup, as torchtitan).
    Returns (model, optimizer, blocks, where the weights came from)."""
    model = build_model(cfg.model, strategy.model_init_context(), cfg.peft)
    blocks = find_blocks(model, cfg.strategy.wrap)
    weights = initial_weights(cfg.model, model, cfg.train.seed, cfg.peft)
    if cfg.train.activation_checkpointing:
        apply_checkpointing(model, blocks)
    if cfg.train.compile:  # regional: each block compiled in place (names unchanged), before sharding
        for block in blocks:
            block.compile()
    model, optimizer = strategy.setup(model, adamw_factory(cfg.optim), weights)
    return model, optimizer, blocks, weights


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum (not the mean) of the token cross-entropies, in fp32; padding is no target."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def target_count(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()


def forward(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The logits of a micro-batch (inputs, targets[, position_ids]). Rows of packed conversations
    carry position ids, restarting at each one: the model keeps attention within each."""
    inputs, _, *position_ids = batch
    return logits_of(model(inputs, position_ids=position_ids[0]) if position_ids else model(inputs))


@torch.no_grad()
def evaluate(model: nn.Module, strategy: Strategy, batches, device: torch.device) -> float:
    """The mean token loss over the validation batches of all ranks."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, targets
    for batch in batches:
        batch = [t.to(device) for t in batch]
        with strategy.autocast():
            totals[0] += token_loss_sum(forward(model, batch), batch[1]).double()
        totals[1] += target_count(batch[1])
    model.train()
    strategy.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def describe(cfg: Config, env: DistEnv, total_steps: int) -> str:
    """What will run, resolved: the start line."""
    s, t = cfg.strategy, cfg.train
    offload = "+".join(what for what, on in (("optimizer", s.offload_optimizer), ("params", s.offload_params)) if on)
    sharding = f" sharding={s.sharding.value}" if s.name is StrategyName.fsdp else ""
    global_batch = t.micro_batch_size * t.grad_accum_steps * env.world_size
    return (f"strategy={s.name.value} world_size={env.world_size} device={env.device} model={cfg.model.name} "
            f"steps={total_steps} precision={t.precision.value}{sharding} offload={offload or 'none'} "
            f"activation_checkpointing={'on' if t.activation_checkpointing else 'off'} global_batch={global_batch} "
            f"({t.micro_batch_size} x {t.grad_accum_steps} accumulation x {env.world_size} "
            f"rank{'s' if env.world_size > 1 else ''}) "
            f"seq_len={cfg.model.seq_len}")


class StepProfiler:
    """train.profile=START:STOP: a torch profiler trace of those steps, per rank, in the run dir."""

    def __init__(self, spec: str | None, run_dir: Path, rank: int, device: torch.device):
        self.steps = profile_steps(spec) if spec else None
        self.path = run_dir / "profile" / f"trace_rank{rank}.json"
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            self.profiler = torch.profiler.profile(activities=self.activities)
            self.profiler.__enter__()
        if self.profiler is not None:  # each step a span of its own in the trace, as profiler.step() names them
            self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.span.__enter__()

    def after(self, step: int) -> None:
        if self.profiler is None:
            return
        self.span.__exit__(None, None, None)
        if step == self.steps[1]:
            self.profiler.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            self.profiler = None
            log.info(f"profile of steps {self.steps[0]}-{self.steps[1]}: {self.path.parent}/trace_rank*.json "
                     "(chrome://tracing, ui.perfetto.dev)")


class EarlyStop:
    """eval.early_stop_patience=K: the run ends after K evaluations in a row without a lower
    validation loss (0: never). Its state goes into checkpoints, so a resume counts on."""

    def __init__(self, patience: int):
        self.patience, self.best, self.best_step, self.worse = patience, math.inf, 0, 0

    def update(self, step: int, val_loss: float) -> bool:
        """Whether to stop after this evaluation (the same on every rank: the loss is all-reduced)."""
        if val_loss < self.best:
            self.best, self.best_step, self.worse = val_loss, step, 0
        else:
            self.worse += 1
        return 0 < self.patience <= self.worse

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "worse": self.worse}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.worse = state["best"], state["best_step"], state["worse"]


def train(cfg: Config, env: DistEnv, run_dir: Path) -> dict:
    t = cfg.train
    setup_logging(run_dir, env.is_main, cfg.log_level.value)
    guard = StepGuard(t.max_bad_steps)  # from the start: a stop signal during setup waits for the first step
    seed_everything(t.seed)
    strategy = build_strategy(cfg, env)
    train_set, val_set = load_data(cfg, env.local_rank)
    stream = BatchStream(train_set, t.micro_batch_size, t.grad_accum_steps, env.rank, env.world_size, t.seed,
                         num_workers=cfg.data.num_workers, pin_memory=env.device.type == "cuda")
    total_steps = t.max_steps or t.epochs * stream.steps_per_epoch

    def release() -> None:  # on every way out: the loader's workers, the signal handlers, the backend's state
        stream.close()
        guard.close()
        strategy.teardown()

    resume_from = on_main(lambda: resolve_resume(cfg.checkpoint))
    resume_step = read_manifest(resume_from)["step"] if resume_from else 0
    if resume_step >= total_steps:
        log.info(f"nothing to do: {resume_from} is at step {resume_step}, and this run ends at step {total_steps}; "
                 "to train longer, raise train.max_steps (or train.epochs)")
        release()
        return {}
    model, optimizer, _, weights = setup_model(cfg, strategy)
    flops_per_token = model_facts(cfg.model, cfg.strategy.wrap).flops_per_token
    peak = t.peak_flops or peak_flops(env.device, t.precision)  # per device; None: no mfu

    records = RunLog(cfg, run_dir, env.is_main)
    checkpoints = CheckpointManager(cfg.checkpoint, strategy, cfg.strategy.name.value,
                                    description(cfg.model, cfg.data.tokenizer, strategy.module), records,
                                    base_fingerprint=weights.fingerprint)
    step, tokens, notes = 0, 0, []
    early_stop = EarlyStop(cfg.eval.early_stop_patience)
    global_batch = t.micro_batch_size * t.grad_accum_steps * env.world_size
    if resume_from:
        state = checkpoints.load(resume_from)
        notes = resume_notes(state, cfg, global_batch, total_steps, run_dir)
        step, tokens, guard.skipped = state["step"], state.get("tokens", 0), state.get("skipped", 0)
        if state.get("loss_scale"):
            strategy.load_loss_scale_state(state["loss_scale"])
        stream.load_state_dict(state["data"])
        if state.get("early_stop"):
            early_stop.load_state_dict(state["early_stop"])

    log.info(f"{describe(cfg, env, total_steps)}; run dir: {run_dir}")
    if restart_count():
        records.log({"event": "restarted", "restart": restart_count(), "step": step})
        log.info(f"restart {restart_count()}: " + (f"resumed from {resume_from} at step {step}" if resume_from
                                                      else "from the start (no checkpoint)"))
    if resume_from:
        log.info(f"resumed from {resume_from} at step {step}: model, optimizer state, schedule and data position")
        records.log({"event": "resumed", "step": step, "from": str(resume_from)})
        for note in notes:  # rank 0's console, like the other [trainer] lines
            log.info(f"resume: {note}")
    else:
        log.info(f"model: {weights.description}")
    eval_every = cfg.eval.every_steps
    profiler = StepProfiler(t.profile, run_dir, env.rank, env.device)

    def validate() -> float:
        batches = eval_batches(val_set, t.micro_batch_size, env.rank, env.world_size, cfg.eval.max_batches)
        val_loss = evaluate(model, strategy, batches, env.device)
        records.log({"step": step, "split": "val", "loss": val_loss, "ppl": math.exp(min(val_loss, 700))})
        return val_loss

    def save(last: bool = False) -> Path | None:
        return checkpoints.save(step, {"step": step, "epoch": stream.epoch, "skipped": guard.skipped,
                                       "loss_scale": strategy.loss_scale_state(),
                                       "tokens": tokens + int(tokens_since.item()), "data": stream.state_dict(),
                                       # what a resume compares against (resume_notes)
                                       "global_batch": global_batch,
                                       "schedule_steps": cfg.optim.schedule_steps or total_steps,
                                       "run_dir": str(run_dir), "early_stop": early_stop.state_dict(),
                                       # for other formats' optimizer param groups (trainer.convert)
                                       "optim": {"lr": lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                                                 "weight_decay": cfg.optim.weight_decay},
                                       "val_loss": val_loss if evaluated else None},  # for checkpoint.keep_best
                                last=last or step == total_steps)

    def stop(checkpoint: Path | None) -> None:
        name = signal.Signals(guard.stop_signal).name
        records.log({"event": "preempted", "step": step, "signal": name,
                     "checkpoint": str(checkpoint) if checkpoint else None})
        log.info(f"{name}: all ranks stopped after step {step}; " + (
            f"saved {checkpoint}: the same command resumes from it" if checkpoint else
            "nothing saved (" + ("the save failed" if checkpoints.root else "no checkpoint.dir") + ")"))
        progress.close()
        records.stop()
        release()
        raise Stopped(guard.stop_signal, step)

    # A thread lock, not tqdm's default multiprocessing one: only rank 0 draws, and a named
    # semaphore of a rank that leaves with os._exit is reported leaked by the resource tracker.
    tqdm.set_lock(threading.RLock())
    progress = tqdm(total=total_steps, initial=step, disable=not env.is_main, desc="train", dynamic_ncols=True)
    last, val_loss, first_step, evaluated, stopping_early = {}, None, step + 1, False, False
    since, steps_since = time.perf_counter(), 0
    tokens_since = torch.zeros((), dtype=torch.long, device=env.device)  # read at log steps only
    try:  # the bar ends its line before anything else is printed
        while step < total_steps:
            profiler.before(step + 1)
            log_now = (step + 1) % t.log_every == 0 or step + 1 == total_steps
            strategy.track_memory = log_now
            lr = lr_at(step, total_steps, cfg.optim)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [[t.to(env.device, non_blocking=True) for t in batch] for batch in stream.next_step()]
            # The loss is the sum of token losses over the target tokens of the whole step, all
            # micro-batches and ranks. Backends average gradients over ranks, hence x world size.
            targets = strategy.all_reduce(sum(target_count(batch[1]) for batch in micro_batches))
            scale = env.world_size / targets
            loss_sum = torch.zeros((), device=env.device)
            mem = None
            for i, batch in enumerate(micro_batches):
                with strategy.no_sync(i < len(micro_batches) - 1):
                    with strategy.autocast():
                        micro_loss = token_loss_sum(forward(model, batch), batch[1])
                    strategy.backward(micro_loss * scale)
                loss_sum += micro_loss.detach()
                if log_now:  # the bytes held after each backward: gradients peak before they are reduced
                    held = strategy.memory_bytes()
                    mem = held if mem is None or held["grads"] > mem["grads"] else mem
            step += 1
            tokens_since += targets
            # Every rank learns here whether the step is finite everywhere (else no update is made)
            # and whether a stop signal reached any rank.
            grad_norm = strategy.step(
                t.grad_clip, lambda norm, loss=loss_sum: guard.check(torch.isfinite(loss) & torch.isfinite(norm)))
            guard.count(step)
            steps_since += 1
            progress.update()
            profiler.after(step)
            paused = time.perf_counter()
            if t.compile and step == first_step:  # the first step compiles: timed apart, left out of step times
                log.info(f"first step, with torch.compile: {paused - since:.1f} s")
                records.log({"event": "compiled", "step": step, "first_step_s": paused - since})
                since, steps_since = paused, 0
            evaluated = val_set is not None and ((eval_every and step % eval_every == 0) or step == total_steps)
            if evaluated:
                val_loss = validate()
                stopping_early = early_stop.update(step, val_loss)
            since += time.perf_counter() - paused  # step times leave evaluations out
            if log_now:
                mean_loss = (strategy.all_reduce(loss_sum) / targets).item()  # at log steps only
                elapsed = time.perf_counter() - since
                new_tokens = int(tokens_since.item())
                tokens += new_tokens
                tokens_since.zero_()
                tokens_per_s = new_tokens / elapsed if steps_since else None
                last = {"step": step, "epoch": stream.epoch, "loss": mean_loss, "lr": lr,
                        "grad_norm": float(grad_norm), "skipped": guard.skipped, "tokens": tokens,
                        "tokens_per_s": tokens_per_s, "step_time_s": elapsed / steps_since if steps_since else None,
                        "mfu": tokens_per_s * flops_per_token / (peak * env.world_size) if peak and tokens_per_s
                        else None, "mem": mem}
                records.log(last)
                postfix = {"loss": f"{mean_loss:.4f}", "lr": f"{lr:.2e}"}
                if tokens_per_s:
                    postfix["tok/s"] = f"{tokens_per_s:,.0f}"
                if last["mfu"] is not None:
                    postfix["mfu"] = f"{last['mfu']:.1%}"
                if val_loss is not None:
                    postfix["val_loss"] = f"{val_loss:.4f}"
                progress.set_postfix(postfix)
                since, steps_since = time.perf_counter(), 0
            # Recorded before saved: a rank killed during a save leaves the step's record behind
            # (the restart resumes from the checkpoint before and records those steps again).
            paused = time.perf_counter()
            due = checkpoints.due(step, total_steps) or (stopping_early and checkpoints.root is not None)
            saved = save(last=stopping_early) if due else None
            if (evaluated or due) and not guard.stop_signal:  # a signal during them: honoured now
                guard.check_stop()
            if guard.stop_signal and step < total_steps:  # at the last step: the run ends as planned
                stop(saved or (save() if checkpoints.root else None))
            since += time.perf_counter() - paused  # ... and saves
            if stopping_early:
                e = early_stop
                log.info(f"early stop after step {step}: no lower val loss in {e.worse} evaluations "
                         f"(eval.early_stop_patience={e.patience}); the best, {e.best:.4f}, was at step {e.best_step}")
                records.log({"event": "early_stop", "step": step, "best_step": e.best_step, "best_val_loss": e.best})
                break
    finally:
        progress.close()
    strategy.barrier()
    summary = {"step": step, "loss": last.get("loss"), "tokens": tokens,
               **({"val_loss": val_loss} if val_loss is not None else {})}
    records.finish(summary)
    log.info(f"done: {step} steps" + (f", final loss {last['loss']:.4f}" if last else "")
             + (f", val loss {val_loss:.4f}" if val_loss is not None else "") + f"; run dir: {run_dir}")
    release()
    return summary
