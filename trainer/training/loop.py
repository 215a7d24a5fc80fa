"""The training loop. It talks to the Strategy only: no backend import, no isinstance."""
from __future__ import annotations

import math
import signal
import threading
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from trainer.checkpoint.format import TrainerState, read_manifest
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.resume import data_position, resolve_resume, resumed_line
from trainer.checks import check_validation_rows
from trainer.config import Config
from trainer.data import (
    IGNORE_INDEX,
    BatchStream,
    data_fingerprint,
    eval_batches,
    load_data,
    sources_of,
    validation_by_source,
)
from trainer.distributed import DistEnv, all_reduced, on_main, peak_flops, restart_count, seed_everything
from trainer.errors import RunError
from trainer.log import log, setup_logging
from trainer.losses.objectives import NextToken, Objective, record, target_count
from trainer.losses.router_loss import AUX, language_loss, router_logits, start_words, with_router_loss
from trainer.models import description, model_facts
from trainer.models.weights import WeightSource
from trainer.oom import Watch, size
from trainer.saved_bytes import SavedBytes
from trainer.strategies import Strategy, build_strategy
from trainer.training.adapt import adapt
from trainer.training.dpo_reference import build_objective
from trainer.training.faults import StepGuard, Stopped, Verdict
from trainer.training.loggers import RunLog
from trainer.training.report import describe, export_hint
from trainer.training.resume_notes import resume_notes
from trainer.training.schedule import lr_at
from trainer.training.sequence_shares import share
from trainer.training.setup import setup_model
from trainer.training.steps import EarlyStop, StepMeter, StepProfiler


def input_count(targets: torch.Tensor) -> torch.Tensor:
    """The positions the model processed that are not padding: each row up to its last target (a
    row's padding is its tail, which holds no target)."""
    positions = torch.arange(1, targets.shape[-1] + 1, device=targets.device)
    return torch.where(targets != IGNORE_INDEX, positions, 0).amax(dim=-1).sum()


@torch.no_grad()
def evaluate(model: nn.Module, strategy: Strategy, objective: Objective, batches, device: torch.device
             ) -> tuple[float, dict]:
    """The mean loss over the validation batches of all ranks (per target token, or per pair), and
    the means of the objective's statistics."""
    model.eval()
    totals = torch.zeros(2 + len(objective.stats), dtype=torch.float64, device=device)  # loss sum, units, stats
    first = int(strategy.layout.sequence.rank == 0)  # strategy.sp: the units are counted on the whole rows, once a group
    for whole in batches:
        whole = [t.to(device) for t in whole]
        batch, sharded = share(whole, strategy.layout.sequence)
        with sharded, strategy.autocast():
            loss, stats = objective.loss_sum(model, batch)
        # strategy.tp: a tensor group's ranks compute the same rows' loss; its first rank counts it
        totals += torch.cat([loss.double().view(1), objective.count(whole).double().view(1) * first,
                             stats.double()]) * strategy.layout.counts_loss
    model.train()
    all_reduced(totals)
    return (totals[0] / totals[1]).item(), record(objective.stats, totals[2:], totals[1])


