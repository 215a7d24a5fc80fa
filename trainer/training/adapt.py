"""train.on_oom=adapt at a restart: the plan this start runs, from the out-of-memory records in the
run dir (oom.py: the records and the ladder down to micro-batch 1, activation checkpointing
and the fused loss). Past those, the strategy fallbacks: the next option of the planner's decision order
that it says fits with the failure's bytes (trainer/plan/auto.py: strategy_fallbacks), whose settings pass the
checks a user's command gets (checks.check_settings); a fallback they refuse is skipped, and said why.
The portable checkpoint resumes under the new strategy as under any other.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from trainer.checks import check_settings
from trainer.config import Config
from trainer.errors import RunError
from trainer.oom import Adaptation, adapted_plan, append, changes, read_oom_records, value, what_failed, when
from trainer.plan.auto import strategy_fallbacks


def first_strategy_fallback(plan: Adaptation, failure: dict, cfg: Config,
                            world_size: int) -> tuple[Adaptation | None, str, list[str]]:
    """The plan at the first strategy fallback after `plan` that fits and passes the checks, and why it
    fits (None where none does); each fallback refused by the checks, with the check's reason."""
    missing = None if failure["asked"] is None else failure["asked"] - (failure["free"] or 0)
    here, skipped = plan.applied(cfg), []
    for settings, why in strategy_fallbacks(here, world_size, missing):
        # a larger sp leaves fewer data-parallel ranks: more accumulation keeps the global batch
        accumulation, rest = divmod(plan.grad_accum_steps * settings["sp"], here.strategy.sp)
        if rest:
            skipped.append(f"strategy.sp={settings['sp']} refused: train.grad_accum_steps={plan.grad_accum_steps} "
                           f"x {settings['sp']} / {here.strategy.sp} is not whole (the global batch would change)")
            continue
        fallback = replace(plan, strategy=settings, grad_accum_steps=accumulation, adaptations=plan.adaptations + 1)
        try:
            check_settings(fallback.applied(cfg), world_size)
        except RunError as refused:
            taken = " ".join(f"{key}={value(after)}" for key, _, after in changes(here, fallback.applied(cfg)))
            skipped.append(f"{taken} refused: {refused}")
            continue
        return fallback, why, skipped
    return None, "", skipped


def adapt(cfg: Config, run_dir: Path, kept: dict | None, world_size: int) -> tuple[Adaptation, list[dict]]:
    """The plan this start runs: the settings', or the one kept in the checkpoint it resumes from,
    or the latest adapted in this run dir, whichever is furthest; then one step down the ladder for
    each failure since. The `adapted` events of the steps taken now (each appended to oom.jsonl
    too). Run on one rank (it reads and writes the run dir); a failure with nothing left to adapt,
    or past train.max_adaptations, is a RunError."""
    records = read_oom_records(run_dir)
    plan = Adaptation.of(cfg)
    last_adapted = max((i for i, r in enumerate(records) if r["event"] == "adapted"), default=-1)
    for candidate in [kept, records[last_adapted]["plan"] if last_adapted >= 0 else None]:
        if candidate and Adaptation(**candidate).past(plan, cfg.strategy.sp):
            plan = Adaptation(**candidate)
    events = []
    for failure in records[last_adapted + 1:]:
        if Adaptation(**failure["plan"]) != plan:  # another rank's record of the same failure, or an older plan's
            continue
        adapted, fits, skipped = adapted_plan(plan, failure, cfg), "", []
        if adapted is None and failure["where"] != "evaluation":
            adapted, fits, skipped = first_strategy_fallback(plan, failure, cfg, world_size)
        if adapted is None or adapted.adaptations > cfg.train.max_adaptations:
            left = ("nothing is left to adapt" + "".join(f"; {line}" for line in skipped)) if adapted is None else \
                f"train.max_adaptations={cfg.train.max_adaptations} are used up"
            raise RunError(f"{what_failed(failure)}; {left}: python -m trainer.plan for a strategy that fits")
        what = ", ".join(f"{key} {value(before)} -> {value(after)}"
                         for key, before, after in changes(plan.applied(cfg), adapted.applied(cfg)))
        plan = adapted
        events.append({"event": "adapted", "step": failure["step"], "what": what,
                       "why": f"rank {failure['rank']} ran out of memory {when(failure)}" + (f"; {fits}" if fits else ""),
                       "asked": failure["asked"], "free": failure["free"], "skipped": skipped, "plan": asdict(plan)})
    for event in events:
        append(run_dir, event)
    return plan, events
