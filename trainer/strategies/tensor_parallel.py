"""Tensor parallelism (`strategy.tp`, docs/strategies.md, Tensor parallelism): the model's plan
(models/tensor_plan.py) applied with torch's `parallelize_module`, module by module, on the meta model,
over the "tp" dimension of the layout's ("dp", "tp") mesh; FSDP2 then shards over "dp" (fsdp.py,
torchtitan's recipe). Each split parameter becomes a DTensor of the tensor group: Shard(0) (colwise,
embedding_rowwise), Shard(1) (rowwise), _StridedShard(0, K) (packed_colwise: rank t keeps chunk t of
each of K parts, transformers' own placement of it) or Replicate; `tensor_part` says which block of
the full tensor a rank holds, for the checkpoint's pieces.

With sequence parallelism (`strategy.tp_sequence_parallel`, the model's `_tp_sequence_plan`; torchtitan's
apply_tp) the tensors between the split layers are each rank's 1/tp of the sequence (dim 1): the
embeddings' and rowwise layers' sums reduce-scattered over it, the norms computing on their rank's tokens,
attention's and the MLP's inputs all-gathered whole, and their input gradients reduce-scattered back
(Megatron's g and its conjugate). A Hugging Face family's embeddings stay whole (its forward builds the mask
and positions from them): its first decoder layer takes its rank's tokens of them (`sequence_split`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from trainer.models.tensor_plan import on_first_input, planned_modules, splits_at_embeddings, style_and_parts
from trainer.models.weights import Block


def replicated_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x`, whole on every rank of the group (a local tensor, or sequence_gathered's Replicate DTensor), as a
    local tensor whose gradient is summed over the group in backward (each rank's is the part through its
    own share of the weights: Megatron's f; after a gather, reduce-scattered over the sequence)."""
    whole = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])


class LocalStyle(ParallelStyle):
    """A style whose module computes on local tensors, as written (its parameters' local shares are
    swapped in around its forward): the placements of its parameters say what each rank holds."""

    def placement(self) -> Placement:
        raise NotImplementedError

    def local_parameter(self, p: DTensor) -> torch.Tensor:
        return p.to_local()

    def local_input(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(p, device_mesh, [self.placement()], src_data_rank=None)  # meta: placements only
            module.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))
        forward = module.forward

        def local_forward(x, *args, **kwargs):
            held = dict(module._parameters)
            module._parameters.update({name: self.local_parameter(p) for name, p in held.items() if p is not None})
            try:
                return forward(self.local_input(x, device_mesh), *args, **kwargs)
            finally:
                module._parameters.update(held)

        module.forward = local_forward
        return module


class PackedColwise(LocalStyle):
    """packed_colwise:K: a Linear whose output is K equal projections one after another (the built-in's
    qkv, a SwiGLU gate and up); rank t keeps chunk t of each, so its output is its heads' (features')
    share of each, in the order the model's forward splits them."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def placement(self) -> Placement:
        return _StridedShard(0, split_factor=self.parts)

    def local_input(self, x, mesh):
        return replicated_input(x, mesh)


class ReplicatedGradientSummed(LocalStyle):
    """replicated_with_grad_allreduce: whole on every rank, applied to that rank's heads only (Qwen3's
    q_norm/k_norm), so its gradient is each rank's part: summed over the group (a Partial gradient,
    which FSDP2 reduces to the parameter's Replicate)."""

    def placement(self) -> Placement:
        return Replicate()

    def local_parameter(self, p):
        return p.to_local(grad_placements=[Partial()])


class SequencePositions(ReplicatedGradientSummed):
    """sequence_positions: an embedding given the whole sequence's positions, looking up its rank's share
    of them, its tokens' (no exchange)."""

    def local_input(self, x, mesh):
        return x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]


class SequenceGathered(ParallelStyle):
    """sequence_gathered: the module's first input, its rank's tokens, all-gathered whole as a Replicate
    DTensor (its split layers take it as their whole input; their gradients reduce-scattered back); its
    other inputs (a Hugging Face attention's positions and mask) as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            tokens = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return tokens.redistribute(device_mesh, [Replicate()])

        on_first_input(module, gather)
        return module


class SequenceSplit(ParallelStyle):
    """sequence_split: the module's first input, whole on every rank of the group, as its rank's tokens (a
    local slice, no exchange; its gradient, each rank's tokens', all-gathered whole in backward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(x):
            whole = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(1)]).to_local()

        on_first_input(module, split)
        return module


def parallel_style(value: str, sequence_parallel: bool = False, embeddings_split: bool = True) -> ParallelStyle:
    """torch's style for a plan's style name (models/tensor_plan.py lists them); `sequence_parallel`: the
    tensors between the split layers are split over the sequence, not whole; the embeddings' sums with them
    where `embeddings_split` (`splits_at_embeddings`)."""
    style, parts = style_and_parts(value)
    between = Shard(1) if sequence_parallel else Replicate()
    embedded = between if embeddings_split else Replicate()
    return {"colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(output_layouts=between),
            # the output layer: its logits stay split over the vocabulary, a DTensor for the loss (fsdp.py's
            # loss_parallel), never gathered
            "colwise_gather_output": lambda: ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                                             use_local_output=False),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=embedded),
            "packed_colwise": lambda: PackedColwise(parts),
            "replicated_with_grad_allreduce": lambda: ReplicatedGradientSummed(),
            # a norm on its rank's tokens: its gradient is theirs, summed over the group as a replicated weight's
            "sequence_parallel": lambda: ReplicatedGradientSummed(),
            "sequence_positions": lambda: SequencePositions(),
            "sequence_gathered": lambda: SequenceGathered(),
            "sequence_split": lambda: SequenceSplit()}[style]()


def parallelize(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split the modules of the model's plan over `mesh` (the "tp" dimension), on the meta model; with
    `sequence_parallel`, those of its `_tp_sequence_plan` too."""
    sequence_plan = planned_modules(model, "_tp_sequence_plan") if sequence_parallel else []
    embeddings_split = splits_at_embeddings(sequence_plan)
    for _, module, value in planned_modules(model) + sequence_plan:
        parallelize_module(module, mesh, parallel_style(value, sequence_parallel, embeddings_split))


class Part(NamedTuple):
    """Which part of a full tensor a rank of the tensor group holds: a run of its flat values from `start`
    (`block` None), or a `Block` of its columns; `shape`: the part's own."""
    start: int
    block: Block | None
    shape: tuple[int, ...]


def tensor_part(shape: tuple[int, ...], placement: Placement, mesh: DeviceMesh) -> Part:
    """This rank's part of a tensor of `shape` placed by `placement` on the 1-D `mesh`: rows (Shard(0))
    are a flat run; columns (Shard(1)) a block of columns; packed_colwise's chunk t of each of K parts a
    block of the tensor seen as K rows."""
    size, rank = mesh.size(), mesh.get_local_rank()
    if isinstance(placement, _StridedShard):
        part = math.prod(shape) // placement.split_factor
        return Part(0, Block(rank * part // size, part // size, part), (shape[0] // size, *shape[1:]))
    local, offset = compute_local_shape_and_global_offset(shape, mesh, [placement])
    if isinstance(placement, Shard) and placement.dim % len(shape) == 1:
        return Part(0, Block(offset[1], local[1], shape[1]), tuple(local))
    assert placement.is_replicate() or placement.dim % len(shape) == 0, placement
    return Part(offset[0] * math.prod(shape[1:]) if shape else 0, None, tuple(local))
