"""train.on_oom (docs/design.md, Out of memory): a rank that runs out of memory records what failed in the run dir's
oom.jsonl and leaves, and the job stops as it does for a dead rank; the restart (max_restarts,
torchrun's, a SLURM requeue) reads the records and adapts the plan before it resumes from the
newest checkpoint. The ladder: the micro-batch halved and the accumulation doubled (the global
batch, the loss's normalisation and so the losses stay those of the planned run), then, at
micro-batch 1, activation checkpointing, then the fused loss where the run takes it, then the
strategy fallbacks that the planner chooses with the failure's bytes (training/adapt.py). An evaluation
out of memory halves the evaluation's micro-batch only. The plan in force is kept in each
checkpoint (TrainerState.plan).

oom.jsonl holds two kinds of lines: `out_of_memory` (a rank's failure, with the plan it ran) and
`adapted` (the plan a restart took from them), so that every start finds the same plan and says
each adaptation once.
"""
from __future__ import annotations

import json
import os
import re
import resource
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Callable

import torch

from trainer.config import Config, OnOom, StrategyName
from trainer.models.checks import fusable

RECORDS = "oom.jsonl"
# For tests only: "rank=R,rows=N[,bytes=B][,where=forward|backward|evaluation][,from_step=S]" makes
# rank R raise torch.OutOfMemoryError in every forward (or backward, evaluation) of N rows or more
# (default 1), from step S on (default: forward, step 1); with bytes=B only while the rank keeps
# more than B bytes from step to step, parameters and optimizer state (its strategy's `memory_bytes`;
# gradients come and go within a step): a device of B bytes, full, that asks for the excess.
TEST_SWITCH = "TRAINER_TEST_OOM"
# The allocators' words for the bytes asked: CUDA's "Tried to allocate 2.00 GiB", the host's
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes"; CUDA's for
# what was free then: "of which 1.50 GiB is free".
ASKED = re.compile(r"tried to allocate ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
FREE = re.compile(r"of which ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB) is free", re.IGNORECASE)
UNITS = {"bytes": 1, "B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's (and the test switch's) OutOfMemoryError, or the host allocator's failure, which torch
    raises as a plain RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error))


def said_bytes(words: re.Pattern, message: str) -> int | None:
    match = words.search(message)
    return round(float(match.group(1)) * UNITS[match.group(2)]) if match else None


def asked_bytes(message: str) -> int | None:
    return said_bytes(ASKED, message)