def micro_steps(model: nn.Module, strategy: Strategy, micro_batches: list[list[torch.Tensor]], averaged: int,
                track_memory: bool, objective: Objective | None = None, watch: Watch | None = None) -> StepSums:
    """Forward and backward of one optimizer step's micro-batches: the summed loss and statistics
    of this rank, the step's units, target tokens and input tokens of all ranks, and the bytes
    held at the gradients' peak if `track_memory`. `averaged`: the ranks the backend averages
    gradients over (`Degrees.averaged`)."""
    # The loss is the sum of the objective's losses (per target token, or per pair) over the units
    # of the whole step, all micro-batches and ranks. Backends average gradients over ranks, hence
    # x the ranks they average over (the world, less strategy.tp's copies).
    objective = objective or NextToken()
    during = watch.during if watch else lambda where, rows: nullcontext()  # out of memory: recorded, train.on_oom
    # strategy.sp: each rank computes the loss of its own share of the rows' tokens; the group's first
    # rank counts the units and inputs on the whole rows (a pair, or a row's inputs up to its last
    # target, spans the shares)
    whole, (micro_batches, contexts) = micro_batches, zip(*(share(batch, strategy.layout.sequence) for batch in micro_batches))
    first = int(strategy.layout.sequence.rank == 0)
    # strategy.tp: a tensor group's ranks read the same rows and compute the same loss; its first rank counts them
    once = int(strategy.layout.counts_loss)
    units, targets, inputs = all_reduced(torch.stack([
        sum(objective.count(batch) for batch in whole) * first, sum(target_count(batch[1]) for batch in micro_batches),
        sum(input_count(batch[1]) for batch in whole) * first]) * once)
    scale = averaged / units
    loss_sum, mem, activations = torch.zeros((), device=targets.device), None, None
    stats = torch.zeros(len(objective.stats), device=targets.device)
    for i, batch in enumerate(micro_batches):
        # the backward too in the sharded context: activation checkpointing runs the forward again there
        with strategy.micro_step(final=i == len(micro_batches) - 1), contexts[i]:
            # at log steps: the bytes the forward saves for backward (mem.activations), this rank's
            with during("forward", len(batch[0])), strategy.autocast(), \
                    SavedBytes() if track_memory else nullcontext() as saved:
                micro_loss, micro_stats = objective.loss_sum(model, batch)
            if saved is not None:
                saved.kept_by_functions(micro_loss)
                activations = max(activations or 0, saved.bytes)
            with during("backward", len(batch[0])):
                strategy.backward(micro_loss * scale, measure_memory=track_memory)
        loss_sum += micro_loss.detach() * once
        stats += micro_stats * once
        if track_memory:  # the bytes held after each backward: gradients peak before they are reduced
            held = strategy.memory_bytes()
            mem = held if mem is None or held["grads"] > mem["grads"] else mem
    if mem is not None:
        mem = {**mem, "activations": activations}  # the largest of the step's micro-batches
    return StepSums(loss_sum, stats, units, targets, inputs, mem)


@dataclass
class StepSums:
    loss: torch.Tensor  # this rank's summed loss
    stats: torch.Tensor  # this rank's summed statistics of the objective
    units: torch.Tensor  # of all ranks: what the loss is the mean over (target tokens, pairs)
    targets: torch.Tensor  # target tokens of all ranks
    inputs: torch.Tensor  # input tokens of all ranks
    mem: dict | None


