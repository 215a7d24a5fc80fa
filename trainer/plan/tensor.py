"""What tensor parallelism (`strategy.tp`, docs/strategies.md, Tensor parallelism) changes for the planner,
read from the model's own plan (models/tensor_plan.py's `planned_modules`) on the meta device: the
parameter elements it splits, the activations a rank keeps (the model traced with each split layer
holding a rank's share of its weights), and the bytes its tensor group all-reduces per token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.config import Config, Precision, StrategyConfig, StrategyName
from trainer.errors import ConfigError
from trainer.memory import DTYPE_BYTES
from trainer.models.tensor_plan import (
    on_first_input,
    planned_modules,
    splits_at_embeddings,
    style_and_parts,
    uses_sequence_parallel,
)

# the styles whose layer's output features (rows of the weight) a rank keeps 1 / tp of
SPLIT_ROWS = ("colwise", "colwise_gather_output", "embedding_rowwise", "packed_colwise")
# the strategies that split with DeepSpeed's AutoTP, which leaves embeddings whole (strategies/ds_tp.py's SPECS)
AUTOTP = (StrategyName.zero1, StrategyName.zero2, StrategyName.zero3)
# torch's loss_parallel all-reduces, per token, the logits' max, the sum of their exponentials and the
# target's logit, in fp32 (the loss casts the logits to fp32)
LOSS_PARALLEL_BYTES_PER_TOKEN = 3 * 4


@dataclass(frozen=True)
class TensorSplit:
    """What the model's plan splits over a tensor group of `tp` ranks, and the payload of the group's
    all-reduces per token of a micro-batch row, in the training dtype (torch's parallel styles)."""
    tp: int
    split_params: int  # elements of the split layers' parameters (all of them: a rank holds 1 / tp)
    split_matmul_params: int  # of split_params, those that multiply (not an embedding's lookups)
    forward_per_token: int  # rowwise and embedding_rowwise outputs, summed over the group
    recomputed_per_token: int  # of forward_per_token, the blocks' (their forward runs again with checkpointing)
    backward_per_token: int  # the colwise layers' inputs' gradients, summed over the group
    loss_per_token: int  # loss_parallel's exchange (the output layer's logits stay split)
    replicated_gradients: int  # elements of replicated_with_grad_allreduce parameters, their gradients summed
    split_frozen: int = 0  # of split_params, those that do not train (LoRA's base layers)
    split_frozen_matmul: int = 0  # of split_frozen, those that multiply

    def traffic(self, tokens: int, micro_steps: int, reductions: int, checkpointing: bool) -> int:
        """All-reduce payload per optimizer step of `micro_steps` micro-batches of `tokens` tokens each,
        on one rank of the group; the replicated parameters' fp32 gradients summed where the strategy reduces
        gradients (`reductions` times a step)."""
        per_token = self.forward_per_token + self.backward_per_token + self.loss_per_token \
            + (self.recomputed_per_token if checkpointing else 0)
        return per_token * tokens * micro_steps + 4 * self.replicated_gradients * reductions


def split_modules(model: nn.Module, strategy: StrategyName) -> list[tuple[str, nn.Module, str]]:
    """`planned_modules` as `strategy` splits them: on zero1/2/3 (AutoTP) the embeddings stay whole."""
    modules = planned_modules(model)
    if strategy not in AUTOTP:
        return modules
    return [planned for planned in modules if style_and_parts(planned[2])[0] != "embedding_rowwise"]


def tensor_split(model: nn.Module, blocks: list[nn.Module], strategy: StrategyConfig, precision: Precision,
                 quiet: set[int] | frozenset = frozenset()) -> TensorSplit:
    """`model`'s plan at `strategy`'s tp (on meta), as its strategy splits it (`split_modules`); `blocks`
    its blocks (what checkpointing recomputes); `quiet` the ids of the split layers whose input needs no
    gradient (with LoRA, those before the first adapter: activations.py's `inputs_without_gradient`): no
    input gradient of theirs is all-reduced. With sequence-parallel norms (`uses_sequence_parallel`: fsdp's),
    the `_tp_sequence_plan`'s reduce-scatters and all-gathers move, as a ring, what the all-reduces they
    replace do (each rowwise sum a reduce-scatter and its gradient's all-gather, each colwise input an
    all-gather and its gradient's reduce-scatter, once for a gathered module's colwise layers): counted as
    those; a Hugging Face family's embeddings, whose sum stays an all-reduce, add their split's
    (`sequence_split`) gradient all-gather."""
    element = DTYPE_BYTES[precision]
    inside = {id(m) for block in blocks for m in block.modules()}
    split = matmul = forward = recomputed = backward = replicated = loss = frozen = frozen_matmul = 0
    sequence_plan = planned_modules(model, "_tp_sequence_plan") if uses_sequence_parallel(strategy, model) else []
    # a gathered module's input gradient, its colwise layers' summed (q, k and v's of one input): one reduce-scatter
    gathered_by = {id(layer): id(gathered) for _, gathered, value in sequence_plan if value == "sequence_gathered"
                   for layer in gathered.modules()}
    gathered_counted: set[int] = set()
    for _, module, value in split_modules(model, StrategyName(strategy.name)) + sequence_plan:
        style, _ = style_and_parts(value)
        # a rowwise layer's bias is added once the outputs are summed: whole on every rank
        counted = [p for name, p in module.named_parameters(recurse=False) if not (style == "rowwise" and name == "bias")]
        count = sum(p.numel() for p in counted)
        # peft=lora: the base layers are frozen (no gradient to sum, nothing to update), the adapters train
        stays = sum(p.numel() for p in counted if not p.requires_grad)
        if style in ("replicated_with_grad_allreduce", "sequence_parallel", "sequence_positions"):
            replicated += count - stays
            continue
        if style == "sequence_gathered":  # its gather and the colwise layers' gradients: counted as theirs
            continue
        if style == "sequence_split":  # a slice, its gradient all-gathered (half an all-reduce's payload of the
            # embeddings' width: a Hugging Face model's, whose sum stays an all-reduce)
            backward += model.get_input_embeddings().embedding_dim * element // 2
            continue
        split += count
        frozen += stays
        matmul += count if style != "embedding_rowwise" else 0
        frozen_matmul += stays if style != "embedding_rowwise" else 0
        if style in ("rowwise", "embedding_rowwise"):
            out = module.weight.shape[1] if style == "embedding_rowwise" else module.weight.shape[0]
            forward += out * element
            recomputed += out * element if id(module) in inside else 0
        elif id(module) not in quiet and gathered_by.get(id(module)) not in gathered_counted:
            backward += module.weight.shape[1] * element
            gathered_counted.add(gathered_by.get(id(module), id(module)))
        if style == "colwise_gather_output":  # its logits stay split: the loss is computed where they are
            loss = LOSS_PARALLEL_BYTES_PER_TOKEN
    return TensorSplit(strategy.tp, split, matmul, forward, recomputed, backward, loss, replicated, frozen, frozen_matmul)


def hold_local_shares(model: nn.Module, tp: int, strategy: StrategyName) -> None:
    """On meta: each layer `strategy` splits (`split_modules`) holds one rank's share of its weights (rows
    for the colwise styles, columns for rowwise; a rowwise bias whole), so that a forward makes and keeps what a rank
    of the tensor group does (its heads, its features; the split logits)."""
    for _, module, value in split_modules(model, strategy):
        style, _ = style_and_parts(value)
        if style not in SPLIT_ROWS and style != "rowwise":
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if style == "rowwise":
                shape = (p.shape[0], p.shape[1] // tp) if p.dim() == 2 else tuple(p.shape)
            else:
                shape = (p.shape[0] // tp, *p.shape[1:])
            share = torch.empty(shape, dtype=p.dtype, device="meta")
            module.register_parameter(name, nn.Parameter(share, requires_grad=p.requires_grad))


def hold_sequence_shares(model: nn.Module, tp: int) -> list[RemovableHandle]:
    """On meta, with the model's `_tp_sequence_plan` (strategy.tp_sequence_parallel): what runs between the
    split layers holds a rank's 1 / tp of the sequence (the rowwise layers', embeddings' and positions'
    outputs keep their first 1 / tp, a reduce-scatter's share; where the embeddings stay whole, the input of
    the module that splits it) and attention's, the MLP's and the output layer's inputs are whole again (an
    all-gather's copy), so that a forward keeps what a rank of the tensor group does. Returns the hooks that
    do it."""
    sequence_plan = planned_modules(model, "_tp_sequence_plan")
    scattered = ("rowwise", "sequence_positions") + (("embedding_rowwise",) if splits_at_embeddings(sequence_plan) else ())
    exchanges = []
    for _, module, value in planned_modules(model) + sequence_plan:
        style, _ = style_and_parts(value)
        if style in scattered:
            exchanges.append(module.register_forward_hook(lambda _, args, y: y[:, :y.shape[1] // tp].clone()))
        elif style == "sequence_split":
            exchanges.append(on_first_input(module, lambda x: x[:, :x.shape[1] // tp].clone()))
        elif style in ("sequence_gathered", "colwise_gather_output"):
            exchanges.append(on_first_input(module, lambda x: x.repeat(1, tp, 1)))
    return exchanges


def tensor_parallel_sizes(cfg: Config, world_size: int, strategy: StrategyName) -> list[int]:
    """strategy.tp values above 1 that this run may take on `strategy`: every size dividing the world that
    the trainer's checks accept (the model's plan, its split dimensions, heads and key-value heads; the
    settings tensor parallelism crosses with), without offload (zero's offload crosses with every size); none
    where they refuse every size (peft=lora: zero1/2/3 refuse it, fsdp takes it)."""
    from trainer.checks import check_tensor_parallel
    from trainer.models import meta_model

    model = meta_model(cfg.model, cfg.peft)
    settings = dataclasses.replace(cfg.strategy, name=strategy, offload_params=False, offload_optimizer=False)
    sizes = []
    for tp in range(2, world_size + 1):
        if world_size % tp:
            continue
        try:
            check_tensor_parallel(dataclasses.replace(cfg, strategy=dataclasses.replace(settings, tp=tp)), world_size,
                                  model)
        except ConfigError:
            continue
        sizes.append(tp)
    return sizes