def free_bytes(device: torch.device) -> int | None:
    """What was left: the device's free memory; on the host, what the kernel has available, and no
    more than the address space left under a `ulimit -v` / `prlimit --as` limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    except OSError:  # not Linux
        return None
    available = int(info["MemAvailable"].split()[0]) * 1024
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return available
    return max(0, min(available, limit - int(status["VmSize"].split()[0]) * 1024))


def format_bytes(n: int | None) -> str:
    """Bytes as the console says them: `2.00 GiB` from 1 GiB up, `512.0 MiB` below; None: `unknown bytes`."""
    return "unknown bytes" if n is None else f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


@dataclass(frozen=True)
class Adaptation:
    """The adaptation record: the settings out-of-memory restarts adapt (kept in oom.jsonl and in the
    checkpoint's trainer state), and how often they did. The planner's plan is trainer.plan's Plan."""
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: bool
    eval_micro_batch_size: int
    adaptations: int = 0
    fused_loss: bool = False
    # a strategy fallback's {"name", "sp", "offload_optimizer", "offload_params"}; None: the settings'
    strategy: dict | None = None

    @classmethod
    def of(cls, cfg: Config) -> Adaptation:
        t = cfg.train
        return cls(t.micro_batch_size, t.grad_accum_steps, t.activation_checkpointing,
                   cfg.eval.micro_batch_size or t.micro_batch_size, fused_loss=t.fused_loss)

    def rows(self, sp: int) -> float:
        """Rows of a step per rank of the world: a sequence-parallel group of `sp` ranks (the settings'
        strategy.sp, where no strategy fallback says another) reads the same rows."""
        return self.micro_batch_size * self.grad_accum_steps / (self.strategy or {}).get("sp", sp)

    def past(self, other: Adaptation, sp: int) -> bool:
        """Whether this plan has taken, from `other` of the same global batch, at least its steps (sp:
        the settings' strategy.sp)."""
        return self.rows(sp) == other.rows(sp) and self.eval_micro_batch_size <= other.eval_micro_batch_size and (
            self.micro_batch_size < other.micro_batch_size or (self.micro_batch_size == other.micro_batch_size and
                                                               self.fallbacks_taken() >= other.fallbacks_taken()))

    def fallbacks_taken(self) -> tuple[bool, bool, int]:
        """Which fallbacks past micro-batch 1 the plan took: how far down the ladder (activation
        checkpointing, the fused loss, then the strategy fallbacks, counted by the adaptations that took them)."""
        return self.activation_checkpointing, self.fused_loss, self.adaptations if self.strategy else -1

    def applied(self, cfg: Config) -> Config:
        """cfg under this plan; eval.max_batches counts the same rows at the evaluation's micro-batch."""
        first_eval = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
        if self.strategy:
            cfg = replace(cfg, strategy=replace(cfg.strategy, **{**self.strategy,
                                                                 "name": StrategyName(self.strategy["name"])}))
        return replace(cfg, train=replace(cfg.train, micro_batch_size=self.micro_batch_size,
                                          grad_accum_steps=self.grad_accum_steps,
                                          activation_checkpointing=self.activation_checkpointing,
                                          fused_loss=self.fused_loss),
                       eval=replace(cfg.eval, micro_batch_size=self.eval_micro_batch_size,
                                    max_batches=cfg.eval.max_batches * first_eval // self.eval_micro_batch_size))


def smaller(rows: int) -> int:
    """The largest divisor of rows up to its half: the global batch stays whole (6 -> 3, 3 -> 1)."""
    return max(d for d in range(1, rows // 2 + 1) if rows % d == 0)


def next_plan(plan: Adaptation, failure: dict, can_fuse: bool = False) -> Adaptation | None:
    """The plan after `plan` ran out of memory as `failure` says; None where nothing is left to adapt.
    can_fuse: whether the model takes the fused loss (logits that are its output layer's own)."""
    step = {"adaptations": plan.adaptations + 1}
    if failure["where"] == "setup":  # the model, its shards or the optimizer: no batch was drawn yet
        return None
    if failure["where"] == "evaluation":
        rows = plan.eval_micro_batch_size
        return replace(plan, eval_micro_batch_size=smaller(rows), **step) if rows > 1 else None
    rows = plan.micro_batch_size
    if rows > 1:
        return replace(plan, micro_batch_size=smaller(rows),
                       grad_accum_steps=plan.grad_accum_steps * rows // smaller(rows), **step)
    if not plan.activation_checkpointing:
        return replace(plan, activation_checkpointing=True, **step)
    if can_fuse and not plan.fused_loss:  # no [tokens, vocab] logits held (models/fused_loss.py)
        return replace(plan, fused_loss=True, **step)
    return None


SETTINGS = ("train.micro_batch_size", "train.grad_accum_steps", "train.activation_checkpointing", "train.fused_loss",
            "eval.micro_batch_size", "strategy.name", "strategy.sp", "strategy.offload_optimizer",
            "strategy.offload_params")


def setting(cfg: Config, key: str) -> object:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def changes(before: Config, after: Config) -> list[tuple[str, object, object]]:
    """(setting, before, after) of each setting a plan adapts that differs (strategy.name said as `strategy`)."""
    return [(key.removesuffix(".name"), setting(before, key), setting(after, key)) for key in SETTINGS
            if setting(before, key) != setting(after, key)]


def value(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else v.value if isinstance(v, Enum) else str(v)


class OutOfMemory(Exception):
    """This rank ran out of memory. Not a RunError: only this rank knows, its peers wait in a
    collective; it records the failure, says it and leaves (`leave_out_of_memory`)."""

    def __init__(self, failure: dict):
        super().__init__(failure["error"])
        self.failure = failure


@dataclass
class OomRecorder:
    """Records this rank's out-of-memory failures: where the rank is (the step, the plan, what runs),
    and `record_oom_in(where)`, inside which an out-of-memory is raised as OutOfMemory with that record."""
    plan: Adaptation
    rank: int
    device: torch.device
    step: int = 0
    where: str = "setup"
    held: Callable[[], dict] | None = None  # the strategy's memory_bytes, for the test switch's bytes=B

    @contextmanager
    def record_oom_in(self, where: str, rows: int = 0):
        """Inside: an out-of-memory raised as OutOfMemory, with what failed."""
        before, self.where = self.where, where
        try:
            self._test_switch(rows)
            yield
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            free = said_bytes(FREE, str(error))  # what was free at the failure, where CUDA says it
            raise OutOfMemory({"event": "out_of_memory", "step": self.step, "where": where, "rank": self.rank,
                               "rows": rows, "asked": asked_bytes(str(error)),
                               "free": free_bytes(self.device) if free is None else free,
                               "plan": asdict(self.plan), "error": str(error).splitlines()[0][:300]}) from error
        self.where = before

    def _test_switch(self, rows: int) -> None:
        if not (switch := os.environ.get(TEST_SWITCH)):
            return
        fault = {"where": "forward", "from_step": "1", "rows": "1", **dict(pair.split("=") for pair in switch.split(","))}
        if not (int(fault["rank"]) == self.rank and rows >= int(fault["rows"]) and self.where == fault["where"]
                and self.step >= int(fault["from_step"])):
            return
        if "bytes" not in fault:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} MiB ({TEST_SWITCH}={switch})")
        held = sum(self.held()[key] for key in ("params", "optim"))
        if held > int(fault["bytes"]):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {held - int(fault['bytes'])} bytes. "
                                         f"The device, of which 0 bytes is free, holds {held} ({TEST_SWITCH}={switch})")


def when(failure: dict) -> str:
    """Where a rank ran out of memory: `in the forward of step 3`, `during set-up`."""
    return "during set-up" if failure["where"] == "setup" else f"in the {failure['where']} of step {failure['step']}"


def what_failed(failure: dict) -> str:
    """Which rank ran out of memory, where, at which micro-batch, asking for how much."""
    plan, where = Adaptation(**failure["plan"]), failure["where"]
    rows = f"eval.micro_batch_size={plan.eval_micro_batch_size}" if where == "evaluation" else \
        f"train.micro_batch_size={plan.micro_batch_size}"
    return (f"rank {failure['rank']} ran out of memory {when(failure)} at {rows}: it asked "
            f"for {format_bytes(failure['asked'])} with {format_bytes(failure['free'])} free")


def adapted_plan(plan: Adaptation, failure: dict, cfg: Config) -> Adaptation | None:
    """next_plan for this run: whether it takes the fused loss is asked only where the ladder reaches it."""
    fused_loss_is_next = (failure["where"] != "evaluation" and plan.micro_batch_size == 1
                          and plan.activation_checkpointing and not plan.fused_loss)
    return next_plan(plan, failure, can_fuse=fused_loss_is_next and fusable(cfg))


def adaptation_left(failure: dict, cfg: Config) -> bool:
    """Whether a restart may adapt after `failure`: train.on_oom=adapt, and train.max_adaptations not
    used up by the plan that failed. The rank's line, the trainer's own launcher (which restarts the
    ranks for it) and the restart (training/adapt.py) all go by it."""
    return cfg.train.on_oom is OnOom.adapt and Adaptation(**failure["plan"]).adaptations < cfg.train.max_adaptations


def failure_line(failure: dict, cfg: Config, restart: bool) -> str:
    """The one line of a rank out of memory: what failed, and what the restart changes (restart:
    whether one comes for it) or what to change."""
    plan = Adaptation(**failure["plan"])
    adapted = adapted_plan(plan, failure, cfg)
    if adapted is None and cfg.train.on_oom is OnOom.adapt and failure["where"] != "evaluation":
        change = "the next strategy that the planner says fits"
    elif adapted is None:
        change = "python -m trainer.plan for a strategy that fits"
    else:
        change = " ".join(f"{key}={value(after)}" for key, _, after in changes(plan.applied(cfg), adapted.applied(cfg)))
    if cfg.train.on_oom is OnOom.fail:
        same = "" if adapted is None else " (the same global batch and losses)"
        return f"{what_failed(failure)}; try {change}{same}, or train.on_oom=adapt"
    if not adaptation_left(failure, cfg):
        return (f"{what_failed(failure)}; train.max_adaptations={cfg.train.max_adaptations} are used up: python -m "
                "trainer.plan for a strategy that fits")
    if restart:
        return f"{what_failed(failure)}; recorded in the run dir's {RECORDS}: the restart adapts ({change})"
    return (f"{what_failed(failure)}; no restart left to adapt ({change}): give the launcher restarts (torchrun "
            "--max-restarts N), or start the ranks with nproc=N, which restarts them to adapt, or change it yourself")


def read_oom_records(run_dir: Path) -> list[dict]:
    path = run_dir / RECORDS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def append(run_dir: Path, record: dict) -> None:
    """One line, flushed to disk: the rank leaves right after."""
    with open(run_dir / RECORDS, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


