"""`strategy=auto` (the plan's choice set in the run's config) and train.on_oom's strategy fallbacks (the
options after a run's own that hold the bytes it was short less): the planner deciding for a run."""
from __future__ import annotations

import dataclasses

from trainer.config import Config, StrategyName
from trainer.models.checks import fusable
from trainer.oom import format_bytes
from trainer.plan.cost import GB, Option, Plan, make_plan, memory_budget, offload_settings, sequence_parallel_sizes
from trainer.plan.report import format_plan


def resolve_auto(cfg, world_size: int) -> None:
    """strategy=auto: plan against this run's world size (plan.world_size when given) and device,
    then set the choice in `cfg` (a DictConfig) so that everything downstream sees a concrete
    strategy. The line that says the choice names every setting it replaced."""
    from trainer.config import to_config
    from trainer.errors import ConfigError
    from trainer.log import log

    typed = to_config(cfg)
    planned_world = typed.plan.world_size or world_size
    plan = make_plan(typed, planned_world, *memory_budget(typed))
    log.info(f"strategy=auto:\n{format_plan(plan)}")
    long_context = {}
    # the sequence does not fit without strategy.tp: the fused loss, then sequence parallelism, where they make it
    # fit (the fused loss moves nothing; sp divides every activation, tp only its layers' inner ones); else tp
    if not plan.choice or plan.choice.tp > 1:
        plan, long_context = plan_for_the_sequence(typed, planned_world, plan)
    if not plan.choice:
        raise ConfigError(f"strategy=auto: no strategy fits {plan.gpu_memory_bytes / GB:.3g} GB per device "
                          f"({plan.memory_source})")
    chosen = {("train", "activation_checkpointing"): plan.choice.activation_checkpointing,
              **{("strategy", key): on for key, on in offload_settings(StrategyName(plan.choice.name), plan.choice.offload).items()},
              ("strategy", "ep"): plan.choice.ep, ("strategy", "tp"): plan.choice.tp, **long_context}
    replaced = []
    for (group, key), value in chosen.items():
        if cfg[group][key] != value:
            replaced.append(f"{group}.{key}={str(value).lower()} (was {str(cfg[group][key]).lower()})")
        cfg[group][key] = value
    cfg.strategy.name = plan.choice.name
    if planned_world != world_size:
        replaced.append(f"planned for plan.world_size={planned_world}, this run has {world_size} rank"
                        f"{'s' if world_size > 1 else ''}")
    log.info(f"strategy=auto chose {plan.choice.name}{f' ep={plan.choice.ep}' if plan.choice.ep > 1 else ''}"
             f"{f' tp={plan.choice.tp}' if plan.choice.tp > 1 else ''}"
             f"{' + activation checkpointing' if plan.choice.activation_checkpointing else ''}"
             f"{' + CPU offload' if plan.choice.offload else ''}" + (f"; {'; '.join(replaced)}" if replaced else ""))


def own_option(plan: Plan, cfg: Config) -> Option | None:
    """The option of `plan` that cfg runs: its strategy, strategy.ep and strategy.tp, activation
    checkpointing and offload; None where the planner has none (a setting the trainer refuses: strategy.ep with
    LoRA, fsdp's offload at strategy.tp, ...)."""
    s = cfg.strategy
    return next((o for o in plan.options if o.name == StrategyName(s.name).value and o.ep == s.ep and o.tp == s.tp
                 and o.activation_checkpointing == cfg.train.activation_checkpointing
                 and o.offload == (s.offload_optimizer or s.offload_params)), None)


def strategy_fallbacks(cfg: Config, world_size: int, missing: int | None) -> list[tuple[dict, str]]:
    """train.on_oom's strategy fallbacks for cfg, which ran out of memory `missing` bytes short (the
    bytes asked less those free, measured; None: unknown): in the decision order, strategy.sp where
    the world and the heads divide (not at strategy.tp > 1), then the options after cfg's own (the later
    stages, then CPU offload), each with activation checkpointing and cfg's strategy.ep and strategy.tp;
    those the planner says fit: holding at least the
    missing bytes (at least one) less per device than cfg's own option, as it counts them. Each as
    the strategy settings it takes ({"name", "sp", "offload_optimizer", "offload_params"}) and why."""
    budget = memory_budget(cfg)
    here = make_plan(cfg, world_size, *budget)
    own = own_option(here, cfg)
    if own is None:  # not planned: no count to hold less than (the micro-batch still halves)
        return []
    limit = own.per_gpu_bytes["total"] - max(missing or 0, 1)
    s = cfg.strategy
    settings = {"name": StrategyName(s.name).value, "sp": s.sp, "offload_optimizer": s.offload_optimizer,
                "offload_params": s.offload_params}
    candidates = []
    for sp in sequence_parallel_sizes(cfg, world_size) if s.tp == 1 else []:  # sp and tp do not cross
        if sp > s.sp:
            trial = dataclasses.replace(cfg, strategy=dataclasses.replace(s, sp=sp))
            candidates.append(({**settings, "sp": sp}, own_option(make_plan(trial, world_size, *budget), trial)))
    candidates += [({**settings, "name": o.name, **offload_settings(StrategyName(o.name), o.offload)}, o)
                   for o in here.options[here.options.index(own) + 1:]
                   if o.activation_checkpointing and o.ep == s.ep and o.tp == s.tp]
    # the run's own strategy with activation checkpointing (a set-up out of memory comes before that
    # fallback) is no change of strategy
    candidates = [(fallback, option) for fallback, option in candidates if fallback != settings]
    return [(fallback, f"the planner counts {format_bytes(option.per_gpu_bytes['total'])} per device there "
                       f"against {format_bytes(own.per_gpu_bytes['total'])} at {own.name}, which was "
                       f"{format_bytes(missing)} short")
            for fallback, option in candidates if option.per_gpu_bytes["total"] <= limit]


def plan_for_the_sequence(typed: Config, world_size: int, plan: Plan) -> tuple[Plan, dict]:
    """strategy=auto when nothing fits: the first of train.fused_loss=true, then strategy.sp=2, 3, 4, ...
    (each with and without the fused loss) whose plan has a choice; the settings it takes."""
    for sp in sequence_parallel_sizes(typed, world_size):
        for fused in (False, True) if fusable(typed) else (False,):
            if (sp, fused) == (typed.strategy.sp, typed.train.fused_loss) or sp < typed.strategy.sp or (
                    typed.train.fused_loss and not fused):
                continue
            trial = dataclasses.replace(typed, strategy=dataclasses.replace(typed.strategy, sp=sp),
                                        train=dataclasses.replace(typed.train, fused_loss=fused))
            found = make_plan(trial, world_size, plan.gpu_memory_bytes, plan.memory_source)
            if found.choice:
                return found, {("strategy", "sp"): sp, ("train", "fused_loss"): fused}
    return plan, {}
