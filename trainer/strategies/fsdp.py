"""FSDP2: `fully_shard` on every block, then on the root (torchtitan's parallelize recipe)."""
from __future__ import annotations

import math
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.config import Sharding
from trainer.models.blocks import find_blocks
from trainer.models.experts import shard_experts
from trainer.models.tensor_plan import uses_sequence_parallel
from trainer.models.weights import allocate_params, fill
from trainer.strategies.base import follow_rank0_buffers, hold_in, tensor_bytes, toggled
from trainer.strategies.precision import REDUCE_DTYPES
from trainer.strategies.tensor_parallel import parallelize, tensor_part
from trainer.strategies.torch_native import TorchStrategy


class FSDPStrategy(TorchStrategy):
    def make_grad_scaler(self):
        return ShardedGradScaler(self.env.device.type)  # agrees on inf/nan across shards

    @cached_property
    def tensor_mesh(self):
        """strategy.tp: the ("dp", "tp") mesh, made once (its groups are collective to make)."""
        return self.layout.tensor_mesh(self.env.device.type)

    def mesh(self):
        if self.layout.degrees.tp > 1:  # sharded over the data-parallel ranks only; a tensor group splits the rest
            return self.tensor_mesh["dp"]
        # HSDP: replicate across nodes, shard inside one. NO_SHARD is HSDP with shards of size 1.
        shard = {Sharding.FULL_SHARD: self.env.world_size, Sharding.SHARD_GRAD_OP: self.env.world_size,
                 Sharding.HYBRID_SHARD: self.env.local_world_size, Sharding.NO_SHARD: 1}[Sharding(self.cfg.strategy.sharding)]
        return self.layout.data_mesh(self.env.device.type, shard)

    def wrap(self, model, weights):
        s = self.cfg.strategy
        kwargs = dict(
            mesh=self.mesh(),
            # Sharded parameters stay fp32 (the master weights); compute in bf16/fp16, reduce in
            # strategy.reduce_dtype (fp32 by default).
            mp_policy=MixedPrecisionPolicy() if not self.precision.mixed else
            MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=REDUCE_DTYPES[s.reduce_dtype]),
            offload_policy=CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda") if self._offloaded()
            else OffloadPolicy(),
            reshard_after_forward=Sharding(s.sharding) is not Sharding.SHARD_GRAD_OP,
        )
        if self.layout.experts.size > 1:
            self.shard_experts(model, kwargs)
        if self.layout.degrees.tp > 1:  # split over "tp" first, then sharded over "dp" (torchtitan's order)
            parallelize(model, self.tensor_mesh["tp"], uses_sequence_parallel(s, model))
        for block in find_blocks(model, s.wrap):
            fully_shard(block, **kwargs)
        model = fully_shard(model, **kwargs)
        # Built on the meta device: each rank allocates and fills only its own shards.
        allocate_params(model, torch.device("cpu") if self._offloaded() else self.env.device)
        fill(model, weights, lambda p: [self.flat_range(p, p)[i] for i in (0, 1, 4)])
        follow_rank0_buffers(model, self.env.device, self.env.world_size)
        return model

    def shard_experts(self, model, kwargs) -> None:
        """strategy.ep: each experts module keeps this rank's experts (models/experts.py), sharded over
        the ranks that hold the same ones (world / ep), its own FSDP unit with their LoRA adapters
        (the outermost of peft's wrappers), so the block's all-gather leaves it out. Its gradients
        come from the tokens of the whole expert group: summed over those ranks and divided by the
        world, they are the mean over all ranks, as every other gradient."""
        world, ep = self.env.world_size, self.layout.experts.size
        mesh = self.layout.expert_data_mesh(self.env.device.type)
        modules = shard_experts(model, self.layout.experts)
        for module in modules:
            fully_shard(module, **{**kwargs, "mesh": mesh})
            module.set_gradient_divide_factor(world)
            # a plain sum, then the division (gloo has no PREMUL_SUM); where the experts are not
            # sharded (ep = world) not set: torch 2.13 would then divide twice
            module.set_force_sum_reduction_for_comms(world > ep)
        self._experts.add(modules)

    def setup_frozen(self, model, weights):
        # sharded per block like the policy (its shards held in the training dtype), gathered per
        # block in its forward
        model.requires_grad_(False)
        hold_in(model, self.precision.dtype, frozen_only=True)
        return self.holds(self.wrap(model, weights).eval())

    @property
    def module(self):
        return self.model

    def local_range(self, tensor):
        mesh, local = tensor.device_mesh, tensor.to_local().detach().view(-1)
        if mesh.mesh_dim_names == ("dp", "tp"):  # strategy.tp: FSDP2's rows of this rank's part of the tensor group's
            part = tensor_part(tuple(tensor.shape), tensor.placements[1], mesh["tp"])
            _, offset = compute_local_shape_and_global_offset(part.shape, mesh["dp"], [Shard(0)])
            start = part.start + offset[0] * math.prod(part.shape[1:])
            # a part the group's ranks hold alike (Replicate): one saves each share of it
            replicas, index = (mesh.size(1), mesh.get_local_rank(1)) if part.shape == tensor.shape else (1, 0)
            return start, local, replicas, index, part.block
        # Shard(0) rows [r0, r1) of a parameter are the flat range [r0 * row, r1 * row).
        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
        start = offset[0] * math.prod(tensor.shape[1:])
        if mesh.mesh_dim_names == ("dp",):  # strategy.tp, a parameter the plan leaves whole: every rank of the group
            replicas, index = self.layout.degrees.tp, self.layout.tp_rank
        else:
            replicas, index = (mesh.size(0), mesh.get_local_rank(0)) if mesh.ndim == 2 else (1, 0)  # HSDP
        return start, local, replicas, index, None

    def memory_bytes(self):
        held = super().memory_bytes()
        # grad_reduce=step: between micro-steps FSDP2 keeps each parameter's unsharded gradient
        # in its FSDPParam, not in the sharded parameter's .grad; counted too.
        unsharded = []
        for module in self.model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group else []:
                unsharded.append(fsdp_param.unsharded_accumulated_grad)
                if hasattr(fsdp_param, "_unsharded_param"):
                    unsharded.append(fsdp_param._unsharded_param.grad)
        held["grads"] += tensor_bytes(unsharded)
        return held

    def backward(self, loss, measure_memory=False):
        with self.autocast():
            super().backward(loss, measure_memory)

    def micro_step(self, final):
        # step: unsharded gradients accumulate locally, reduce-scatter on the final micro-step;
        # micro_step: FSDP2's default, reduce-scatter every backward into sharded gradients.
        return toggled(self.model.set_requires_gradient_sync, final or self._reduce_every_micro_step)

    def by_mesh(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` a mesh at a time (one foreach over DTensors of two meshes is refused): strategy.ep's
        experts, strategy.tp's split parameters ("dp", "tp"), the rest."""
        meshes: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            meshes.setdefault((p in self._experts, p.device_mesh.mesh_dim_names), []).append(p)
        return list(meshes.values())

    def total_norm(self, params):
        # a DTensor per mesh, reduced over it: each element counted once (a Replicate dimension's copies
        # once; a parameter on the "dp" mesh alone is whole on every rank of a tensor group, and not summed
        # over it); strategy.ep: an expert's gradient lives on one rank of each expert group, so the
        # experts' squares are summed over the group too, each counted once
        norms = []
        for same_mesh in self.by_mesh(params):
            norm = super().total_norm(same_mesh).full_tensor()
            if same_mesh[0] in self._experts:
                squares = norm ** 2
                dist.all_reduce(squares, group=self.layout.experts.group)
                norm = squares.sqrt()
            norms.append(norm)
        return norms[0] if len(norms) == 1 else torch.stack(norms).norm()

    def clip(self, max_grad_norm):
        for same_mesh in self.by_mesh(list(self.model.parameters())):
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_grad_norm, self._norm)

    def _offloaded(self):
        # FSDP2's one CPUOffloadPolicy moves params, grads and the optimizer step together: either
        # flag asks for it
        s = self.cfg.strategy
        return ["params", "grads", "optimizer"] if s.offload_params or s.offload_optimizer else []

    def start_settings(self):
        return {"sharding": Sharding(self.cfg.strategy.sharding).value, **super().start_settings()}
