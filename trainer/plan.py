"""`python -m trainer.plan [overrides]`: what each memory strategy costs per GPU and per step,
and the fastest that fits (options in the decision order DDP -> activation checkpointing ->
ZeRO-1/2 -> FSDP2 / ZeRO-3 -> CPU offload, which breaks ties). Same configs as the trainer;
`plan.json=true` prints JSON only. `plan.run_dir=DIR` of a run that ran out of memory
(train.on_oom): what failed there, and the plan at the one it adapted to.

The parameter count comes from the real model built on the meta device. Bytes per parameter
follow trainer/memory.py (what our backends keep; `plan.master_weights=false` for pure bf16).
FSDP2 and ZeRO-3 both shard everything, but FSDP2's sharded fp32 parameters are its master
weights, while DeepSpeed keeps an fp32 master partition beside parameters in the training dtype:
FSDP2 never holds more (fp32: 16 against 20 bytes per parameter; bf16: 16 each), so it comes
first; ZeRO-3 follows, and with offload moves the parameters and optimizer state while FSDP2
moves its gradients too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.config import Config, GradReduce, ObjectiveName, PeftName, Precision, ReduceDtype, StrategyName
from trainer.errors import ConfigError
from trainer.memory import DTYPE_BYTES, SHARDED, peak_gradient_bytes, per_rank_bytes, reduce_bytes
from trainer.oom import RECORDS, read_records, size, what_failed
from trainer.oom import Plan as RunPlan
from trainer.plan_activations import ActivationCount, planned
from trainer.strategies.ds_config import ZERO3_PERSISTENCE_THRESHOLD

if TYPE_CHECKING:
    from trainer.models import ModelFacts

GB = 1e9
STAGES = (StrategyName.ddp, StrategyName.zero1, StrategyName.zero2, StrategyName.fsdp, StrategyName.zero3)
# What CPU offload moves to host memory, per strategy (DDP cannot offload).
OFFLOADED = {StrategyName.zero1: ("optim",), StrategyName.zero2: ("optim",),
             StrategyName.fsdp: ("params", "grads", "optim"), StrategyName.zero3: ("params", "optim")}
# The strategies that take strategy.ep > 1 (models/experts.py: ddp and zero3 refuse it)
EXPERT_PARALLEL = (StrategyName.zero1, StrategyName.zero2, StrategyName.fsdp)


@dataclass
class Option:
    name: str
    activation_checkpointing: bool
    offload: bool
    per_gpu_bytes: dict[str, int]
    host_bytes: int
    comm_bytes: dict[str, int] = field(default_factory=dict)  # payload per optimizer step (`step_traffic`)
    step_s: float = 0.0  # estimated: compute + communication + offload copies, not overlapped
    fits: bool = False
    chosen: bool = False
    longest_seq_len: int = 0  # the longest model.seq_len whose activations fit beside the rest (0: none)
    ep: int = 1  # strategy.ep: ranks that split each MoE layer's experts


@dataclass
class Plan:
    params: int
    trainable: int  # all but frozen parameters (LoRA: the adapters)
    world_size: int
    gpu_memory_bytes: int
    precision: str
    master_weights: bool
    flops_per_s: float
    link_gbps: float
    pcie_gbps: float
    options: list[Option] = field(default_factory=list)
    memory_source: str = ""  # where gpu_memory_bytes came from (memory_budget)
    activations: ActivationCount | None = None  # per micro-batch, without checkpointing, as configured
    # the longest seq_len per (sp, fused_loss, activation checkpointing), on the strategy of `room_for`
    long_context: list[tuple[int, bool, bool, int]] = field(default_factory=list)
    room_for: str = ""

    @property
    def choice(self) -> Option | None:
        return next((o for o in self.options if o.chosen), None)


def count_params(cfg: Config) -> int:
    from trainer.models import model_facts

    return model_facts(cfg.model, cfg.strategy.wrap).params


def step_traffic(strategy: StrategyName, n_params: int, small_params: int, world_size: int, precision: Precision,
                 grad_accum_steps: int, grad_reduce: GradReduce, offload: bool,
                 reduce_dtype: ReduceDtype = ReduceDtype.fp32, frozen_params: int = 0) -> dict[str, int]:
    """Payload bytes of the collectives one rank joins per optimizer step (a tensor's full size per
    all-reduce, reduce-scatter or all-gather), and bytes copied between host and device for
    offload, as our backends do it (measured on gloo in tests/test_see_and_speed.py):
    - DDP all-reduces gradients; FSDP2 all-gathers parameters in the training dtype for
      forward and backward of every micro-step and reduce-scatters gradients;
    - DeepSpeed ZeRO-1/2 all-reduce gradients and all-gather updated parameters once a step;
      ZeRO-3 reduce-scatters gradients and all-gathers parameters per forward and backward,
      except those below its persistence threshold, gathered once a step;
    - gradients travel in the reduce dtype (`strategy.reduce_dtype`: fp32 by default).
    grad_reduce=micro_step reduces every micro-step (ZeRO-1: still once, at the boundary).
    `n_params` train; `frozen_params` (LoRA's base) have no gradients and are never updated, but
    FSDP2 and ZeRO-3 gather them for forward and backward too."""
    total = n_params + frozen_params
    if world_size == 1:
        return {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "host": 0}
    train_bytes, grad_bytes = DTYPE_BYTES[precision], reduce_bytes(precision, reduce_dtype)
    reductions = grad_accum_steps if GradReduce(grad_reduce) is GradReduce.micro_step else 1
    traffic = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "host": 0}
    if strategy is StrategyName.ddp:
        traffic["all_reduce"] = grad_bytes * n_params * reductions
    elif strategy in (StrategyName.zero1, StrategyName.zero2):
        traffic["all_reduce"] = grad_bytes * n_params * (reductions if strategy is StrategyName.zero2 else 1)
        traffic["all_gather"] = train_bytes * n_params
        traffic["host"] = (4 + train_bytes) * n_params // world_size if offload else 0
    elif strategy is StrategyName.fsdp:
        traffic["all_gather"] = train_bytes * total * 2 * grad_accum_steps
        traffic["reduce_scatter"] = grad_bytes * n_params * reductions
        traffic["host"] = 4 * total // world_size * (2 * grad_accum_steps + reductions) if offload else 0
    else:  # zero3
        gathered = total - small_params
        traffic["all_gather"] = train_bytes * (gathered * 2 * grad_accum_steps + small_params)
        traffic["reduce_scatter"] = grad_bytes * n_params * reductions
        traffic["host"] = (4 * n_params + train_bytes * total * 2 * grad_accum_steps) // world_size if offload else 0
    return traffic


def sequence_traffic(count: ActivationCount, row_len: int, rows: int, checkpointing: bool) -> int:
    """Payload bytes of the sequence group's all-to-alls (strategy.sp > 1) per optimizer step, for
    `rows` rows of `row_len` tokens: the forward's, counted on the meta device (grouped-query key/value
    heads as few as models/sequence.py sends them), as much again for their gradients in backward,
    and once more with activation checkpointing (the forward runs again in backward)."""
    passes = 3 if checkpointing else 2
    return int(count.exchanged_per_token * row_len / count.sp * rows * passes)


def expert_traffic(tokens: int, facts: ModelFacts, ep: int, precision: Precision, checkpointing: bool) -> int:
    """Bytes of hidden vectors that leave this rank for the others of its expert group per optimizer step
    (strategy.ep, models/experts.py's dispatch), for `tokens` tokens: at every MoE layer each (token,
    expert) pair's vector (d_model elements in the training dtype) goes to its expert's rank, another
    with probability (ep - 1) / ep where routing is even, and comes back: two all-to-alls in forward,
    their gradients' two in backward, and the forward's two again with activation checkpointing."""
    passes = 6 if checkpointing else 4
    return tokens * facts.routed_per_token * facts.d_model * DTYPE_BYTES[precision] * passes * (ep - 1) // ep


def step_seconds(traffic: list[tuple[dict[str, int], int]], compute_flops: float, cfg: Config) -> float:
    """Compute at plan.flops_per_s, collectives over plan.link_gbps, offload copies over plan.pcie_gbps;
    no overlap assumed, so an upper bound. Each traffic comes with the ranks its collectives join (the
    world; strategy.ep's experts: the world / ep ranks that hold the same ones): rings, where an
    all-reduce moves 2 (N-1)/N of its payload per rank, the others (N-1)/N; an all-to-all within a
    sequence group of sp ranks (sp-1)/sp; the experts' all-to-all is counted as what leaves the rank."""
    sp = cfg.strategy.sp
    moved = host = 0.0
    for part, ranks in traffic:
        ring = (ranks - 1) / ranks
        moved += 2 * ring * part["all_reduce"] + ring * (part["reduce_scatter"] + part["all_gather"]) \
            + (sp - 1) / sp * part.get("all_to_all", 0) + part.get("expert_all_to_all", 0)
        host += part["host"]
    return (compute_flops / cfg.plan.flops_per_s + moved * 8 / (cfg.plan.link_gbps * 1e9)
            + host * 8 / (cfg.plan.pcie_gbps * 1e9))


def expert_parallel_sizes(facts: ModelFacts, world_size: int) -> list[int]:
    """strategy.ep values above 1 this world and model allow: every size dividing the world and the
    experts a layer has (none for a model without routed experts that ep can split)."""
    return [n for n in range(2, world_size + 1) if world_size % n == 0 and facts.experts % n == 0] \
        if facts.expert_params else []


def held_bytes(stage: StrategyName, n_params: int, ranks: int, cfg: Config) -> dict[str, int]:
    """Bytes per rank of `n_params` trainable parameters held by `stage` over `ranks` ranks, gradients
    at their peak (trainer/memory.py)."""
    t, precision = cfg.train, Precision(cfg.train.precision)
    held = per_rank_bytes(stage, n_params, ranks, precision, master_weights=cfg.plan.master_weights,
                          reduce_dtype=cfg.strategy.reduce_dtype)
    held["grads"] = peak_gradient_bytes(stage, held["grads"], n_params, t.grad_accum_steps, cfg.strategy.grad_reduce,
                                        precision)
    return held


def decision_order(expert_sizes: list[int]):
    """(offload, strategy, strategy.ep, activation checkpointing) of each option in the decision order:
    cheaper in speed first, each ep size after the same strategy without it; offload last of all
    (without ep: what it moves and ep's groups were not tried together)."""
    for offload in (False, True):
        for stage in STAGES:
            if offload and stage not in OFFLOADED:
                continue
            for ep in (1, *expert_sizes) if stage in EXPERT_PARALLEL and not offload else (1,):
                for checkpointing in (False, True):
                    yield offload, stage, ep, checkpointing


def make_plan(cfg: Config, world_size: int, gpu_memory_bytes: int, memory_source: str = "",
              n_params: int | None = None) -> Plan:
    from trainer.models import model_facts

    m, t = cfg.model, cfg.train
    precision = Precision(t.precision)
    facts = model_facts(m, cfg.strategy.wrap, cfg.peft)  # built on the meta device
    n_params = facts.params if n_params is None else n_params
    # Frozen parameters (LoRA's base) are held in the training dtype, with no gradients and no
    # optimizer state; the per-parameter bytes of trainer/memory.py apply to the trainable ones.
    frozen = facts.params - facts.trainable if n_params == facts.params else 0
    trainable = n_params - frozen
    plan = Plan(n_params, trainable, world_size, gpu_memory_bytes, precision.value, cfg.plan.master_weights,
                cfg.plan.flops_per_s, cfg.plan.link_gbps, cfg.plan.pcie_gbps, memory_source=memory_source)
    # objective=dpo: a row holds a pair's two sequences (2 x seq_len wide); full fine-tuning without
    # precompute_ref holds a frozen copy of the model, its parameters in the training dtype (ddp: fp32), sharded
    # where the policy's are (LoRA's reference is the base with the adapters off: nothing more; with
    # peft.init, the starting adapter: the adapters' parameters again, whole on every rank)
    dpo = ObjectiveName(cfg.objective.name) is ObjectiveName.dpo
    row_len = m.seq_len * (2 if dpo else 1)
    reference = n_params if dpo and not cfg.objective.precompute_ref and PeftName(cfg.peft.name) is PeftName.none else 0
    starting_adapter = trainable if dpo and not cfg.objective.precompute_ref and PeftName(cfg.peft.name) is PeftName.lora \
        and cfg.peft.init else 0
    # strategy.sp: a rank computes 1 / sp of each row (its tokens, and attention for 1 / sp of the heads)
    tokens_per_rank = t.micro_batch_size * t.grad_accum_steps * row_len // cfg.strategy.sp
    # strategy.ep (fsdp, zero1/2, without offload or LoRA): ep ranks split each MoE layer's experts
    expert_sizes = expert_parallel_sizes(facts, world_size) if PeftName(cfg.peft.name) is PeftName.none else []
    for offload, stage, ep, checkpointing in decision_order(expert_sizes):
        # strategy.ep: a rank holds 1 / ep of the experts, held as a model of their own by the
        # world / ep ranks that hold the same ones (FSDP2 shards them there, ZeRO-1/2 partition their
        # optimizer state and ZeRO-2 their gradients there); every other parameter over the world
        experts = facts.expert_params if ep > 1 else 0
        held = held_bytes(stage, trainable - experts, world_size, cfg)
        if experts:
            held = {k: v + held_bytes(stage, experts // ep, world_size // ep, cfg)[k] for k, v in held.items()}
        # ddp's copy is fp32, as the policy's parameters (Strategy.frozen_dtype)
        copy_bytes = 4 if stage is StrategyName.ddp else DTYPE_BYTES[precision]
        held["params"] += (DTYPE_BYTES[precision] * frozen + copy_bytes * reference) // (
            world_size if "params" in SHARDED[stage] else 1) + DTYPE_BYTES[precision] * starting_adapter
        moved = OFFLOADED[stage] if offload else ()
        gpu = {k: 0 if k in moved else v for k, v in held.items()}
        need = activation_need(cfg, checkpointing, t.fused_loss, cfg.strategy.sp)
        gpu["activations"] = need.bytes(row_len, t.micro_batch_size)
        gpu["total"] = sum(gpu.values())
        whole = min(facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), n_params)  # ZeRO-3 keeps these whole
        traffic = step_traffic(stage, trainable - experts, whole, world_size, precision, t.grad_accum_steps,
                               cfg.strategy.grad_reduce, offload, cfg.strategy.reduce_dtype, frozen)
        traffic["all_to_all"] = sequence_traffic(need, row_len, t.micro_batch_size * t.grad_accum_steps,
                                                 checkpointing)
        # strategy.ep: the experts' own collectives among the ranks that hold the same ones, and
        # the tokens' all-to-alls in place of gathering the other ranks' experts
        expert_collectives = step_traffic(stage, experts // ep, 0, world_size // ep, precision,
                                          t.grad_accum_steps, cfg.strategy.grad_reduce, offload,
                                          cfg.strategy.reduce_dtype)
        traffic["expert_all_to_all"] = expert_traffic(tokens_per_rank, facts, ep, precision, checkpointing)
        # with activation checkpointing, every block's forward runs twice: 8 instead of 6 FLOPs
        flops = facts.flops_per_token * tokens_per_rank * (8 / 6 if checkpointing else 1)
        comm = {k: v + expert_collectives.get(k, 0) for k, v in traffic.items()}
        option = Option(stage.value, checkpointing, offload, gpu, sum(held[k] for k in moved), comm,
                        step_seconds([(traffic, world_size), (expert_collectives, world_size // ep)], flops, cfg),
                        ep=ep)
        option.fits = gpu["total"] <= gpu_memory_bytes
        option.longest_seq_len = need.longest(gpu_memory_bytes - gpu["total"] + gpu["activations"],
                                              t.micro_batch_size) // (2 if dpo else 1)
        plan.options.append(option)
    # The fastest that fits; within 1 % of it, the decision order (the options' order) decides.
    fitting = [o for o in plan.options if o.fits]
    if fitting:
        fastest = min(o.step_s for o in fitting)
        next(o for o in fitting if o.step_s <= fastest * 1.01).chosen = True
    plan.activations = planned(cfg, False, t.fused_loss)
    plan_long_context(plan, cfg, world_size, 2 if dpo else 1)
    return plan


def activation_need(cfg: Config, checkpointing: bool, fused_loss: bool, sp: int = 1) -> ActivationCount:
    """The activation bytes an option needs per rank (trainer/plan_activations.py counts them on the
    meta device) at the peak of backward: those kept for backward, and beside them the larger of the
    output layer's and loss's gradients (at backward's start) and, with checkpointing, one block's
    activations, recomputed in backward (later, when the former are gone)."""
    kept = planned(cfg, checkpointing, fused_loss, sp)
    recomputed = planned(cfg, False, fused_loss, sp).per_token_per_layer if checkpointing else 0.0
    return dataclasses.replace(kept, per_token=kept.per_token + max(recomputed, kept.output_backward_per_token))


def sequence_parallel_sizes(cfg: Config, world_size: int) -> list[int]:
    """strategy.sp values this world and model allow: every size dividing the world, the attention
    heads and model.seq_len (6 heads on 6 ranks: 1, 2, 3 and 6 where seq_len divides by 3)."""
    from trainer.models import meta_model

    model = meta_model(cfg.model, cfg.peft)
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None) or getattr(
        getattr(model, "shape", None), "n_heads", None)
    if heads is None:  # a custom model: its own attention, sp=1 planned
        return [1]
    return [n for n in range(1, world_size + 1) if world_size % n == 0 and heads % n == 0 and cfg.model.seq_len % n == 0]


def plan_long_context(plan: Plan, cfg: Config, world_size: int, rows_per_sequence: int) -> None:
    """The longest seq_len per sp, fused loss and checkpointing, on the chosen option's strategy and
    offload (nothing chosen: the one that leaves activations the most room)."""
    base = plan.choice or min(plan.options, key=lambda o: o.per_gpu_bytes["total"] - o.per_gpu_bytes["activations"])
    rest = base.per_gpu_bytes["total"] - base.per_gpu_bytes["activations"]
    plan.room_for = f"{base.name}{' + CPU offload' if base.offload else ''}"
    t = cfg.train
    for sp in sequence_parallel_sizes(cfg, world_size):
        for fused in (False, True):
            for checkpointing in (False, True):
                need = activation_need(cfg, checkpointing, fused, sp)
                longest = need.longest(plan.gpu_memory_bytes - rest, t.micro_batch_size) // rows_per_sequence
                plan.long_context.append((sp, fused, checkpointing, longest))


def format_plan(plan: Plan) -> str:
    unit, size = ("GB", GB) if plan.gpu_memory_bytes >= GB else ("MB", 1e6)
    trainable = f" ({plan.trainable:,} trainable)" if plan.trainable < plan.params else ""
    lines = [f"{plan.params:,} parameters{trainable}, world size {plan.world_size}, {plan.gpu_memory_bytes / size:.1f} {unit} "
             f"per GPU{f' ({plan.memory_source})' if plan.memory_source else ''}, {plan.precision}"
             f"{' with fp32 master weights' if plan.master_weights else ', no fp32 master weights'}; {unit} per GPU:",
             f"  {'strategy':<8}{'ep':>4}{'AC':>4}{'offload':>9}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}"
             f"{'total':>9}{'host':>9}{'comm':>9}{'step s':>9}{'max seq':>10}  fits"]
    # one format for the whole column: seconds to the millisecond, or in exponent form for tiny models
    step_format = ".3f" if max((o.step_s for o in plan.options), default=0) >= 0.01 else ".2e"
    for o in plan.options:
        g = {k: v / size for k, v in o.per_gpu_bytes.items()}
        lines.append(f"  {o.name:<8}{o.ep:>4}{'yes' if o.activation_checkpointing else '-':>4}{'yes' if o.offload else '-':>9}"
                     f"{g['params']:>9.2f}{g['grads']:>9.2f}{g['optim']:>9.2f}{g['activations']:>9.2f}"
                     f"{g['total']:>9.2f}{o.host_bytes / size:>9.2f}{sum(o.comm_bytes.values()) / size:>9.2f}"
                     f"{o.step_s:>9{step_format}}{o.longest_seq_len:>10}  {'yes' if o.fits else 'no':<3}"
                     + ("  <- chosen" if o.chosen else ""))
    if not plan.choice:
        lines.append("  nothing fits: more GPUs, a smaller micro batch, or a smaller model")
    lines.append(f"  ep: strategy.ep; comm: collective payload per step (offload copies, strategy.sp's all-to-alls and "
                 "the hidden vectors strategy.ep's all-to-alls send to other ranks included); step s: estimated at "
                 f"{plan.flops_per_s:.3g} FLOP/s, {plan.link_gbps:g} Gbit/s links, {plan.pcie_gbps:g} Gbit/s PCIe, "
                 "without overlap; chosen: the fastest that fits, the first of those within 1 %; "
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
            "options": [{"name": o.name, "ep": o.ep, "activation_checkpointing": o.activation_checkpointing,
                         "offload": o.offload,
                         "per_gpu_bytes": o.per_gpu_bytes, "host_bytes": o.host_bytes, "comm_bytes": o.comm_bytes,
                         "step_s": o.step_s, "fits": o.fits, "chosen": o.chosen,
                         "longest_seq_len": o.longest_seq_len} for o in plan.options],
            "long_context": [{"sp": sp, "fused_loss": fused, "activation_checkpointing": ac, "longest_seq_len": n}
                             for sp, fused, ac, n in plan.long_context]}


DEFAULT_GPU_MEMORY_GB = 80.0  # the budget where neither plan.gpu_memory_gb nor a GPU says one


def memory_budget(cfg: Config) -> tuple[int, str]:
    """The memory per device to plan for, and where it came from: plan.gpu_memory_gb when given
    (planning for other cards than the local one), else the local GPU's, else 80 GB."""
    from trainer.distributed import device_type

    if cfg.plan.gpu_memory_gb is not None:
        return int(cfg.plan.gpu_memory_gb * GB), "plan.gpu_memory_gb"
    if device_type() == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, f"the local GPU, {torch.cuda.get_device_name(0)}"
    return int(DEFAULT_GPU_MEMORY_GB * GB), "the default: no local GPU and no plan.gpu_memory_gb"


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
    if not plan.choice:  # the sequence does not fit: the fused loss, then sequence parallelism, where they make it fit
        plan, long_context = plan_for_the_sequence(typed, planned_world, plan)
    if not plan.choice:
        raise ConfigError(f"strategy=auto: no strategy fits {plan.gpu_memory_bytes / GB:.3g} GB per device "
                          f"({plan.memory_source})")
    chosen = {("train", "activation_checkpointing"): plan.choice.activation_checkpointing,
              **{("strategy", key): on for key, on in offload_settings(plan.choice).items()},
              ("strategy", "ep"): plan.choice.ep, **long_context}
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
             f"{' + activation checkpointing' if plan.choice.activation_checkpointing else ''}"
             f"{' + CPU offload' if plan.choice.offload else ''}" + (f"; {'; '.join(replaced)}" if replaced else ""))


def offload_settings(option: Option) -> dict[str, bool]:
    """strategy.offload_optimizer and strategy.offload_params of an option (OFFLOADED: what it moves)."""
    return {"offload_optimizer": option.offload,
            "offload_params": option.offload and "params" in OFFLOADED[StrategyName(option.name)]}


def own_option(plan: Plan, cfg: Config) -> Option:
    """The option of `plan` that cfg runs: its strategy, strategy.ep, activation checkpointing and offload."""
    s = cfg.strategy
    return next(o for o in plan.options if o.name == StrategyName(s.name).value and o.ep == s.ep
                and o.activation_checkpointing == cfg.train.activation_checkpointing
                and o.offload == (s.offload_optimizer or s.offload_params))


def strategy_rungs(cfg: Config, world_size: int, missing: int | None) -> list[tuple[dict, str]]:
    """train.on_oom's strategy rungs for cfg, which ran out of memory `missing` bytes short (the
    bytes asked less those free, measured; None: unknown): in the decision order, strategy.sp where
    the world and the heads divide, then the options after cfg's own (the later stages, then CPU
    offload), each with activation checkpointing and cfg's strategy.ep; those the planner says fit: holding at least the
    missing bytes (at least one) less per device than cfg's own option, as it counts them. Each as
    the strategy settings it takes ({"name", "sp", "offload_optimizer", "offload_params"}) and why."""
    budget = memory_budget(cfg)
    here = make_plan(cfg, world_size, *budget)
    own = own_option(here, cfg)
    limit = own.per_gpu_bytes["total"] - max(missing or 0, 1)
    s = cfg.strategy
    settings = {"name": StrategyName(s.name).value, "sp": s.sp, "offload_optimizer": s.offload_optimizer,
                "offload_params": s.offload_params}
    candidates = []
    for sp in sequence_parallel_sizes(cfg, world_size):
        if sp > s.sp:
            trial = dataclasses.replace(cfg, strategy=dataclasses.replace(s, sp=sp))
            candidates.append(({**settings, "sp": sp}, own_option(make_plan(trial, world_size, *budget), trial)))
    candidates += [({**settings, "name": o.name, **offload_settings(o)}, o)
                   for o in here.options[here.options.index(own) + 1:] if o.activation_checkpointing and o.ep == s.ep]
    # the run's own strategy with activation checkpointing (a set-up out of memory comes before that
    # rung) is no change of strategy
    candidates = [(rung, option) for rung, option in candidates if rung != settings]
    return [(rung, f"the planner counts {size(option.per_gpu_bytes['total'])} per device there against "
                   f"{size(own.per_gpu_bytes['total'])} at {own.name}, which was {size(missing)} short")
            for rung, option in candidates if option.per_gpu_bytes["total"] <= limit]


def plan_for_the_sequence(typed: Config, world_size: int, plan: Plan) -> tuple[Plan, dict]:
    """strategy=auto when nothing fits: the first of train.fused_loss=true, then strategy.sp=2, 3, 4, ...
    (each with and without the fused loss) whose plan has a choice; the settings it takes."""
    for sp in sequence_parallel_sizes(typed, world_size):
        for fused in (False, True):
            if (sp, fused) == (typed.strategy.sp, typed.train.fused_loss) or sp < typed.strategy.sp or (
                    typed.train.fused_loss and not fused):
                continue
            trial = dataclasses.replace(typed, strategy=dataclasses.replace(typed.strategy, sp=sp),
                                        train=dataclasses.replace(typed.train, fused_loss=fused))
            found = make_plan(trial, world_size, plan.gpu_memory_bytes, plan.memory_source)
            if found.choice:
                return found, {("strategy", "sp"): sp, ("train", "fused_loss"): fused}
    return plan, {}


def after_out_of_memory(cfg: Config, run_dir: Path) -> tuple[Config, list[str]]:
    """plan.run_dir: the run's out-of-memory failures, one line each, and cfg at the plan the run
    adapted to (the last of its oom.jsonl), which the table then shows."""
    records = read_records(run_dir)
    if not records:
        raise ConfigError(f"plan.run_dir: {run_dir} has no {RECORDS}: that run never ran out of memory")
    lines = [f"{run_dir}: {what_failed(r)}" for r in records if r["event"] == "out_of_memory"]
    if adapted := [r for r in records if r["event"] == "adapted"]:
        plan = RunPlan(**adapted[-1]["plan"])
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


if __name__ == "__main__":
    main()
