"""The memory planner: `python -m trainer.plan`, `strategy=auto` and out-of-memory's strategy fallbacks.

- cost.py: what each option holds per GPU and moves per step, the fastest that fits (`make_plan`);
- activations.py: the activation bytes of a micro-batch, traced on the meta device;
- tensor.py: what strategy.tp splits, keeps and all-reduces, read from the model's plan on the meta device;
- auto.py: `strategy=auto` (`resolve_auto`) and train.on_oom's strategy fallbacks (`strategy_fallbacks`);
- report.py: the table, its JSON and the command (`main`).
"""
from trainer.plan.auto import plan_for_the_sequence, resolve_auto, strategy_fallbacks
from trainer.plan.cost import (
    Option,
    Plan,
    activation_need,
    count_params,
    make_plan,
    memory_budget,
    sequence_parallel_sizes,
    step_traffic,
)
from trainer.plan.report import main

__all__ = ["Option", "Plan", "activation_need", "count_params", "main", "make_plan", "memory_budget",
           "plan_for_the_sequence", "resolve_auto", "sequence_parallel_sizes", "step_traffic", "strategy_fallbacks"]