class Run:
    """What a training run holds between its steps (model, optimizer, checkpoints, records, the
    step count) and what it does besides stepping: evaluate, log, save, stop. `train` drives it."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path, strategy: Strategy, guard: StepGuard,
                 stream: BatchStream, val_set, total_steps: int, resume_from: Path | None, records: RunLog,
                 watch: Watch):
        t = cfg.train
        if val_set is not None:
            check_validation_rows(cfg, len(val_set))
        self.cfg, self.env, self.run_dir, self.strategy, self.guard = cfg, env, run_dir, strategy, guard
        self.stream, self.val_set, self.total_steps = stream, val_set, total_steps
        self.global_batch = t.micro_batch_size * t.grad_accum_steps * strategy.layout.dp_size
        self.model, self.optimizer, _, weights = setup_model(cfg, strategy)
        routers = router_logits(self.model)  # where the config asks for the router's loss: before any forward
        # Before a checkpoint is loaded: the policy as it starts is the reference (training/dpo_reference.py)
        self.objective = build_objective(cfg, self.model, strategy, stream.sampler.dataset, val_set,
                                         weights.fingerprint)
        self.objective = with_router_loss(self.objective, routers, strategy.layout.sequence)  # where the config asks
        self.stats: dict = {}  # the objective's statistics of the last logged step
        self.records = records
        self.plan, self.watch = watch.plan, watch  # train.on_oom
        self.checkpoints = CheckpointManager(cfg.checkpoint, strategy, cfg.strategy.name.value,
                                             description(cfg.model, cfg.data.tokenizer, strategy.module,
                                                         cfg.data.chat_template),
                                             self.records, base_fingerprint=weights.fingerprint,
                                             collective_timeout_s=cfg.collective_timeout_s)
        self.early_stop = EarlyStop(cfg.eval.early_stop_patience)
        self.saved: Path | None = None  # the newest checkpoint this run wrote: the done line names it
        self.step, self.lr, self.val_loss, self.evaluated, self.last = 0, 0.0, None, False, {}
        state = TrainerState.from_dict(self.checkpoints.load(resume_from)) if resume_from else TrainerState()
        if resume_from:
            self.step, guard.skipped, guard.scale_skips = state.step, state.skipped, state.scale_skips
            if state.loss_scale:
                strategy.precision.load_scale_state(state.loss_scale)
            if position := data_position(state.data, cfg):  # other data start at their beginning
                stream.load_state_dict(position)
            if state.early_stop:
                self.early_stop.load_state_dict(state.early_stop)
        self.facts = model_facts(cfg.model, cfg.strategy.wrap, cfg.peft)  # a model built on meta: once a run
        self.meter = StepMeter(env.device, self.facts.flops_per_token,
                               t.peak_flops or peak_flops(env.device, t.precision), env.world_size,
                               tokens=state.tokens, input_tokens=state.input_tokens)
        self.announce(resume_from, state, weights)

    def announce(self, resume_from: Path | None, state: TrainerState, weights: WeightSource) -> None:
        log.info(f"{describe(self.cfg, self.env, self.strategy, self.total_steps, self.facts)}{start_words(self.objective)}; "
                 f"run dir: {self.run_dir}")
        if sources := sources_of(self.stream.dataset):  # data=mixture: each source
            self.records.log({"event": "sources", "step": self.step, "sources": sources})
        if restart_count():
            self.records.log({"event": "restarted", "restart": restart_count(), "step": self.step})
            log.info(f"restart {restart_count()}: " + (f"resumed from {resume_from} at step {self.step}"
                                                          if resume_from else "from the start (no checkpoint)"))
        if not resume_from:
            log.info(f"model: {weights.description}")
            return
        log.info(resumed_line(resume_from, self.step, read_manifest(resume_from),
                              data_kept=data_position(state.data, self.cfg) is not None))
        self.records.log({"event": "resumed", "step": self.step, "from": str(resume_from)})
        for note in resume_notes(state, self.cfg, self.global_batch, self.total_steps, self.run_dir):
            log.info(f"resume: {note}")  # rank 0's console, like the other [trainer] lines

    def train_step(self, log_now: bool) -> tuple[torch.Tensor | None, torch.Tensor, dict | None]:
        """One optimizer step: (the mean loss over all ranks, the gradient norm, the bytes held at
        the gradients' peak); the loss and the bytes at log steps only (they cost a sync)."""
        self.lr = lr_at(self.step, self.total_steps, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        micro_batches = [[t.to(self.env.device, non_blocking=True) for t in batch] for batch in self.stream.next_step()]
        self.watch.step = self.step + 1
        sums = micro_steps(self.model, self.strategy, micro_batches, self.strategy.layout.degrees.averaged, log_now,
                           self.objective, self.watch)
        loss_sum, mem = sums.loss, sums.mem
        # The norm, then every rank's verdict (a non-finite loss or norm anywhere: no update; and
        # whether a stop signal reached any rank), then the update or the skip.
        with self.watch.during("optimizer step"):  # part-way, some ranks updated: resumed from the checkpoint before
            grad_norm = self.strategy.grad_norm()
            verdict = self.guard.decide(loss_sum, grad_norm, loss_scaled=self.strategy.precision.scale_state() is not None)
            if verdict is Verdict.update:
                self.strategy.apply(self.cfg.train.grad_clip)
            else:
                self.strategy.skip(finite_gradients=bool(torch.isfinite(grad_norm)))
        self.step += 1
        self.guard.count(self.step)
        self.meter.count(sums.targets, sums.inputs)
        if not log_now:
            return None, grad_norm, mem
        totals = all_reduced(torch.cat([loss_sum.view(1), sums.stats]))
        self.stats = record(self.objective.stats, totals[1:], sums.units)
        return totals[0] / sums.units, grad_norm, mem

    def compiled(self) -> None:
        """After the first step under train.compile, which compiles: its time, kept out of step times."""
        first_step_s = self.meter.restart()
        log.info(f"first step, with torch.compile: {first_step_s:.1f} s")
        self.records.log({"event": "compiled", "step": self.step, "first_step_s": first_step_s})

    def validate(self) -> bool:
        """Evaluate where due (eval.every_steps, and the last step); whether to stop early after it."""
        every = self.cfg.eval.every_steps
        self.evaluated = self.val_set is not None and bool((every and self.step % every == 0)
                                                           or self.step == self.total_steps)
        if not self.evaluated:
            return False
        rows = self.cfg.eval.micro_batch_size or self.cfg.train.micro_batch_size
        batches = eval_batches(self.val_set, rows, self.strategy.layout.dp_rank, self.strategy.layout.dp_size, self.cfg.eval.max_batches)
        with self.watch.during("evaluation", rows):
            self.val_loss, stats = evaluate(self.model, self.strategy, self.objective.evaluation("val"), batches,
                                            self.env.device)
            source_losses = self.source_losses(rows)
        # a perplexity where the loss is per token (objective=lm; of the token loss alone), the objective's statistics
        per_token = not set(stats) - {AUX}
        ppl = {"ppl": math.exp(min(language_loss(self.objective, self.val_loss, stats), 700))} if per_token else {}
        self.records.log({"step": self.step, "split": "val", "loss": self.val_loss, **ppl, **stats, **source_losses})
        return self.early_stop.update(self.step, self.val_loss)

    def source_losses(self, micro_batch_size: int) -> dict:
        """data=mixture: the val loss of each source's held-out rows apart, as `loss/<name>`, and
        those blended by the sources' fractions of the training draws (`blended_loss`)."""
        losses = {name: evaluate(self.model, self.strategy, self.objective.evaluation("val"),
                                 eval_batches(rows, micro_batch_size, self.strategy.layout.dp_rank, self.strategy.layout.dp_size,
                                              self.cfg.eval.max_batches), self.env.device)[0]
                  for name, rows in validation_by_source(self.val_set).items()}
        if not losses:
            return {}
        return {**{f"loss/{name}": loss for name, loss in losses.items()}, "blended_loss": self.val_set.blended(losses)}

    def log_line(self, mean_loss: torch.Tensor, grad_norm, mem: dict | None) -> dict:
        """Record the step's numbers; what the progress bar shows of them."""
        self.last = {"step": self.step, "epoch": self.stream.epoch, "loss": mean_loss.item(), "lr": self.lr,
                     "grad_norm": float(grad_norm), "skipped": self.guard.skipped, **self.meter.read(), "mem": mem,
                     **self.stats}
        if (scaler := self.strategy.precision.scale_state()) is not None:  # fp16: the scaler's own skips, apart
            self.last.update(scale_skips=self.guard.scale_skips, loss_scale=scaler["scale"])
        self.last.update(self.stream.counts())  # data=mixture: samples_by_source, tokens_by_source
        self.records.log(self.last)
        shown = {"loss": f"{self.last['loss']:.4f}", "lr": f"{self.lr:.2e}"}
        if self.last["tokens_per_s"]:
            shown["tok/s"] = f"{self.last['tokens_per_s']:,.0f}"
        if self.last["mfu"] is not None:
            shown["mfu"] = f"{self.last['mfu']:.1%}"
        if self.val_loss is not None:
            shown["val_loss"] = f"{self.val_loss:.4f}"
        return shown

    def save(self, last: bool = False, wait: bool = False) -> Path | None:
        """The step saved (checkpoint.async: being saved; `wait`, or `last`: saved by the return)."""
        o = self.cfg.optim
        state = TrainerState(
            step=self.step, epoch=self.stream.epoch, skipped=self.guard.skipped, scale_skips=self.guard.scale_skips,
            loss_scale=self.strategy.precision.scale_state(), **self.meter.totals(),
            data={**self.stream.state_dict(), "fingerprint": data_fingerprint(self.cfg)},
            global_batch=self.global_batch, schedule_steps=o.schedule_steps or self.total_steps,
            run_dir=str(self.run_dir), early_stop=self.early_stop.state_dict(),
            optim={"lr": self.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
            val_loss=self.val_loss if self.evaluated else None,
            plan=asdict(self.plan) if self.plan.adaptations else None)
        saved = self.checkpoints.save(self.step, state.to_dict(), last=last or self.step == self.total_steps,
                                      wait=wait)
        self.saved = saved or self.saved
        return saved

    def stop(self, saved: Path | None) -> None:
        """After a stop signal: saved (if not yet, and there is a checkpoint.dir), recorded, raised."""
        checkpoint = (saved and self.checkpoints.wait()) or (self.save(wait=True) if self.checkpoints.root else None)
        name = signal.Signals(self.guard.stop_signal).name
        self.records.log({"event": "preempted", "step": self.step, "signal": name,
                          "checkpoint": str(checkpoint) if checkpoint else None})
        log.info(f"{name}: all ranks stopped after step {self.step}; " + (
            f"saved {checkpoint}: the same command resumes from it" if checkpoint else
            "nothing saved (" + ("the save failed" if self.checkpoints.root else "no checkpoint.dir") + ")"))
        raise Stopped(self.guard.stop_signal, self.step)

    def leave(self, kind, error, traceback) -> None:
        """On every way out, before the strategy is torn down: checkpoint.async's save in flight
        waited for where every rank leaves the same way (the end, a stop, a RunError); not where this
        rank alone fails (its peers may be gone): its step dir is then never published."""
        self.checkpoints.close(wait=error is None or isinstance(error, (RunError, Stopped)))

    def stop_early(self) -> None:
        e = self.early_stop
        log.info(f"early stop after step {self.step}: no lower val loss in {e.worse} evaluations "
                 f"(eval.early_stop_patience={e.patience}); the best, {e.best:.4f}, was at step {e.best_step}")
        self.records.log({"event": "early_stop", "step": self.step, "best_step": e.best_step,
                          "best_val_loss": e.best})

    def finish(self) -> dict:
        summary = {"step": self.step, "loss": self.last.get("loss"), "tokens": self.meter.tokens,
                   **({"val_loss": self.val_loss} if self.val_loss is not None else {})}
        self.records.finish(summary)
        log.info(f"done: {self.step} steps" + (f", final loss {self.last['loss']:.4f}" if self.last else "")
                 + (f", val loss {self.val_loss:.4f}" if self.val_loss is not None else "")
                 + (f"; saved {self.saved} ({export_hint(self.cfg)})" if self.saved else "")
                 + f"; run dir: {self.run_dir}")
        return summary


def train(cfg: Config, env: DistEnv, run_dir: Path) -> dict:
    """One run on this rank: set up, resume, step to the end (or a stop signal, or an early stop)."""
    setup_logging(run_dir, env.is_main, cfg.log_level.value)
    # On every way out, released once: the loggers, the loader's workers, the backend's state, the signal handlers.
    with ExitStack() as cleanup:
        guard = StepGuard(cfg.train.max_bad_steps)  # from the start: a stop signal during setup waits for the first step
        cleanup.callback(guard.close)
        resume_from = on_main(lambda: resolve_resume(cfg.checkpoint))
        # train.on_oom: the plan after the out-of-memory failures recorded in the run dir
        kept = read_manifest(resume_from)["trainer"].get("plan") if resume_from else None
        plan, adapted = on_main(lambda: adapt(cfg, run_dir, kept, env.world_size))
        cfg = plan.applied(cfg)
        t = cfg.train
        seed_everything(t.seed)
        strategy = build_strategy(cfg, env)
        cleanup.callback(strategy.teardown)
        train_set, val_set = load_data(cfg, env.local_rank)
        # the data's ranks: a sequence-parallel group reads the same samples
        stream = BatchStream(train_set, t.micro_batch_size, t.grad_accum_steps, strategy.layout.dp_rank, strategy.layout.dp_size, t.seed,
                             num_workers=cfg.data.num_workers, pin_memory=env.device.type == "cuda")
        cleanup.callback(stream.close)
        total_steps = t.max_steps or stream.steps_for(t.epochs)
        if resume_from and (at := read_manifest(resume_from)["step"]) >= total_steps:
            log.info(f"nothing to do: {resume_from} is at step {at}, and this run ends at step {total_steps}; "
                     "to train longer, raise train.max_steps (or train.epochs)")
            return {}
        records = cleanup.enter_context(RunLog(cfg, run_dir, env.is_main))  # closed with the run's status
        for event in adapted:
            records.log(event)
            log.info(f"adapted after out of memory: {event['what']} ({event['why']}, asking for "
                     f"{size(event['asked'])} with {size(event['free'])} free)"
                     + "".join(f"; skipped {line}" for line in event["skipped"]))
        watch = Watch(plan, env.rank, env.device, held=strategy.memory_bytes)  # train.on_oom, from set-up on
        with watch.during("setup"):  # the model built and sharded, its weights, the optimizer, the checkpoint
            run = Run(cfg, env, run_dir, strategy, guard, stream, val_set, total_steps, resume_from, records, watch)
        cleanup.push(run.leave)
        profiler, first_step = StepProfiler(t.profile, run_dir, env.rank, env.device), run.step + 1
        # A thread lock, not tqdm's default multiprocessing one: only rank 0 draws, and a named
        # semaphore of a rank that leaves with os._exit is reported leaked by the resource tracker.
        tqdm.set_lock(threading.RLock())
        with tqdm(total=total_steps, initial=run.step, disable=not env.is_main, desc="train",
                  dynamic_ncols=True) as progress:  # the bar ends its line before anything else is printed
            while run.step < total_steps:
                profiler.before(run.step + 1)
                log_now = (run.step + 1) % t.log_every == 0 or run.step + 1 == total_steps
                mean_loss, grad_norm, mem = run.train_step(log_now)
                progress.update()
                profiler.after(run.step)
                if t.compile and run.step == first_step:  # the first step compiles: timed apart
                    run.compiled()
                with run.meter.paused():  # step times leave evaluations out
                    stopping_early = run.validate()
                if log_now:
                    progress.set_postfix(run.log_line(mean_loss, grad_norm, mem))
                # Recorded before saved: a rank killed during a save leaves the step's record behind
                # (the restart resumes from the checkpoint before and records those steps again).
                with run.meter.paused():  # ... and saves
                    due = run.checkpoints.due(run.step, total_steps) or (
                        stopping_early and run.checkpoints.root is not None)
                    saved = run.save(last=stopping_early) if due else None
                    if (run.evaluated or due) and not guard.stop_signal:  # a signal during them: honoured now
                        guard.check_stop()
                    if guard.stop_signal and run.step < total_steps:  # at the last step: the run ends as planned
                        run.stop(saved)
                if stopping_early:
                    run.stop_early()
                    break
        dist.barrier()
        return run.finish()
