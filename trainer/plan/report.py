"""`python -m trainer.plan [overrides]`: the plan as a table (or `plan.json=true`: JSON only), with
the same configs as the trainer. `plan.run_dir=DIR` of a run that ran out of memory (train.on_oom):
what failed there, and the plan at the one it adapted to."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer.config import Config
from trainer.errors import ConfigError
from trainer.oom import RECORDS, Adaptation, read_oom_records, what_failed
from trainer.plan.cost import GB, Plan, make_plan, memory_budget


def format_plan(plan: Plan) -> str:
    unit, size = ("GB", GB) if plan.gpu_memory_bytes >= GB else ("MB", 1e6)
    trainable = f" ({plan.trainable:,} trainable)" if plan.trainable < plan.params else ""
    lines = [f"{plan.params:,} parameters{trainable}, world size {plan.world_size}, {plan.gpu_memory_bytes / size:.1f} {unit} "
             f"per GPU{f' ({plan.memory_source})' if plan.memory_source else ''}, {plan.precision}"
             f"{' with fp32 master weights' if plan.master_weights else ', no fp32 master weights'}; {unit} per GPU:",
             f"  {'strategy':<8}{'ep':>4}{'tp':>4}{'AC':>4}{'offload':>9}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}"
             f"{'total':>9}{'host':>9}{'comm':>9}{'step s':>9}{'max seq':>10}  fits"]
    # one format for the whole column: seconds to the millisecond, or in exponent form for tiny models
    step_format = ".3f" if max((o.step_s for o in plan.options), default=0) >= 0.01 else ".2e"
    for o in plan.options:
        g = {k: v / size for k, v in o.per_gpu_bytes.items()}
        lines.append(f"  {o.name:<8}{o.ep:>4}{o.tp:>4}{'yes' if o.activation_checkpointing else '-':>4}{'yes' if o.offload else '-':>9}"
                     f"{g['params']:>9.2f}{g['grads']:>9.2f}{g['optim']:>9.2f}{g['activations']:>9.2f}"
                     f"{g['total']:>9.2f}{o.host_bytes / size:>9.2f}{sum(o.comm_bytes.values()) / size:>9.2f}"
                     f"{o.step_s:>9{step_format}}{o.longest_seq_len:>10}  {'yes' if o.fits else 'no':<3}"
                     + ("  <- chosen" if o.chosen else ""))
    if not plan.choice:
        lines.append("  nothing fits: more GPUs, a smaller micro batch, or a smaller model")
    lines.append(f"  ep: strategy.ep; tp: strategy.tp (chosen only where nothing without it fits; strategy=auto "
                 "tries the fused loss and strategy.sp first); comm: collective payload per step (offload copies, "
                 "strategy.sp's all-to-alls, the hidden vectors strategy.ep's all-to-alls send to other ranks and "
                 "strategy.tp's all-reduces included); step s: estimated at "
                 f"{plan.flops_per_s:.3g} FLOP/s, {plan.link_gbps:g} Gbit/s links, {plan.pcie_gbps:g} Gbit/s PCIe, "
                 "without overlap; chosen: the fastest per row trained that fits, the first of those within 1 %; "
                 "max seq: the longest model.seq_len whose activations fit beside the rest")
    return "\n".join(lines + long_context_lines(plan))


def long_context_lines(plan: Plan) -> list[str]:
    """The activations per token, and the longest seq_len per sp, fused loss and checkpointing."""
    a = plan.activations
    if a is None:
        return []
    lines = [f"activations (counted on the meta device): {a.per_token_per_layer / 1e3:,.1f} kB per token per layer, "
             f"{a.per_token / 1e3:,.1f} kB per token in all, of which the output layer and loss "
             f"{a.logits_per_token / 1e3:,.1f} kB" + (f" + {a.constant / 1e6:,.1f} MB a micro-batch" if a.constant >= 1e5 else "")
             + (f"; {a.per_token_squared:,.1f} B per token squared" if a.per_token_squared else ""),
             f"longest model.seq_len that fits, on {plan.room_for} (per rank: seq_len / sp tokens of each row):",
             f"  {'sp':>4}  {'fused_loss':<11}{'AC':<5}{'max seq':>10}"]
    lines += [f"  {sp:>4}  {'on' if fused else 'off':<11}{'on' if ac else 'off':<5}{longest:>10}"
              for sp, fused, ac, longest in plan.long_context]
    return lines


def plan_as_json(plan: Plan) -> dict:
    """The plan as the table gives it: the budget line (memory per GPU and where it came from,
    precision, master weights, the rates the step times assume), the options, the long context."""
    return {"params": plan.params, "trainable": plan.trainable, "world_size": plan.world_size,
            "gpu_memory_bytes": plan.gpu_memory_bytes, "memory_source": plan.memory_source,
            "precision": plan.precision, "master_weights": plan.master_weights,
            "flops_per_s": plan.flops_per_s, "link_gbps": plan.link_gbps, "pcie_gbps": plan.pcie_gbps,
            "options": [{"name": o.name, "ep": o.ep, "tp": o.tp, "activation_checkpointing": o.activation_checkpointing,
                         "offload": o.offload,
                         "per_gpu_bytes": o.per_gpu_bytes, "host_bytes": o.host_bytes, "comm_bytes": o.comm_bytes,
                         "step_s": o.step_s, "fits": o.fits, "chosen": o.chosen,
                         "longest_seq_len": o.longest_seq_len} for o in plan.options],
            "long_context": [{"sp": sp, "fused_loss": fused, "activation_checkpointing": ac, "longest_seq_len": n}
                             for sp, fused, ac, n in plan.long_context]}


def after_out_of_memory(cfg: Config, run_dir: Path) -> tuple[Config, list[str]]:
    """plan.run_dir: the run's out-of-memory failures, one line each, and cfg at the plan the run
    adapted to (the last of its oom.jsonl), which the table then shows."""
    records = read_oom_records(run_dir)
    if not records:
        raise ConfigError(f"plan.run_dir: {run_dir} has no {RECORDS}: that run never ran out of memory")
    lines = [f"{run_dir}: {what_failed(r)}" for r in records if r["event"] == "out_of_memory"]
    if adapted := [r for r in records if r["event"] == "adapted"]:
        plan = Adaptation(**adapted[-1]["plan"])
        cfg = plan.applied(cfg)
        t, s = cfg.train, cfg.strategy
        strategy = (f" strategy={s.name.value} strategy.sp={s.sp} strategy.offload_optimizer="
                    f"{str(s.offload_optimizer).lower()} strategy.offload_params={str(s.offload_params).lower()}"
                    if plan.strategy else "")
        lines.append(f"it adapted to train.micro_batch_size={t.micro_batch_size} train.grad_accum_steps="
                     f"{t.grad_accum_steps} train.activation_checkpointing={str(t.activation_checkpointing).lower()} "
                     f"eval.micro_batch_size={cfg.eval.micro_batch_size}{strategy}: planned below at that plan")
    return cfg, lines


def main(argv: list[str] | None = None) -> None:
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from trainer.checks import check_overrides
    from trainer.config import CONFIG_MODULE, register_configs, to_config
    from trainer.errors import RunError
    from trainer.hub import resolve_names
    from trainer.log import refuse
    from trainer.models import resolve_model

    overrides = sys.argv[1:] if argv is None else argv
    register_configs()
    try:
        check_overrides(overrides)
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            composed = compose(config_name="config", overrides=overrides)
        resolve_names(composed, data_too=False)  # model.path=org/name: its config from the HF cache (trainer/hub.py)
        cfg = to_config(composed)
        world = cfg.plan.world_size or int(os.environ.get("WORLD_SIZE", cfg.nproc))
        cfg.model = resolve_model(cfg.model)
        cfg, out_of_memory = after_out_of_memory(cfg, Path(cfg.plan.run_dir)) if cfg.plan.run_dir else (cfg, [])
        plan = make_plan(cfg, world, *memory_budget(cfg))
    except (RunError, HydraException, OmegaConfBaseException) as e:  # the trainer's one-line errors
        refuse(e, "trainer.plan")
    if cfg.plan.json:
        print(json.dumps({**plan_as_json(plan), "out_of_memory": out_of_memory}, indent=1))
    else:
        print("\n".join([*out_of_memory, format_plan(plan)]))

