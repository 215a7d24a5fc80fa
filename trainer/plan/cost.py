"""The planner's cost model: what each memory strategy holds per GPU and moves per step, and the
fastest option that fits (options in the decision order DDP -> activation checkpointing ->
ZeRO-1/2 -> FSDP2 / ZeRO-3 -> CPU offload, which breaks ties; then the same order at each strategy.tp,
chosen only where nothing without it fits), and the longest seq_len per sequence-parallel degree.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trainer.config import Config, GradReduce, ObjectiveName, PeftName, Precision, ReduceDtype, StrategyName
from trainer.memory import DTYPE_BYTES, SHARDED, async_save_bytes, peak_gradient_bytes, per_rank_bytes, reduce_bytes
from trainer.models.checks import fusable
from trainer.models.tensor_plan import planned_modules
from trainer.plan.activations import ActivationCount, inputs_without_gradient, planned
from trainer.plan.tensor import TensorSplit, tensor_parallel_sizes, tensor_split
from trainer.strategies.ds_config import ZERO3_PERSISTENCE_THRESHOLD

if TYPE_CHECKING:
    from trainer.models import ModelFacts

GB = 1e9
STAGES = (StrategyName.ddp, StrategyName.zero1, StrategyName.zero2, StrategyName.fsdp, StrategyName.zero3)
# What CPU offload moves to host memory, per strategy (DDP cannot offload).
OFFLOADED = {StrategyName.zero1: ("optim",), StrategyName.zero2: ("optim",),
             StrategyName.fsdp: ("params", "grads", "optim"), StrategyName.zero3: ("params", "optim")}
def offload_settings(stage: StrategyName, offload: bool) -> dict[str, bool]:
    """strategy.offload_optimizer and strategy.offload_params of `stage` with or without offload (OFFLOADED:
    what it moves)."""
    return {"offload_optimizer": offload, "offload_params": offload and "params" in OFFLOADED[stage]}


# The strategies that take strategy.ep > 1 (models/experts.py: ddp refuses it), and strategy.tp > 1
EXPERT_PARALLEL = TENSOR_PARALLEL = (StrategyName.zero1, StrategyName.zero2, StrategyName.fsdp, StrategyName.zero3)


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
    tp: int = 1  # strategy.tp: ranks that split each planned layer's weights and read the same rows


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

    def seconds_per_row(self, option: Option) -> float:
        """An option's step time per row the world trains a step (strategy.tp: world / tp data-parallel
        ranks read micro-batches; the others' steps train as many rows as there are ranks)."""
        return option.step_s / (self.world_size // option.tp)


def count_params(cfg: Config) -> int:
    from trainer.models import model_facts

    return model_facts(cfg.model, cfg.strategy.wrap).params


def step_traffic(strategy: StrategyName, n_params: int, small_params: int, world_size: int, precision: Precision,
                 grad_accum_steps: int, grad_reduce: GradReduce, offload: bool,
                 reduce_dtype: ReduceDtype = ReduceDtype.fp32, frozen_params: int = 0) -> dict[str, int]:
    """Payload bytes of the collectives one rank joins per optimizer step (a tensor's full size per
    all-reduce, reduce-scatter or all-gather), and bytes copied between host and device for
    offload, as our backends do it (measured on gloo in tests/test_plan.py):
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
    sequence group of sp ranks (sp-1)/sp; the experts' all-to-all is counted as what leaves the rank;
    strategy.tp's all-reduces (`tensor_all_reduce`) as rings of its tensor group's tp ranks."""
    sp = cfg.strategy.sp
    moved = host = 0.0
    for part, ranks in traffic:
        ring = (ranks - 1) / ranks
        moved += 2 * ring * (part.get("all_reduce", 0) + part.get("tensor_all_reduce", 0)) \
            + ring * (part.get("reduce_scatter", 0) + part.get("all_gather", 0)) \
            + (sp - 1) / sp * part.get("all_to_all", 0) + part.get("expert_all_to_all", 0)
        host += part.get("host", 0)
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


def frozen_bytes(stage: StrategyName, frozen: int, ranks: int, precision: Precision, reference: int = 0) -> int:
    """Bytes per rank of `frozen` parameters (LoRA's base), held in the training dtype with no gradients and
    no optimizer state, and of objective=dpo's `reference` copy (ddp's fp32, as the policy's parameters:
    Strategy._frozen_dtype), sharded over `ranks` where `stage` shards parameters."""
    copy_bytes = 4 if stage is StrategyName.ddp else DTYPE_BYTES[precision]
    return (DTYPE_BYTES[precision] * frozen + copy_bytes * reference) // (ranks if "params" in SHARDED[stage] else 1)


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
    # strategy.ep (fsdp, zero1/2/3, without offload or LoRA): ep ranks split each MoE layer's experts
    expert_sizes = expert_parallel_sizes(facts, world_size) if PeftName(cfg.peft.name) is PeftName.none else []
    # checkpoint.async: a rank's share of the step dir, copied to host memory at each save and kept
    save_copy = async_save_bytes(trainable, frozen, world_size, frozen_saved=m.path is None) \
        if cfg.checkpoint.async_ and cfg.checkpoint.dir else 0
    for offload, stage, ep, checkpointing in decision_order(expert_sizes):
        # strategy.ep: a rank holds 1 / ep of the experts, held as a model of their own by the
        # world / ep ranks that hold the same ones (FSDP2 and ZeRO-3 shard them there, ZeRO-1/2 partition
        # their optimizer state and ZeRO-2 their gradients there); every other parameter over the world
        experts = facts.expert_params if ep > 1 else 0
        held = held_bytes(stage, trainable - experts, world_size, cfg)
        if experts:
            held = {k: v + held_bytes(stage, experts // ep, world_size // ep, cfg)[k] for k, v in held.items()}
        held["params"] += frozen_bytes(stage, frozen, world_size, precision, reference) \
            + DTYPE_BYTES[precision] * starting_adapter
        moved = OFFLOADED[stage] if offload else ()
        gpu = {k: 0 if k in moved else v for k, v in held.items()}
        need = activation_need(cfg, checkpointing, t.fused_loss, cfg.strategy.sp)
        gpu["activations"] = need.bytes(row_len, t.micro_batch_size)
        gpu["total"] = sum(gpu.values())
        whole = min(facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), n_params)  # ZeRO-3 keeps these whole
        experts_whole = 0
        if experts:  # strategy.ep: the experts' own, at a rank's share, go with their collectives below
            in_whole, experts_whole = facts.expert_elements_below(ZERO3_PERSISTENCE_THRESHOLD, ep)
            whole = max(0, whole - in_whole)
        traffic = step_traffic(stage, trainable - experts, whole, world_size, precision, t.grad_accum_steps,
                               cfg.strategy.grad_reduce, offload, cfg.strategy.reduce_dtype, frozen)
        traffic["all_to_all"] = sequence_traffic(need, row_len, t.micro_batch_size * t.grad_accum_steps,
                                                 checkpointing)
        # strategy.ep: the experts' own collectives among the ranks that hold the same ones, and
        # the tokens' all-to-alls in place of gathering the other ranks' experts
        expert_collectives = step_traffic(stage, experts // ep, experts_whole, world_size // ep, precision,
                                          t.grad_accum_steps, cfg.strategy.grad_reduce, offload,
                                          cfg.strategy.reduce_dtype)
        traffic["expert_all_to_all"] = expert_traffic(tokens_per_rank, facts, ep, precision, checkpointing)
        # with activation checkpointing, every block's forward runs twice: 8 instead of 6 FLOPs
        flops = facts.flops_per_token * tokens_per_rank * (8 / 6 if checkpointing else 1)
        comm = {k: v + expert_collectives.get(k, 0) for k, v in traffic.items()}
        option = Option(stage.value, checkpointing, offload, gpu, sum(held[k] for k in moved) + save_copy, comm,
                        step_seconds([(traffic, world_size), (expert_collectives, world_size // ep)], flops, cfg),
                        ep=ep)
        option.fits = gpu["total"] <= gpu_memory_bytes
        option.longest_seq_len = need.longest(gpu_memory_bytes - gpu["total"] + gpu["activations"],
                                              t.micro_batch_size) // (2 if dpo else 1)
        plan.options.append(option)
    if n_params == facts.params:  # strategy.tp: what the model's own plan splits (not of another count)
        from trainer.models import meta_model
        from trainer.models.blocks import find_blocks

        model = meta_model(m, cfg.peft)
        blocks = find_blocks(model, cfg.strategy.wrap)
        sizes = {stage: tensor_parallel_sizes(cfg, world_size, stage) for stage in TENSOR_PARALLEL}
        # peft=lora: the split layers before the first adapter take inputs autograd computes no gradient for
        quiet = inputs_without_gradient(model, blocks, [m for _, m, _ in planned_modules(model)]) \
            if frozen and any(sizes.values()) else set()
        for tp in sorted(set().union(*sizes.values())):
            for offload, stage, _, checkpointing in decision_order([]):
                if tp not in sizes.get(stage, ()) or offload and stage is StrategyName.fsdp:  # fsdp's tp: no offload
                    continue
                strategy = dataclasses.replace(cfg.strategy, name=stage, tp=tp, **offload_settings(stage, offload))
                split = tensor_split(model, blocks, strategy, precision, quiet)
                plan.options.append(tensor_parallel_option(dataclasses.replace(cfg, strategy=strategy), facts, split,
                                                           world_size, checkpointing, save_copy, gpu_memory_bytes))
    # The fastest that fits, per row the world trains; within 1 % of it, the decision order (the options'
    # order) decides. strategy.tp only where nothing without it fits: its tensor group reads the same
    # rows, so a step trains tp times fewer of them than the run asked for.
    fitting = [o for o in plan.options if o.fits and o.tp == 1] or [o for o in plan.options if o.fits]
    if fitting:
        fastest = min(plan.seconds_per_row(o) for o in fitting)
        next(o for o in fitting if plan.seconds_per_row(o) <= fastest * 1.01).chosen = True
    plan.activations = planned(cfg, False, t.fused_loss)
    plan_long_context(plan, cfg, world_size, 2 if dpo else 1)
    return plan


def tensor_parallel_option(cfg: Config, facts: ModelFacts, split: TensorSplit, world_size: int, checkpointing: bool,
                           save_copy: int, gpu_memory_bytes: int) -> Option:
    """cfg's strategy (fsdp, or zero1/2/3 through AutoTP, with its offload) at strategy.tp=`split.tp`: a rank
    holds 1 / tp of each parameter the strategy splits and the others whole, which the strategy then
    shards or partitions over the world / tp data-parallel ranks as it does over the world without tp
    (trainer/memory.py's bytes per parameter there), the activations as a rank of the tensor group keeps
    them (counted on meta); per step, the strategy's own collectives (and offload's copies) of those
    parameters among the data-parallel ranks, and the tensor group's all-reduces (`TensorSplit.traffic`)
    among its tp ranks. A rank computes 1 / tp of the split layers' and of attention's FLOPs (its heads),
    the rest whole. peft=lora (fsdp): the frozen base, split as its layers and sharded over the data-parallel
    ranks, in the training dtype with no gradients or optimizer state (`frozen_bytes`); the adapters, split as
    their layers (models/tensor_plan.py's `with_adapters`), at trainer/memory.py's bytes per parameter."""
    t, tp, precision = cfg.train, split.tp, Precision(cfg.train.precision)
    stage, offload = StrategyName(cfg.strategy.name), cfg.strategy.offload_optimizer
    dp = world_size // tp
    local = facts.params - split.split_params + split.split_params // tp
    frozen = facts.params - facts.trainable - split.split_frozen + split.split_frozen // tp
    held = held_bytes(stage, local - frozen, dp, cfg)
    held["params"] += frozen_bytes(stage, frozen, dp, precision)
    moved = OFFLOADED[stage] if offload else ()
    gpu = {k: 0 if k in moved else v for k, v in held.items()}
    need = activation_need(cfg, checkpointing, t.fused_loss, 1, tp)
    gpu["activations"] = need.bytes(cfg.model.seq_len, t.micro_batch_size)
    gpu["total"] = sum(gpu.values())
    # ZeRO-3's parameters below its persistence threshold, counted at their whole sizes (a split one is smaller)
    whole = min(facts.elements_below(ZERO3_PERSISTENCE_THRESHOLD), local)
    data_parallel = step_traffic(stage, local - frozen, whole, dp, precision, t.grad_accum_steps,
                                 cfg.strategy.grad_reduce, offload, cfg.strategy.reduce_dtype, frozen)
    reductions = t.grad_accum_steps if GradReduce(cfg.strategy.grad_reduce) is GradReduce.micro_step else 1
    tensor = {"tensor_all_reduce": split.traffic(t.micro_batch_size * cfg.model.seq_len, t.grad_accum_steps,
                                                 reductions, checkpointing)}
    attention_flops = 12 * facts.n_layers * facts.d_model * cfg.model.seq_len
    # model_facts' FLOPs: 6 an element that trains, 4 a frozen one (no gradient of its own)
    split_flops = 6 * split.split_matmul_params - 2 * split.split_frozen_matmul
    flops_per_token = facts.flops_per_token - (1 - 1 / tp) * (split_flops + attention_flops)
    flops = flops_per_token * t.micro_batch_size * t.grad_accum_steps * cfg.model.seq_len * (
        8 / 6 if checkpointing else 1)
    option = Option(stage.value, checkpointing, offload, gpu, sum(held[k] for k in moved) + save_copy,
                    {**data_parallel, **tensor},
                    step_seconds([(data_parallel, dp), (tensor, tp)], flops, cfg), tp=tp)
    option.fits = gpu["total"] <= gpu_memory_bytes
    option.longest_seq_len = need.longest(gpu_memory_bytes - gpu["total"] + gpu["activations"], t.micro_batch_size)
    return option


def activation_need(cfg: Config, checkpointing: bool, fused_loss: bool, sp: int = 1, tp: int = 1) -> ActivationCount:
    """The activation bytes an option needs per rank (trainer/plan/activations.py counts them on the
    meta device) at the peak of backward: those kept for backward, and beside them the larger of the
    output layer's and loss's gradients (at backward's start) and, with checkpointing, one block's
    activations, recomputed in backward (later, when the former are gone)."""
    kept = planned(cfg, checkpointing, fused_loss, sp, tp=tp)
    recomputed = planned(cfg, False, fused_loss, sp, tp=tp).per_token_per_layer if checkpointing else 0.0
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
    plan.room_for = f"{base.name}{f' tp={base.tp}' if base.tp > 1 else ''}{' + CPU offload' if base.offload else ''}"
    t = cfg.train
    # the activations as the base's strategy keeps them (zero's AutoTP: no sequence-parallel norms)
    cfg = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, name=StrategyName(base.name)))
    # strategy.tp crosses neither with strategy.sp nor with the fused loss, which takes only an output layer
    # whose logits are the model's (models/checks.py; not one with LoRA on it)
    fused_options = (False, True) if base.tp == 1 and fusable(cfg) else (False,)
    for sp in sequence_parallel_sizes(cfg, world_size) if base.tp == 1 else [1]:
        for fused in fused_options:
            for checkpointing in (False, True):
                need = activation_need(cfg, checkpointing, fused, sp, base.tp)
                longest = need.longest(plan.gpu_memory_bytes - rest, t.micro_batch_size) // rows_per_sequence
                plan.long_context.append((sp, fused, checkpointing, longest))


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
