"""strategy.ep on DeepSpeed ZeRO-1/2/3: the dispatch is ours (models/experts.py); DeepSpeed is told which
parameters are experts, so that it reduces their gradients and partitions their optimizer state (ZeRO-3:
the parameters too) over the ranks that hold the same experts (its expert-data-parallel group), and
counts each expert once in the gradient norm.

What DeepSpeed 0.19.8 keys on, read in its source and checked against one rank (exact within 1e-7):
- `engine.has_moe_layers`, set only where a submodule is its MoE layer (`deepspeed.moe.layer.MoE`,
  or AutoEP's `AutoEPMoELayer`). Without it the experts are averaged over the world and every rank's
  experts are overwritten by rank 0's at start. A parameter-free marker of that class sets it.
- an expert parameter: `allreduce = False` and `group_name = "ep_size_N"` (`is_moe_param`), the key
  of the groups `groups._create_expert_and_data_parallel(N)` makes: expert groups of N consecutive
  ranks, and the ranks with the same `rank % N` as expert-data-parallel groups (layout.py's).
- the client optimizer's groups: expert parameters alone in groups with `moe: True` and `name`
  that key (DeepSpeed splits groups only for an optimizer it builds itself).
- ZeRO-3: an expert parameter marked `ds_zero_placement_family = "autoep_expert"` with that key as
  `ds_zero_partition_group_name`, and partitioned over the expert-data-parallel group already:
  `deepspeed.initialize` refuses one that zero.Init partitioned over the world as it was built
  (`_resolve_zero3_param_placement`), so `partition_experts` partitions them again.
It divides the experts' reduced gradients by the world size, as FSDP2 is told to here: the mean over
all ranks, since each expert's gradient already holds its whole expert group's tokens.
"""
from __future__ import annotations

import torch
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.utils import groups
from torch import nn

from trainer.models.experts import ExpertGroup, ExpertRows, expert_modules, shard_experts
from trainer.patches import zero3_start_build


class ExpertParallelMarker(AutoEPMoELayer):
    """Makes DeepSpeed's engine see a MoE model (`has_moe_layers`); holds nothing and never runs. Its
    base's own __init__, which converts a Hugging Face MoE block into AutoEP's, is skipped on purpose:
    the engine reads only the attributes set here."""

    def __init__(self, experts: int, ep: int):
        nn.Module.__init__(self)
        self.num_experts, self.ep_size, self.num_local_experts = experts, ep, experts // ep
        self.expert_group_name = self.ep_group_name = group_name(ep)

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """The engine's call to make the groups: `tell_deepspeed` made them already."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertParallelMarker only marks the model for DeepSpeed's engine")


def group_name(ep: int) -> str:
    return f"ep_size_{ep}"


def make_groups(ep: int) -> None:
    """DeepSpeed's expert and expert-data-parallel groups of `ep` (what its own MoE layer makes); every rank,
    in order, once."""
    groups._create_expert_and_data_parallel(ep)


def partition_experts(model: nn.Module, group: ExpertGroup, device: torch.device) -> list[nn.Module]:
    """ZeRO-3, after `make_groups`: the experts modules of `model` (built under zero.Init, every parameter
    partitioned over the world) keep this rank's experts only (shard_experts), each parameter partitioned
    over the ranks that hold the same experts; the values come afterwards, as for every ZeRO-3 parameter."""
    modules = expert_modules(model)
    convert = None
    for module in modules:  # back to the meta shapes that shard_experts splits
        for name, p in list(module.named_parameters(recurse=False)):
            convert = p.convert_to_zero_parameters  # the zero.Init that built the model
            module.register_parameter(name, nn.Parameter(torch.empty(p.ds_shape, dtype=p.dtype, device="meta"),
                                                         requires_grad=p.requires_grad))
    shard_experts(model, group)
    same_experts = groups._get_expert_data_parallel_group(group_name(group.size))
    for module in modules:
        for name, p in list(module.named_parameters(recurse=False)):
            local = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            local.ds_zero_partition_process_group = same_experts  # read by zero.Init as it partitions
            module.register_parameter(name, local)
            with zero3_start_build():  # partitioned without sending values that are overwritten
                convert([local])
    return modules


def tell_deepspeed(model: nn.Module, modules: list[nn.Module], ep: int) -> None:
    """Before `deepspeed.initialize`, after `make_groups`: the experts' parameters marked, the marker added."""
    for module in modules:  # with their LoRA adapters, which live with them
        for p in module.parameters():
            p.allreduce, p.group_name = False, group_name(ep)
            # ZeRO-3 (stage 1/2 do not read these): partitioned over the expert-data-parallel group, and
            # the gradient norm summed over the expert group as well
            p.ds_zero_placement_family, p.ds_zero_partition_group_name = "autoep_expert", group_name(ep)
    local = modules[0].num_experts  # shard_experts left each module (and its adapters' wrappers) its own
    model.add_module("expert_parallel", ExpertParallelMarker(local * ep, ep))


def expert_param_groups(optimizer: torch.optim.Optimizer, experts: ExpertRows, ep: int) -> None:
    """Each of the optimizer's groups (before its first step) split in two: its expert parameters in a
    group of their own, marked as DeepSpeed's MoE groups are."""
    split = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        split.append({**settings, "params": [p for p in group["params"] if p not in experts]})
        split.append({**settings, "params": [p for p in group["params"] if p in experts], "moe": True,
                      "name": group_name(ep)})
    optimizer.param_groups[:] = [g for g in split if g["params"]]
