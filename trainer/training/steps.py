"""What the loop keeps about its steps besides the model: their tokens, time and mfu (`StepMeter`),
a profile of some of them (`StepProfiler`), and when to stop early (`EarlyStop`)."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from trainer.config import profile_steps
from trainer.log import log


class StepMeter:
    """Tokens, time and mfu of the steps since the last log line. Two counts: target tokens (the
    loss's denominator) and input tokens (what the model processed: each row up to its last target,
    its padding left out), which the rate and mfu are of. Evaluations and saves are left out of
    the time, and so is the first, compiling step, with its tokens (`restart`). Counts are summed
    on the device and read at log lines only (a read waits for the device)."""

    def __init__(self, device: torch.device, flops_per_token: int, peak_flops: float | None, world_size: int,
                 tokens: int = 0, input_tokens: int = 0):
        self.tokens, self.input_tokens = tokens, input_tokens  # up to the last log line
        self.pending = torch.zeros(2, dtype=torch.long, device=device)  # targets, inputs since then
        self.untimed = torch.zeros_like(self.pending)  # of those, counted before the last restart
        self.flops_per_token, self.peak = flops_per_token, peak_flops * world_size if peak_flops else None
        self.since, self.steps = time.perf_counter(), 0

    def restart(self) -> float:
        """Start timing anew: the steps counted so far are left out of the next rate; the seconds
        since the last start."""
        now = time.perf_counter()
        elapsed, self.since, self.steps = now - self.since, now, 0
        self.untimed.copy_(self.pending)
        return elapsed

    def count(self, targets: torch.Tensor, inputs: torch.Tensor) -> None:
        self.pending[0] += targets
        self.pending[1] += inputs
        self.steps += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.since += time.perf_counter() - start

    def totals(self) -> dict:
        """The cumulative counts, for a checkpoint: {"tokens", "input_tokens"}."""
        targets, inputs = self.pending.tolist()
        return {"tokens": self.tokens + targets, "input_tokens": self.input_tokens + inputs}

    def read(self) -> dict:
        """The numbers of a log line ({"tokens", "input_tokens", "tokens_per_s", "step_time_s",
        "mfu"}); timing starts anew."""
        (targets, inputs), (_, timed_inputs) = torch.stack([self.pending, self.pending - self.untimed]).tolist()
        steps, elapsed = self.steps, self.restart()
        self.tokens += targets
        self.input_tokens += inputs
        self.pending.zero_()
        self.untimed.zero_()
        per_s = timed_inputs / elapsed if steps else None
        return {"tokens": self.tokens, "input_tokens": self.input_tokens, "tokens_per_s": per_s,
                "step_time_s": elapsed / steps if steps else None,
                "mfu": per_s * self.flops_per_token / self.peak if self.peak and per_s else None}


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
    validation loss (0: never). A NaN val loss counts neither way. Its state goes into checkpoints,
    so a resume counts on."""

    def __init__(self, patience: int):
        self.patience, self.best, self.best_step, self.worse = patience, math.inf, 0, 0

    def update(self, step: int, val_loss: float) -> bool:
        """Whether to stop after this evaluation (the same on every rank: the loss is all-reduced)."""
        if math.isnan(val_loss):
            return False
        if val_loss < self.best:
            self.best, self.best_step, self.worse = val_loss, step, 0
        else:
            self.worse += 1
        return 0 < self.patience <= self.worse

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "worse": self.worse}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.worse = state["best"], state["best_step"], state["worse"]
