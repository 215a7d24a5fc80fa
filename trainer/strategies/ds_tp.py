"""strategy.tp on zero1/2/3 (docs/strategies.md, Tensor parallelism): DeepSpeed's AutoTP, which
`deepspeed.initialize` runs itself when the config says `tensor_parallel.autotp_size`. It splits the
layers of the model's plan (models/tensor_plan.py, the plan fsdp splits), given to it as its
`partition_config`, and ZeRO then partitions each rank's slices over the data-parallel group.

AutoTP replaces a split parameter's data with this rank's slice and marks it (DS_AUTOTP_UC_META):
its full shape, the dimension split and each rank's size of it. `TensorSlice` reads that mark as the
place of this rank's slice in the full tensor, for the checkpoint's pieces and the first weights.

The output layer is split by vocabulary rows, its logits left split (no rank builds the whole
[tokens, vocabulary] logits): `split_logits` gives them to the loss as a DTensor of the tensor group,
whose cross-entropy torch's `loss_parallel` computes where they are, as on fsdp.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainer.errors import ConfigError
from trainer.models.tensor_plan import planned_modules, style_and_parts
from trainer.models.weights import Block

# our styles as AutoTP's layer specs: an embedding stays whole on zero (AutoTP splits an embedding
# over its hidden dimension, not its rows); packed_colwise's K equal parts split each, as fsdp does; the
# output layer column-parallel without its gather: each rank's logits are its rows' (split_logits)
SPECS = {"colwise": {"partition_type": "column"},
         "rowwise": {"partition_type": "row"},
         "colwise_gather_output": {"partition_type": "column"},
         "embedding_rowwise": {"partition_type": "skip"},
         "replicated_with_grad_allreduce": {"partition_type": "skip", "grad_allreduce": True}}


def planned_styles(model: nn.Module) -> list[tuple[str, str]]:
    """(name in `model`, style value) of each planned module (a module the plan leaves whole, a tied
    output layer, is in none)."""
    planned = {id(module): value for _, module, value in planned_modules(model)}
    return [(name, planned[id(module)]) for name, module in model.named_modules() if id(module) in planned]


def partition_config(model: nn.Module) -> dict:
    """The model's plan as AutoTP's `partition_config`: a layer spec per planned module, by its name in
    `model` (AutoTP leaves the others)."""
    specs = []
    for name, value in planned_styles(model):
        style, parts = style_and_parts(value)
        spec = SPECS.get(style) or {"partition_type": "column", "shape": [parts, -1], "partition_dim": 0}
        specs.append({"patterns": [f"^{re.escape(name)}\\.weight$"], **spec})
    return {"use_default_specs": False, "layer_specs": specs}


def output_layers(model: nn.Module) -> list[str]:
    """The names of the planned output layers (colwise_gather_output) in `model`: none where the output
    layer is tied to the embedding (both stay whole, and so do its logits)."""
    return [name for name, value in planned_styles(model) if style_and_parts(value)[0] == "colwise_gather_output"]


def split_logits(model: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """The logits of each output layer `names` (AutoTP's column-parallel layer, this rank's vocabulary
    rows) as a DTensor split over the vocabulary on the tensor group's 1-D `mesh` (Shard(-1)), for
    torch's loss_parallel. Its shards must be torch's: equal (a ds_config's tp_grain_size may make
    AutoTP's uneven)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    for name in names:
        layer = model.get_submodule(name)
        sizes = getattr(layer.weight, DS_AUTOTP_UC_META)["partition_sizes"]
        if len(set(sizes)) > 1:
            raise ConfigError(f"strategy.tp={mesh.size()}: AutoTP split {name}'s vocabulary unevenly ({list(sizes)} "
                              "rows), which the vocabulary-parallel loss does not take; leave the ds_config's "
                              "tensor_parallel.tp.tp_grain_size unset")
        layer.register_forward_hook(lambda _, args, logits: DTensor.from_local(logits, mesh, [Shard(-1)],
                                                                                run_check=False))


class TensorSlice(NamedTuple):
    """Where this rank's slice of a parameter lies in the full tensor: a run of its flat values from
    `start`, or a `Block` (its ranges count in the block's own order); `saved`: whether this rank
    saves it (a parameter whole on every rank of the tensor group: its first rank only)."""
    start: int
    block: Block | None
    saved: bool
    full_shape: tuple[int, ...]


def tensor_slice(p: torch.Tensor, tp_rank: int) -> TensorSlice:
    """This rank's slice of `p`, as AutoTP marked it: rows (dimension 0) are a run of the flat tensor,
    columns (dimension 1) a `Block`; K packed equal parts split each (rows of each part), a `Block` of
    the tensor seen as K rows."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(p, DS_AUTOTP_UC_META, None)
    shape = tuple(getattr(p, "ds_shape", p.shape))
    if meta is None or meta["replicated"] or meta["partition_dim"] is None:
        return TensorSlice(0, None, tp_rank == 0, shape)
    full, dim = tuple(meta["logical_shape"]), meta["partition_dim"]
    inner = math.prod(full[dim + 1:])
    widths = meta["sub_param_shard_widths"]
    if widths:  # packed parts: equal, each split alike (models/tensor_plan.py's packed_colwise)
        assert dim == 0 and len({tuple(w) for w in widths}) == 1, meta
        part = math.prod(full) // len(widths)
        return TensorSlice(0, Block(sum(widths[0][:tp_rank]) * inner, widths[0][tp_rank] * inner, part), True, full)
    sizes = meta["partition_sizes"]
    first = sum(sizes[:tp_rank])
    if dim == 0:
        return TensorSlice(first * inner, None, True, full)
    assert dim == 1 and len(full) == 2, meta
    return TensorSlice(0, Block(first, sizes[tp_rank], full[1]), True, full)
